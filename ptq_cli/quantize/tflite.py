"""The engine over TFLite models (`--backend litert`): the converter's calibration of the Keras source, ranges read
off the calibrated model's tensors (percentiles, or moved from a QDQ model), `--method` judged on held-out images, and
the int8 weights refined (tflite_rounding.py); the interpreter that runs the candidates."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from ptq_cli import model_file
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards.library_noise import native_stderr_silenced
from ptq_cli.model_file import (
    file_sha256,
    in_fixed_batches,
    load_keras,
)
from ptq_cli.quantize import reuse
from ptq_cli.quantize.policy import chosen_method, even_draw, held_out_split, rounding_image_count, sqnr_figure
from ptq_cli.quantize.rounding import LEARNED, NEAREST
from ptq_cli.quantize.settings import (
    METHOD_CANDIDATES,
    ProgressCallback,
    QuantizationSettings,
)
from ptq_cli.quantize.tflite_rounding import learned_int8
from ptq_cli.transforms.tflite_graph import op_kind
from ptq_cli.transforms.tflm_kernels import reference_codes

# Images run through both models to tell which onnxruntime tensor is which TFLite tensor (--ranges-from).
MATCH_IMAGES = 32


MATCH_TOLERANCE = 0.05  # relative distance of the per-image mean and spread of the two tensors' values


ACTIVATION_BATCH = 100  # images per interpreter call while collecting activations


def ranged_tensors(model_object) -> list[int]:
    """The tensors the converter calibrated (a min/max each), but the model's outputs: a softmax's output
    range is fixed by its kernel."""
    graph = model_object.subgraphs[0]
    outputs = set(int(index) for index in graph.outputs)
    return [index for index, tensor in enumerate(graph.tensors)
            if index not in outputs and tensor.quantization is not None and tensor.quantization.min is not None
            and len(tensor.quantization.min) == 1]


def activations(calibrated: bytes, tensors: list[int], images: np.ndarray):
    """The float values of `tensors` on `images`, ACTIVATION_BATCH images at a time (index -> array)."""
    from ai_edge_litert.interpreter import OpResolverType

    Interpreter = interpreter_class()
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


def percentile_ranges(calibrated: bytes, tensors: list[int], calibration: np.ndarray, percentile: float) -> dict[int, tuple[float, float]]:
    """ptq's --method percentile on the TFLite tensors: onnxruntime's own histogram collector, with the
    settings onnxruntime's percentile calibration uses (2,048 bins, asymmetric)."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    collector = HistogramCollector(method="percentile", symmetric=False, num_bins=2048, num_quantized_bins=128,
                                   percentile=percentile, scenario="same")
    with contextlib.redirect_stdout(io.StringIO()):  # it print()s its progress; stdout is ptq's own (--json)
        for values in activations(calibrated, tensors, calibration):
            collector.collect({str(index): [value] for index, value in values.items()})
        result = collector.compute_collection_result()
    return {int(index): (float(bounds[0]), float(bounds[1])) for index, bounds in result.items()}


def grid_ranges(qdq) -> dict[str, tuple[float, float]]:
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


def signature(values: np.ndarray) -> np.ndarray:
    """Per image, the mean and spread of a tensor's values: the same whatever the layout."""
    flat = values.reshape(len(values), -1).astype(np.float64)
    return np.concatenate([flat.mean(axis=1), flat.std(axis=1)])


def ranges_model(ranges_from: Path, source_sha256: str | None):
    """The onnxruntime QDQ model --ranges-from names, checked to be made by ptq from the same FP32 model."""
    qdq = model_file.read_made_from(ranges_from, source_sha256, "--ranges-from")
    if not grid_ranges(qdq):
        raise PtqError(f"--ranges-from: {ranges_from} has no quantized activations (an onnxruntime QDQ model is needed)")
    return qdq


