"""OpenVINO: runs OpenVINO IR (.xml + .bin) and, when asked (`--runtime openvino`), ONNX files; quantizes
into IR in one of two ways: by default ptq's own QDQ quantization (its calibration, pair rule, float stem and
learned rounding; quantize/qdq.py), its pairs placed where the CPU plugin fuses them (quantize/placement.py
OpenVinoCpu), which `openvino.convert_model` turns into IR and the CPU plugin runs on its int8 kernels; with
`--method nncf`, NNCF's (`nncf.quantize`, OpenVINO backend).

The CPU plugin's default inference precision on a CPU with AMX or AVX512-BF16 is bf16, which silently
costs accuracy; ptq always sets the hint (`f32` unless told) and records it with every figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends import base
from ptq_cli.backends.base import Backend, LoadedModel, Quantizer, RunOptions, Runtime, finish_load, float_parts
from ptq_cli.backends.base import describe_settings as describe_qdq_settings
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards.library_noise import native_stderr_silenced
from ptq_cli.model_file import (
    CONVOLUTION,
    ELEMENTWISE,
    TRANSPOSE,
    in_fixed_batches,
    layout_from_consumers,
    metadata_object,
    model_input,
    num_classes,
    read_bytes,
    read_onnx,
    resolve_threads,
)
from ptq_cli.quantize import placement, qdq
from ptq_cli.quantize.overflow import ALL_LAYERS, FIRST_LAYER, JUDGED
from ptq_cli.quantize.rounding import LEARNED, NEAREST
from ptq_cli.quantize.settings import BackendOptions, CommonChoices, QuantizationSettings, QuantizeCall, QuantizedFile, option

NAME = "openvino"
SUFFIX = ".xml"
PRECISIONS = ("f32", "bf16")
DEFAULT_PRECISION = "f32"
STATIC_SHAPES = 4  # batch sizes compiled for a static shape per model (each compile takes tens of milliseconds)
RT_INFO_SECTION = "ptq"  # ptq's metadata in the IR's rt_info: ptq/<key>
STORED_KEYS = (base.QUANTIZATION_METADATA_KEY, inputs.INPUT_METADATA_KEY, base.SOURCE_METADATA_KEY, base.PRUNING_METADATA_KEY)
# The layers with weights: what NNCF quantizes and what --ignored-scope leaves in float.
WEIGHTED_OPS = ("Convolution", "GroupConvolution", "ConvolutionBackpropData", "GroupConvolutionBackpropData", "MatMul")
# A name OpenVINO made up while converting (Multiply_2903, from a process-wide counter): it changes from
# one conversion to the next, so such layers are renamed by their place in the graph.
GENERATED_NAME = re.compile(r"^[A-Z][A-Za-z0-9]*_\d+$")
NNCF = "nncf"  # --method nncf: NNCF's own quantization; the other methods are onnxruntime's calibration, converted to IR


def sniff(head: bytes) -> bool:
    return head.lstrip().startswith((b"<?xml", b"<net"))


def available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def _openvino():
    try:
        import openvino
    except ImportError as error:
        raise PtqError("OpenVINO is not installed: pip install 'ptq-cli[openvino]' (make install does)") from error
    _decline_telemetry()
    return openvino


def _decline_telemetry() -> None:
    """OpenVINO's model converter and NNCF send usage events to Google Analytics unless the user has opted
    out (openvino_telemetry's consent file); ptq sends nothing. Without a network their sender, a forked
    process, also hangs the process at exit while it resolves the analytics host."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:
        return
    OptInChecker.check = lambda _self, *_args, **_kwargs: ConsentCheckResult.DECLINED


def _files(path: Path) -> list[Path]:
    """The files a model consists of: an IR's .xml and .bin, or the one ONNX file."""
    if path.suffix == SUFFIX:
        weights = path.with_suffix(".bin")
        if not weights.is_file():
            raise PtqError(f"{path}: its weights {weights.name} are missing (an OpenVINO IR is an .xml and a .bin)")
        return [path, weights]
    return [path]


def _stored(path: Path, model) -> dict[str, str]:
    """ptq's metadata: from the IR's rt_info, or from an ONNX file's metadata_props."""
    if path.suffix != SUFFIX:
        from ptq_cli.model_file import metadata

        return metadata(read_onnx(path))
    return {key: str(model.get_rt_info([RT_INFO_SECTION, key]).astype(str)) for key in STORED_KEYS if model.has_rt_info([RT_INFO_SECTION, key])}


def _dims(partial_shape) -> list:
    return [dim.get_length() if dim.is_static else None for dim in partial_shape]


def _graph_layout(value) -> tuple[str, int] | None:
    """layout_from_consumers (model_file) on OpenVINO's graph."""

    def reader(read) -> tuple[str, Any]:
        targets = list(read.get_target_inputs())
        if len(targets) != 1:
            return "", None
        node = targets[0].get_node()
        kind = node.get_type_name()
        if kind in ("Convolution", "GroupConvolution") and targets[0].get_index() == 0:
            filters = _dims(node.inputs()[1].get_partial_shape())
            return CONVOLUTION, (None if None in filters else  # G x O/G x I/G x ... for a group convolution
                                            filters[0] * filters[2] if kind == "GroupConvolution" else filters[1])
        if kind == "Transpose":
            return TRANSPOSE, node.outputs()[0]
        return (ELEMENTWISE if kind in ("Multiply", "Subtract", "Divide", "Add", "Convert") else ""), node.outputs()[0]

    return layout_from_consumers(value, reader)


def _read(core, path: Path) -> tuple[Any, int, str]:
    """(the model read by OpenVINO, its files' size and sha256), or a one-line error."""
    digest, size = hashlib.sha256(), 0
    for index, file in enumerate(_files(path)):
        data = read_bytes(file)
        if index == 0 and path.suffix == SUFFIX and not data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"<"):
            raise PtqError(f"{path}: not an OpenVINO IR (its .xml is not XML)")
        if index == 0 and path.suffix != SUFFIX:
            read_onnx(path, data)  # OpenVINO offers a file no frontend claims to the next (TensorFlow's, which logs to stderr)
        digest.update(data)
        size += len(data)
    try:
        with native_stderr_silenced():  # its frontends' own log lines (absl's "E0000 ...") would come before ptq's one line
            model = core.read_model(str(path))
    except Exception as error:  # OpenVINO raises RuntimeError subclasses for unreadable models
        raise PtqError(f"{path}: OpenVINO cannot read it ({first_line(error)})") from error
    if len(model.inputs) != 1:
        raise PtqError(f"{path}: {len(model.inputs)} inputs; ptq takes image classifiers with one image input")
    if not model.outputs:
        raise PtqError(f"{path}: the model has no outputs")
    return model, size, digest.hexdigest()


