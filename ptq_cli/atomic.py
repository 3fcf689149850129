"""Write every output through a temporary file and a rename, so no reader ever sees half a file.

The one naming rule for temporary files: `.<name>.<pid>-<random>.partial<suffix>`, beside the output.
Whatever lists models or records skips them (`is_temporary`), and the next write to the same folder
removes those left by a process that no longer runs (a `kill -9`, a power cut).
"""

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
        remove_stale_temporaries(path)
        # Same directory, so the final os.replace is atomic; same suffix, for writers that look at it.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}-", suffix=f"{PARTIAL}{path.suffix}")
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


PARTIAL = ".partial"


def is_temporary(path: Path) -> bool:
    """A temporary file of an unfinished write (finished or abandoned): never a model or a record."""
    name = Path(path).name
    return name.startswith(".") and PARTIAL in name


def remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files in `path`'s folder whose writing process is gone; a live writer's stay."""
    for candidate in Path(path).parent.glob(f".*{PARTIAL}*"):
        owner = candidate.name.rsplit(PARTIAL, 1)[0].rsplit(".", 1)[-1].split("-", 1)[0]
        if candidate.is_file() and not (owner.isdigit() and _running(int(owner))):
            candidate.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process (or an odd number): leave its file alone
    return True


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
