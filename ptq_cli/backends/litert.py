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

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from ptq_cli.backends import base
from ptq_cli.backends.base import (
    AUTO_METHOD,
    INT4,
    METHOD_CANDIDATES,
    Backend,
    LoadedModel,
    ProgressCallback,
    QuantizationSettings,
    QuantizedFile,
    Quantizer,
    RunOptions,
    Runtime,
    chosen_method,
    finish_load,
    held_out_mask,
    held_out_split,
    rounding_image_count,
    sqnr_figure,
)
from ptq_cli.backends.model_file import (
    KERAS_SAVE_HINT,
    file_sha256,
    in_fixed_batches,
    load_keras,
    metadata_object,
    model_input,
    num_classes,
    read_bytes,
    read_onnx,
    resolve_threads,
)
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.guards.library_noise import native_stderr_silenced
from ptq_cli.transforms.int4 import Mixed, to_int4
from ptq_cli.transforms.overflow import NO_FIX
from ptq_cli.transforms.rounding import LEARNED, NEAREST
from ptq_cli.transforms.tflite_graph import op_kind
from ptq_cli.transforms.tflite_layout import microcontroller_layout
from ptq_cli.transforms.tflite_rounding import learned_int8
from ptq_cli.transforms.tflm_kernels import reference_codes