class _Compiled:
    """The model compiled for the CPU, dynamic in its batch, and for each of the first STATIC_SHAPES batch
    sizes it is given, a copy compiled for that static shape (its kernels skip the per-call shape inference)."""

    def __init__(self, ov, core, model, path: Path, described: inputs.ModelInput, config: dict, chunk: int | None) -> None:
        self.ov, self.core, self.model, self.path, self.described, self.config, self.chunk = ov, core, model, path, described, config, chunk
        try:
            compiled = self.core.compile_model(model, "CPU", config)
        except Exception as error:  # noqa: BLE001
            raise PtqError(f"{path}: OpenVINO cannot compile it ({first_line(error)})") from error
        self.dynamic = (compiled, compiled.create_infer_request())
        self.static: dict[int, tuple | None] = {}

    def _for(self, size: int) -> tuple:
        if self.chunk is not None:  # a graph tied to its batch is already static
            return self.dynamic
        if size not in self.static and len(self.static) < STATIC_SHAPES:
            try:
                fixed = self.model.clone()
                fixed.reshape({self.described.name: self.ov.PartialShape([size, *self.described.shape(1)[1:]])})
                exact = self.core.compile_model(fixed, "CPU", self.config)
                self.static[size] = (exact, exact.create_infer_request())
            except Exception:  # noqa: BLE001  a graph that will not take this batch statically runs dynamic
                self.static[size] = None
        return self.static.get(size) or self.dynamic

    def run(self, batch: np.ndarray) -> np.ndarray:
        chosen, request = self._for(len(batch))
        try:
            # Shared buffers save a copy each way; the output is copied out before the next call reuses it.
            outputs = request.infer({0: np.ascontiguousarray(batch)}, share_inputs=True, share_outputs=True)
            return np.array(outputs[chosen.output(0)]).reshape(len(batch), -1)
        except Exception as error:  # noqa: BLE001  OpenVINO's own exception types
            raise PtqError(f"{self.path}: OpenVINO failed to run it ({first_line(error)})") from error

    def predict(self, batch: np.ndarray) -> np.ndarray:
        return self.run(batch) if self.chunk is None else in_fixed_batches(self.run, batch, self.chunk)


