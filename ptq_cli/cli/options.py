"""The options the commands share, as typer annotations: the data and preprocessing block, the quantization block
(built from the backend table, each backend's own options in its panel), counts, seeds and workers."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from ptq_cli import backends, settings
from ptq_cli import inputs as inputs_service
from ptq_cli.datasets import Dataset, open_dataset
from ptq_cli.errors import PtqError
from ptq_cli.guards import trust
from ptq_cli.quantize import overflow
from ptq_cli.quantize.rounding import AUTO as AUTO_ROUNDING
from ptq_cli.quantize.rounding import ROUNDING_CHOICES
from ptq_cli.services import executor as executor_service
from ptq_cli.services import fetch as fetch_service
from ptq_cli.services import quant_settings
from ptq_cli.services.make import calibration as calibration_service
from ptq_cli.services.make import prune as prune_service
from ptq_cli.services.make import stem as stem_service
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import plan as int8_plan


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


Int8Path = _choices("Int8Path", int8_plan.INT8_PATH_CHOICES)


KernelPath = _choices("KernelPath", int8_plan.KERNEL_PATH_CHOICES)


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
    typer.Option(help="How weights are rounded to their 8-bit codes: nearest (each weight alone), or learned (GPTQ: layer by layer, each rounding error moved onto the weights not yet rounded, weighted by the calibration inputs, then each bias corrected for the mean output error against FP32; same scales, pair rule kept). auto learns the rounding on 3/4 of the calibration images and keeps it where the output is closer to FP32 on the other 1/4. onnxruntime, openvino (its QDQ model, placed for OpenVINO, converted) and litert (on the converter's grid); pytorch and --method nncf round to nearest."),
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
    typer.Option(min=1, max=MAX_THREADS, help="Inference threads, from 1 to 4 per core. (default: all cores)", show_default=False),
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
class DataChoice(calibration_service.DataSource):
    """The data block's options as the services take them (a DataSource), and whether --data was given."""

    data_given: bool = True  # whether --data was given (else `data` is the study's CIFAR-10)

    def dataset(self) -> Dataset:
        return open_dataset(self.data)


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