NAME = "litert"
SUFFIX = ".tflite"
FORMAT = "TFLite"
INTEGER_TYPES = {np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8"}
METADATA_PREFIX = "ptq."  # ptq's entries in the flatbuffer's metadata; TFLite Micro ignores metadata
# Images run through both models to tell which onnxruntime tensor is which TFLite tensor (--ranges-from).
MATCH_IMAGES = 32
MATCH_TOLERANCE = 0.05  # relative distance of the per-image mean and spread of the two tensors' values
ACTIVATION_BATCH = 100  # images per interpreter call while collecting activations


def sniff(head: bytes) -> bool:
    """A TFLite flatbuffer carries the identifier "TFL3" at bytes 4-8."""
    return head[4:8] == b"TFL3"


def available() -> bool:
    try:
        import ai_edge_litert.interpreter  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreter_class():
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as error:
        raise PtqError("LiteRT is not installed: pip install 'ptq-cli[litert]' (make install does)") from error
    return Interpreter


def io_quantization(detail: dict) -> tuple[float, int] | None:
    """(scale, zero point) of an integer tensor, None for a float one."""
    if np.dtype(detail["dtype"]) not in INTEGER_TYPES:
        return None
    scale, zero_point = detail["quantization"]
    return float(scale), int(zero_point)


def as_input(images: np.ndarray, detail: dict) -> np.ndarray:
    """Images in the model's input format (float) as its input tensor takes them: quantized with its scale and zero point."""
    quantization = io_quantization(detail)
    if quantization is None:
        return images.astype(np.float32)
    scale, zero_point = quantization
    limits = np.iinfo(np.dtype(detail["dtype"]))
    return np.clip(np.round(images / scale + zero_point), limits.min, limits.max).astype(detail["dtype"])


def describe_io(detail: dict) -> str:
    """e.g. "int8 (scale 1, zero point -128)" or "float32"."""
    quantization = io_quantization(detail)
    kind = INTEGER_TYPES.get(np.dtype(detail["dtype"]), np.dtype(detail["dtype"]).name)
    return kind if quantization is None else f"{kind} (scale {quantization[0]:g}, zero point {quantization[1]})"


def verify(data: bytes, path: Path) -> None:
    """The flatbuffer checked by LiteRT's interpreter (its verifier), before a runtime that trusts it reads it."""
    Interpreter = _interpreter_class()
    try:
        Interpreter(model_content=data)
    except (ValueError, RuntimeError) as error:
        raise PtqError(f"{path}: LiteRT cannot load it ({first_line(error)})") from error



def _allocated(path: Path, data: bytes, threads: int):
    """LiteRT's interpreter on the model, its tensors allocated."""
    Interpreter = _interpreter_class()
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

IO_DTYPES = {"int8": "int8", "uint8": "uint8", "float": "float32"}


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


@contextlib.contextmanager
def _quiet():
    """TensorFlow prints the exported signature on stdout, which is for ptq's results (--json), and logs
    from C++ on stderr; its failures come as exceptions."""
    with native_stderr_silenced(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def _tensorflow():
    try:
        with _quiet():
            import tensorflow as tf
    except ImportError as error:
        raise PtqError(f"--backend litert: needs tensorflow-cpu to convert (pip install 'ptq-cli[keras,litert]'; make install does): {error}") from error
    return tf


def _key(step: str, keras_path: Path, calibration: np.ndarray, *settings: object) -> Callable[[], str]:
    """What a step's result within one `ptq run` is keyed by (base.computed_once): the Keras file, the images, settings."""
    return lambda: base.digest(step.encode(), bytes.fromhex(file_sha256(keras_path)), repr((calibration.shape, str(calibration.dtype), settings)).encode(),
                               np.ascontiguousarray(calibration).tobytes())


def _calibrated(keras_path: Path, calibration: np.ndarray, progress: ProgressCallback | None = None) -> bytes:
    """The float TFLite model with the converter's calibration statistics (min/max per tensor) over
    `calibration`, one image per step, not yet quantized; within `ptq run`, made once for its TFLite models."""
    return base.computed_once(_key("calibrated", keras_path, calibration), lambda: _calibrate(keras_path, calibration, progress), size=len)


def _calibrate(keras_path: Path, calibration: np.ndarray, progress: ProgressCallback | None = None) -> bytes:
    tf = _tensorflow()
    with _quiet():
        keras_model = load_keras(tf, keras_path)
    expected = tuple(keras_model.input_shape[1:])
    if tuple(calibration.shape[1:]) != expected:
        raise PtqError(f"{keras_path}: takes input {expected}, the ONNX model's calibration images are {tuple(calibration.shape[1:])}")
    converter = tf.lite.TFLiteConverter.from_keras_model(keras_model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    def one_at_a_time():
        for index in range(len(calibration)):
            if progress is not None:
                progress(index, len(calibration))
            yield [calibration[index : index + 1]]

    converter.representative_dataset = one_at_a_time
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter._experimental_calibrate_only = True  # noqa: SLF001  the statistics, to adjust before quantizing
    try:
        with _quiet():
            return bytes(converter.convert())
    except Exception as error:  # noqa: BLE001  the converter's own exception types
        raise PtqError(f"{keras_path}: the TFLite converter failed ({_last_line(error)})") from error


def _last_line(error: Exception) -> str:
    """TensorFlow's converter errors end with the line that says what failed."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def _ranged_tensors(model_object) -> list[int]:
    """The tensors the converter calibrated (a min/max each), but the model's outputs: a softmax's output
    range is fixed by its kernel."""
    graph = model_object.subgraphs[0]
    outputs = set(int(index) for index in graph.outputs)
    return [index for index, tensor in enumerate(graph.tensors)
            if index not in outputs and tensor.quantization is not None and tensor.quantization.min is not None
            and len(tensor.quantization.min) == 1]


def _activations(calibrated: bytes, tensors: list[int], images: np.ndarray):
    """The float values of `tensors` on `images`, ACTIVATION_BATCH images at a time (index -> array)."""
    from ai_edge_litert.interpreter import OpResolverType

    Interpreter = _interpreter_class()
    # Without the XNNPACK delegate: a delegated graph does not keep its inner tensors, whatever is asked.
    interpreter = Interpreter(model_content=calibrated, experimental_preserve_all_tensors=True,
                              experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    image = interpreter.get_input_details()[0]
    for start in range(0, len(images), ACTIVATION_BATCH):
        batch = images[start : start + ACTIVATION_BATCH]
        interpreter.resize_tensor_input(image["index"], list(batch.shape))
        interpreter.allocate_tensors()
        interpreter.set_tensor(image["index"], np.ascontiguousarray(batch, dtype=np.float32))
        interpreter.invoke()
        yield {index: interpreter.get_tensor(index) for index in tensors}


def _percentile_ranges(calibrated: bytes, tensors: list[int], calibration: np.ndarray, percentile: float) -> dict[int, tuple[float, float]]:
    """ptq's --method percentile on the TFLite tensors: onnxruntime's own histogram collector, with the
    settings onnxruntime's percentile calibration uses (2,048 bins, asymmetric)."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    collector = HistogramCollector(method="percentile", symmetric=False, num_bins=2048, num_quantized_bins=128,
                                   percentile=percentile, scenario="same")
    with contextlib.redirect_stdout(io.StringIO()):  # it print()s its progress; stdout is ptq's own (--json)
        for values in _activations(calibrated, tensors, calibration):
            collector.collect({str(index): [value] for index, value in values.items()})
        result = collector.compute_collection_result()
    return {int(index): (float(bounds[0]), float(bounds[1])) for index, bounds in result.items()}


def _grid_ranges(qdq) -> dict[str, tuple[float, float]]:
    """The float range each activation QuantizeLinear of an onnxruntime QDQ model covers, by tensor name."""
    from onnx import numpy_helper

    constants = {initializer.name: numpy_helper.to_array(initializer) for initializer in qdq.graph.initializer}
    ranges = {}
    for node in qdq.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in constants or len(node.input) < 3:
            continue
        scale, zero_point = constants.get(node.input[1]), constants.get(node.input[2])
        if scale is None or zero_point is None or scale.size != 1:
            continue
        limits = np.iinfo(zero_point.dtype)
        ranges[node.input[0]] = ((limits.min - int(zero_point)) * float(scale), (limits.max - int(zero_point)) * float(scale))
    return ranges


def _signature(values: np.ndarray) -> np.ndarray:
    """Per image, the mean and spread of a tensor's values: the same whatever the layout."""
    flat = values.reshape(len(values), -1).astype(np.float64)
    return np.concatenate([flat.mean(axis=1), flat.std(axis=1)])


def _ranges_model(ranges_from: Path, source_sha256: str | None):
    """The onnxruntime QDQ model --ranges-from names, checked to be made by ptq from the same FP32 model."""
    qdq = read_onnx(ranges_from)
    made_from = {prop.key: prop.value for prop in qdq.metadata_props}.get(base.SOURCE_METADATA_KEY)
    if source_sha256 is None or made_from != source_sha256:
        raise PtqError(f"--ranges-from: {ranges_from} was not quantized by ptq from this FP32 model")
    if not _grid_ranges(qdq):
        raise PtqError(f"--ranges-from: {ranges_from} has no quantized activations (an onnxruntime QDQ model is needed)")
    return qdq


def _transferred_ranges(ranges_from: Path, qdq, calibrated: bytes, tensors: list[int],
                        calibration: np.ndarray) -> tuple[dict[int, tuple[float, float]], list[int]]:
    """The activation ranges of an onnxruntime QDQ model made from the same FP32 model, each TFLite tensor
    matched to the onnxruntime tensor whose values it has on the same images; and the tensors left unmatched."""
    import onnx
    import onnxruntime

    grids = _grid_ranges(qdq)
    names = list(grids)
    outputs = {output.name for output in qdq.graph.output}
    qdq.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names if name not in outputs)
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = onnxruntime.InferenceSession(qdq.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001  onnxruntime's own exception types
        raise PtqError(f"--ranges-from: {ranges_from}: onnxruntime cannot load it ({first_line(error)})") from error
    first = session.get_inputs()[0]
    images = calibration[:MATCH_IMAGES]
    fixed = first.shape[0] if isinstance(first.shape[0], int) and first.shape[0] > 0 else None
    widths: list[int] = []

    def run(batch: np.ndarray) -> np.ndarray:
        """Every named tensor, flattened per image, side by side (a tensor without the batch first: NaN)."""
        values = [value.reshape(len(batch), -1) if value.ndim and value.shape[0] == len(batch) else np.full((len(batch), 1), np.nan)
                  for value in session.run(names, {first.name: batch})]
        widths[:] = [value.shape[1] for value in values]
        return np.concatenate(values, axis=1)

    flat = run(images) if fixed is None else in_fixed_batches(run, images, fixed)
    bounds = np.cumsum([0, *widths])
    onnx_values = {name: flat[:, bounds[k] : bounds[k + 1]] for k, name in enumerate(names)}
    tflite_values = next(_activations(calibrated, tensors, images))
    # onnxruntime drops a ReLU its QuantizeLinear does anyway (zero point 0): what a tensor holds is its
    # values clipped to its grid.
    signatures = {name: _signature(np.clip(values, *grids[name])) for name, values in onnx_values.items()}
    matched, unmatched = {}, []
    for index in tensors:
        wanted = _signature(tflite_values[index])
        width = int(np.prod(tflite_values[index].shape[1:]))
        candidates = [(np.linalg.norm(signatures[name] - wanted) / (np.linalg.norm(wanted) + 1e-12), name)
                      for name in names if onnx_values[name].shape[1] == width]
        distance, name = min(candidates, default=(np.inf, None))
        if name is not None and distance <= MATCH_TOLERANCE:
            matched[index] = grids[name]
        else:
            unmatched.append(index)
    return matched, unmatched


def _with_ranges(calibrated: bytes, ranges: dict[int, tuple[float, float]]) -> bytes:
    """The calibrated model with these (min, max) in place of the converter's statistics (each widened to
    hold 0, as every quantizer does)."""
    from tensorflow.lite.tools import flatbuffer_utils

    model_object = flatbuffer_utils.convert_bytearray_to_object(calibrated)
    tensors = model_object.subgraphs[0].tensors
    for index, (low, high) in ranges.items():
        tensors[index].quantization.min = np.array([min(low, 0.0)], np.float32)
        tensors[index].quantization.max = np.array([max(high, 0.0)], np.float32)
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model_object))


