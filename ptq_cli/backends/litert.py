"""LiteRT (TensorFlow Lite): runs .tflite models with the LiteRT interpreter (`ai-edge-litert`, not the whole
of TensorFlow), float or full-integer, honouring the input and output quantization (scale, zero point); and
quantizes to a full-integer .tflite with the TFLite converter, from the Keras model an ONNX model was
converted from (`ptq convert --keras` records it).

A full-integer model takes int8 or uint8 input: ptq prepares float images as for any model (scale, mean,
std), then quantizes them with the input tensor's own scale and zero point, as a device would.

Quantizing: the converter calibrates on ptq's calibration set (its min/max per tensor), ptq may replace
those ranges (its percentile rule, or the ranges of an onnxruntime model), then the converter's quantizer
turns them into int8 tensors, the path TensorFlow's own QuantizationDebugger takes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli.backends import base
from ptq_cli.backends.base import Backend, LoadedModel, Quantizer, RunOptions, Runtime, finish_load
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.guards.library_noise import native_stderr_silenced
from ptq_cli.model_file import (
    KERAS_SAVE_HINT,
    file_sha256,
    in_fixed_batches,
    metadata_object,
    model_input,
    num_classes,
    read_bytes,
    resolve_threads,
)
from ptq_cli.quantize.int4 import Mixed, to_int4
from ptq_cli.quantize.overflow import NO_FIX
from ptq_cli.quantize.policy import held_out_mask, held_out_split
from ptq_cli.quantize.rounding import LEARNED, NEAREST
from ptq_cli.quantize.settings import (
    AUTO_METHOD,
    INT4,
    BackendOptions,
    CommonChoices,
    QuantizationSettings,
    QuantizeCall,
    QuantizedFile,
    option,
)
from ptq_cli.quantize.tflite import (
    INTEGER_TYPES,
    IO_DTYPES,
    as_input,
    calibrated_tflite,
    choose_method,
    import_tensorflow,
    interpreter_class,
    io_quantization,
    judged_scores,
    quantized_tflite,
    ranged_tensors,
    ranges_model,
    refined,
    transferred_ranges,
    with_method,
    with_ranges,
)
from ptq_cli.transforms.tflite_layout import microcontroller_layout

NAME = "litert"
SUFFIX = ".tflite"
FORMAT = "TFLite"
METADATA_PREFIX = "ptq."  # ptq's entries in the flatbuffer's metadata; TFLite Micro ignores metadata


def sniff(head: bytes) -> bool:
    """A TFLite flatbuffer carries the identifier "TFL3" at bytes 4-8."""
    return head[4:8] == b"TFL3"


def available() -> bool:
    try:
        import ai_edge_litert.interpreter  # noqa: F401
    except ImportError:
        return False
    return True


def describe_io(detail: dict) -> str:
    """e.g. "int8 (scale 1, zero point -128)" or "float32"."""
    quantization = io_quantization(detail)
    kind = INTEGER_TYPES.get(np.dtype(detail["dtype"]), np.dtype(detail["dtype"]).name)
    return kind if quantization is None else f"{kind} (scale {quantization[0]:g}, zero point {quantization[1]})"


def verify(data: bytes, path: Path) -> None:
    """The flatbuffer checked by LiteRT's interpreter (its verifier), before a runtime that trusts it reads it."""
    Interpreter = interpreter_class()
    try:
        Interpreter(model_content=data)
    except (ValueError, RuntimeError) as error:
        raise PtqError(f"{path}: LiteRT cannot load it ({first_line(error)})") from error


def _allocated(path: Path, data: bytes, threads: int):
    """LiteRT's interpreter on the model, its tensors allocated."""
    Interpreter = interpreter_class()
    try:
        with native_stderr_silenced():  # XNNPACK's "Created ... delegate" line; failures still raise with their reason
            interpreter = Interpreter(model_content=data, num_threads=threads)
            interpreter.allocate_tensors()
    except (ValueError, RuntimeError) as error:
        raise PtqError(f"{path}: LiteRT cannot load it ({first_line(error)})") from error
    input_details, output_details = interpreter.get_input_details(), interpreter.get_output_details()
    if len(input_details) != 1:
        raise PtqError(f"{path}: {len(input_details)} inputs; ptq takes image classifiers with one image input")
    if not output_details:
        raise PtqError(f"{path}: the model has no outputs")
    return interpreter


