"""Write every output through a temporary file and a rename, so no reader ever sees half a file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ptq_cli.errors import PtqError


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it to `path`, on any failure delete it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Same directory, so the final os.replace is atomic; same suffix, for writers that look at it.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".partial{path.suffix}")
        os.close(fd)
    except OSError as error:
        raise PtqError(f"{path}: cannot write ({error.strerror or error})") from error
    tmp_path = Path(tmp_name)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)
