"""The backend table: one module per framework, each with the same functions.

- `load(path, threads, flags) -> LoadedModel`: run a model file of this framework;
- `quantize(onnx_model, output, settings, calibration_inputs, stored_metadata) -> QuantizedFile` (LiteRT
  quantizes the Keras model the ONNX model records as its source);
- `sniff(first_bytes) -> bool`: whether a file is this framework's;
- `NAME`, `SUFFIX`.
How a model was quantized is described in one place for all: services.quant_settings.describe_quantization.
A new runtime is a new module here and a row in BACKENDS.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from ptq_cli.backends import litert, onnxruntime, openvino, pytorch
from ptq_cli.errors import PtqError
from ptq_cli.services.models import require_file

BACKENDS: dict[str, ModuleType] = {onnxruntime.NAME: onnxruntime, pytorch.NAME: pytorch, openvino.NAME: openvino, litert.NAME: litert}
# Told apart by content, most specific first; ONNX takes what no other backend claims.
SNIFF_ORDER = (pytorch, openvino, litert, onnxruntime)
# Runtimes that run another backend's files: OpenVINO runs ONNX files too.
RUNTIMES = (onnxruntime.NAME, openvino.NAME)


def backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise PtqError(f"--backend: '{name}' is not one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def loads_code(path: Path) -> bool:
    """Whether loading the file runs code stored in it: a TorchScript archive (by name or by content)."""
    try:
        return for_file(path) is pytorch
    except PtqError:
        return False


def for_file(path: Path, runtime: str | None = None) -> ModuleType:
    """The backend of a model file, by its content (a TorchScript file is a zip archive), not its name;
    `runtime` "openvino" takes an ONNX file to OpenVINO."""
    path = Path(path)
    require_file(path)
    if runtime is not None and runtime not in RUNTIMES:
        raise PtqError(f"--runtime: '{runtime}' is not one of {', '.join(RUNTIMES)}")
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except OSError as error:
        raise PtqError(f"{path}: cannot read ({error.strerror or error})") from error
    if path.suffix == pytorch.SUFFIX:
        found = pytorch
    else:
        found = next(module for module in SNIFF_ORDER if module.sniff(head))
    if runtime is None or runtime == found.NAME:
        return found
    if found is onnxruntime and runtime == openvino.NAME:
        return openvino
    raise PtqError(f"--runtime {runtime}: {path} is a {found.NAME} model; only ONNX files run on another runtime")