def load(path: Path, options: RunOptions) -> LoadedModel:
    """The model in the LiteRT interpreter with `threads` threads; a batch dimension declared dynamic is
    resized to each batch, a fixed one runs that many images at a time."""
    path = Path(path)
    data = read_bytes(path)
    interpreter = _allocated(path, data, resolve_threads(options.threads))
    image, scores = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    signature = [int(dim) for dim in image.get("shape_signature", image["shape"])]
    described = model_input(path, image["name"], [dim if dim > 0 else None for dim in signature])
    classes = num_classes(path, [int(dim) for dim in scores["shape"]])
    dynamic = signature[0] < 1
    chunk = None if dynamic else max(int(image["shape"][0]), 1)
    output_quantization = io_quantization(scores)
    input_type = np.dtype(image["dtype"])
    state = {"batch": int(image["shape"][0])}

    def run(batch: np.ndarray) -> np.ndarray:
        if dynamic and len(batch) != state["batch"]:
            interpreter.resize_tensor_input(image["index"], [len(batch), *described.shape(1)[1:]])
            interpreter.allocate_tensors()
            state["batch"] = len(batch)
        batch = as_input(batch, image)
        try:
            interpreter.set_tensor(image["index"], np.ascontiguousarray(batch, dtype=input_type))
            interpreter.invoke()
            result = interpreter.get_tensor(scores["index"])
        except (ValueError, RuntimeError) as error:
            raise PtqError(f"{path}: LiteRT failed to run it ({first_line(error)})") from error
        result = result.reshape(len(batch), -1).astype(np.float32)
        if output_quantization is not None:
            scale, zero_point = output_quantization
            result = (result - zero_point) * scale
        return result

    def predict(batch: np.ndarray) -> np.ndarray:
        return run(batch) if chunk is None else in_fixed_batches(run, batch, chunk)

    stored = metadata(data)
    tensor_types = {np.dtype(detail["dtype"]) for detail in interpreter.get_tensor_details()}
    dtype, quantization = made(path, tensor_types, stored, np.dtype(image["dtype"]), describe_io(image), describe_io(scores))
    note = None if dynamic else f"fixed batch {chunk}: run {chunk} at a time"
    return finish_load(path, BACKEND, options, described=described, predict=predict, dtype=dtype, size_bytes=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), stored=stored, declared_classes=classes, quantization=quantization, note=note)


def made(path: Path, tensor_types: set[np.dtype], stored: dict[str, str], input_type: np.dtype, input_words: str,
         output_words: str) -> tuple[str, dict | None]:
    """(data type, quantization) of a .tflite from its tensors' types: how ptq quantized it, if it did (else
    named by its input's type: legacy uint8 models), with its input and output described."""
    if not tensor_types & set(INTEGER_TYPES):
        return "fp32", None
    settings = metadata_object(path, stored, base.QUANTIZATION_METADATA_KEY) or {}
    dtype = settings.get("dtype") or INTEGER_TYPES.get(np.dtype(input_type), "int8")
    return dtype, {**settings, "format": FORMAT, "dtype": dtype, "weight_dtype": settings.get("weight_dtype") or "int8", "input": input_words,
                   "output": output_words}


