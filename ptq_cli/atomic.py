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
    _refuse_directory(path)
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
        try:
            os.replace(tmp_path, path)
        except OSError as error:
            raise PtqError(f"{path}: cannot write ({error.strerror or error})") from error
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _refuse_directory(path: Path) -> None:
    if str(path) in ("", ".") or path.is_dir():
        raise PtqError(f"{path}: is a directory; give a file name")


def check_writable(path: Path) -> None:
    """Fail before long work, not after it: `path` must be a file name in a directory we can create files in.

    Probes by creating (and deleting) a temporary file in the nearest existing directory, since
    permission bits alone do not tell (root ignores them; read-only mounts and immutable flags do not).
    """
    path = Path(path)
    _refuse_directory(path)
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PtqError(f"{path}: cannot write ({existing} is not a directory)")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".ptq-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise PtqError(f"{path}: cannot write ({existing}: {error.strerror or error})") from error


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