def _judged_scores(data: bytes, images: np.ndarray) -> np.ndarray:
    """What `--method auto` compares, on reference kernels (no XNNPACK, as a microcontroller: TFLM's own where ptq's
    copy covers the model, `tflm_kernels.reference_codes`): the scores before a final SOFTMAX (the probabilities hide
    most differences), else the first output, in float."""
    from ai_edge_litert import schema_py_generated as schema

    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph = model_object.subgraphs[0]
    judged = int(graph.outputs[0])
    for operator in graph.operators:
        if op_kind(model_object, operator) in ("SOFTMAX", "LOG_SOFTMAX") and int(operator.outputs[0]) == judged:
            judged = int(operator.inputs[0])
            break
    image = _interpreter_class()(model_content=data).get_input_details()[0]
    values = reference_codes(data, {image["index"]: as_input(images, image)}, [judged])[judged]
    grid = graph.tensors[judged].quantization
    if values.dtype.kind == "f" or grid is None or grid.scale is None or not len(grid.scale):
        return values.astype(np.float64)
    return (values.astype(np.float64) - int(grid.zeroPoint[0])) * float(grid.scale[0])


def _with_method(calibrated: bytes, method: str, percentile: float | None, calibration: np.ndarray) -> bytes:
    """The calibrated model with the ranges `method` gives: the converter's min/max, or ptq's percentile rule."""
    if method != "percentile" or percentile is None:
        return calibrated
    from tensorflow.lite.tools import flatbuffer_utils

    tensors = _ranged_tensors(flatbuffer_utils.convert_bytearray_to_object(calibrated))
    return _with_ranges(calibrated, _percentile_ranges(calibrated, tensors, calibration, percentile))