def tensor_types(data: bytes) -> set[np.dtype]:
    """The types of the tensors of a .tflite's first subgraph, read from the flatbuffer."""
    from ai_edge_litert import schema_py_generated as schema

    names = {value: name for name, value in vars(schema.TensorType).items() if not name.startswith("_")}
    numpy_types = {"FLOAT32": np.float32, "FLOAT16": np.float16, "INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64}
    try:
        graph = schema.Model.GetRootAs(data, 0).Subgraphs(0)
        found = {names.get(graph.Tensors(index).Type()) for index in range(graph.TensorsLength())}
    except Exception:  # noqa: BLE001  a flatbuffer the interpreter loaded but this reader does not
        return set()
    return {np.dtype(numpy_types[name]) for name in found if name in numpy_types}


def metadata(data: bytes) -> dict[str, str]:
    """ptq's entries in a .tflite's metadata (name -> text)."""
    from ai_edge_litert import schema_py_generated as schema

    try:
        model = schema.Model.GetRootAs(data, 0)
        entries = {}
        for index in range(model.MetadataLength()):
            entry = model.Metadata(index)
            name = (entry.Name() or b"").decode("utf-8", "replace")
            buffer = model.Buffers(entry.Buffer())
            if name.startswith(METADATA_PREFIX) and buffer is not None and buffer.DataLength():
                entries[name] = buffer.DataAsNumpy().tobytes().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001  a flatbuffer the interpreter loaded but this reader does not: no ptq metadata
        return {}
    return entries


# Quantizing: from the Keras source, with the TFLite converter.


def keras_source(onnx_model) -> Path:
    """The Keras file `ptq convert --keras` recorded in the ONNX model, checked to be unchanged."""
    name = onnx_model.graph.name or "model"
    stored = {prop.key: prop.value for prop in onnx_model.metadata_props}
    entry = metadata_object(Path(name), stored, base.KERAS_SOURCE_METADATA_KEY)
    if entry is None:
        raise PtqError(f"{name}: --backend litert quantizes the Keras model an ONNX model was converted from, and this one names "
                       "none (ptq convert --keras records it); ptq does not convert ONNX graphs to TFLite")
    path = Path(str(entry.get("path", "")))
    if path.is_dir():
        raise PtqError(f"{name}: its TensorFlow source {path} is a SavedModel folder; --backend litert quantizes from a .keras or .h5 file "
                       f"({KERAS_SAVE_HINT})")
    if not path.is_file():
        raise PtqError(f"{name}: its Keras source {path} is missing")
    if file_sha256(path) != entry.get("sha256"):
        raise PtqError(f"{name}: its Keras source {path} has changed since the conversion (sha256 differs); convert it again")
    return path


def _with_metadata(quantized: bytes, entries: dict[str, str]) -> bytes:
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    model_object = flatbuffer_utils.convert_bytearray_to_object(quantized)
    model_object.metadata = list(model_object.metadata or [])
    for name, text in entries.items():
        buffer = schema.BufferT()
        buffer.data = np.frombuffer(text.encode("utf-8", "surrogateescape"), np.uint8)
        model_object.buffers.append(buffer)
        entry = schema.MetadataT()
        entry.name, entry.buffer = name, len(model_object.buffers) - 1
        model_object.metadata.append(entry)
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model_object))


def quantize(call: QuantizeCall) -> QuantizedFile:
    """A full-integer .tflite of the Keras model the ONNX `model` was converted from, calibrated on
    `calibration` (images in the model's input format, which is the Keras model's); ptq's settings and
    input contract go into the flatbuffer's metadata."""
    model, settings, calibration, stored, progress = call.model, call.settings, call.calibration, call.stored, call.progress
    output = Path(call.output)
    if output.suffix != SUFFIX:
        raise PtqError(f"--output: {output} must end in {SUFFIX}")
    keras_path = keras_source(model)
    options = _options(settings)
    ranges_from = Path(options.ranges_from) if options.ranges_from else None
    qdq = ranges_model(ranges_from, stored.get(base.SOURCE_METADATA_KEY)) if ranges_from else None
    calibration = calibration.astype(np.float32, copy=False)
    io_type = getattr(import_tensorflow(), IO_DTYPES[options.io or "int8"])
    if settings.method == AUTO_METHOD:
        settings = choose_method(keras_path, calibration, settings, io_type)
    calibrated = calibrated_tflite(keras_path, calibration, progress)
    from tensorflow.lite.tools import flatbuffer_utils

    notes: list[str] = []
    if ranges_from:
        tensors = ranged_tensors(flatbuffer_utils.convert_bytearray_to_object(calibrated))
        ranges, unmatched = transferred_ranges(ranges_from, qdq, calibrated, tensors, calibration)
        notes.append(f"activation ranges of {len(ranges)} of {len(tensors)} tensors from {ranges_from.name}"
                     + (f"; {len(unmatched)} kept the converter's min/max" if unmatched else ""))
        calibrated = with_ranges(calibrated, ranges)
    else:
        calibrated = with_method(calibrated, settings.method, settings.percentile, calibration)
    quantized = quantized_tflite(calibrated, settings, io_type, keras_path)
    if settings.weight_dtype != INT4 and settings.rounding != NEAREST:
        quantized, settings, rounded = refined(quantized, calibrated, calibration, settings)
        notes += rounded
    if settings.weight_dtype == INT4:
        quantized, four_bit = _four_bit(quantized, calibrated, calibration, settings, lambda data: _entries(data, settings, stored, keras_path))
        notes.append(four_bit)
        settings = replace(settings, rounding=LEARNED)
    layout = microcontroller_layout(quantized, _tflm_arena())
    quantized = layout.data
    if layout.changes:
        notes.append(f"laid out for a microcontroller (same outputs): {'; '.join(layout.changes)}")
    data = _entries(quantized, settings, stored, keras_path)
    if options.max_flash_kb is not None and len(data) > options.max_flash_kb * 1024:
        notes.append(f"{len(data):,} bytes: over --max-flash-kb {options.max_flash_kb:g} ({options.max_flash_kb * 1024:,.0f} bytes) with every "
                     "layer that can be 4-bit in 4 bits")
    with atomic_output(output) as tmp:
        tmp.write_bytes(data)
    return QuantizedFile(len(data), notes=tuple(notes), settings=settings)