def transferred_ranges(ranges_from: Path, qdq, calibrated: bytes, tensors: list[int],
                        calibration: np.ndarray) -> tuple[dict[int, tuple[float, float]], list[int]]:
    """The activation ranges of an onnxruntime QDQ model made from the same FP32 model, each TFLite tensor
    matched to the onnxruntime tensor whose values it has on the same images; and the tensors left unmatched."""
    import onnx
    import onnxruntime

    grids = grid_ranges(qdq)
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
    tflite_values = next(activations(calibrated, tensors, images))
    # onnxruntime drops a ReLU its QuantizeLinear does anyway (zero point 0): what a tensor holds is its
    # values clipped to its grid.
    signatures = {name: signature(np.clip(values, *grids[name])) for name, values in onnx_values.items()}
    matched, unmatched = {}, []
    for index in tensors:
        wanted = signature(tflite_values[index])
        width = int(np.prod(tflite_values[index].shape[1:]))
        candidates = [(np.linalg.norm(signatures[name] - wanted) / (np.linalg.norm(wanted) + 1e-12), name)
                      for name in names if onnx_values[name].shape[1] == width]
        distance, name = min(candidates, default=(np.inf, None))
        if name is not None and distance <= MATCH_TOLERANCE:
            matched[index] = grids[name]
        else:
            unmatched.append(index)
    return matched, unmatched


def with_ranges(calibrated: bytes, ranges: dict[int, tuple[float, float]]) -> bytes:
    """The calibrated model with these (min, max) in place of the converter's statistics (each widened to
    hold 0, as every quantizer does)."""
    from tensorflow.lite.tools import flatbuffer_utils

    model_object = flatbuffer_utils.convert_bytearray_to_object(calibrated)
    tensors = model_object.subgraphs[0].tensors
    for index, (low, high) in ranges.items():
        tensors[index].quantization.min = np.array([min(low, 0.0)], np.float32)
        tensors[index].quantization.max = np.array([max(high, 0.0)], np.float32)
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model_object))


def judged_scores(data: bytes, images: np.ndarray) -> np.ndarray:
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
    image = interpreter_class()(model_content=data).get_input_details()[0]
    values = reference_codes(data, {image["index"]: as_input(images, image)}, [judged])[judged]
    grid = graph.tensors[judged].quantization
    if values.dtype.kind == "f" or grid is None or grid.scale is None or not len(grid.scale):
        return values.astype(np.float64)
    return (values.astype(np.float64) - int(grid.zeroPoint[0])) * float(grid.scale[0])


def with_method(calibrated: bytes, method: str, percentile: float | None, calibration: np.ndarray) -> bytes:
    """The calibrated model with the ranges `method` gives: the converter's min/max, or ptq's percentile rule."""
    if method != "percentile" or percentile is None:
        return calibrated
    from tensorflow.lite.tools import flatbuffer_utils

    tensors = ranged_tensors(flatbuffer_utils.convert_bytearray_to_object(calibrated))
    return with_ranges(calibrated, percentile_ranges(calibrated, tensors, calibration, percentile))


def choose_method(keras_path: Path, calibration: np.ndarray, settings: QuantizationSettings, io_type) -> QuantizationSettings:
    """`--method auto`: each METHOD_CANDIDATES range calibrated on 3/4 of the calibration images, quantized, and
    judged by the image SQNR against the float model on the other 1/4; the settings with the best one."""
    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if len(held_out) == 0 or len(rest) == 0:
        return replace(settings, method=METHOD_CANDIDATES[0][0])

    def scored() -> tuple[tuple[str, float | None, float | None], ...]:
        calibrated = calibrated_tflite(keras_path, rest)
        reference = judged_scores(calibrated, held_out)
        scores: list[tuple[str, float | None, float | None]] = []
        for method, percentile in METHOD_CANDIDATES:
            quantized = quantized_tflite(with_method(calibrated, method, percentile, rest), settings, io_type, keras_path)
            scores.append((method, percentile, sqnr_figure(image_sqnr_db(reference, judged_scores(quantized, held_out)))))
        return tuple(scores)

    # Within `ptq run`, its TFLite models share the comparison: it reads only these settings.
    scores = reuse.computed_once(step_key("method scores", keras_path, calibration, settings.per_channel, str(io_type), METHOD_CANDIDATES), scored)
    method, percentile = chosen_method(scores)
    return replace(settings, method=method, percentile=percentile).with_evidence(method_sqnr_db=scores)


