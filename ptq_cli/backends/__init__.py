"""The backend table: one module per backend, each exporting one `BACKEND` row (backends/base.Backend).

A new backend or runtime is a new module here and its row in `register` below; services loop over the
table and never test a backend's name. A test (or a plugin) adds a row with `register`.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ptq_cli.backends import executorch, litert, onnxruntime, openvino, pt2e, pytorch, tflm
from ptq_cli.backends.base import Backend
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import declare_companions
from ptq_cli.model_file import foreign_kind, require_file

# In the order the report lists them; the first is the default backend and the runtime every speed-up
# is also given against.
TABLE: dict[str, Backend] = {}


def register(row: Backend) -> Backend:
    TABLE[row.name] = row
    if row.companion_suffixes:
        declare_companions(row.suffix, row.companion_suffixes)
    return row


for _module in (onnxruntime, pytorch, pt2e, executorch, openvino, litert, tflm):
    register(_module.BACKEND)


DEFAULT = onnxruntime.NAME


def quantizers() -> tuple[str, ...]:
    return tuple(name for name, row in TABLE.items() if row.quantizer is not None)


def runtimes() -> tuple[str, ...]:
    """Runtimes that run another backend's files when asked (`--runtime`), with the backends whose files they run."""
    taken = {suffix for row in TABLE.values() for suffix in row.runtime.runs_suffixes}
    return tuple(name for name, row in TABLE.items() if row.runtime.runs_suffixes or set(row.suffixes) & taken)


def precisions() -> tuple[str, ...]:
    return tuple(dict.fromkeys(precision for row in TABLE.values() for precision in row.runtime.precisions))


def methods() -> tuple[str, ...]:
    return tuple(dict.fromkeys(method for row in TABLE.values() if row.quantizer is not None for method in row.quantizer.methods))


def private_options() -> dict[str, tuple[Backend, ...]]:
    """Each setting only some quantizers take (a field of their Options) and those quantizers, in table order."""
    owners: dict[str, tuple[Backend, ...]] = {}
    for row in TABLE.values():
        for item in fields(row.quantizer.options) if row.quantizer is not None else ():
            owners[item.name] = (*owners.get(item.name, ()), row)
    return owners


def suffixes() -> tuple[str, ...]:
    return tuple(dict.fromkeys(suffix for row in TABLE.values() for suffix in row.suffixes))


def order(name: str) -> int:
    return list(TABLE).index(name) if name in TABLE else len(TABLE)


def backend(name: str) -> Backend:
    if name not in TABLE:
        raise PtqError(f"--backend: '{name}' is not one of {', '.join(TABLE)}")
    return TABLE[name]


def loads_code(path: Path) -> bool:
    """Whether loading the file runs code stored in it (a TorchScript archive, by name or by content)."""
    try:
        return for_file(path).name == pytorch.BACKEND.name
    except PtqError:
        return False


def _sniffed(path: Path, head: bytes) -> Backend:
    """A row whose suffix decides (a .pt file is TorchScript, so a damaged one says so), else the first row
    whose sniffing claims the bytes, the catch-all rows (ONNX: it then says if the file is not) last."""
    rows = list(TABLE.values())
    decided = [row for row in rows if row.suffix_decides and path.suffix in row.suffixes]
    claimed = [row for row in rows if not row.catch_all and row.sniff(head)]
    return (decided or claimed or [row for row in rows if row.catch_all])[0]


def for_file(path: Path, runtime: str | None = None) -> Backend:
    """The backend of a model file, by its content, not its name; `runtime` runs it on another runtime
    that takes files of its kind (an ONNX file on OpenVINO)."""
    path = Path(path)
    require_file(path)
    head = bounded.read_head(path, 8, "model file")
    foreign = foreign_kind(path, head)
    if foreign is not None:
        raise PtqError(f"{path}: {foreign}")
    found = _sniffed(path, head)
    if runtime is None or runtime == found.name:
        return found
    if runtime not in runtimes():
        raise PtqError(f"--runtime: '{runtime}' is not one of {', '.join(runtimes())}")
    chosen = TABLE[runtime]
    if found.suffix in chosen.runtime.runs_suffixes:
        return chosen
    kinds = ", ".join(dict.fromkeys(chosen.suffixes + chosen.runtime.runs_suffixes))
    raise PtqError(f"--runtime {runtime}: {path} is a model of {found.name}; {runtime} runs {kinds} files only")