def _entries(quantized: bytes, settings: QuantizationSettings, stored: dict[str, str], keras_path: Path) -> bytes:
    """The model with ptq's metadata: only the settings that were set (the file is what a microcontroller stores)."""
    described = {key: value for key, value in settings.as_dict().items() if value is not None and value != ()}
    extra = json.loads(stored.get(base.QUANTIZATION_METADATA_KEY, "{}"))
    return _with_metadata(quantized, {**stored, base.QUANTIZATION_METADATA_KEY: json.dumps({**described, **extra, "keras_source": keras_path.name},
                                                                                             separators=(",", ":"))})


FLASH_SLACK = 64  # bytes kept free under --max-flash-kb for the settings the metadata records after the choice


def _four_bit(quantized: bytes, calibrated: bytes, calibration: np.ndarray, settings: QuantizationSettings,
              written: Callable[[bytes], bytes]) -> tuple[bytes, str]:
    """The int8 model's filters made 4-bit, layer by layer on the calibration images fed as the model's int8 input;
    with --max-flash-kb, the layers whose 4 bits cost most back in 8 bits while the file (`written`: as it will be
    written, laid out and with its metadata) fits. (model, note)."""
    from ptq_cli.metrics import sqnr_db

    image = interpreter_class()(model_content=quantized).get_input_details()[0]
    mixed, max_flash_kb = None, _options(settings).max_flash_kb
    if max_flash_kb is not None:
        judged_images = held_out_split(calibration)[0]
        reference = judged_scores(calibrated, judged_images)
        budget = max_flash_kb * 1024 - FLASH_SLACK
        mixed = Mixed(fits=lambda data: len(written(microcontroller_layout(data).data)) <= budget,
                      judge=lambda data: sqnr_db(reference, judged_scores(data, judged_images)))
    int4 = to_int4(quantized, as_input(calibration, image), mixed=mixed, held=held_out_mask(len(calibration)))
    judged = f"; 8 bits back where they gain most output SQNR on {len(judged_images)} calibration images" if mixed else ""
    aimed = (f"; aimed at the int8 model's outputs, taking up the earlier layers' error: {', '.join(int4.compensating)}" if int4.compensating
             else "")
    return int4.data, (f"int4 filters: {len(int4.layers)} layers (GPTQ codes and clipping, bias corrected, on {len(calibration)} calibration "
                       f"images{judged}{aimed}); 8-bit: {', '.join(int4.kept) or 'none'}")


def _tflm_arena():
    """TFLite Micro's arena figure for a flatbuffer (it judges the op order), or None without TFLite Micro."""
    from ptq_cli.backends import tflm_interpreter

    return tflm_interpreter.arena_of if tflm_interpreter.available() else None


IO_TYPES = ("int8", "uint8", "float")  # the first is TFLite Micro's; float keeps float I/O around the int8 body