def load(path: Path, options: RunOptions) -> LoadedModel:
    """The model compiled for the CPU with the precision hint set (f32 unless told) and `threads` threads;
    a fixed batch is reshaped to a dynamic one (OpenVINO re-infers the shapes)."""
    ov = _openvino()
    path = Path(path)
    precision = options.precision or DEFAULT_PRECISION
    if precision not in PRECISIONS:
        raise PtqError(f"--precision: '{precision}' is not one of {', '.join(PRECISIONS)}")
    options = replace(options, precision=precision)
    core = ov.Core()
    model, size, sha256 = _read(core, path)
    stored = _stored(path, model)
    value = model.inputs[0]
    declared = _dims(value.get_partial_shape())
    described = model_input(path, value.get_any_name(), declared, value.get_element_type() == ov.Type.f32, options.flags.size, _graph_layout(value))
    if None in declared[1:]:  # a height and width left open: the size --input-size gave
        try:
            model.reshape({value.get_any_name(): ov.PartialShape([declared[0] or -1, *described.shape(1)[1:]])})
        except Exception as error:  # noqa: BLE001  OpenVINO's own exception types
            raise PtqError(f"{path}: OpenVINO cannot take its input as {described.layout} {described.shape(1)[1:]} ({first_line(error)})") from error
    classes = num_classes(path, _dims(model.outputs[0].get_partial_shape()))
    note, chunk = None, None
    if described.batch is not None:
        try:
            model.reshape({value.get_any_name(): ov.PartialShape([-1, *described.shape(1)[1:]])})
            note = f"fixed batch {described.batch} made dynamic (OpenVINO reshape)"
        except Exception:  # noqa: BLE001  a graph tied to its batch: run it in chunks of that batch
            note, chunk = f"fixed batch {described.batch}: run {described.batch} at a time", described.batch
    config = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": resolve_threads(options.threads)}
    compiled = _Compiled(ov, core, model, path, described, config, chunk)
    quantization = metadata_object(path, stored, base.QUANTIZATION_METADATA_KEY)
    dtype = str((quantization or {}).get("dtype") or ("int8" if any(op.get_type_name() == "FakeQuantize" for op in model.get_ops()) else "fp32"))
    return finish_load(path, BACKEND, options, described=described, predict=compiled.predict, dtype=dtype, size_bytes=size, sha256=sha256,
                       stored=stored, declared_classes=classes, quantization=quantization, note=note)


# How OpenVINO's CPU plugin ran each layer (ProfilingInfo.node_type, exec_type): an exec type ending _i8/_u8 is an
# integer kernel; a standalone FakeQuantize or Convert converts precision; reorders and reshapes move data.
CONVERT_LAYERS = frozenset({"FakeQuantize", "Convert"})
LAYOUT_LAYERS = frozenset({"Reorder", "Transpose", "Reshape", "Concat", "Split", "Gather"})
PRODUCT_LAYERS = frozenset({"Convolution", "GroupConvolution", "FullyConnected", "MatMul", "Deconvolution"})


def layer_kind(node_type: str, exec_type: str) -> str:
    if exec_type.lower().endswith(("_i8", "_u8")):
        return base.INT8_KERNEL
    return base.CONVERT if node_type in CONVERT_LAYERS else base.LAYOUT if node_type in LAYOUT_LAYERS else base.FLOAT_KERNEL


