"""LiteRT (TensorFlow Lite): runs .tflite models with the LiteRT interpreter (`ai-edge-litert`, not the whole
of TensorFlow), float or full-integer, honouring the input and output quantization (scale, zero point).

A full-integer model takes int8 or uint8 input: ptq prepares float images as for any model (scale, mean,
std), then quantizes them with the input tensor's own scale and zero point, as a device would.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError
from ptq_cli.services import inputs
from ptq_cli.services.models import LoadedModel, ModelInfo, in_fixed_batches, model_input, num_classes, read_bytes, resolve_threads

NAME = "litert"
SUFFIX = ".tflite"
FORMAT = "TFLite"
INTEGER_TYPES = {np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8"}


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


def _quantization(detail: dict) -> tuple[float, int] | None:
    """(scale, zero point) of an integer tensor, None for a float one."""
    if np.dtype(detail["dtype"]) not in INTEGER_TYPES:
        return None
    scale, zero_point = detail["quantization"]
    return float(scale), int(zero_point)


def describe_io(detail: dict) -> str:
    """e.g. "int8 (scale 1, zero point -128)" or "float32"."""
    quantization = _quantization(detail)
    kind = INTEGER_TYPES.get(np.dtype(detail["dtype"]), np.dtype(detail["dtype"]).name)
    return kind if quantization is None else f"{kind} (scale {quantization[0]:g}, zero point {quantization[1]})"


def load(path: Path, threads: int | None, flags: inputs.PreprocessingFlags) -> LoadedModel:
    """The model in the LiteRT interpreter with `threads` threads; a batch dimension declared dynamic is
    resized to each batch, a fixed one runs that many images at a time."""
    path = Path(path)
    data = read_bytes(path)
    threads = resolve_threads(threads)
    Interpreter = _interpreter_class()
    try:
        interpreter = Interpreter(model_content=data, num_threads=threads)
        interpreter.allocate_tensors()
    except (ValueError, RuntimeError) as error:
        raise PtqError(f"{path}: LiteRT cannot load it ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from error
    input_details, output_details = interpreter.get_input_details(), interpreter.get_output_details()
    if len(input_details) != 1:
        raise PtqError(f"{path}: {len(input_details)} inputs; ptq takes image classifiers with one image input")
    if not output_details:
        raise PtqError(f"{path}: the model has no outputs")
    image, scores = input_details[0], output_details[0]
    signature = [int(dim) for dim in image.get("shape_signature", image["shape"])]
    described = model_input(path, image["name"], [dim if dim > 0 else None for dim in signature])
    classes = num_classes(path, [int(dim) for dim in scores["shape"]])
    dynamic = signature[0] < 1
    chunk = None if dynamic else max(int(image["shape"][0]), 1)
    input_quantization, output_quantization = _quantization(image), _quantization(scores)
    input_type = np.dtype(image["dtype"])
    state = {"batch": int(image["shape"][0])}

    def run(batch: np.ndarray) -> np.ndarray:
        if dynamic and len(batch) != state["batch"]:
            interpreter.resize_tensor_input(image["index"], [len(batch), *described.shape(1)[1:]])
            interpreter.allocate_tensors()
            state["batch"] = len(batch)
        if input_quantization is not None:
            scale, zero_point = input_quantization
            limits = np.iinfo(input_type)
            batch = np.clip(np.round(batch / scale + zero_point), limits.min, limits.max).astype(input_type)
        try:
            interpreter.set_tensor(image["index"], np.ascontiguousarray(batch, dtype=input_type))
            interpreter.invoke()
            result = interpreter.get_tensor(scores["index"])
        except (ValueError, RuntimeError) as error:
            raise PtqError(f"{path}: LiteRT failed to run it ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from error
        result = result.reshape(len(batch), -1).astype(np.float32)
        if output_quantization is not None:
            scale, zero_point = output_quantization
            result = (result - zero_point) * scale
        return result

    def predict(batch: np.ndarray) -> np.ndarray:
        return run(batch) if chunk is None else in_fixed_batches(run, batch, chunk)

    tensor_types = {np.dtype(detail["dtype"]) for detail in interpreter.get_tensor_details()}
    integer = bool(tensor_types & set(INTEGER_TYPES))
    dtype = INTEGER_TYPES.get(input_type, "int8") if integer else "fp32"
    quantization = {
        "format": FORMAT, "dtype": dtype, "weight_dtype": "int8", "input": describe_io(image), "output": describe_io(scores),
    } if integer else None
    preprocessing = inputs.resolve(flags, None)
    note = None if dynamic else f"fixed batch {chunk}: run {chunk} at a time"
    info = ModelInfo(path, NAME, dtype, quantization, len(data), hashlib.sha256(data).hexdigest())
    return LoadedModel(info, predict, described, preprocessing, classes or int(scores["shape"][-1]), note)

