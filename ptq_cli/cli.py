"""The `ptq` command line: parse options, call a service, render the result. Nothing else lives here."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import io
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn
from rich.text import Text
from typer._click.exceptions import ClickException, UsageError  # typer >= 0.22 vendors click (pyproject: typer>=0.29)

from ptq_cli import backends, render, settings
from ptq_cli import cpu as cpu_info
from ptq_cli import inputs as inputs_service
from ptq_cli.backends.model_file import read_onnx as check_model
from ptq_cli.datasets import Dataset, open_dataset
from ptq_cli.errors import Interrupted, PtqError, Terminated, TerminateSignal
from ptq_cli.guards import atomic, bounded, hardstop, trust
from ptq_cli.guards.atomic import check_outputs, write_text
from ptq_cli.services import executor as executor_service
from ptq_cli.services import fetch as fetch_service
from ptq_cli.services import models as models_service
from ptq_cli.services import quant_settings
from ptq_cli.services.make import calibration as calibration_service
from ptq_cli.services.make import convert as convert_service
from ptq_cli.services.make import export as export_service
from ptq_cli.services.make import prune as prune_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.services.make import stem as stem_service
from ptq_cli.services.measure import benchmark as benchmark_service
from ptq_cli.services.measure import evaluate as evaluate_service
from ptq_cli.services.measure import report as report_service
from ptq_cli.services.quant_settings import QuantizationSettings
from ptq_cli.services.study import pipeline as pipeline_service
from ptq_cli.services.study import sensitivity as sensitivity_service
from ptq_cli.services.study import sweep as sweep_service
from ptq_cli.services.study import tune as tune_service
from ptq_cli.services.study import validation as validation_service
from ptq_cli.transforms import overflow
from ptq_cli.transforms.rounding import AUTO as AUTO_ROUNDING
from ptq_cli.transforms.rounding import ROUNDING_CHOICES

# torch's C++ side prints deprecation warnings for quantized tensors straight to stderr; ptq's stderr is
# for its own messages. Set before torch is first imported (services import it lazily).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

class _StandardOutput:
    """sys.stdout as it is at each write (a test runner swaps it), a failed write named as standard output's."""

    def write(self, text: str) -> int:
        try:
            return sys.stdout.write(text)
        except OSError as error:
            raise PtqError(f"standard output: cannot write ({error.strerror or error})") from error

    def flush(self) -> None:
        try:
            sys.stdout.flush()
        except OSError as error:
            raise PtqError(f"standard output: cannot write ({error.strerror or error})") from error

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stdout, name)


# No markup in what is printed: names come from users' files ("[/]" in a class name is a name, not a tag).
out = Console(file=_StandardOutput(), markup=False)  # type: ignore[arg-type]
err = Console(stderr=True, markup=False)


# The command line as ptq was given it (recorded in `ptq run`'s manifest).
COMMAND_LINE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("command_line", default=("ptq",))


class PtqGroup(typer.core.TyperGroup):
    """The one error handler: bad input and usage errors become one line on stderr and exit code 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        given = list(sys.argv[1:] if args is None else args)
        COMMAND_LINE.set(("ptq", *given))
        args = _fill_optional_values(given)
        _tolerant_streams()
        try:
            with _terminate_as_interrupt(), trust.scope(), warnings.catch_warnings():
                # Library warnings (numpy overflow on odd inputs, deprecations) are not ptq's messages:
                # what matters to the user is turned into ptq's own line or record field.
                warnings.simplefilter("ignore")
                code = super().main(args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra)
        except PtqError as error:
            code = _fail(str(error), error.exit_code)
        except UsageError as error:
            if not error.format_message():  # `ptq` alone: the help was asked for, and has been printed
                return self._exit(0, standalone_mode)
            command = error.ctx.command_path if error.ctx else "ptq"
            code = _fail(f"{error.format_message()} (see `{command} --help`)", error.exit_code)
        except ClickException as error:
            code = _fail(error.format_message(), error.exit_code)
        except OSError as error:  # a full disk, a vanished directory: the file and the reason, not a traceback
            code = _fail(f"{error.filename or 'ptq'}: {error.strerror or error}", 2)
        return self._exit(code, standalone_mode)

    @staticmethod
    def _exit(code: Any, standalone_mode: bool) -> Any:
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        # Typer turns Ctrl-C into a silent exit 130 before main() sees it; say what happened instead.
        try:
            for limit in bounded.LIMITS:  # a limit set to something unusable fails now, whether or not this run meets it
                limit.value()
            return super().invoke(ctx)
        except KeyboardInterrupt as interrupt:
            kind = Terminated if isinstance(interrupt, TerminateSignal) else Interrupted
            raise kind("interrupted; no partial output was written") from interrupt


def _tolerant_streams() -> None:
    """A terminal or pipe that cannot show a character (PYTHONIOENCODING=ascii, a C locale) gets an
    escape for it, not a UnicodeEncodeError in the middle of a table."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a CI timeout, systemd) ends ptq the way Ctrl-C does: temporary files removed."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise TerminateSignal

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    stopping = False
    try:
        with hardstop.signals_watched():
            yield
    except (KeyboardInterrupt, Interrupted):
        stopping = True
        raise
    finally:
        # Ended by a signal, the process is on its way out (threads a runtime left running may hold it a moment): a
        # second signal then ends it at once with the signal's exit code, not by the signal itself (-15).
        signal.signal(signal.SIGTERM, hardstop.exit_at_once if stopping else previous)
        if stopping:
            signal.signal(signal.SIGINT, hardstop.exit_at_once)


# Options whose value may be left out (`--markdown` alone means the default path). Typer has no such
# option type, so a bare occurrence gets its default value inserted before parsing.
OPTIONAL_VALUES = {"--markdown": str(settings.MARKDOWN_REPORT)}


def _fill_optional_values(args: list[str]) -> list[str]:
    filled: list[str] = []
    for index, arg in enumerate(args):
        filled.append(arg)
        following = args[index + 1] if index + 1 < len(args) else None
        if arg in OPTIONAL_VALUES and (following is None or following.startswith("-")):
            filled.append(OPTIONAL_VALUES[arg])
    return filled


def _fail(message: str, exit_code: int) -> int:
    message = " ".join(str(message).split())  # one line, whatever a library put in its message
    try:
        err.print(Text.assemble(("Error:", "red"), f" {message}"), highlight=False, soft_wrap=True)
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr that cannot take the line (/dev/full, closed): the exit code still says it
        pass
    return exit_code


app = typer.Typer(
    cls=PtqGroup,
    help="Post-training quantization of image classifiers (ONNX in; 8-bit models out for onnxruntime, PyTorch, OpenVINO and LiteRT), measured on your images. Defaults: the MLPerf Tiny ResNet8 study on CIFAR-10.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",  # paragraphs reflow to the width; markdown mode ate `_x_` and `<name>` in defaults
)


def _show_version(asked: bool) -> None:
    if asked:
        import ptq_cli

        typer.echo(f"ptq {ptq_cli.__version__}")
        raise typer.Exit


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version, help="Print ptq's version and exit.")] = False) -> None:
    """Post-training quantization of image classifiers, measured on your images."""


def _choices(name: str, values) -> Any:
    """A str Enum for typer from a service's tuple of accepted values (the one list of them)."""
    return Enum(name, [(value, value) for value in dict.fromkeys(values)], type=str)


