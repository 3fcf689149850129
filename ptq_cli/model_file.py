"""Reading a model's files, whatever the backend: bounded reads, ONNX parsing with its external weights
(from the model's folder only), the input/output shapes an image classifier declares, and what an ONNX
graph says of itself (ptq's metadata, its data type, how a model ptq did not make is quantized): the
helpers every ONNX-reading part shares, onnxruntime's or not."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import inputs, settings
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import companions
from ptq_cli.inputs import ModelInput
from ptq_cli.transforms.graph import symbolic_batch
from ptq_cli.transforms.qdq_edits import private_weight_dequantizers

# Quantize records how a model was made inside the model file itself, under this metadata key.
QUANTIZATION_METADATA_KEY = "ptq.quantization"
# ... and `ptq prune` how it pruned a model (kept through quantization), under this one.
PRUNING_METADATA_KEY = "ptq.pruning"
# ... and the sha256 of the float model a model was made from (the reference of its accuracy delta).
SOURCE_METADATA_KEY = "ptq.source_sha256"
# ... and `ptq convert --keras` the Keras file an ONNX model was converted from ({"path", "sha256"}): LiteRT
# quantization starts from that file.
KERAS_SOURCE_METADATA_KEY = "ptq.keras_source"


def require_file(path: Path) -> None:
    if not path.exists():
        raise PtqError(f"{path}: model file not found")
    if not path.is_file():
        kind = foreign_kind(path)
        raise PtqError(f"{path}: {kind}" if kind else f"{path}: not a file")


SAVED_MODEL = "saved_model.pb"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
KERAS_SAVE_HINT = "save it as .keras (model.save('model.keras')) and convert that with ptq convert --keras"


def foreign_kind(path: Path, head: bytes | None = None) -> str | None:
    """What a file (or folder) given as a model is when it is a kind ptq does not run but can name, and the command
    that takes it: a Keras file, a SavedModel folder, a PyTorch checkpoint. Read by content, never by loading it."""
    path = Path(path)
    if path.is_dir():
        saved = (path / SAVED_MODEL).is_file()
        return f"a TensorFlow SavedModel folder; convert it first: ptq convert --keras {path} --output {path.name}.onnx" if saved else None
    if head is None:
        head = bounded.read_head(path, 8, "model file")
    if head.startswith(HDF5_SIGNATURE):
        return f"a Keras .h5 model (HDF5); convert it first: ptq convert --keras {path} --output {path.stem}.onnx"
    if not head.startswith(b"PK\x03\x04"):
        return None
    names = _zip_names(path)
    if "config.json" in names and any(name.endswith(".weights.h5") for name in names):
        return f"a Keras .keras model; convert it first: ptq convert --keras {path} --output {path.stem}.onnx"
    if any(name.endswith("/data.pkl") for name in names) and not any("/code/" in name for name in names):
        return ("a PyTorch checkpoint (torch.save of a module or state_dict), not a TorchScript or ONNX model; export the model "
                "with torch.onnx.export and give the .onnx")
    return None


ZIP_NAMES = 100_000  # members listed to tell a zip's kind; a model's zip holds far fewer


def _zip_names(path: Path) -> set[str]:
    import zipfile

    try:
        with bounded.open_regular(path, "model file") as handle, zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
            return {info.filename for info in infos[:ZIP_NAMES]}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return set()


def read_bytes(path: Path) -> bytes:
    require_file(path)
    data = bounded.read_bytes(path, bounded.MODEL_BYTES, "model file")
    if not data:
        raise PtqError(f"{path}: empty file")
    return data


# file_sha256's answers, by what the files' status says of their bytes: a report over many records of one large
# model reads it once.
_DIGESTS: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """The sha256 of a model's bytes: its file, then the files its kind keeps beside it (an OpenVINO IR's .xml,
    then its .bin). Streamed, never held whole; a file whose device, inode, size and times are unchanged is not
    read again."""
    path = Path(path)
    files = [path, *(companion for companion in companions(path)[1:] if companion.is_file())]
    key = tuple(_status(file) for file in files if bounded.regular_size(file, "model file") >= 0)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        for file in files:
            with bounded.open_regular(file, "model file") as handle:
                size = bounded.regular_size(file, "model file")
                if size > bounded.MODEL_BYTES.value():
                    raise bounded.MODEL_BYTES.refuse(file, f"{size:,} bytes")
                for offset in range(0, size, 2**24):
                    digest.update(bounded.read_span(handle, file, offset, min(2**24, size - offset), "model file"))
        if len(_DIGESTS) > 4096:
            _DIGESTS.clear()
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def _status(path: Path) -> tuple:
    info = path.stat()
    return (str(path.resolve()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def load_keras(tf: Any, path: Path) -> Any:
    """A Keras model file, uncompiled, in Keras' safe mode (a Lambda layer's stored code is refused, not run); one line
    if Keras cannot load it."""
    try:
        return tf.keras.models.load_model(str(path), compile=False, safe_mode=True)
    except Exception as error:  # Keras raises many types for a bad file; all mean the same to the user
        # Keras 3 writes some models to .h5 that it cannot read back (MobileNetV3's hard-swish); their .keras loads.
        hint = "; if Keras saved it, save it as .keras (model.save('model.keras')) and give that" if path.suffix.lower() == ".h5" else ""
        raise PtqError(f"{path}: not a loadable Keras model ({first_line(error)}){hint}") from error


def read_onnx(path: Path, data: bytes | None = None):
    """Parse and check an ONNX file (or its bytes, already read), or raise a one-line PtqError naming it."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if data is None:
        data = read_bytes(path)
    try:
        model = onnx.load_from_string(data)
        _read_external_data(path, model, len(data))
        onnx.checker.check_model(model)
    except (DecodeError, onnx.checker.ValidationError, ValueError, RuntimeError, OSError) as error:
        foreign = foreign_kind(path, data[:8]) if path.is_file() else None
        raise PtqError(f"{path}: {foreign}" if foreign else f"{path}: not a valid ONNX model ({first_line(error)})") from error
    if not model.graph.input or not model.graph.node:
        raise PtqError(f"{path}: not a valid ONNX model (empty graph)")
    return model