def profile(path: Path, options: RunOptions, batch: np.ndarray, runs: int) -> base.RuntimeProfile:
    """OpenVINO's performance counters (PERF_COUNT) on the model compiled for `batch`'s shape, 1 thread, the precision
    hint `options` gives: each executed layer's time over `runs` runs after a warm-up run, summed by its layer type
    and how it ran (its exec type's precision)."""
    ov = _openvino()
    core = ov.Core()
    model, _, _ = _read(core, Path(path))
    try:
        model.reshape({model.inputs[0].get_any_name(): ov.PartialShape(list(batch.shape))})
    except Exception:  # noqa: BLE001  a graph tied to its batch: profiled at that batch
        batch = batch[: _dims(model.inputs[0].get_partial_shape())[0] or 1]
    config = {"PERF_COUNT": "YES", "INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": options.precision or DEFAULT_PRECISION}
    try:
        request = core.compile_model(model, "CPU", config).create_infer_request()
        request.infer({0: np.ascontiguousarray(batch)})
        layers: dict[tuple[str, str], tuple[set, float]] = {}
        for _ in range(runs):
            request.infer({0: np.ascontiguousarray(batch)})
            for info in (info for info in request.get_profiling_info() if str(info.status).endswith("EXECUTED")):
                key = (info.node_type, layer_kind(info.node_type, info.exec_type))
                names, micros = layers.get(key, (set(), 0.0))
                layers[key] = ({*names, info.node_name}, micros + info.real_time.total_seconds() * 1e6)
    except Exception as error:  # noqa: BLE001  OpenVINO's own exception types
        raise PtqError(f"{path}: OpenVINO cannot profile it ({first_line(error)})") from error
    ops = sorted((base.OpTime(op, kind, len(names), round(micros / 1000 / runs, 4)) for (op, kind), (names, micros) in layers.items()),
                 key=lambda op: -op.milliseconds)
    products = [op for op in ops if op.op in PRODUCT_LAYERS]
    return base.RuntimeProfile(tuple(ops), sum(op.nodes for op in products), sum(op.nodes for op in products if op.kind == base.INT8_KERNEL),
                               len(batch), runs, "OpenVINO's performance counters (PERF_COUNT), 1 thread")


def _convert(model):
    """openvino.convert_model of an ONNX model (onnx.ModelProto), its weighted layers named stably."""
    ov = _openvino()
    with tempfile.TemporaryDirectory(prefix="ptq-openvino-") as workdir:
        source = Path(workdir) / "source.onnx"
        source.write_bytes(model.SerializeToString())
        try:
            converted = ov.convert_model(str(source))
        except Exception as error:  # noqa: BLE001  the converter's own exception types
            raise PtqError(f"{model.graph.name or 'model'}: openvino.convert_model failed ({first_line(error)})") from error
    for index, op in enumerate(op for op in converted.get_ordered_ops() if op.get_type_name() in WEIGHTED_OPS):
        if GENERATED_NAME.match(op.get_friendly_name()):
            op.set_friendly_name(f"{op.get_type_name().lower()}_layer{index}")
    return converted


def _weighted_layers(converted) -> list[str]:
    return [op.get_friendly_name() for op in converted.get_ordered_ops() if op.get_type_name() in WEIGHTED_OPS]


def _stem_layers(converted) -> list[str]:
    """The weighted layers the input reaches without passing another one (the stem), by name."""
    frontier, seen, found = list(converted.get_parameters()), set(), []
    while frontier:
        for output in frontier.pop().outputs():
            for target in output.get_target_inputs():
                op = target.get_node()
                if op.get_type_name() in WEIGHTED_OPS:
                    if op.get_friendly_name() not in found:
                        found.append(op.get_friendly_name())
                elif op.get_friendly_name() not in seen:
                    seen.add(op.get_friendly_name())
                    frontier.append(op)
    return found


def layers(model) -> list[str]:
    """The names of the layers NNCF quantizes in the ONNX model (onnx.ModelProto), in graph order: what
    --ignored-scope and tune's float stage name."""
    return _weighted_layers(_convert(model))