def _choose_method(keras_path: Path, calibration: np.ndarray, settings: QuantizationSettings, io_type) -> QuantizationSettings:
    """`--method auto`: each METHOD_CANDIDATES range calibrated on 3/4 of the calibration images, quantized, and
    judged by the image SQNR against the float model on the other 1/4; the settings with the best one."""
    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if len(held_out) == 0 or len(rest) == 0:
        return replace(settings, method=METHOD_CANDIDATES[0][0])

    def scored() -> tuple[tuple[str, float | None, float | None], ...]:
        calibrated = _calibrated(keras_path, rest)
        reference = _judged_scores(calibrated, held_out)
        scores: list[tuple[str, float | None, float | None]] = []
        for method, percentile in METHOD_CANDIDATES:
            quantized = _quantized(_with_method(calibrated, method, percentile, rest), settings, io_type, keras_path)
            scores.append((method, percentile, sqnr_figure(image_sqnr_db(reference, _judged_scores(quantized, held_out)))))
        return tuple(scores)

    # Within `ptq run`, its TFLite models share the comparison: it reads only these settings.
    scores = base.computed_once(_key("method scores", keras_path, calibration, settings.per_channel, str(io_type), METHOD_CANDIDATES), scored)
    method, percentile = chosen_method(scores)
    return replace(settings, method=method, percentile=percentile, method_sqnr_db=scores)