def read_made_from(path: Path, source_sha256: str | None, flag: str):
    """An ONNX model a `flag` option names, checked to be one ptq quantized from the FP32 model of this sha256."""
    model = read_onnx(path)
    made_from = {prop.key: prop.value for prop in model.metadata_props}.get(SOURCE_METADATA_KEY)
    if source_sha256 is None or made_from != source_sha256:
        raise PtqError(f"{flag}: {path} was not quantized by ptq from this FP32 model")
    return model


def files_of(path: Path) -> tuple[tuple[str, bytes], ...]:
    """The model file and its companions (an IR's weights) as (name, bytes): what a worker process is given."""
    return tuple((companion.name, read_bytes(companion)) for companion in companions(Path(path)))


def _read_external_data(path: Path, model, held: int = 0) -> None:
    """Weights kept beside the model (onnx's external data) read into it, from files inside its folder only.

    The bound counts each tensor's bytes, not each file once: many tensors may name the same bytes of one file.
    Every byte is read through ptq's bounded, non-blocking reads; `held` is what the model file itself holds."""
    from onnx import TensorProto
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    tensors = [tensor for tensor in _get_all_tensors(model) if uses_external_data(tensor)]
    if not tensors:
        return
    folder = Path(path).resolve().parent
    total, spans = held, []
    for tensor in tensors:
        info = ExternalDataInfo(tensor)
        target = (folder / info.location).resolve()
        if not info.location or not target.is_relative_to(folder):
            raise PtqError(f"{path}: its external data '{info.location}' lies outside the model's folder; refused")
        size = bounded.regular_size(target, "external data file")
        offset = int(info.offset or 0)
        length = int(info.length) if info.length else size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise PtqError(f"{path}: tensor '{tensor.name[:80]}' names bytes {offset:,}-{offset + length:,} of '{info.location}', "
                           f"which holds {size:,}")
        expected = _tensor_bytes(tensor)
        if expected is not None and length != expected:
            raise PtqError(f"{path}: tensor '{tensor.name[:80]}' is {list(tensor.dims)}, {expected:,} bytes, but names {length:,} bytes "
                           f"of '{info.location}'")
        total += length
        if total > bounded.MODEL_BYTES.value():
            raise bounded.MODEL_BYTES.refuse(path, f"{total:,} bytes with its external data (counted per tensor)")
        if total > bounded.PROTOBUF_BYTES:
            raise PtqError(f"{path}: {total:,} bytes with its external data (counted per tensor); ptq holds a model in one protobuf, "
                           f"at most {bounded.PROTOBUF_BYTES:,} bytes")
        spans.append((tensor, target, offset, length))
    for tensor, target, offset, length in spans:
        with bounded.open_regular(target, "external data file") as handle:
            tensor.raw_data = bounded.read_span(handle, target, offset, length, "external data file")
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