def quantize(call: QuantizeCall) -> QuantizedFile:
    """The ONNX model (onnx.ModelProto) quantized on `calibration` (images in the model's input format) and
    written as IR (.xml + .bin, weights not compressed to fp16), both files through temporary names: with
    NNCF for `--method nncf`, else through ptq's onnxruntime QDQ quantization."""
    model, settings, calibration, stored = call.model, call.settings, call.calibration, call.stored
    output = Path(call.output)
    if output.suffix != SUFFIX:
        raise PtqError(f"--output: {output} must end in .xml (an OpenVINO IR is written as .xml and .bin)")
    if settings.method == NNCF:  # NNCF has its own overflow fix: first-layer where ptq's route would judge
        fix = FIRST_LAYER if settings.overflow_fix == JUDGED else settings.overflow_fix
        return _quantize_nncf(model, output, replace(settings, overflow_fix=fix), calibration, stored)
    if settings.float_nodes:
        raise PtqError(f"--ignored-scope: NNCF's ignored scope; applies to --backend openvino --method {NNCF}")
    ov = _openvino()
    # The QDQ engine's model with its pairs where OpenVINO's CPU plugin fuses them (placement.OpenVinoCpu: at the inputs of
    # convolutions and matrix products only), without space-to-depth (a regrouping for onnxruntime's own fast kernel):
    # the IR is that model converted.
    as_qdq = replace(settings, backend=qdq.WRITER, format=qdq.FORMAT, options=placement.Options(space_to_depth=False))
    with tempfile.TemporaryDirectory(prefix="ptq-openvino-") as workdir:
        written = qdq.quantize(replace(call, output=Path(workdir) / f"quantized{qdq.SUFFIX}", settings=as_qdq, stored=dict(stored)),
                               placement=placement.OPENVINO_CPU)
        try:
            converted = ov.convert_model(str(Path(workdir) / f"quantized{qdq.SUFFIX}"))
        except Exception as error:  # noqa: BLE001  the converter's own exception types
            raise PtqError(f"{model.graph.name or 'model'}: openvino.convert_model failed on the QDQ model ({first_line(error)})") from error
    applied = replace(written.settings or as_qdq, backend=NAME, format=BACKEND.format, options=settings.options)
    extra = {"space_to_depth_convs": [asdict(rewrite) for rewrite in written.space_to_depth]} if written.space_to_depth else {}
    return QuantizedFile(_save_ir(ov, converted, output, stored, applied, extra), written.space_to_depth, written.notes, applied)


def _quantize_nncf(model, output: Path, settings: QuantizationSettings, calibration: np.ndarray, stored: dict[str, str]) -> QuantizedFile:
    """NNCF post-training quantization of the model converted with openvino.convert_model, one NNCF sample per image."""
    ov = _openvino()
    import nncf

    # NNCF logs (INFO: ignored nodes ...) to stdout, which is for ptq's results (--json); its INFO lines repeat ptq's
    # own settings for every candidate `tune` makes. Its warnings go to stderr.
    nncf_logger = logging.getLogger("nncf")
    nncf_logger.setLevel(logging.WARNING)
    for handler in nncf_logger.handlers:
        if type(handler) is logging.StreamHandler:  # its own; not a subclass another tool (pytest) added
            handler.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed
    converted = _convert(model)
    layers = _weighted_layers(converted)
    unknown = [name for name in settings.float_nodes if name not in layers]
    if unknown:
        raise PtqError(f"--ignored-scope: '{unknown[0]}' is not a layer of {model.graph.name or 'the model'}; "
                       f"its layers: {', '.join(layers)}")
    ignored = list(settings.float_nodes) + (_stem_layers(converted) if settings.stem == "float" else [])
    samples = [calibration[index : index + 1] for index in range(len(calibration))]
    first = converted.inputs[0]
    if _dims(first.get_partial_shape())[0] not in (None, 1):
        converted.reshape({first.get_any_name(): ov.PartialShape([-1, *_dims(first.get_partial_shape())[1:]])})
    from nncf.quantization.advanced_parameters import OverflowFix

    overflow_fix = {FIRST_LAYER: OverflowFix.FIRST_LAYER, ALL_LAYERS: OverflowFix.ENABLE}.get(settings.overflow_fix or "", OverflowFix.DISABLE)
    options = settings.options if isinstance(settings.options, Options) else Options(NNCF_PRESETS[0], BIAS_CORRECTIONS[0])
    advanced = nncf.AdvancedQuantizationParameters(disable_bias_correction=options.bias_correction == "none", overflow_fix=overflow_fix)
    try:
        # NNCF draws its progress bars on stdout, which is for ptq's results (--json): they go to a terminal's stderr,
        # and nowhere when stderr is a log or a pipe (a bar redrawn as lines is noise there).
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stderr if sys.stderr.isatty() else devnull):
            quantized = nncf.quantize(
                converted,
                nncf.Dataset(samples),
                preset=nncf.QuantizationPreset.MIXED if options.nncf_preset == "mixed" else nncf.QuantizationPreset.PERFORMANCE,
                subset_size=options.subset_size or len(samples),
                fast_bias_correction=options.bias_correction != "full",
                ignored_scope=nncf.IgnoredScope(names=list(dict.fromkeys(ignored))) if ignored else None,
                advanced_parameters=advanced,
            )
    except Exception as error:  # noqa: BLE001  NNCF raises its own types (e.g. for an unknown ignored layer)
        raise PtqError(f"nncf.quantize failed ({type(error).__name__}: {first_line(error, '')})") from error
    return QuantizedFile(_save_ir(ov, quantized, output, stored, settings))