DType = _choices("DType", quant_settings.DTYPES)
WeightDType = _choices("WeightDType", quant_settings.WEIGHT_DTYPES)
Backend = _choices("Backend", backends.quantizers())
Target = _choices("Target", quant_settings.TARGETS)
Method = _choices("Method", backends.methods())
Preset = _choices("Preset", inputs_service.PRESETS)
Asset = _choices("Asset", fetch_service.ASSETS)
Scope = _choices("Scope", prune_service.SCOPES)
Runtime = _choices("Runtime", backends.runtimes())
Precision = _choices("Precision", backends.precisions())
Cpus = _choices("Cpus", cpu_info.CPU_TARGETS)
OverflowFix = _choices("OverflowFix", overflow.OVERFLOW_FIXES)
Stem = _choices("Stem", quant_settings.STEM_CHOICES)
Rounding = _choices("Rounding", ROUNDING_CHOICES)
MODELS_HELP = f"Model file ({', '.join(backends.suffixes())}); repeat for several. (default: every model in models/)"
Int8Path = _choices("Int8Path", evaluate_service.INT8_PATH_CHOICES)
KernelPath = _choices("KernelPath", (evaluate_service.NATIVE_PATH, cpu_info.SATURATING))
# Which CPUs a quantized model is for, and how it stays exact on those without VNNI (one block, shared).
CpusOption = Annotated[
    Cpus,
    typer.Option(help="Which CPUs the model is for: all (every x86 CPU, with or without VNNI/AMX, and ARM: weights or activations bounded so that x86 kernels without VNNI cannot overflow) or vnni (x86 with VNNI/AMX, and ARM: the full 8-bit range, loses accuracy on AVX2-only CPUs). Stored in the model; evaluate and benchmark warn on a CPU outside it.", rich_help_panel="Deployment"),
]
OverflowFixOption = Annotated[
    OverflowFix | None,
    typer.Option(help="With --cpus all: the layers whose int8 weights are bounded so that no pair of u8 x s8 products overflows int16 (the pair rule): first-layer (where the input's full range meets them; measured) or all-layers (proven: the model cannot saturate). onnxruntime's depthwise convolutions are exempt: their kernel cannot saturate (fbgemm's can: PyTorch bounds them too, or keeps 7-bit activations instead: --activation-bits); LiteRT needs nothing. (default: all-layers for a model with clamped activations such as ReLU6, whose outputs sit at the top code; otherwise onnxruntime and PyTorch judge all-layers against first-layer on held-out calibration images and keep all-layers unless first-layer is 0.5 dB closer, the others first-layer)", show_default=False, rich_help_panel="Deployment"),
]
StemOption = Annotated[
    Stem,
    typer.Option(help=f"The stem, the layers the image enters first: float leaves them (and the image) unquantized, a few percent of the compute; int8 quantizes them. auto measures: float where the stem's weights alone, quantized as these settings would, take the output's SQNR below {stem_service.STEM_FLOAT_BELOW_DB:g} dB on {stem_service.PROBE_IMAGES} calibration images. LiteRT is always int8."),
]
RoundingOption = Annotated[
    Rounding,
    typer.Option(help="How weights are rounded to their 8-bit codes: nearest (each weight alone), or learned (GPTQ: layer by layer, each rounding error moved onto the weights not yet rounded, weighted by the calibration inputs, then each bias corrected for the mean output error against FP32; same scales, pair rule kept). auto learns the rounding on 3/4 of the calibration images and keeps it where the output is closer to FP32 on the other 1/4. onnxruntime, openvino (its QDQ model converted) and litert (on the converter's grid); pytorch and --method nncf round to nearest."),
]
# Where a model runs: ONNX files on onnxruntime unless told; OpenVINO IR always on OpenVINO.
RuntimeOption = Annotated[
    Runtime | None,
    typer.Option(help="Run ONNX models on onnxruntime or on OpenVINO (IR models always run on OpenVINO); TFLite models on LiteRT (XNNPACK) or on tflm (TensorFlow Lite Micro's reference kernels: what a microcontroller runs, and its tensor arena). (default: each file's own runtime)", show_default=False, rich_help_panel="Runtime"),
]
PrecisionOption = Annotated[
    Precision | None,
    typer.Option(help="OpenVINO's inference precision hint, recorded with every figure (its own default on AMX CPUs is bf16). (default: f32)", show_default=False, rich_help_panel="Runtime"),
]


def _finite(value: float | None) -> float | None:
    """Click's float ranges let NaN through (every comparison with it is false)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value


# Counts and seeds shared by the commands, range-checked while parsing: before any work starts.
MAX_THREADS = 4 * (os.cpu_count() or 1)  # more threads than that only slows inference down
ThreadsOption = Annotated[
    int | None,
    typer.Option(min=1, max=MAX_THREADS, help=f"Inference threads, 1 to {MAX_THREADS}. (default: all cores)", show_default=False),
]


def _trust(value: bool) -> bool:
    trust.trust_remote_code(value)
    return value


TrustOption = Annotated[bool, typer.Option(
    "--trust-remote-code", callback=_trust,
    help="Load TorchScript (.pt) files ptq did not write. Loading one runs the code inside it: pass this only for files from a source you trust.")]
SeedOption = Annotated[int, typer.Option(min=0, max=2**32 - 1, help="Random seed for drawing the calibration images: the same seed gives the same images.")]
SamplesPerClassOption = Annotated[
    int | None,
    typer.Option(min=1, help=f"Calibration images drawn from each class. (default: {settings.SAMPLES_PER_CLASS}, or all of the smallest class if it has fewer)", show_default=False),
]
RunsOption = Annotated[int, typer.Option(min=1, max=10_000, help="Timed runs of each model for each measurement, after 10 warm-up runs (at most 10,000).")]


# One option block for the quantization settings, shared by quantize, sweep and sensitivity; each command
# gives its own defaults (quantize leaves them to the backend).
DTypeOption = Annotated[DType | None, typer.Option(help="Activation type (and weight type unless --weight-dtype is given). PyTorch, OpenVINO and LiteRT take int8 only. (default: int8; onnxruntime without --dtype, --weight-dtype or --target: --target speed)", show_default=False, rich_help_panel="Quantization")]
WeightDTypeOption = Annotated[WeightDType | None, typer.Option(help="Weight type. int4: 4-bit convolution filters (--backend litert: TFLite's INT4, run by TFLite Micro and LiteRT), rounded by GPTQ on the calibration images; the stem, fully-connected layers and any layer whose unpacked filter would enlarge TFLite Micro's arena stay in 8 bits (--max-flash-kb puts more back). (default: same as --dtype)", show_default=False, rich_help_panel="Quantization")]
PerChannelOption = Annotated[bool | None, typer.Option("--per-channel/--per-tensor", help="One weight scale per output channel, or one per tensor. Where no default is shown, the backend's: per-tensor for onnxruntime (per-channel for a model with depthwise convolutions, where one scale per tensor leaves most channels a few codes), per-channel for the others.", rich_help_panel="Quantization")]
MethodOption = Annotated[Method | None, typer.Option(help="Activation calibration, the backend's own: onnxruntime auto|minmax|entropy|percentile|per-image (per-image: each activation's range from the 99th percentile over the images of each image's own extremes, so that a few images far out of range do not set every image's scale; auto: minmax, percentile 99.999 and 99.99, per-image 99 and 90 each judged on held-out calibration images by the mean of each image's own output SQNR, so that no few images with large scores decide, the best kept; then each activation scale searched around it, kept where the held-out images come closer to FP32); pytorch auto|histogram|minmax|per-image (auto: histogram, minmax, per-image 99 and 90 judged the same way, histogram kept unless another is 0.5 dB closer); openvino onnxruntime's five (ptq's QDQ model, converted) or nncf (NNCF quantizes); litert minmax (the converter's) or percentile (ptq's rule on the TFLite tensors). Where no default is shown, the backend's first.", rich_help_panel="Quantization")]
PercentileOption = Annotated[float | None, typer.Option(callback=_finite, min=50, max=100, help="Percentile kept by --method percentile (of all values; default 99.999) or per-image (of each image's extremes; default 99).", show_default=False, rich_help_panel="Quantization")]


# One option block for the data and its preprocessing, shared by every command that reads images.
DataOption = Annotated[
    Path | None,
    typer.Option("--data", "--data-dir", help=f"Images, with labels or without, told apart by layout: CIFAR-10 python batches, an image folder (ROOT/train|test|val/<class>/*.png|jpg|…, ROOT/<class>/*, or ROOT/*.jpg without labels), or an .npz (images uint8 NHWC, labels[, class_names]). (default: ${settings.ASSETS_ENV}/cifar-10-batches-py, {settings.ASSETS_ENV}={settings.DEFAULT_ASSETS})", show_default=False, rich_help_panel="Data and preprocessing"),
]
CalibrationDataOption = Annotated[
    Path | None,
    typer.Option(help="Draw calibration (and tuning's validation) images from this dataset instead of --data's train split, e.g. when --data has only a test set. (default: --data)", show_default=False, rich_help_panel="Data and preprocessing"),
]
CalibrationSizeOption = Annotated[
    int | None,
    typer.Option(min=1, help=f"Calibration images in all, for every backend: drawn evenly over the classes of labelled images, at random from unlabelled ones. (default: {settings.SAMPLES_PER_CLASS} per class; {settings.CALIBRATION_IMAGES:,} images of an unlabelled set, or all it has)", show_default=False, rich_help_panel="Data and preprocessing"),
]
PresetOption = Annotated[
    Preset | None,
    typer.Option("--preprocess", help=f"The model's input normalisation, (pixels x scale - mean) / std: {inputs_service.describe_presets()}. Check your training recipe's values: many CIFAR recipes use std 0.2023,0.1994,0.2010, not cifar10-normalized's; give those with --scale/--mean/--std. (default: what a model ptq made says, else raw255)", show_default=False, rich_help_panel="Data and preprocessing"),
]
ScaleOption = Annotated[float | None, typer.Option(callback=_finite, help="Pixels (0-255) are multiplied by this, e.g. 0.00392157 for 0-1. (default: the preset's)", show_default=False, rich_help_panel="Data and preprocessing")]
MeanOption = Annotated[str | None, typer.Option(help="Per-channel mean subtracted after scaling, in the model's channel order (B,G,R with --bgr), or one value; in the units --scale gives (0-1 means need --scale 0.00392157). (default: the preset's)", show_default=False, rich_help_panel="Data and preprocessing")]
StdOption = Annotated[str | None, typer.Option(help="Per-channel standard deviation divided by after the mean, in the model's channel order (B,G,R with --bgr), or one value. (default: the preset's)", show_default=False, rich_help_panel="Data and preprocessing")]
BgrOption = Annotated[bool | None, typer.Option("--bgr/--rgb", help="Channel order the model takes. (default: RGB)", show_default=False, rich_help_panel="Data and preprocessing")]
InputSizeOption = Annotated[str | None, typer.Option("--input-size", metavar="<size>", help="Height and width (224, or 240x320) to feed a model whose input leaves them open (a dynamic-axes export); stored in the models made from it. (default: the size the model declares)", show_default=False, rich_help_panel="Data and preprocessing")]


@dataclass(frozen=True)
class DataChoice:
    data: Path
    calibration_data: Path | None
    flags: inputs_service.PreprocessingFlags
    calibration_size: int | None = None  # --calibration-size: calibration images in all
    data_given: bool = True  # whether --data was given (else `data` is the study's CIFAR-10)

    def dataset(self) -> Dataset:
        return open_dataset(self.data)

    def validation_dataset(self) -> Dataset:
        """Where tuning's validation images come from: never the images models are judged on."""
        return calibration_service.calibration_dataset(self.data, self.calibration_data, validation=True)


