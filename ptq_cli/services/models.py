"""Load a model file (ONNX or TorchScript) into one runner: NHWC float32 batch in, class scores out."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError

# Quantize records how a model was made inside the model file itself, under this metadata key.
QUANTIZATION_METADATA_KEY = "ptq.quantization"
# ... and `ptq prune` how it pruned a model (kept through quantization), under this one.
PRUNING_METADATA_KEY = "ptq.pruning"
# ... and in TorchScript files, as this extra file inside the archive.
TORCHSCRIPT_METADATA_FILE = "ptq.json"
ZIP_MAGIC = b"PK\x03\x04"  # TorchScript files are zip archives
ONNXRUNTIME = "onnxruntime"
PYTORCH = "pytorch"


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    framework: str  # ONNXRUNTIME or PYTORCH
    dtype: str  # "fp32", "int8" or "uint8"
    quantization: dict | None  # the settings quantize used; None for a float model
    size_bytes: int
    sha256: str
    pruning: dict | None = None  # the settings prune used; None for an unpruned model


@dataclass(frozen=True)
class LoadedModel:
    info: ModelInfo
    predict: Callable[[np.ndarray], np.ndarray]  # (N, 32, 32, 3) float32 -> (N, 10) scores


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _require_file(path: Path) -> None:
    if not path.exists():
        raise PtqError(f"{path}: model file not found")
    if not path.is_file():
        raise PtqError(f"{path}: not a file")


def read_onnx(path: Path, data: bytes | None = None):
    """Parse and check an ONNX file (or its bytes, already read), or raise a one-line PtqError naming it."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if data is None:
        _require_file(path)
        data = path.read_bytes()
    try:
        model = onnx.load_from_string(data)
        onnx.checker.check_model(model)
    except (DecodeError, onnx.checker.ValidationError, ValueError, RuntimeError, OSError) as error:
        raise PtqError(f"{path}: not a valid ONNX model ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from error
    if not model.graph.input or not model.graph.node:
        raise PtqError(f"{path}: not a valid ONNX model (empty graph)")
    return model


def _onnx_dtype(model) -> tuple[str, dict | None]:
    import onnx

    metadata = {prop.key: prop.value for prop in model.metadata_props}
    if QUANTIZATION_METADATA_KEY in metadata:
        settings = json.loads(metadata[QUANTIZATION_METADATA_KEY])
        return settings["dtype"], settings
    # A quantized model from elsewhere: the zero point of its first QuantizeLinear tells the activation type.
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and len(node.input) > 2 and node.input[2] in initializers:
            zero_point = initializers[node.input[2]]
            return ("uint8" if zero_point.data_type == onnx.TensorProto.UINT8 else "int8"), None
    return "fp32", None


NHWC = "NHWC"  # CIFAR-10 as ptq holds it, and the Keras model's layout
NCHW = "NCHW"  # PyTorch's usual layout: such ONNX models get their batch transposed


def check_io(path: Path, input_shape: list, output_shape: list) -> str:
    """The input layout of a CIFAR-10 classifier, or a one-line error: 32x32 RGB in, 10 class scores out."""
    known = [dim if isinstance(dim, int) and dim > 0 else None for dim in input_shape]
    if not output_shape or output_shape[-1] != 10:
        raise PtqError(f"{path}: output shape {output_shape} does not give 10 class scores (CIFAR-10 has 10 classes)")
    if len(known) == 4 and known[1:] == [3, 32, 32]:
        return NCHW
    if len(known) == 4 and known[1:] in ([32, 32, 3], [None, None, None]):
        return NHWC
    raise PtqError(f"{path}: input shape {input_shape} is neither NHWC N x 32 x 32 x 3 nor NCHW N x 3 x 32 x 32")


def _dims(value) -> list:
    return [dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None) for dim in value.type.tensor_type.shape.dim]


def onnx_layout(path: Path, model) -> str:
    """check_io on the shapes an ONNX graph declares (before any session is made)."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [value for value in model.graph.input if value.name not in initializers]
    return check_io(path, _dims(inputs[0]), _dims(model.graph.output[0]))


def to_layout(images: np.ndarray, layout: str) -> np.ndarray:
    """NHWC images in the model's layout."""
    return images if layout == NHWC else np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def default_threads() -> int:
    return os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    """The inference thread count: all cores unless told, and never below one."""
    if threads is not None and threads < 1:
        raise PtqError(f"--threads: must be at least 1, got {threads}")
    return threads or default_threads()


# Batches smaller than this per thread are run whole: splitting them costs more than it saves.
MIN_SHARD = 32