def _save_ir(ov, quantized, output: Path, stored: dict[str, str], settings: QuantizationSettings, described: dict | None = None) -> int:
    """The IR written with ptq's metadata (the settings beside `stored`) in its rt_info, through temporary
    names, the .bin first; its size in bytes (.xml + .bin)."""
    extra = json.loads(stored.get(base.QUANTIZATION_METADATA_KEY, "{}"))
    contents = {**stored, base.QUANTIZATION_METADATA_KEY: json.dumps({**settings.as_dict(), **(described or {}), **extra})}
    for key, value in contents.items():
        quantized.set_rt_info(value, [RT_INFO_SECTION, key])
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.{os.getpid()}-", suffix=".partial", dir=output.parent))
    try:
        try:
            ov.save_model(quantized, str(staging / output.name), compress_to_fp16=False)
        except RuntimeError as error:  # OpenVINO's C++ stream error on a full disk, with no errno to tell
            raise PtqError(f"{output}: cannot write the IR ({first_line(error, 'OpenVINO failed')}; is the disk full?)") from error
        weights = output.with_suffix(".bin")
        # The .bin first: an .xml on disk always has its weights beside it.
        os.replace(staging / weights.name, weights)
        os.replace(staging / output.name, output)
    finally:
        for leftover in staging.glob("*"):
            leftover.unlink(missing_ok=True)
        staging.rmdir()
    return output.stat().st_size + output.with_suffix(".bin").stat().st_size


NNCF_PRESETS = ("performance", "mixed")  # NNCF's: symmetric activations, or asymmetric ones
BIAS_CORRECTIONS = ("fast", "full", "none")