# Bytes an element of each whole-byte ONNX type takes (sub-byte types, strings: not checked).
ELEMENT_BYTES = {"FLOAT": 4, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "INT32": 4, "INT64": 8, "BOOL": 1, "FLOAT16": 2, "DOUBLE": 8,
                 "UINT32": 4, "UINT64": 8, "COMPLEX64": 8, "COMPLEX128": 16, "BFLOAT16": 2, "FLOAT8E4M3FN": 1, "FLOAT8E4M3FNUZ": 1,
                 "FLOAT8E5M2": 1, "FLOAT8E5M2FNUZ": 1, "FLOAT8E8M0": 1}


def _tensor_bytes(tensor) -> int | None:
    """The bytes a tensor of whole-byte elements holds by its dims (None for the other types)."""
    from onnx import TensorProto

    name = TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in TensorProto.DataType.values() else ""
    return int(np.prod(tensor.dims, dtype=np.int64)) * ELEMENT_BYTES[name] if name in ELEMENT_BYTES else None


def onnx_dims(value) -> list:
    return [dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or None) for dim in value.type.tensor_type.shape.dim]


def graph_inputs(model) -> list:
    initializers = {init.name for init in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def model_input(path: Path, name: str, shape: list, elem_float: bool = True, size: tuple[int, int] | None = None,
                layout: tuple[str, int] | None = None) -> ModelInput:
    """The layout, channels and size of an image classifier's input from its declared shape.

    A 4-D input whose second dimension is 1 or 3 (and last is not) is NCHW, PyTorch's layout; one whose
    last dimension is 1 or 3 is NHWC, TensorFlow's; else `layout` (layout, channels), where the graph tells it.
    A height and width the shape leaves open come from `size` (--input-size); a fully symbolic input the graph
    says nothing of is taken as NHWC 32 x 32 x 3, the Keras ResNet8's contract."""
    if not elem_float:
        raise PtqError(f"{path}: input '{name}' is not float32; ptq feeds float images (scaled and normalised as told)")
    known = [dim if isinstance(dim, int) and dim > 0 else None for dim in shape]
    if len(known) != 4:
        raise PtqError(f"{path}: input shape {shape} is not an image batch (N x C x H x W or N x H x W x C)")
    if known[1] in (1, 3) and known[3] not in (1, 3):
        layout = (inputs.NCHW, known[1])
    elif known[3] in (1, 3):
        layout = (inputs.NHWC, known[3])
    elif layout is None and known[1:] == [None, None, None]:
        layout, size = (inputs.NHWC, 3), size or (32, 32)
    channel_dim = None if layout is None else known[1 if layout[0] == inputs.NCHW else 3]
    if layout is None or layout[1] not in (1, 3) or channel_dim not in (None, layout[1]):
        raise PtqError(f"{path}: input shape {shape} is neither N x C x H x W nor N x H x W x C with 1 or 3 channels")
    sides = known[2:4] if layout[0] == inputs.NCHW else known[1:3]
    height, width = _sides(path, name, shape, sides, size)
    described = ModelInput(name, layout[0], layout[1], height, width, known[0])
    bounded.check_input(path, [known[0] or 1, *described.shape(1)[1:]])
    return described


def _sides(path: Path, name: str, shape: list, sides: list, size: tuple[int, int] | None) -> tuple[int, int]:
    """(height, width): the declared ones, with those the shape leaves open taken from `size`."""
    if size is not None and any(side is not None and side != given for side, given in zip(sides, size, strict=True)):
        raise PtqError(f"--input-size {size[0]}x{size[1]}: {path} declares its input '{name}' as {shape}")
    if None in sides and size is None:
        raise PtqError(f"{path}: input '{name}' {shape} leaves its height and width open: give the size the model was trained at "
                       "with --input-size (e.g. --input-size 224)")
    return (sides[0] or size[0], sides[1] or size[1]) if size is not None else (sides[0], sides[1])


def num_classes(path: Path, output_shape: list) -> int | None:
    """The class count an output shape declares ([N, K] or [N, K, 1, 1]), None if symbolic."""
    dims = [dim for dim in output_shape[1:] if dim != 1] if len(output_shape) > 2 else output_shape[1:]
    if len(output_shape) < 2 or len(dims) > 1:
        raise PtqError(f"{path}: output shape {output_shape} is not N x classes")
    last = dims[0] if dims else 1
    if isinstance(last, int) and last > 0:
        bounded.check_count(path, last, bounded.CLASSES, f"output declares {last:,} classes")
        return last
    return None


def in_fixed_batches(run: Callable[[np.ndarray], np.ndarray], batch: np.ndarray, size: int) -> np.ndarray:
    """`run` (a model tied to a batch of `size`) over any batch: in parts of `size`, the last filled up
    with copies of the last image, whose scores are then dropped."""
    padded = -(-len(batch) // size) * size
    filled = np.concatenate([batch, np.repeat(batch[-1:], padded - len(batch), axis=0)]) if padded != len(batch) else batch
    return np.concatenate([run(part) for part in np.split(filled, padded // size)])[: len(batch)]


def default_threads() -> int:
    """Every core, or the share this process was given (settings.task_cpus)."""
    return settings.task_cpus() or os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    """The inference thread count: all cores unless told, and never below one."""
    if threads is not None and threads < 1:
        raise PtqError(f"--threads: must be at least 1, got {threads}")
    return threads or default_threads()


def metadata_object(path: Path, stored: dict[str, str], key: str) -> dict | None:
    """A JSON object ptq stored in a model's metadata under `key`, or None when absent; a one-line error
    naming the file when the entry is damaged."""
    if key not in stored:
        return None
    try:
        value = bounded.json_loads(stored[key])
    except ValueError as error:
        raise PtqError(f"{path}: model metadata '{key}' is not JSON ({error})") from error
    if not isinstance(value, dict):
        raise PtqError(f"{path}: model metadata '{key}' is not a JSON object")
    return value


def metadata(model) -> dict[str, str]:
    """The model's metadata_props as a dict (ptq keeps its settings, input contract and source there)."""
    return {prop.key: prop.value for prop in model.metadata_props}


def quantized_dtype(model) -> tuple[str, dict | None]:
    """The model's data type ("fp32", "int8", "uint8") and how it was quantized: ptq's settings from its metadata, else read off the graph."""
    import onnx

    stored = metadata(model)
    if QUANTIZATION_METADATA_KEY in stored:
        try:
            settings = bounded.json_loads(stored[QUANTIZATION_METADATA_KEY])
            return str(settings["dtype"]), settings
        except (ValueError, KeyError, TypeError):
            pass  # unreadable settings: tell the type from the graph
    # A quantized model from elsewhere: the zero point of its first QuantizeLinear tells the activation type,
    # and the graph the rest (described_from_graph).
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and len(node.input) > 2 and node.input[2] in initializers:
            zero_point = initializers[node.input[2]]
            dtype = "uint8" if zero_point.data_type == onnx.TensorProto.UINT8 else "int8"
            return dtype, described_from_graph(model, dtype)
    return "fp32", None


QOPERATOR_OPS = ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QGemm")


def described_from_graph(model, dtype: str) -> dict:
    """How a quantized model ptq did not make is quantized, read from its graph: QDQ or QOperator, the weights'
    type (the codes a DequantizeLinear reads from an initializer) and granularity (one scale per channel)."""
    import onnx

    initializers = {init.name: init for init in model.graph.initializer}
    weights = [node for node in model.graph.node if node.op_type == "DequantizeLinear" and node.input[0] in initializers]
    types = {initializers[node.input[0]].data_type for node in weights}
    per_channel = any(len(node.input) > 1 and node.input[1] in initializers and int(np.prod(initializers[node.input[1]].dims)) > 1 for node in weights)
    quantized_ops = {node.op_type for node in model.graph.node} & set(QOPERATOR_OPS)
    return {"format": "QOperator" if quantized_ops and not weights else "QDQ", "dtype": dtype,
            "weight_dtype": "uint8" if types == {onnx.TensorProto.UINT8} else "int8", "per_channel": per_channel, "made_by": "another tool"}


# What layout_from_consumers' `reader` says of the one node reading a value: a convolution (its input channels,
# None where unknown), a transpose or an elementwise op (the value it writes), or anything else.
CONVOLUTION, TRANSPOSE, ELEMENTWISE = "convolution", "transpose", "elementwise"


def layout_from_consumers(value, reader: Callable[[Any], tuple[str, Any]]) -> tuple[str, int] | None:
    """(layout, channels) of an input as a graph reads it, where the declared shape leaves that open: fed, through
    elementwise ops, to a convolution, NCHW with its input channels; through a transpose first, NHWC. `reader(value)`
    classifies the one node that reads `value` (ONNX and OpenVINO graphs each have theirs); None if not one."""
    transposed = False
    for _ in range(8):
        kind, found = reader(value)
        if kind == CONVOLUTION:
            return ((inputs.NHWC if transposed else inputs.NCHW), int(found)) if found else None
        if kind == TRANSPOSE and not transposed:
            transposed = True
        elif kind != ELEMENTWISE:
            return None
        value = found
    return None


def graph_layout(model, name: str) -> tuple[str, int] | None:
    """layout_from_consumers on an ONNX graph: a Conv with constant 4-D weights, a Transpose NHWC -> NCHW, and
    the arithmetic a normalisation is written with."""
    initializers = {init.name: init for init in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for value in node.input:
            consumers.setdefault(value, []).append(node)

    def reader(value: str) -> tuple[str, Any]:
        found = consumers.get(value, [])
        if len(found) != 1:
            return "", None
        node = found[0]
        if node.op_type == "Conv" and node.input[0] == value and node.input[1] in initializers and len(initializers[node.input[1]].dims) == 4:
            group = next((attribute.i for attribute in node.attribute if attribute.name == "group"), 1)
            return CONVOLUTION, int(initializers[node.input[1]].dims[1]) * max(group, 1)
        perm = next((list(attribute.ints) for attribute in node.attribute if attribute.name == "perm"), None)
        if node.op_type == "Transpose" and perm == [0, 3, 1, 2]:
            return TRANSPOSE, node.output[0]
        return (ELEMENTWISE if node.op_type in ("Sub", "Div", "Mul", "Add", "Cast", "Identity") else ""), node.output[0]

    return layout_from_consumers(name, reader)


def describe_input(path: Path, model, size: tuple[int, int] | None = None):
    """(ModelInput, declared class count or None) of an ONNX classifier, or a one-line error; `size` gives the
    height and width a model leaves open (--input-size), else the size a model ptq wrote stores with its preprocessing."""
    import onnx

    stored = inputs.from_metadata(metadata(model).get(inputs.INPUT_METADATA_KEY), path) if size is None else None
    size = stored.size if stored is not None else size

    found = graph_inputs(model)
    if len(found) != 1:
        raise PtqError(f"{path}: {len(found)} inputs ({', '.join(value.name for value in found)}); ptq takes image classifiers with one image input")
    value = found[0]
    is_float = value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    dims = onnx_dims(value)
    known_channels = len(dims) == 4 and (dims[1] in (1, 3) or dims[3] in (1, 3))
    described = model_input(path, value.name, dims, is_float, size, None if known_channels else graph_layout(model, value.name))
    if not model.graph.output:
        raise PtqError(f"{path}: the graph has no outputs; ptq takes classifiers whose first output is the class scores")
    return described, num_classes(path, onnx_dims(model.graph.output[0]))


# onnxruntime's session option for its exact (slower) u8 x s8 kernels on x86 CPUs without VNNI.
EXACT_PATH_CONFIG = "session.x64quantprecision"


def exact_kernel_bytes(data: bytes) -> bytes:
    """The model's bytes as onnxruntime's exact kernels load them: shared int8 weights given one copy per node (same
    arithmetic; transforms.qdq_edits.private_weight_dequantizers says why). Bytes that do not parse are left to onnxruntime."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_from_string(data)
    except (DecodeError, ValueError, RuntimeError):
        return data
    private = private_weight_dequantizers(model)
    return data if private is model else private.SerializeToString()


def ort_session(path: Path, data: bytes, exact_int8: bool = False, profile_prefix: str | None = None):
    """An onnxruntime session on the model's bytes: one thread, not spinning, silent; a graph it cannot load is one PtqError.
    `profile_prefix`: its profiler on, writing its events to a file that starts so."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if profile_prefix is not None:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    if exact_int8:
        options.add_session_config_entry(EXACT_PATH_CONFIG, "1")
        data = exact_kernel_bytes(data)
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4  # a failure is reported as a one-line PtqError, never as a log line
    # Idle onnxruntime threads spin, and would slow whatever runs next (another model being timed).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    ort.set_default_logger_severity(4)
    try:
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types for unloadable graphs
        kernels = f" with its exact int8 kernels ({EXACT_PATH_CONFIG}=1; --int8-path saturating runs without them)" if exact_int8 else ""
        raise PtqError(f"{path}: onnxruntime cannot load it{kernels} ({first_line(error)})") from error


def free_batch(path: Path, model, described: inputs.ModelInput):
    """The model with a symbolic batch dimension if it computes the same as the fixed-batch model image
    by image (compared on random inputs); None where the graph ties itself to the fixed batch."""
    if described.batch is None:
        return model
    candidate = symbolic_batch(model, described.batch)
    rng = np.random.default_rng(0)
    # A batch other than the fixed one (2 images, or 3 for a fixed 2): the fixed model runs once per image.
    probe = rng.standard_normal((3 if described.batch == 2 else 2, *described.shape(1)[1:]), dtype=np.float32)
    try:
        fixed = ort_session(path, model.SerializeToString())
        freed = ort_session(path, candidate.SerializeToString())
        expected = [fixed.run(None, {described.name: np.repeat(probe[i : i + 1], described.batch, axis=0)})[0][:1] for i in range(len(probe))]
        got = freed.run(None, {described.name: probe})[0]
    except Exception:  # noqa: BLE001  any failure means the batch cannot be freed
        return None
    return candidate if got.shape == (len(probe), *expected[0].shape[1:]) and np.allclose(np.concatenate(expected), got, rtol=1e-4, atol=1e-5) else None