def refined(quantized: bytes, calibrated: bytes, calibration: np.ndarray, settings: QuantizationSettings) -> tuple[bytes, QuantizationSettings, list[str]]:
    """(model, settings with the rounding decided, notes): learned int8 codes and corrected biases
    (quantize/tflite_rounding.py) where they bring the held-out calibration images' scores closer to the float
    model's than the converter's nearest codes (or where asked)."""
    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if settings.rounding == LEARNED or len(held_out) == 0:
        rest = calibration
    pixels = int(np.prod(calibration.shape[1:3]))
    count = rounding_image_count(pixels)
    refining = rest[even_draw(len(rest), count)]
    image = interpreter_class()(model_content=quantized).get_input_details()[0]
    result = learned_int8(quantized, calibrated, as_input(refining, image))
    notes = [f"learned rounding: {result.layers} layers, {result.codes_changed:,} of {result.codes:,} weight codes moved off nearest, "
             f"biases corrected, from {len(refining)} calibration images"]
    if settings.rounding == LEARNED or len(held_out) == 0:
        return result.data, replace(settings, rounding=LEARNED), notes
    reference = judged_scores(calibrated, held_out)
    nearest_db, learned_db = (image_sqnr_db(reference, judged_scores(model, held_out)) for model in (quantized, result.data))
    choice = LEARNED if learned_db > nearest_db else NEAREST
    measured = replace(settings, rounding=choice).with_evidence(rounding_nearest_db=sqnr_figure(nearest_db), rounding_learned_db=sqnr_figure(learned_db))
    return (result.data if choice == LEARNED else quantized), measured, notes


def interpreter_class():
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


IO_DTYPES = {"int8": "int8", "uint8": "uint8", "float": "float32"}


@contextlib.contextmanager
def quiet():
    """TensorFlow prints the exported signature on stdout, which is for ptq's results (--json), and logs
    from C++ on stderr; its failures come as exceptions."""
    with native_stderr_silenced(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def import_tensorflow():
    try:
        with quiet():
            import tensorflow as tf
    except ImportError as error:
        raise PtqError(f"--backend litert: needs tensorflow-cpu to convert (pip install 'ptq-cli[keras,litert]'; make install does): {error}") from error
    return tf


def step_key(step: str, keras_path: Path, calibration: np.ndarray, *settings: object) -> Callable[[], str]:
    """What a step's result within one `ptq run` is keyed by (reuse.computed_once): the Keras file, the images, settings."""
    return lambda: reuse.digest(step.encode(), bytes.fromhex(file_sha256(keras_path)), repr((calibration.shape, str(calibration.dtype), settings)).encode(),
                               np.ascontiguousarray(calibration).tobytes())


def calibrated_tflite(keras_path: Path, calibration: np.ndarray, progress: ProgressCallback | None = None) -> bytes:
    """The float TFLite model with the converter's calibration statistics (min/max per tensor) over
    `calibration`, one image per step, not yet quantized; within `ptq run`, made once for its TFLite models."""
    return reuse.computed_once(step_key("calibrated", keras_path, calibration), lambda: calibrate(keras_path, calibration, progress), size=len)


def calibrate(keras_path: Path, calibration: np.ndarray, progress: ProgressCallback | None = None) -> bytes:
    tf = import_tensorflow()
    with quiet():
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
        with quiet():
            return bytes(converter.convert())
    except Exception as error:  # noqa: BLE001  the converter's own exception types
        raise PtqError(f"{keras_path}: the TFLite converter failed ({last_line(error)})") from error


def last_line(error: Exception) -> str:
    """TensorFlow's converter errors end with the line that says what failed."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def quantized_tflite(calibrated: bytes, settings: QuantizationSettings, io_type, keras_path: Path) -> bytes:
    """The converter's quantizer on the calibrated model: every op int8 (one line naming those left in float)."""
    from tensorflow.lite.python.convert import mlir_quantize
    from tensorflow.lite.tools import flatbuffer_utils

    try:
        with quiet():
            quantized = mlir_quantize(calibrated, not settings.per_channel, input_data_type=io_type, output_data_type=io_type)
    except Exception as error:  # noqa: BLE001  the quantizer's own exception types
        raise PtqError(f"{keras_path}: the TFLite quantizer failed ({last_line(error)})") from error
    left = float_ops(flatbuffer_utils.convert_bytearray_to_object(quantized))
    if left:
        raise PtqError(f"{keras_path}: the TFLite converter left {len(left)} ops in float ({', '.join(sorted(set(left)))}); "
                       "TFLite Micro needs every op in int8")
    return quantized


INTEGER_TYPES = {np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8"}


def float_ops(model_object) -> list[str]:
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