@dataclass(frozen=True)
class Options(BackendOptions, owner="NNCF", backends="openvino", article="an"):
    """NNCF's own settings (`--method nncf`); given alone, they ask for it."""

    nncf_preset: str | None = option(
        None, "--nncf-preset", "--preset", choices=NNCF_PRESETS,
        help="NNCF's preset (--backend openvino; --preset is its older name): performance (symmetric activations) or mixed (asymmetric). "
             "(default: performance)")
    bias_correction: str | None = option(
        None, choices=BIAS_CORRECTIONS, help="NNCF bias correction: fast, full (slower, often more accurate) or none. (default: fast)")
    subset_size: int | None = option(None, minimum=1, cli=int, help="Calibration samples NNCF uses. (default: the whole calibration set)")
    ignored_scope: tuple[str, ...] = option((), cli=list[str], help="A layer (node name) NNCF leaves in float; repeat for several.")

    def settle(self, common: CommonChoices) -> tuple[Options, CommonChoices]:
        given = self.given()
        method = common.method or (NNCF if given else None)  # an NNCF option says which quantizer is meant
        if method != NNCF:
            if given:
                raise PtqError(f"{given[0]}: an NNCF option; applies to --backend openvino --method {NNCF}")
            # onnxruntime's rules, less its space-to-depth (a regrouping for onnxruntime's own fast kernel).
            return self, placement.Options(space_to_depth=False).settle(common)[1]
        if "uint8" in (common.dtype, common.weight_dtype):
            raise PtqError("--dtype uint8: NNCF quantizes to int8 (its presets choose symmetric or asymmetric activations: --nncf-preset)")
        if common.per_channel is False:
            raise PtqError("--per-tensor: NNCF quantizes weights per channel on the CPU")
        if common.rounding == LEARNED:
            raise PtqError(f"--rounding learned: --method {NNCF} rounds NNCF's way (learned rounding: --backend openvino without --method {NNCF})")
        # Its ignored scope is the common list of float layers (tune fills it too).
        settled = replace(self, nncf_preset=self.nncf_preset or NNCF_PRESETS[0], bias_correction=self.bias_correction or BIAS_CORRECTIONS[0],
                          ignored_scope=())
        return settled, replace(common, method=NNCF, per_channel=True, rounding=NEAREST, float_nodes=(*common.float_nodes, *self.ignored_scope))

    def describe(self) -> str:
        if self.nncf_preset is None:
            return ""
        return f"NNCF {self.nncf_preset} preset, {self.bias_correction} bias correction" + (f", {self.subset_size} samples" if self.subset_size else "")

    def stored(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if name != "ignored_scope"}  # held as float_nodes


def _describe(settings: dict) -> str:
    if settings.get("method") != NNCF:
        return describe_qdq_settings({**settings, "format": "IR from QDQ"})
    parts = [f"NNCF IR a:{settings['dtype']} w:{settings.get('weight_dtype', settings['dtype'])}", f"{settings.get('nncf_preset')} preset",
             f"{settings.get('bias_correction')} bias correction", f"{settings.get('subset_size') or settings.get('calibration_samples', '?')} samples"]
    return ", ".join(parts + float_parts(settings))


def _overflow_words(settings: dict) -> dict[str, str]:
    """NNCF keeps its models exact its own way; ptq's QDQ route by the pair rule (the common words)."""
    return {FIRST_LAYER: "NNCF overflow fix, first layer", ALL_LAYERS: "NNCF overflow fix, all layers"} if settings.get("method") == NNCF else {}


def _tune_grid(_dtype: str, _methods: tuple[str, ...]) -> list[dict]:
    """NNCF's own calibration choices: its preset x its bias correction."""
    return [{"method": NNCF, "nncf_preset": preset, "bias_correction": correction} for preset in NNCF_PRESETS for correction in BIAS_CORRECTIONS]


def _fast_on_x86(settings: QuantizationSettings) -> bool:
    # The CPU plugin runs every QDQ model on its int8 kernels; NNCF's fast preset has symmetric activations.
    return settings.method != NNCF or (isinstance(settings.options, Options) and settings.options.nncf_preset == "performance")


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format="IR", available=available, companion_suffixes=(".bin",),
    summary="onnxruntime QDQ (learned rounding) or, with --method nncf, nncf.quantize; saved as OpenVINO IR (.xml + .bin)",
    quantizer=Quantizer(
        # ptq's onnxruntime route with its calibration methods and defaults (per-tensor unless the model has depthwise
        # convolutions, the pair rule, learned rounding), or NNCF: min/max statistics of its preset, then bias correction,
        # weights per channel. Tune searches NNCF's settings.
        quantize, methods=(*qdq.METHODS, NNCF), tune_methods=(NNCF,), per_channel=False, granularities=(True,),
        overflow_fixes=(FIRST_LAYER, ALL_LAYERS), clamped_overflow_fix=ALL_LAYERS, judges_overflow_fix=True, learned_rounding=True,
        options=Options, describe=_describe, tune_grid=_tune_grid, float_layers=layers, fast_on_x86=_fast_on_x86,
        overflow_words=_overflow_words, keeps_time_budget=True,
    ),
    # ONNX files too (`--runtime openvino`), always with a precision hint.
    runtime=Runtime(load, profile=profile, runs_suffixes=(".onnx",), precisions=PRECISIONS,
                    settings="CPU plugin, INFERENCE_NUM_THREADS threads, one synchronous infer request, compiled for each batch size"),
)