def _quantized(calibrated: bytes, settings: QuantizationSettings, io_type, keras_path: Path) -> bytes:
    """The converter's quantizer on the calibrated model: every op int8 (one line naming those left in float)."""
    from tensorflow.lite.python.convert import mlir_quantize
    from tensorflow.lite.tools import flatbuffer_utils

    try:
        with _quiet():
            quantized = mlir_quantize(calibrated, not settings.per_channel, input_data_type=io_type, output_data_type=io_type)
    except Exception as error:  # noqa: BLE001  the quantizer's own exception types
        raise PtqError(f"{keras_path}: the TFLite quantizer failed ({_last_line(error)})") from error
    left = _float_ops(flatbuffer_utils.convert_bytearray_to_object(quantized))
    if left:
        raise PtqError(f"{keras_path}: the TFLite converter left {len(left)} ops in float ({', '.join(sorted(set(left)))}); "
                       "TFLite Micro needs every op in int8")
    return quantized


def _refined(quantized: bytes, calibrated: bytes, calibration: np.ndarray, settings: QuantizationSettings) -> tuple[bytes, QuantizationSettings, list[str]]:
    """(model, settings with the rounding decided, notes): learned int8 codes and corrected biases
    (transforms/tflite_rounding.py) where they bring the held-out calibration images' scores closer to the float
    model's than the converter's nearest codes (or where asked)."""
    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if settings.rounding == LEARNED or len(held_out) == 0:
        rest = calibration
    pixels = int(np.prod(calibration.shape[1:3]))
    count = rounding_image_count(pixels)
    refining = rest[np.linspace(0, len(rest) - 1, min(count, len(rest))).astype(int)]
    image = _interpreter_class()(model_content=quantized).get_input_details()[0]
    result = learned_int8(quantized, calibrated, as_input(refining, image))
    notes = [f"learned rounding: {result.layers} layers, {result.codes_changed:,} of {result.codes:,} weight codes moved off nearest, "
             f"biases corrected, from {len(refining)} calibration images"]
    if settings.rounding == LEARNED or len(held_out) == 0:
        return result.data, replace(settings, rounding=LEARNED), notes
    reference = _judged_scores(calibrated, held_out)
    nearest_db, learned_db = (image_sqnr_db(reference, _judged_scores(model, held_out)) for model in (quantized, result.data))
    choice = LEARNED if learned_db > nearest_db else NEAREST
    measured = replace(settings, rounding=choice, rounding_nearest_db=sqnr_figure(nearest_db), rounding_learned_db=sqnr_figure(learned_db))
    return (result.data if choice == LEARNED else quantized), measured, notes


def _float_ops(model_object) -> list[str]:
    """The ops of a quantized model that still compute in float (the model's own float I/O aside)."""
    from tensorflow.lite.python import schema_py_generated as schema

    graph = model_object.subgraphs[0]
    edges = {int(index) for index in (*graph.inputs, *graph.outputs)}
    left = []
    for operator in graph.operators:
        kind = op_kind(model_object, operator)
        if kind in ("QUANTIZE", "DEQUANTIZE"):
            continue
        used = [int(index) for index in (*operator.inputs, *operator.outputs) if index >= 0 and int(index) not in edges]
        if any(graph.tensors[index].type == schema.TensorType.FLOAT32 for index in used):
            left.append(kind)
    return left


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