@dataclass(frozen=True)
class Options(BackendOptions, owner="LiteRT", backends="litert"):
    """LiteRT's own options: the flatbuffer's I/O types, whose activation ranges it takes, what must fit a microcontroller."""

    io: str | None = option(
        None, choices=IO_TYPES,
        help="Type of the .tflite's input and output tensors: int8 (what TFLite Micro wants), uint8, or float around the int8 body. (default: int8)")
    ranges_from: str | None = option(
        None, cli=Path,
        help="An onnxruntime QDQ model ptq quantized from the same FP32 model: its activation ranges (scale, zero point) replace the converter's "
             "calibration, tensor by tensor, so both models compute on the same grid.")
    max_flash_kb: float | None = option(
        None, cli=float,
        help="With --weight-dtype int4: the flash the .tflite may take, in KB (1,024 bytes). The 4-bit layers whose 4 bits cost most (output SQNR "
             "against the float model on calibration images, measured layer by layer) go back to 8 bits while the file stays within it. "
             "(default: none go back)")

    def settle(self, common: CommonChoices) -> tuple[Options, CommonChoices]:
        if "uint8" in (common.dtype, common.weight_dtype):
            raise PtqError("--dtype uint8: a full-integer TFLite model computes in int8; --io uint8 gives it uint8 input and output")
        settled = replace(self, io=self.io or IO_TYPES[0], ranges_from=str(self.ranges_from) if self.ranges_from is not None else None)
        if self.ranges_from is not None:
            if common.method not in (None, AUTO_METHOD, "minmax"):
                raise PtqError(f"--method {common.method}: --ranges-from takes the activation ranges from {self.ranges_from} instead")
            common = replace(common, method="minmax")  # the converter's min/max, then replaced by the other model's ranges
        if self.max_flash_kb is not None:
            if common.weight_dtype != INT4:
                raise PtqError("--max-flash-kb: a flash budget chooses which layers keep 8-bit weights in a 4-bit model (--weight-dtype int4)")
            if not self.max_flash_kb > 0:
                raise PtqError(f"--max-flash-kb: {self.max_flash_kb} is not a positive size in KB")
        return settled, common

    def describe(self) -> str:
        ranges = f", activation ranges from {self.ranges_from}" if self.ranges_from else ""
        budget = f", within {self.max_flash_kb:g} KB of flash" if self.max_flash_kb is not None else ""
        return f"input / output tensors {self.io}{ranges}{budget}"

    def input_files(self) -> tuple[Path, ...]:
        return (Path(self.ranges_from),) if self.ranges_from else ()


def _options(settings: QuantizationSettings) -> Options:
    return settings.options if isinstance(settings.options, Options) else Options()


def _describe(settings: dict) -> str:
    """A full-integer .tflite: its tensors' types, how ptq calibrated it (if it did), its I/O quantization."""
    parts = [f"TFLite a:{settings['dtype']} w:{settings.get('weight_dtype', settings['dtype'])}"]
    if "per_channel" in settings:  # ptq made it: how it was calibrated
        parts.append("per-channel" if settings["per_channel"] else "per-tensor")
        ranges = settings.get("ranges_from")
        parts.append(f"ranges of {ranges.replace(chr(92), '/').rsplit('/', 1)[-1]}" if ranges else
                     settings.get("method", "?") + (f" {settings['percentile']:g}" if settings.get("percentile") else ""))
        parts.append(f"{settings.get('calibration_samples', '?')} samples")
        if settings.get("weight_dtype") == INT4:
            budget = f"; layers back in 8 bits within {settings['max_flash_kb']:g} KB" if settings.get("max_flash_kb") else ""
            parts.append(f"GPTQ int4 conv filters (stem and fully-connected layers int8{budget})")
    return ", ".join([*parts, f"input {settings.get('input', '?')}", f"output {settings.get('output', '?')}"])


def _output_name(stem: str, settings: QuantizationSettings) -> str:
    return f"{stem}_{settings.dtype}{'_ranges' if _options(settings).ranges_from else ''}{'_w4' if settings.weight_dtype == INT4 else ''}{SUFFIX}"


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format=FORMAT, available=available, summary="the TFLite converter, full-integer int8 .tflite for TFLite Micro",
    quantizer=Quantizer(
        # The TFLite converter's min/max, or ptq's percentile rule (onnxruntime's histogram collector) on the same tensors, by
        # default whichever measures best (choose_method); XNNPACK widens to int16 before adding, so no overflow fix.
        quantize, methods=(AUTO_METHOD, "minmax", "percentile"), per_channel=True, overflow_fixes=(NO_FIX,),
        float_stem=False,  # full-integer: every layer int8
        int4_weights=True,  # TFLite's INT4 filters (quantize/int4.py)
        learned_rounding=True,  # refined: GPTQ int8 codes and bias correction (quantize/tflite_rounding.py)
        options=Options, describe=_describe, output_name=_output_name,
        tune_refused="--backend litert: tune searches onnxruntime, pytorch and openvino; for TFLite use ptq quantize --backend litert "
                     "(--method, --per-tensor, --ranges-from a tuned onnxruntime model)",
    ),
    runtime=Runtime(load, settings="ai-edge-litert Interpreter with its default XNNPACK delegate, num_threads threads, a fixed batch run that "
                                   "many images per invoke"),
)