def load_onnx(path: Path, threads: int | None = None) -> LoadedModel:
    """One onnxruntime session for the model's whole life, run data-parallel over `threads` threads.

    Each run uses one intra-op thread and a large batch is split into one shard per thread, run
    concurrently on the same session (onnxruntime releases the GIL and allows concurrent runs).
    Measured on ResNet8 at batch 256 on 2 cores: int8 goes from about 21,000 to 25,000 images/s
    against intra-op threading, because its small convolutions split poorly inside one operator,
    while FP32 stays within noise of it (benchmarks/pipeline.py shows both).
    """
    import onnxruntime as ort

    path = Path(path)
    _require_file(path)
    data = path.read_bytes()
    model = read_onnx(path, data)
    dtype, quantization = _onnx_dtype(model)
    threads = resolve_threads(threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types for unloadable graphs
        raise PtqError(f"{path}: onnxruntime cannot load it ({str(error).splitlines()[0]})") from error
    model_input = session.get_inputs()[0]
    layout = check_io(path, list(model_input.shape), list(session.get_outputs()[0].shape))
    input_name = model_input.name
    pool = ThreadPoolExecutor(threads, thread_name_prefix="ptq-ort") if threads > 1 else None

    def run(images: np.ndarray) -> np.ndarray:
        return session.run(None, {input_name: to_layout(images, layout)})[0]

    def predict(images: np.ndarray) -> np.ndarray:
        if pool is None or len(images) < MIN_SHARD * threads:
            return run(images)
        return np.concatenate(list(pool.map(run, np.array_split(images, threads))))

    metadata = {prop.key: prop.value for prop in model.metadata_props}
    pruning = json.loads(metadata[PRUNING_METADATA_KEY]) if PRUNING_METADATA_KEY in metadata else None
    info = ModelInfo(path, ONNXRUNTIME, dtype, quantization, len(data), hashlib.sha256(data).hexdigest(), pruning)
    return LoadedModel(info, predict)


# TorchScript runs a large batch in chunks of at most this many images, whose activations stay in
# cache. Measured on 2 cores, 1,024 images per call (images/s, FP32 / int8): 3,391 / 7,400 whole;
# 9,545-11,489 / 16,778-25,858 in chunks of 64 (two runs). onnxruntime, split per thread already, stays flat.
TORCH_CHUNK = 64


def load_torchscript(path: Path, threads: int | None = None) -> LoadedModel:
    import torch

    from ptq_cli.services.torch_compat import quiet_torch_quantization_warnings

    quiet_torch_quantization_warnings()
    path = Path(path)
    _require_file(path)
    threads = resolve_threads(threads)
    data = path.read_bytes()
    extra_files = {TORCHSCRIPT_METADATA_FILE: ""}
    try:
        module = torch.jit.load(io.BytesIO(data), map_location="cpu", _extra_files=extra_files)
    except Exception as error:  # torch raises RuntimeError, ValueError or zip errors for a damaged archive
        raise PtqError(f"{path}: not a loadable TorchScript model ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from error
    module.eval()
    metadata = json.loads(extra_files[TORCHSCRIPT_METADATA_FILE] or "{}")
    dtype = metadata.get("dtype") or ("int8" if "quantize_per_tensor" in module.inlined_graph.str() else "fp32")
    quantization = metadata if dtype != "fp32" else None
    torch.set_num_threads(threads)

    def predict(images: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            if len(images) <= TORCH_CHUNK:
                return module(torch.from_numpy(images)).numpy()
            return np.concatenate([module(torch.from_numpy(chunk)).numpy() for chunk in np.array_split(images, -(-len(images) // TORCH_CHUNK))])

    try:
        probe = predict(np.zeros((1, 32, 32, 3), dtype=np.float32))
    except RuntimeError as error:
        # A TorchScript error is a stack of frames; its last line says what went wrong.
        cause = [line for line in str(error).splitlines() if line.strip()][-1:] or [type(error).__name__]
        raise PtqError(f"{path}: does not take an NHWC N x 32 x 32 x 3 float32 batch ({cause[0].strip()})") from error
    check_io(path, [None, 32, 32, 3], list(probe.shape))
    info = ModelInfo(path, PYTORCH, dtype, quantization, len(data), hashlib.sha256(data).hexdigest())
    return LoadedModel(info, predict)


def load_model(path: Path, threads: int | None = None) -> LoadedModel:
    """The runner for a model file, chosen by its content, not its name."""
    path = Path(path)
    _require_file(path)
    with path.open("rb") as handle:
        is_zip = handle.read(4) == ZIP_MAGIC
    return load_torchscript(path, threads) if is_zip or path.suffix == ".pt" else load_onnx(path, threads)
