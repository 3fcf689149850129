"""Within one `ptq run`, what a quantizer made (files, intermediate models, choices) handed back when the same inputs
come again: the run makes several models from one FP32 model, some of them from the same inputs."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ptq_cli.guards.atomic import atomic_output
from ptq_cli.quantize.settings import QuantizedFile


@dataclass
class _MadeOnce:
    """While `reusing_made_files()` is open: what backends made (files, intermediate models, choices), by the digest
    of what each was made from, with its size in bytes."""

    open: bool = False
    made: dict[str, tuple[Any, int]] = field(default_factory=dict)  # oldest first
    directory: Path | None = None  # files kept for the scope's later calls (onnxruntime's calibration caches)


REUSE_BYTES = 512 * 2**20  # the bytes kept at most: the oldest go first
_MADE = _MadeOnce()
REUSED_NOTE = "the same file an earlier stage of this run made from the same model, images and settings: written again, not made again"


@contextmanager
def reusing_made_files() -> Iterator[None]:
    """Within it, a backend hands back what it made from the same inputs earlier (`made_once`, `computed_once`):
    `ptq run` makes several models from one FP32 model, and OpenVINO's default IR is onnxruntime's int8 QDQ model
    converted."""
    was_open, _MADE.open = _MADE.open, True
    if not was_open:
        _MADE.directory = Path(tempfile.mkdtemp(prefix="ptq-reused-"))
    try:
        yield
    finally:
        _MADE.open = was_open
        if not was_open:
            _MADE.made.clear()
            shutil.rmtree(_MADE.directory or "", ignore_errors=True)
            _MADE.directory = None


def reused_file(key: Callable[[], str], suffix: str) -> Path | None:
    """Within `reusing_made_files()`, where a backend keeps (or finds) the file it made from the inputs `key()` digests,
    for later calls of the same run; None outside it."""
    if not _MADE.open or _MADE.directory is None:
        return None
    return _MADE.directory / f"{key()}{suffix}"


def digest(*parts: bytes | memoryview) -> str:
    """sha256 over `parts`, each with its length, so no two lists of parts give the same bytes. A part may be a byte
    view of an array (`array.reshape(-1).view(np.uint8).data`): hashed where it lies, not copied."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(len(part).to_bytes(8, "little"))
        hashed.update(part)
    return hashed.hexdigest()


T = TypeVar("T")


def computed_once(key: Callable[[], str], compute: Callable[[], T], size: Callable[[T], int] = lambda _: 0) -> T:
    """`compute()`; within `reusing_made_files()`, what an earlier `compute()` of the same `key()` returned (`size`:
    the bytes it holds)."""
    if not _MADE.open:
        return compute()
    digest = key()
    if digest in _MADE.made:
        return _MADE.made[digest][0]
    value = compute()
    _MADE.made[digest] = (value, size(value))
    while sum(held for _, held in _MADE.made.values()) > REUSE_BYTES and len(_MADE.made) > 1:
        del _MADE.made[next(iter(_MADE.made))]
    return value


def made_once(key: Callable[[], str], output: Path, make: Callable[[], QuantizedFile]) -> QuantizedFile:
    """`make()`, which writes `output`; within `reusing_made_files()`, the bytes and result of an earlier `make()` of
    the same `key()` instead, written to `output`."""
    made_now = False

    def make_and_keep() -> tuple[bytes, QuantizedFile]:
        nonlocal made_now
        made_now, result = True, make()
        return Path(output).read_bytes() if _MADE.open else b"", result

    data, result = computed_once(key, make_and_keep, size=lambda kept: len(kept[0]))
    if made_now:
        return result
    with atomic_output(output) as tmp:
        tmp.write_bytes(data)
    return replace(result, notes=(*result.notes, REUSED_NOTE))