def quantize(model, output: Path, settings: QuantizationSettings, calibration: np.ndarray, stored: dict[str, str],
             progress: ProgressCallback | None = None) -> QuantizedFile:
    """A full-integer .tflite of the Keras model the ONNX `model` was converted from, calibrated on
    `calibration` (images in the model's input format, which is the Keras model's); ptq's settings and
    input contract go into the flatbuffer's metadata."""
    output = Path(output)
    if output.suffix != SUFFIX:
        raise PtqError(f"--output: {output} must end in {SUFFIX}")
    keras_path = keras_source(model)
    options = _options(settings)
    ranges_from = Path(options.ranges_from) if options.ranges_from else None
    qdq = _ranges_model(ranges_from, stored.get(base.SOURCE_METADATA_KEY)) if ranges_from else None
    calibration = calibration.astype(np.float32, copy=False)
    io_type = getattr(_tensorflow(), IO_DTYPES[options.io or "int8"])
    if settings.method == AUTO_METHOD:
        settings = _choose_method(keras_path, calibration, settings, io_type)
    calibrated = _calibrated(keras_path, calibration, progress)
    from tensorflow.lite.tools import flatbuffer_utils

    notes: list[str] = []
    if ranges_from:
        tensors = _ranged_tensors(flatbuffer_utils.convert_bytearray_to_object(calibrated))
        ranges, unmatched = _transferred_ranges(ranges_from, qdq, calibrated, tensors, calibration)
        notes.append(f"activation ranges of {len(ranges)} of {len(tensors)} tensors from {ranges_from.name}"
                     + (f"; {len(unmatched)} kept the converter's min/max" if unmatched else ""))
        calibrated = _with_ranges(calibrated, ranges)
    else:
        calibrated = _with_method(calibrated, settings.method, settings.percentile, calibration)
    quantized = _quantized(calibrated, settings, io_type, keras_path)
    if settings.weight_dtype != INT4 and settings.rounding != NEAREST:
        quantized, settings, rounded = _refined(quantized, calibrated, calibration, settings)
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

    image = _interpreter_class()(model_content=quantized).get_input_details()[0]
    mixed, max_flash_kb = None, _options(settings).max_flash_kb
    if max_flash_kb is not None:
        judged_images = held_out_split(calibration)[0]
        reference = _judged_scores(calibrated, judged_images)
        budget = max_flash_kb * 1024 - FLASH_SLACK
        mixed = Mixed(fits=lambda data: len(written(microcontroller_layout(data).data)) <= budget,
                      judge=lambda data: sqnr_db(reference, _judged_scores(data, judged_images)))
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
class Options(base.BackendOptions):
    panel: ClassVar[str] = "LiteRT (--backend litert)"
    word: ClassVar[str] = "a LiteRT option"

    io: str | None = base.option(
        None, choices=IO_TYPES,
        help="Type of the .tflite's input and output tensors: int8 (what TFLite Micro wants), uint8, or float around the int8 body. (default: int8)")
    ranges_from: str | None = base.option(
        None, cli=Path,
        help="An onnxruntime QDQ model ptq quantized from the same FP32 model: its activation ranges (scale, zero point) replace the converter's "
             "calibration, tensor by tensor, so both models compute on the same grid.")
    max_flash_kb: float | None = base.option(
        None, cli=float,
        help="With --weight-dtype int4: the flash the .tflite may take, in KB (1,024 bytes). The 4-bit layers whose 4 bits cost most (output SQNR "
             "against the float model on calibration images, measured layer by layer) go back to 8 bits while the file stays within it. "
             "(default: none go back)")

    def settle(self, common: base.CommonChoices) -> tuple[Options, base.CommonChoices]:
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
        # default whichever measures best (_choose_method); XNNPACK widens to int16 before adding, so no overflow fix.
        quantize, methods=(AUTO_METHOD, "minmax", "percentile"), per_channel=True, overflow_fixes=(NO_FIX,),
        float_stem=False,  # full-integer: every layer int8
        int4_weights=True,  # TFLite's INT4 filters (transforms/int4.py)
        learned_rounding=True,  # _refined: GPTQ int8 codes and bias correction (transforms/tflite_rounding.py)
        options=Options, describe=_describe, output_name=_output_name,
        tune_refused="--backend litert: tune searches onnxruntime, pytorch and openvino; for TFLite use ptq quantize --backend litert "
                     "(--method, --per-tensor, --ranges-from a tuned onnxruntime model)",
    ),
    runtime=Runtime(load, settings="ai-edge-litert Interpreter with its default XNNPACK delegate, num_threads threads, a fixed batch run that "
                                   "many images per invoke"),
)