def _data(data: Path | None, calibration_data: Path | None, preset, scale: float | None, mean: str | None, std: str | None,
          bgr: bool | None, input_size: str | None = None, calibration_size: int | None = None) -> DataChoice:
    """The data and preprocessing options, validated before any work."""
    flags = inputs_service.make_flags(preset and preset.value, scale, mean, std, bgr, input_size)
    return DataChoice(data or settings.cifar_dir(), calibration_data, flags, calibration_size, data is not None)


def _option(name: str, annotation: Any, default: Any = None) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


# The data block's options, as parameters a command takes through `_with_data`.
DATA_PARAMETERS = (_option("data", DataOption), _option("calibration_data", CalibrationDataOption), _option("calibration_size", CalibrationSizeOption))
PREPROCESSING_PARAMETERS = (_option("preprocess", PresetOption), _option("scale", ScaleOption), _option("mean", MeanOption),
                            _option("std", StdOption), _option("bgr", BgrOption), _option("input_size", InputSizeOption))
NO_CHOICE: Any = None  # a command's `choice` before `_with_data` fills it in


def _with_data(calibration: bool = True, preprocessing: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The data and preprocessing options defined once: the command's `choice` parameter becomes --data
    (and --calibration-data) and the preprocessing options, parsed into one validated DataChoice."""
    block = DATA_PARAMETERS[: 3 if calibration else 1] + (PREPROCESSING_PARAMETERS if preprocessing else PREPROCESSING_PARAMETERS[-1:])  # the input size, always

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        parameters: list[inspect.Parameter] = []
        for parameter in signature.parameters.values():
            parameters += block if parameter.name == "choice" else (parameter,)

        @functools.wraps(command)
        def with_choice(**given: Any) -> None:
            values = {parameter.name: given.pop(parameter.name) for parameter in block}
            flags = (values.get("preprocess"), values.get("scale"), values.get("mean"), values.get("std"), values.get("bgr"), values.get("input_size"))
            return command(**given, choice=_data(values["data"], values.get("calibration_data"), *flags, values.get("calibration_size")))

        setattr(with_choice, "__signature__", signature.replace(parameters=parameters))  # noqa: B010  typer reads the new signature
        with_choice.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return with_choice

    return decorate


TargetOption = Annotated[Target | None, typer.Option(help="speed: the fast x86 configuration (onnxruntime: uint8 activations, int8 per-channel weights); other options still override it. onnxruntime's default when neither --dtype nor --weight-dtype is given: it follows FP32 as closely as int8 activations do, about twice as fast (docs).", show_default=False)]
GraphPreprocessOption = Annotated[bool, typer.Option("--graph-preprocess/--no-graph-preprocess", help="Run onnxruntime's quant_pre_process first (shape inference, folds batch-norm Mul/Add into Conv).")]
# One option block for how a model is quantized, shared by the commands that quantize: the command's `quantization`
# parameter becomes these options, and the backend table's --backend choices and each quantizer's own options
# (its module's Options, in its --help panel), read when typer builds the command (a backend registered later shows
# too); the command gets the validated QuantizationSettings.
QUANTIZATION_PARAMETERS = (
    _option("dtype", DTypeOption), _option("target", TargetOption), _option("weight_dtype", WeightDTypeOption),
    _option("per_channel", PerChannelOption), _option("method", MethodOption), _option("percentile", PercentileOption),
    _option("graph_preprocess", GraphPreprocessOption, True), _option("cpus", CpusOption, Cpus("all")), _option("overflow_fix", OverflowFixOption),
    _option("stem", StemOption, Stem(quant_settings.AUTO)), _option("rounding", RoundingOption, Rounding(AUTO_ROUNDING)),
)
COMMON_QUANTIZATION = ("dtype", "weight_dtype", "per_channel", "method", "percentile")  # what sweep and sensitivity take
NO_QUANTIZATION: Any = None  # a command's `quantization` before `_with_quantization` fills it in


def _backend_option_parameter(name: str, owner: backends.Backend) -> inspect.Parameter:
    options = owner.quantizes.options
    item = next(item for item in dataclasses.fields(options) if item.name == name)
    meta = item.metadata
    kind = _choices(f"{owner.name}_{name}", meta["choices"]) if meta["choices"] else meta["cli"]
    bounded_number = {"min": meta["minimum"]} if meta["minimum"] is not None and kind in (int, float) else {}
    option = typer.Option(*meta["flags"], help=meta["help"], show_default=False, rich_help_panel=options.panel or None, **bounded_number)
    return _option(name, Annotated[kind | None, option])


def _backend_parameter() -> inspect.Parameter:
    names = _choices("Backend", backends.quantizers())
    help_text = ". ".join(f"{row.name}: {row.summary}" for row in backends.TABLE.values() if row.quantizer is not None) + "."
    return _option("backend", Annotated[names, typer.Option(help=help_text)], names(backends.DEFAULT))


class _WithQuantization:
    """A command whose `quantization` parameter is the quantization block (`names` of it, with the command's own
    `defaults`; with the backend's, all of it)."""

    def __init__(self, command: Callable[..., Any], names: tuple[str, ...], defaults: dict[str, Any]) -> None:
        self.command, self.names, self.defaults = command, names, defaults
        self.__name__, self.__qualname__, self.__doc__, self.__module__ = command.__name__, command.__qualname__, command.__doc__, command.__module__
        self._built: tuple[tuple[int, ...], list[inspect.Parameter], list[str]] | None = None

    def _block(self) -> list[inspect.Parameter]:
        chosen = [parameter.replace(default=self.defaults.get(parameter.name, parameter.default))
                  for parameter in QUANTIZATION_PARAMETERS if parameter.name in self.names]
        if "backend" not in self.names:
            return chosen
        own = [_backend_option_parameter(name, owners[0]) for name, owners in backends.private_options().items()]
        deployment = [parameter.name for parameter in chosen].index("cpus")  # the backends' panels before the Deployment one
        return [_backend_parameter(), *chosen[:deployment], *own, *chosen[deployment:]]

    def _built_for_table(self) -> tuple[list[inspect.Parameter], list[str]]:
        """(the command's parameters, the block's names), built once for the table as it stands: the signature,
        the annotations and the call share one set of choices."""
        table = tuple(id(row) for row in backends.TABLE.values())
        if self._built is None or self._built[0] != table:
            block = self._block()
            parameters: list[inspect.Parameter] = []
            for parameter in inspect.signature(self.command, eval_str=True).parameters.values():
                parameters += block if parameter.name == "quantization" else (parameter,)
            self._built = (table, parameters, [parameter.name for parameter in block])
        return self._built[1], self._built[2]

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.Signature(self._built_for_table()[0])

    @property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]  # typer reads the types through typing.get_type_hints
        return {parameter.name: parameter.annotation for parameter in self._built_for_table()[0]}

    def __call__(self, **given: Any) -> None:
        block = {name: given.pop(name) for name in self._built_for_table()[1] if name in given}
        values: dict[str, Any] = {name: value.value if isinstance(value, Enum) else str(value) if isinstance(value, Path) else value
                                  for name, value in block.items()}
        preprocess = bool(values.pop("graph_preprocess", True))
        return self.command(**given, quantization=quant_settings.make_settings(preprocess=preprocess, **values))


WHOLE_QUANTIZATION = ("backend", *[parameter.name for parameter in QUANTIZATION_PARAMETERS])


def _with_quantization(names: tuple[str, ...] = WHOLE_QUANTIZATION, **defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return lambda command: _WithQuantization(command, names, defaults)


CalibrationFile = Annotated[
    Path | None,
    typer.Option(help=f"Calibration set from `ptq calibrate`, the same for every model made. (default: {settings.CALIBRATION_FILE} if it was drawn from the same dataset, else built with the calibrate defaults)", show_default=False),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (for scripts) instead of tables.")]
WorkersOption = Annotated[int | None, typer.Option(min=1, help="Run the independent work (each candidate, layer, sweep point or stage of ptq run; evaluate: shards of the split) as tasks on a local Ray instance of this many workers, started and stopped by ptq (the ray extra). (default: one after another in this process; Ray is not imported)", show_default=False, rich_help_panel="Workers")]
RayAddressOption = Annotated[str | None, typer.Option(help="Run the tasks on the Ray cluster at this address (e.g. 10.0.0.5:6379 or auto) instead of a local instance; every node needs ptq installed.", show_default=False, rich_help_panel="Workers")]


def _workers(count: int | None, address: str | None) -> executor_service.Workers:
    if count is not None and address is not None:
        raise PtqError("--workers and --ray-address: give one (a cluster has its own workers)")
    return executor_service.Workers(count, address)


def _emit(as_json: bool, result: Any, renderable: Any) -> None:
    out.print(render.as_json(result) if as_json else renderable, soft_wrap=as_json)
    out.file.flush()  # a full disk or closed pipe behind stdout is said now, naming it


@contextmanager
def _working(message: str) -> Iterator[None]:
    """A spinner on stderr for work with no measurable progress (piped: _heartbeat's lines, for long work only)."""
    if not err.is_terminal:
        with _heartbeat(message.rstrip("…")):
            yield
        return
    with err.status(message):
        yield


# Piped or logged, long work says it is alive: a line once it has run this long, then at least every HEARTBEAT_SECONDS.
HEARTBEAT_START_SECONDS, HEARTBEAT_SECONDS = 5.0, 30.0


@contextmanager
def _heartbeat(description: str) -> Iterator[Callable[[int, int], None]]:
    """Where stderr is not a terminal: a line when the work first counts progress (its input read, so an error
    before it stays one line) or once it has run HEARTBEAT_START_SECONDS, one at least every HEARTBEAT_SECONDS
    (how far, when the work counts), and one when it ends; nothing for quiet work done sooner."""
    began, state = time.monotonic(), {"done": 0, "total": 0, "said": False}
    stopped, lock = threading.Event(), threading.Lock()

    def say(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            err.print(text, highlight=False, soft_wrap=True)
            err.file.flush()

    def counted() -> str:
        return f", {state['done']:,}/{state['total']:,}" if state["total"] else ""

    def beat() -> None:
        wait = HEARTBEAT_START_SECONDS
        while not stopped.wait(wait):
            with lock:
                say(f"{description}: running, {time.monotonic() - began:,.0f} s{counted()}")
                state["said"], wait = True, HEARTBEAT_SECONDS

    def update(done: int, total: int) -> None:
        with lock:
            state.update(done=done, total=total)
            if not state["said"]:
                say(f"{description}: started{counted()}")
                state["said"] = True

    beater = threading.Thread(target=beat, name="ptq-heartbeat", daemon=True)
    beater.start()
    try:
        yield update
    finally:
        stopped.set()
        beater.join()
        if state["said"]:
            say(f"{description}: ended after {time.monotonic() - began:,.1f} s")


@contextmanager
def _progress_bar(description: str, lines: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (only on a terminal); yields the (done, total) callback services take. With
    `lines`, where stderr is not a terminal (a log), one line as each step finishes instead."""
    if lines and not err.is_terminal:
        yield lambda done, total: err.print(f"{description}: {done}/{total}", highlight=False, soft_wrap=True)
        return
    if not err.is_terminal:
        with _heartbeat(description) as update:
            yield update
        return
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@app.command()
def fetch(
    destination: Annotated[Path | None, typer.Option("--dest", help=f"Where the assets go. (default: ${settings.ASSETS_ENV}, {settings.ASSETS_ENV}={settings.DEFAULT_ASSETS})", show_default=False)] = None,
    mirror: Annotated[Path | None, typer.Option(help="Copy from this local copy (e.g. ../shared/assets) instead of downloading; checked by structure, not file hash.", show_default=False)] = None,
    asset: Annotated[list[Asset] | None, typer.Option(help="Only this asset; repeat for several. (default: both)", show_default=False)] = None,
    cifar_url: Annotated[str | None, typer.Option(help=f"CIFAR-10 python tarball URL (e.g. an internal mirror). (default: {fetch_service.CIFAR_URL})", show_default=False)] = None,
    cifar_md5: Annotated[str | None, typer.Option(help=f"Expected md5 of the tarball. (default: the published {fetch_service.CIFAR_MD5})", show_default=False)] = None,
    model_url: Annotated[str | None, typer.Option(help="MLPerf Tiny ResNet8 .h5 URL. (default: MLCommons Tiny on GitHub)", show_default=False)] = None,
    model_sha256: Annotated[str | None, typer.Option(help="Expected sha256 of the .h5. (default: the pinned one)", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Fetch again even if a valid copy is already in place.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Put CIFAR-10 and the MLPerf Tiny ResNet8 .h5 where ptq expects them: download (md5/sha256 checked) or copy a mirror.

    Downloads stream to a temporary file that is renamed into place only when complete and its checksum
    matches; CIFAR-10 is unpacked and validated (keys, shapes, label range, 1,000 test images per class)
    before it replaces anything. A valid copy already in place is kept unless --force.
    """
    with _byte_progress() as progress:
        result = fetch_service.fetch(
            destination or settings.assets_dir(),
            tuple(a.value for a in asset) if asset else fetch_service.ASSETS,
            mirror,
            fetch_service.cifar_source(cifar_url, cifar_md5),
            fetch_service.model_source(model_url, model_sha256),
            force,
            progress,
        )
    _emit(as_json, result, render.fetched(result))


@contextmanager
def _byte_progress() -> Iterator[Callable[[str, int, int], None]]:
    """One download/copy bar per asset on stderr (only on a terminal)."""
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        tasks: dict[str, Any] = {}

        def update(asset: str, done: int, total: int) -> None:
            if asset not in tasks:
                tasks[asset] = bar.add_task(f"Fetching {asset}", total=total or None)
            bar.update(tasks[asset], completed=done, total=total or None)

        yield update


@app.command()
@_with_data(calibration=False)
def convert(
    keras: Annotated[Path | None, typer.Option(help=f"Keras model to convert: a .keras or .h5 file, or a TensorFlow SavedModel folder (its ops vetted before TensorFlow loads it). (default: ${settings.ASSETS_ENV}/mlperf-tiny-resnet8/pretrainedResnet.h5)", show_default=False)] = None,
    output: Annotated[Path, typer.Option(help="Where to write the ONNX model converted from Keras.")] = settings.FP32_ONNX,
    onnx_source: Annotated[Path | None, typer.Option("--onnx", help="Start from this ONNX model instead of Keras (use with --torch).", show_default=False)] = None,
    torch_output: Annotated[Path | None, typer.Option("--torch", help="Also convert the ONNX model to PyTorch (onnx2torch), saved as TorchScript here, e.g. models/resnet8.pt.", show_default=False)] = None,
    opset: Annotated[int, typer.Option(min=10, max=21, help="ONNX opset for tf2onnx.")] = 13,
    check_images: Annotated[int, typer.Option(min=1, help=f"Test images (at least 1: every conversion is checked) on which source and converted outputs must agree within {convert_service.LIMIT}.")] = 1000,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> list[convert_service.ConversionResult]:
    """Convert Keras -> ONNX (tf2onnx) and/or ONNX -> PyTorch TorchScript (onnx2torch), checking each on real test images.

    Each conversion runs the source and the converted model on the same test images and prints the
    max absolute output difference and the top-1 agreement; beyond 0.1% of the largest output it exits 1 and writes nothing.
    """
    if onnx_source is not None and keras is not None:
        raise PtqError("--keras and --onnx: give one source model, not both")
    if onnx_source is not None and torch_output is None:
        raise PtqError("--onnx: converts an existing ONNX model to PyTorch and needs --torch PATH")
    check_outputs([("--output", None if onnx_source is not None else output, (".onnx",)), ("--torch", torch_output, (".pt",))],
                  [keras or (settings.keras_model_path() if onnx_source is None else None), onnx_source])
    dataset = choice.dataset()
    results = []
    if onnx_source is None:
        with _working("Converting Keras -> ONNX with tf2onnx and checking against Keras…"):
            results.append(convert_service.keras_to_onnx(keras or settings.keras_model_path(), output, dataset, opset, check_images, choice.flags))
    if torch_output is not None:
        with _working("Converting ONNX -> PyTorch with onnx2torch and checking against onnxruntime…"):
            results.append(convert_service.onnx_to_torchscript(onnx_source or output, torch_output, dataset, check_images, choice.flags))
    _emit(as_json, results if len(results) > 1 else results[0], Group(*map(render.conversion, results)))
    return results


@app.command()
@_with_data(preprocessing=False)
def calibrate(
    samples_per_class: SamplesPerClassOption = None,
    seed: SeedOption = settings.SEED,
    model: Annotated[Path | None, typer.Option(help="Resize the images to this model's input size (needed when a folder's images differ in size). (default: the images' own size)", show_default=False)] = None,
    output: Annotated[Path, typer.Option(help="Where to write the calibration set (.npz).")] = settings.CALIBRATION_FILE,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> calibration_service.SavedCalibration:
    """Draw a seeded, class-stratified calibration set from the dataset's train split (never its test split).

    The set holds the images as uint8 pixels; each model's own preprocessing is applied when quantizing.
    """
    with _working("Sampling the training images…"):
        saved = calibration_service.draw_and_save(model, choice.data, choice.calibration_data, output, samples_per_class, seed, choice.calibration_size,
                                                  choice.flags)
    calibration_set = saved.calibration
    summary = {"output": output, "samples": len(calibration_set.labels), "seed": seed, "per_class": calibration_set.per_class_counts,
               "dataset": calibration_set.dataset, "split": calibration_set.split, "pixel_range": calibration_set.pixel_range}
    _emit(as_json, summary, render.calibration(calibration_set, output))
    return saved


@app.command()
@_with_quantization()
@_with_data()
def quantize(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model to quantize (the PyTorch backend converts it with onnx2torch first; LiteRT starts from the Keras model `ptq convert --keras` made it from).")] = settings.FP32_ONNX,
    quantization: QuantizationSettings = NO_QUANTIZATION,
    calibration: CalibrationFile = None,
    output: Annotated[Path | None, typer.Option(help="Where to write the quantized model. (default: beside the model, <model>_<dtype>.onnx, <model>_pytorch_<dtype>.pt, <model>_openvino_<dtype>.xml or <model>_<dtype>.tflite)", show_default=False)] = None,
    results_dir: Annotated[Path, typer.Option(help="Records of earlier evaluations and benchmarks: the models made from the same FP32 model that they measured are named after quantizing, as the other choices.")] = settings.RESULTS_DIR,
    portability_cost: Annotated[bool, typer.Option("--portability-cost/--no-portability-cost", help="On a CPU with VNNI, for a model made for all CPUs with an overflow fix: quantize it again for VNNI CPUs alone (--cpus vnni) and say what running right on every x86 CPU costs, both measured against FP32 on the calibration images. Takes one more quantization. (env: PTQ_PORTABILITY_COST=0 turns the default off)", envvar="PTQ_PORTABILITY_COST", show_envvar=False, rich_help_panel="Quantization")] = True,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> quantize_service.QuantizeResult:
    """Static post-training quantization, calibrated on the calibration set: ONNX Runtime (QDQ), PyTorch (FX), OpenVINO (NNCF) or LiteRT (full-integer TFLite).

    The model's input (layout, channels, size, batch) is read from the model; its preprocessing comes
    from --preprocess/--scale/--mean/--std/--bgr and is stored in the quantized model, so evaluating it
    needs no flags. Models below opset 10 (13 for per-channel) are upgraded first.
    """
    request = quantize_service.QuantizeRequest(model, quantization, choice.data, choice.calibration_data, calibration, choice.calibration_size, choice.flags,
                                               output, results_dir, portability_cost)
    result = quantize_service.run(request, _progress_bar)
    _emit(as_json, result, render.quantization(result))
    return result


ExcludeFirst = Annotated[bool, typer.Option("--exclude-first/--prune-first", help="Leave the first convolution (3 input channels, 432 weights) dense.")]
ExcludeClassifier = Annotated[bool, typer.Option("--exclude-classifier/--prune-classifier", help="Leave the classifier (last Gemm/MatMul) dense.")]
Reconstruct = Annotated[bool, typer.Option("--reconstruct/--no-reconstruct", help="Re-fit the kept weights, layer by layer, by least squares on the calibration images (no labels, no training); --no-reconstruct is magnitude pruning alone.")]
ScopeOption = Annotated[Scope, typer.Option(help="global: one magnitude threshold across all pruned layers; layer: every layer to the same sparsity.")]


@app.command()
@_with_data()
def prune(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    sparsity: Annotated[float, typer.Option(callback=_finite, help="Fraction of the weights to set to zero, in [0, 1).")] = 0.5,
    scope: ScopeOption = Scope("global"),
    exclude_first: ExcludeFirst = False,
    exclude_classifier: ExcludeClassifier = False,
    reconstruct: Reconstruct = True,
    calibration: CalibrationFile = None,
    output: Annotated[Path | None, typer.Option(help="Where to write the pruned model. (default: beside the model, <model>_pruned<NN>.onnx)", show_default=False)] = None,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> None:
    """Magnitude pruning: zero the smallest Conv and Gemm/MatMul weights; biases and batch-norm stay untouched.

    Then, unless --no-reconstruct, the kept weights are re-fitted layer by layer by least squares on the
    calibration images, so each layer reproduces the original's output (no training, no labels). Writes
    an ordinary ONNX model (`ptq quantize --model` takes it) and prints the sparsity reached per layer.
    `ptq sweep` shows what pruning costs in accuracy, with and without the re-fit.
    """
    pruning_settings = prune_service.make_settings(sparsity, scope.value, exclude_first, exclude_classifier, reconstruct)
    destination = output or prune_service.default_output(model, sparsity, scope.value)
    check_model(model)
    images = None
    if reconstruct:
        images = _calibration_set(calibration, choice, model).images
    with _working("Pruning" + (" and re-fitting the kept weights…" if reconstruct else "…")):
        result = prune_service.prune_calibrated(model, destination, pruning_settings, images, choice.flags)
    _emit(as_json, result, render.pruning(result))


@app.command()
@_with_quantization(COMMON_QUANTIZATION, dtype=DType("int8"), per_channel=True, method=Method("percentile"))
@_with_data()
def sweep(
    sparsity: Annotated[str, typer.Option(help="Comma-separated sparsities to try, each in [0, 1).")] = "0,0.3,0.5,0.7",
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    quantization: QuantizationSettings = NO_QUANTIZATION,
    scope: ScopeOption = Scope("global"),
    exclude_first: ExcludeFirst = False,
    exclude_classifier: ExcludeClassifier = False,
    reconstruct: Reconstruct = True,
    calibration: CalibrationFile = None,
    models_dir: Annotated[Path, typer.Option(help="Where the pruned and quantized models go.")] = settings.MODELS_DIR / "sweep",
    results_dir: Annotated[Path, typer.Option(help="The sweep record goes to RESULTS_DIR/sweep/<model>_<dtype>_<scope>.json, which `ptq report` shows.")] = settings.RESULTS_DIR,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
) -> None:
    """For each sparsity: prune, quantize (onnxruntime), evaluate both on the test set; accuracy, size and gzipped size.

    Sparsity 0 is the unpruned model. Every point uses the same calibration set and settings (default:
    per-channel weights, percentile calibration). With --workers or --ray-address, each point is pruned
    and quantized as a task and each model evaluated in shards; the models and the record are the same.
    """
    where = _workers(workers, ray_address)
    sparsities = sweep_service.parse_sparsities(sparsity)
    pruning_check = prune_service.make_settings(0.0, scope.value, exclude_first, exclude_classifier, reconstruct)  # checked before any work
    check_model(model)
    calibration_set = _calibration_set(calibration, choice, model)
    with _progress_bar(f"Prune, quantize, evaluate ({where.describe()})", lines=True) as progress:
        result = sweep_service.sweep(
            model, sparsities, quantization, calibration_set, choice.dataset(), models_dir, results_dir,
            pruning_check, progress, choice.flags, where,
        )
    _emit(as_json, result, render.sweep(result))


ValidationPerClass = Annotated[
    int, typer.Option(min=1, help="Validation split size: training images per class, disjoint from the calibration set.")
]


def _calibration_set(calibration: Path | None, choice: DataChoice, model: Path):
    with _working("Loading the calibration set…"):
        return calibration_service.for_model(model, choice.data, choice.calibration_data, saved=calibration, reuse_default=True, flags=choice.flags,
                                             count=choice.calibration_size)


def _calibration_and_validation(calibration: Path | None, choice: DataChoice, model: Path, validation_per_class: int):
    calibration_set = _calibration_set(calibration, choice, model)
    with _working("Drawing the validation split (training images only)…"):
        return calibration_set, validation_service.build_validation_set(calibration_set, choice.validation_dataset(), validation_per_class)


@app.command()
@_with_quantization(COMMON_QUANTIZATION, dtype=DType("int8"), per_channel=False, method=Method("minmax"))
@_with_data()
def sensitivity(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    quantization: QuantizationSettings = NO_QUANTIZATION,
    calibration: CalibrationFile = None,
    validation_per_class: ValidationPerClass = settings.VALIDATION_PER_CLASS,
    results_dir: Annotated[Path, typer.Option(help="The record goes to RESULTS_DIR/sensitivity/<model>_<dtype>.json; each layer's scores to "
                                                   "RESULTS_DIR/tuning/candidates, shared with `ptq tune` (a layer scored before is not scored again).")] = settings.RESULTS_DIR,
    choice: DataChoice = NO_CHOICE,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Per layer: quantize that layer alone and measure the model's output SQNR and validation accuracy against FP32.

    Measured on the validation split (training images not in the calibration set), never the test set;
    sorted worst first. The layer names are what `ptq tune` leaves in float.
    """
    check_model(model)
    where = _workers(workers, ray_address)
    calibration_set, validation_set = _calibration_and_validation(calibration, choice, model, validation_per_class)
    with _progress_bar(f"Quantizing one layer at a time ({where.describe()})", lines=True) as progress:
        result = sensitivity_service.sensitivity(model, quantization, calibration_set, validation_set, progress, choice.flags, where, results_dir)
    record_file = sensitivity_service.save_result(result, results_dir)
    _emit(as_json, result, render.sensitivity(result, record_file))


@app.command()
@_with_data()
def tune(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    dtype: Annotated[DType, typer.Option(help="Activation type to tune for (uint8 also tries int8 weights).")] = DType("int8"),
    backend: Annotated[Backend, typer.Option(help="onnxruntime (QDQ), pytorch (FX, int8 only: granularity x observer x calibration size, no float layers) or openvino (NNCF, int8: preset x bias correction x calibration size x ignored scope); not litert.")] = Backend(backends.DEFAULT),
    max_drop: Annotated[float, typer.Option(callback=_finite, min=0, help="Accuracy budget: points below FP32 allowed on the validation split.")] = 0.05,
    method: Annotated[list[Method] | None, typer.Option(help="Calibration methods to search; repeat for several. (default: onnxruntime minmax and percentile at 99.9, 99.95, 99.99, 99.999; pytorch histogram and minmax)", show_default=False)] = None,
    per_channel: Annotated[bool | None, typer.Option("--per-channel/--per-tensor", help="Search only this weight granularity. (default: both)", show_default=False)] = None,
    max_float_layers: Annotated[int, typer.Option(min=0, help="Most sensitive layers to try leaving in float, one more at a time (0: none).")] = tune_service.MAX_FLOAT_LAYERS,
    calibration: CalibrationFile = None,
    validation_per_class: ValidationPerClass = settings.VALIDATION_PER_CLASS,
    output: Annotated[Path | None, typer.Option(help="Where to write the chosen model. (default: beside the model, <model>_<dtype>_tuned.onnx, <model>_pytorch_int8_tuned.pt or <model>_openvino_int8_tuned.xml)", show_default=False)] = None,
    results_dir: Annotated[Path, typer.Option(help="The record of the search goes to RESULTS_DIR/tuning/<output>.json.")] = settings.RESULTS_DIR,
    stem: StemOption = Stem(quant_settings.AUTO),
    choice: DataChoice = NO_CHOICE,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Search quantization settings for the smallest, fastest model within --max-drop of FP32.

    Every decision is made on the validation split (training images not in the calibration set); the
    test set is never read. Stages: calibration method x granularity x weight type (NNCF: preset x bias
    correction), calibration size, then the most sensitive layers left in float (NNCF: its ignored scope). Without any candidate in budget, the most accurate
    is kept and the command says so (exit 0).
    """
    check_model(model)
    tune_service.check_backend(backend.value)  # before any data is read
    where = _workers(workers, ray_address)
    calibration_set, validation_set = _calibration_and_validation(calibration, choice, model, validation_per_class)
    destination = output or tune_service.default_output(model, dtype.value, backend.value)
    with _progress_bar(f"Tuning {dtype.value} ({backend.value}, {where.describe()})", lines=True) as progress:
        result = tune_service.tune(
            model, dtype.value, max_drop, calibration_set, validation_set, destination, results_dir,
            methods=tuple(m.value for m in method) if method else None,
            granularities=(per_channel,) if per_channel is not None else (True, False),
            max_float_layers=max_float_layers,
            progress=progress,
            backend=backend.value,
            flags=choice.flags,
            stem=stem.value,
            workers=where,
        )
    _emit(as_json, result, render.tuning(result))


def _default_models() -> list[Path]:
    found, skipped = models_service.models_in(settings.MODELS_DIR, backends.suffixes())
    for path in skipped:
        err.print(f"skipped {path}: TorchScript ptq did not write (loading it runs its code; pass --model {path} {trust.OPTION} to load it)",
                  soft_wrap=True, highlight=False)
    if not found:
        raise PtqError(f"{settings.MODELS_DIR}: no {', '.join(backends.suffixes())} models to evaluate (run `ptq convert` or pass --model)")
    return found


@app.command()
@_with_data(calibration=False)
def evaluate(
    model: Annotated[list[Path] | None, typer.Option(help=MODELS_HELP, show_default=False)] = None,
    per_class: Annotated[bool, typer.Option("--per-class", help="Also show per-class accuracy, with the delta against the FP32 source model's record.")] = False,
    results_dir: Annotated[Path, typer.Option(help="Where to write one JSON record per model and dataset.")] = settings.RESULTS_DIR,
    batch_size: Annotated[int, typer.Option(min=1, help="Images per inference call (split over the threads).")] = settings.EVALUATION_BATCH,
    threads: ThreadsOption = None,
    choice: DataChoice = NO_CHOICE,
    runtime: RuntimeOption = None,
    precision: PrecisionOption = None,
    label: Annotated[str | None, typer.Option(help="What the report calls the model, beside its file name (one --model only).", show_default=False)] = None,
    int8_path: Annotated[Int8Path, typer.Option(help="Which x86 int8 path to score 8-bit onnxruntime and PyTorch models on: native (this CPU's), exact (VNNI/AMX, ARM), saturating (AVX2 without VNNI) or both. The path this CPU does not take comes from onnxruntime's exact kernels, a proof that the model cannot saturate, or emulation of an AVX2 CPU on --emulated-images images: its AVX2 kernels run natively with CPUID masked where Linux can fault CPUID (and a C compiler builds ptq's shim), onnxruntime's also in a copy of onnxruntime that sees no AVX-512 state (binutils' objdump makes it), else under qemu-x86_64 -cpu Haswell.", rich_help_panel="Runtime")] = Int8Path("native"),
    emulated_images: Annotated[int | None, typer.Option(min=10, help="Images (the first of each class) scored under emulation. Default: the whole split where the AVX2 kernels run natively while the model input it takes stays under 512 MB, else 1,000 (qemu: about 100 images/s on ResNet8).", show_default=False, rich_help_panel="Runtime")] = None,
    against_fp32: Annotated[Path | None, typer.Option("--against-fp32", help="The FP32 model to measure fidelity against (top-1 agreement, top-5 containment, SQNR and KL of the scores, on the same images; no labels needed). (default: the FP32 source a ptq-made model names, while that file is unchanged)", show_default=False)] = None,
    trust_remote_code: TrustOption = False,  # noqa: ARG001  taken by its callback while parsing
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
    as_json: JsonFlag = False,
) -> list[evaluate_service.Evaluated]:
    """Top-1 accuracy on the dataset's test split (val if it has no test), and fidelity to the FP32 model.

    A quantized model's delta is against its FP32 source model measured on the same images: the source
    (named in the model) is evaluated too if its record is missing. Its fidelity (top-1 agreement, top-5
    containment, SQNR, KL) is measured against that source, or --against-fp32, and needs no labels: on
    images whose labels are not the model's classes (or an unlabelled folder, ROOT/*.jpg), it is the
    measure. Records go to RESULTS_DIR/<model file>-<folder>@<dataset>.json, one per model file,
    runtime and dataset.
    """
    request = evaluate_service.EvaluationRequest(
        tuple(model or _default_models()), choice.dataset(), results_dir, int8_path.value, batch_size, threads, choice.flags, runtime and runtime.value,
        precision and precision.value, label, emulated_images, against_fp32, _workers(workers, ray_address))
    done = []
    for evaluated in evaluate_service.evaluate(request, _progress_bar):
        done.append(evaluated)
        warning = evaluate_service.outside_target(evaluated.record.model_path, (evaluated.record.quantization or {}).get("cpus"))
        if warning:
            err.print(f"warning: {warning}", soft_wrap=True)
        if not as_json:
            if evaluated.source_evaluated is not None:
                out.print(Text(f"Evaluated its FP32 source {evaluated.source_evaluated} too (no record of it on this dataset).", style="dim"))
            labelled = evaluated.record.accuracy is not None
            shown = (evaluate_service.classes_to_show(evaluated.record, evaluated.reference) if labelled else []) if per_class else None
            out.print(render.evaluation(evaluated.record, evaluated.reference, shown, evaluated.path, evaluated.reference_status))
    if as_json:
        out.print(render.as_json([evaluated.record for evaluated in done] if len(done) > 1 else done[0].record), soft_wrap=True)
    return done


@app.command()
@_with_data(calibration=False)
def benchmark(
    model: Annotated[list[Path] | None, typer.Option(help=MODELS_HELP, show_default=False)] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help=f"Batch size for the throughput measurement (latency is always at batch 1). (default: {benchmark_service.DEFAULT_BATCH} at 32x32; a larger input as many pixels a batch, at least {benchmark_service.MIN_BATCH} images: 16 at 224x224)", show_default=False)] = None,
    threads: ThreadsOption = None,
    runs: RunsOption = 100,
    results_dir: Annotated[Path, typer.Option(help="Records go to RESULTS_DIR/benchmarks/<model file>.json, read by `ptq report`.")] = settings.RESULTS_DIR,
    choice: DataChoice = NO_CHOICE,
    runtime: RuntimeOption = None,
    precision: PrecisionOption = None,
    also: Annotated[list[str] | None, typer.Option(help="Also time this model on another runtime in the same turns, as MODEL@RUNTIME[:PRECISION] (e.g. models/resnet8.onnx@openvino:f32: the ONNX file on OpenVINO at f32 beside its onnxruntime run); repeat for several.", show_default=False, rich_help_panel="Runtime")] = None,
    int8_path: Annotated[KernelPath, typer.Option(help="The kernels to time: native (this CPU's) or saturating (those of x86 CPUs without VNNI, AVX2: the speed an 8-bit model gives there). On a CPU with VNNI, every model, FP32 ones too, is timed in a child process that takes the AVX2 kernels at native speed: CPUID masked where Linux can fault CPUID (and a C compiler builds ptq's shim), or, for ONNX models, a copy of onnxruntime that sees no AVX-512 state (binutils' objdump makes it); never under qemu, whose pace says nothing of a CPU's. Records are kept apart from native ones (…~saturating.json).", rich_help_panel="Runtime")] = KernelPath("native"),
    trust_remote_code: TrustOption = False,  # noqa: ARG001  taken by its callback while parsing
    as_json: JsonFlag = False,
) -> benchmark_service.Benchmarked:
    """Latency at batch 1 (p50/p95/p99) and throughput at --batch-size, after warm-up, for ONNX, TorchScript, OpenVINO IR and TFLite models.

    The models are measured in turns, one run of each at a time, so that the machine's ups and downs reach
    them all alike: compare models in one call. At a batch, onnxruntime (spinning off), OpenVINO and TFLite
    models take their turns together; at batch 1, each runtime's models among themselves (so its threads are
    as warm as when serving alone); PyTorch models come last (their spinning threads would slow the next
    model). Throughput is the batch size over the median batch time. A model with a fixed batch runs chunks of it.
    Without --data (and without the study's CIFAR-10), the models are fed seeded random pixels of their input's
    size: speed needs no real images, and the output says what was fed.
    """
    dataset = choice.dataset() if choice.data_given or choice.data.exists() else None
    request = benchmark_service.BenchmarkRequest(tuple(model or _default_models()), dataset, results_dir, batch_size, threads, runs, choice.flags,
                                                 runtime and runtime.value, precision and precision.value,
                                                 tuple(map(benchmark_service.parse_also, also or ())), int8_path.value)
    result = benchmark_service.run(request, _progress_bar)
    for warning in result.warnings:
        err.print(f"warning: {warning}", soft_wrap=True)
    _emit(as_json, [{**render.plain(record), "speedup_vs_fp32": result.speedups[benchmark_service.run_key(record)]} for record in result.records],
          render.benchmarks(result.records, result.speedups))
    return result


@app.command()
def export(
    model: Annotated[Path, typer.Option(help="The .tflite model to export.")],
    c_array: Annotated[bool, typer.Option("--c-array", help="Write it as C source and header: a 16-byte-aligned const unsigned char array and its length, as TensorFlow Lite Micro projects compile in.")] = False,
    output_dir: Annotated[Path | None, typer.Option(help="Where to write <model>.c and <model>.h. (default: beside the model)", show_default=False)] = None,
    symbol: Annotated[str | None, typer.Option(help="The array's C name; its length is <symbol>_len. (default: from the file name, e.g. resnet8_int8_tflite)", show_default=False)] = None,
    arena: Annotated[bool, typer.Option("--arena/--no-arena", help="Run the model once on TensorFlow Lite Micro (with the litert extra) and write the tensor arena it allocated as <SYMBOL>_ARENA_BYTES; a model it cannot run is refused.")] = True,
    as_json: JsonFlag = False,
) -> None:
    """Export a model in the form a deployment compiles in (today: --c-array, for TFLite Micro)."""
    if not c_array:
        raise PtqError("--c-array: the one export format so far; pass it")
    result = export_service.export_c_array(model, output_dir, symbol, arena)
    _emit(as_json, result, render.exported(result))


@app.command()
def report(
    results_dir: Annotated[Path, typer.Option(help="Directory of JSON records written by `ptq evaluate`.")] = settings.RESULTS_DIR,
    markdown: Annotated[
        Path | None,
        typer.Option(help=f"Also write the report as Markdown, to PATH if given. (PATH defaults to {settings.MARKDOWN_REPORT})", metavar="[PATH]"),
    ] = None,
    plot: Annotated[bool, typer.Option("--plot", help="Also draw PNG charts (per-class accuracy; accuracy vs compressed size of `ptq sweep`) beside the Markdown report, linked from it; implies --markdown.")] = False,
    refresh: Annotated[bool, typer.Option("--refresh", help="First evaluate again every model whose file changed since its record (rows otherwise marked stale).")] = False,
    threads: ThreadsOption = None,
    trust_remote_code: TrustOption = False,  # noqa: ARG001  taken by its callback while parsing
    as_json: JsonFlag = False,
) -> report_service.Reported:
    """Compare every evaluated model: accuracy, delta, size, size reduction, speed.

    Reads the records, never re-evaluates (unless --refresh); each row is checked against the model file now on disk, and marked stale when the file changed since it was measured, or missing."""
    refreshed: list[Path] = []
    if refresh:
        with _working("Evaluating the models that changed since their records…"):
            refreshed = evaluate_service.refresh_stale(results_dir, threads)
    result = report_service.report_from_results(results_dir)
    if not result.rows:
        reason = f" ({result.skipped[0]})" if result.skipped else " (run `ptq evaluate` first)"
        raise PtqError(f"{results_dir}: no readable evaluation records{reason}")
    if plot and markdown is None:
        markdown = settings.MARKDOWN_REPORT
    charts: list[Path] = []
    if markdown is not None:
        chart_paths = report_service.chart_paths(markdown) if plot else {}
        check_outputs([("--markdown", markdown, (".md",)), *(("--plot", path, (".png",)) for path in chart_paths.values())],
                      [*report_service.input_files(results_dir)])
        charts = render.write_charts(result, chart_paths)
        write_text(markdown, render.report_markdown(result, charts))
    _emit(as_json, result, render.report(result))
    if markdown is not None and not as_json:
        out.print(f"Markdown report written to {markdown}" + (f"; charts: {', '.join(str(path) for path in charts)}" if charts else ""))
    return report_service.Reported(result, (*refreshed, *((markdown,) if markdown is not None else ()), *charts))


@app.command(name="run")
@_with_data()
def run_pipeline(
    model: Annotated[Path | None, typer.Option(help="Your FP32 ONNX classifier: the study runs on it (no Keras step), outputs named after it, e.g. models/<model>_int8.onnx. (default: the MLPerf Tiny ResNet8, converted from --keras)", show_default=False)] = None,
    keras: Annotated[Path | None, typer.Option(help=f"Keras .h5 model. (default: ${settings.ASSETS_ENV}/mlperf-tiny-resnet8/pretrainedResnet.h5)", show_default=False)] = None,
    samples_per_class: SamplesPerClassOption = None,
    seed: SeedOption = settings.SEED,
    pytorch: Annotated[bool, typer.Option("--pytorch/--no-pytorch", help="Also convert to TorchScript and quantize with PyTorch.")] = True,
    openvino: Annotated[bool, typer.Option("--openvino/--no-openvino", help="Also quantize with NNCF (full bias correction) to OpenVINO IR, and run the FP32 model on OpenVINO at f32; skipped when the openvino extra is not installed.")] = True,
    litert: Annotated[bool, typer.Option("--litert/--no-litert", help="Also quantize to int8 TFLite with the TFLite converter (the converter's calibration, and the ranges of the --target speed model), and evaluate and benchmark them with MLCommons' int8 TFLite ResNet8 (the MLPerf Tiny reference) on LiteRT; skipped when the litert extra is not installed or for --model.")] = True,
    benchmark: Annotated[bool, typer.Option("--benchmark/--no-benchmark", help="Benchmark every model (latency and throughput) for the report.")] = True,
    runs: RunsOption = 100,
    threads: ThreadsOption = None,
    force: Annotated[bool, typer.Option("--force", help="Run every stage, even those whose outputs are up to date.")] = False,
    emulated_images: Annotated[int | None, typer.Option(min=10, help="On a CPU with VNNI: images (the first of each class) of the test split scored under emulation of an AVX2 CPU, for each 8-bit model whose saturating path is not proven equal. Default: the whole split where the AVX2 kernels run natively, 500 under qemu (about 100 images/s on ResNet8).", show_default=False)] = None,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
) -> None:
    """The whole study: convert, calibrate, quantize (int8, uint8, speed, PyTorch), evaluate, benchmark, report.

    Each stage is skipped when its inputs (by sha256), its options and its outputs are those recorded in results/manifest.json
    by the run that made them. The manifest also keeps the tool and library versions, the seed and each stage's command and
    wall time. Outputs go to models/, calibration/, results/ and reports/ here. `ptq run --model yours.onnx --data DIR`
    runs it on your model and images; a backend that cannot take it is left out, and the run says why and goes on.
    With --workers or --ray-address, the stages that do not read each other's files run side by side as tasks, one CPU
    each (the benchmark and the report alone); a cluster must share the run's folder.
    """
    options = pipeline_service.StudyOptions(
        keras_model=keras, data_dir=choice.data, model=model,
        calibration_data=choice.calibration_data, flags=choice.flags, samples_per_class=samples_per_class, calibration_size=choice.calibration_size,
        without=frozenset(name for name, wanted in ((pipeline_service.PYTORCH, pytorch), (pipeline_service.OPENVINO, openvino),
                                                    (pipeline_service.LITERT, litert)) if not wanted),
        seed=seed, benchmark=benchmark, benchmark_runs=runs, threads=threads, force=force, emulated_images=emulated_images,
        workers=_workers(workers, ray_address))
    columns = (SpinnerColumn(finished_text="[green]✓[/green]"), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=not err.is_terminal) as display:
        tasks: dict[int, Any] = {}

        def on_stage(index: int, total: int, stage: pipeline_service.Stage, outcome: pipeline_service.StageOutcome | None) -> None:
            if not err.is_terminal:  # piped or logged: one plain line as each stage starts and as it ends
                err.print(render.stage_line(index, total, stage.name, outcome), highlight=False, soft_wrap=True)
                return
            label = escape(f"[{index + 1}/{total}] {stage.name}")
            if outcome is None:
                tasks[index] = display.add_task(label, total=1)
            else:
                display.update(tasks[index], completed=1, description=render.stage_label(label, outcome))

        result = pipeline_service.run(options, run_stage_command, list(COMMAND_LINE.get()), on_stage)
    _emit(as_json, result, render.pipeline_run(result))


@functools.cache
def _command_group() -> Any:
    """The click group typer builds from the app: built once, not once a stage (it takes longer than a small stage)."""
    return typer.main.get_command(app)


def run_stage_command(command: str, arguments: tuple[str, ...]) -> Any:
    """One stage of `ptq run`: the ptq command it is, parsed and run in this process as typed, its tables and
    progress kept off the terminal (the run shows its stages); returns the command's result. Its errors are
    the run's, said once by the run's own handler."""
    global out, err  # noqa: PLW0603  each command prints through these; a stage's go nowhere
    shown = out, err
    out = err = Console(file=io.StringIO(), markup=False)
    try:
        group = _command_group()
        with group.make_context("ptq", _fill_optional_values([command, *arguments])) as context:
            return group.invoke(context)
    finally:
        out, err = shown


def _reflow(text: str) -> str:
    """Docstring paragraphs as one line each (typer's rich mode keeps single line breaks); list items stay lines."""
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.splitlines()
        joined = lines[:1]
        for line in lines[1:]:
            if line.lstrip().startswith(("- ", "* ")):
                joined.append(line)
            else:
                joined[-1] += " " + line.strip()
        paragraphs.append("\n".join(joined))
    return "\n\n".join(paragraphs)


# Parameters that name what a command writes; every other path it is given, it reads.
OUTPUT_PARAMETERS = frozenset({"output", "torch_output", "output_dir", "results_dir", "models_dir", "destination", "markdown"})


def _read_paths(arguments: dict[str, Any]) -> list[Path]:
    paths: list[Path] = []
    for name, value in arguments.items():
        if name in OUTPUT_PARAMETERS:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Path):
                paths.append(item)
    return paths


def _guarding_inputs(command: Callable[..., Any]) -> Callable[..., Any]:
    """The command's input paths held for its duration: no output may be one of them (atomic.reading)."""

    @functools.wraps(command)
    def guarded(**arguments: Any) -> Any:
        with atomic.reading(_read_paths(arguments)):
            return command(**arguments)

    return guarded


for _command in app.registered_commands:
    _command.help = _reflow(_command.help or inspect.getdoc(_command.callback) or "")
    if _command.callback is not None:
        _command.callback = _guarding_inputs(_command.callback)


def main() -> None:
    app()
