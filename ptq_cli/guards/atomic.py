"""Write every output through a temporary file and a rename, so no reader ever sees half a file.

The one naming rule for temporary files: `.<name>.<pid>-<random>.partial<suffix>`, beside the output.
Whatever lists models or records skips them (`is_temporary`), and the next write to the same folder
removes those left by a process that no longer runs (a `kill -9`, a power cut).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ptq_cli.errors import PtqError

# The errors of a write that fails for its destination (a full disk, a quota, a read-only or failing device).
WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})

# What the running command reads (its files by device and inode, its folders resolved): no output may be one of
# them, through a hard link, a symbolic link or a path inside a folder it reads images from.
_read_files: dict[tuple, str] = {}
_read_folders: dict[Path, str] = {}


@contextlib.contextmanager
def reading(paths: list[Path]) -> Iterator[None]:
    """For the duration of a command: the files and folders it was given to read, which nothing it writes may be."""
    saved = dict(_read_files), dict(_read_folders)
    for given in paths:
        for path in companions(given):
            try:
                if path.is_dir():
                    _read_folders[path.resolve()] = str(given)
                elif path.exists():
                    _read_files[_identity(path)] = str(given)
            except (OSError, ValueError):
                continue  # a name the system cannot look at: the command's own checks word it
    try:
        yield
    finally:
        _read_files.clear()
        _read_folders.clear()
        _read_files.update(saved[0])
        _read_folders.update(saved[1])


def _refuse_input(path: Path) -> None:
    try:
        same = _read_files.get(_identity(path)) if path.exists() else None
        resolved = path.resolve()
    except (OSError, ValueError):
        return
    if same is not None:
        raise PtqError(f"{path}: ptq would write over {same}, which this command reads (the same file, by a link or another name)")
    for folder, given in _read_folders.items():
        if resolved.is_relative_to(folder):
            raise PtqError(f"{path}: ptq would write it inside {given}, a folder this command reads; write it elsewhere")


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it to `path`, on any failure delete it."""
    path = Path(path)
    _refuse_directory(path)
    _refuse_input(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        # Same directory, so the final os.replace is atomic; same suffix, for writers that look at it.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{_short_name(path)}.{os.getpid()}-", suffix=f"{PARTIAL}{path.suffix}")
        os.close(fd)
    except OSError as error:
        raise PtqError(f"{path}: cannot write ({error.strerror or error})") from error
    tmp_path = Path(tmp_name)
    _in_progress.add(tmp_name)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        try:
            os.replace(tmp_path, path)
        except OSError as error:
            raise PtqError(f"{path}: cannot write ({error.strerror or error})") from error
    except OSError as error:  # a full disk while writing: named by the output, not the temporary file
        tmp_path.unlink(missing_ok=True)
        if error.filename not in (None, tmp_name, str(tmp_path)):
            raise
        raise PtqError(f"{path}: cannot write ({error.strerror or error})") from error
    except PtqError as error:  # a message naming the temporary file names the output instead
        tmp_path.unlink(missing_ok=True)
        if tmp_name in str(error):
            raise type(error)(str(error).replace(tmp_name, str(path))) from error
        raise
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    finally:
        _in_progress.discard(tmp_name)


# A file name holds at most 255 bytes; a temporary name adds 29 and the suffix again to the output's name.
NAME_BYTES = 255


def _short_name(path: Path) -> str:
    """The output's name as its temporary file carries it: whole where that fits in a file name, else its stem cut
    short (the suffix kept: remove_stale_temporaries reads it back)."""
    overhead = 29 + len(os.fsencode(path.suffix))
    if len(os.fsencode(path.name)) + overhead <= NAME_BYTES:
        return path.name
    room = max(1, NAME_BYTES - overhead - len(os.fsencode(path.suffix)))
    stem = os.fsencode(path.stem)[:room].decode("utf-8", "ignore") or "output"
    return stem + path.suffix


# The temporary files of this process's unfinished writes: removed by a hard stop (hardstop.py).
_in_progress: set[str] = set()


def remove_own_temporaries() -> None:
    for name in list(_in_progress):
        with contextlib.suppress(OSError):
            os.unlink(name)


PARTIAL = ".partial"


# Exactly what atomic_output names its files (mkstemp adds 8 characters of [a-z0-9_]).
TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]{1,10})-[a-z0-9_]{8}\.partial(?P<suffix>\.[^.]*)?")


def is_temporary(path: Path) -> bool:
    """Looks like a temporary file of an unfinished write: never listed as a model or a record (deleted
    only if remove_stale_temporaries can tell ptq made it)."""
    name = Path(path).name
    return name.startswith(".") and PARTIAL in name


def remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files in `path`'s folder whose writing process is gone; a live writer's stay.
    Only what ptq can tell it made: a regular file of this user, named exactly as atomic_output names them
    for an output of this folder (`.<name>.<pid>-<8 random>.partial<the name's suffix>`)."""
    for candidate in Path(path).parent.glob(f".*{PARTIAL}*"):
        match = TEMPORARY_NAME.fullmatch(candidate.name)
        if match is not None and (match["suffix"] or "") == Path(match["name"]).suffix and _left_by_a_gone_process(candidate, int(match["pid"]), stat.S_ISREG):
            candidate.unlink(missing_ok=True)


def process_folder(prefix: str) -> tempfile.TemporaryDirectory:
    """A private temporary folder that lasts as long as this process holds it (`<prefix><pid>-<random>` in the
    temporary directory). A process that is killed cannot remove its own: those of `prefix` whose process is gone
    are removed first. Only what ptq can tell it made: a folder (not a link) of this user, named exactly so."""
    parent = Path(tempfile.gettempdir())
    named = re.compile(re.escape(prefix) + r"(?P<pid>[0-9]{1,10})-[a-z0-9_]{8}")  # mkdtemp adds 8 characters of [a-z0-9_]
    for candidate in parent.glob(f"{prefix}*"):  # a prefix of ptq's own, without glob characters
        match = named.fullmatch(candidate.name)
        if match is not None and _left_by_a_gone_process(candidate, int(match["pid"]), stat.S_ISDIR):
            shutil.rmtree(candidate, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def _left_by_a_gone_process(candidate: Path, pid: int, is_kind: Callable[[int], bool]) -> bool:
    """Whether `candidate`, named by process `pid`, is this user's, of the kind (a regular file, a folder; not a link)
    and its process no longer runs."""
    if _running(pid):
        return False
    try:
        info = candidate.lstat()
    except OSError:
        return False
    return is_kind(info.st_mode) and info.st_uid == os.geteuid()


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
    _refuse_input(path)
    _probe(path.parent, path)


def check_folder_writable(folder: Path) -> None:
    """As check_writable, for a folder files will be written into under names decided by the work (records)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise PtqError(f"{folder}: cannot write files into it (it is not a directory)")
    _probe(folder, folder)


def _probe(folder: Path, named: Path) -> None:
    """A temporary file created and deleted in `folder`, or the nearest existing directory above it."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PtqError(f"{named}: cannot write ({existing} is not a directory)")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".ptq-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise PtqError(f"{named}: cannot write ({existing}: {error.strerror or error})") from error


# The files that stand with a model file of a suffix (an OpenVINO IR's .xml and its .bin), as the backend
# table declares them (Backend.companion_suffixes).
_COMPANIONS: dict[str, tuple[str, ...]] = {}


def declare_companions(suffix: str, companion_suffixes: tuple[str, ...]) -> None:
    _COMPANIONS[suffix.lower()] = tuple(companion_suffixes)


def companions(path: Path) -> list[Path]:
    """The files one model name stands for: the file, and those its kind keeps beside it."""
    path = Path(path)
    return [path, *(path.with_suffix(suffix) for suffix in _COMPANIONS.get(path.suffix.lower(), ()))]


def _identity(path: Path) -> tuple:
    """What makes two names one file: device and inode when it exists (hard links too), else its resolved path."""
    try:
        info = path.stat()
        return ("inode", info.st_dev, info.st_ino)
    except OSError:
        return ("path", str(path.resolve()))


def check_outputs(outputs: list[tuple[str, Path | None, tuple[str, ...]]], inputs: list[Path | None]) -> None:
    """Before any work, for each output (option, path, the suffixes of its kind): it has one of those
    suffixes, it is none of the inputs (an IR counts with its .bin), no two outputs are one file, and its
    directory can be written. Nothing the user gave is ever written over."""
    read = {}
    for given in inputs:
        for path in companions(given) if given is not None else []:
            if path.exists() and not path.is_dir():
                read[_identity(path)] = given
    written: dict[tuple, tuple[str, Path]] = {}
    for option, named, suffixes in outputs:
        if named is None:
            continue
        given = Path(named)
        check_writable(given)
        if suffixes and given.suffix.lower() not in suffixes:
            raise PtqError(f"{option}: {given} does not end in {' or '.join(suffixes)}; ptq writes only that kind of file there")
        for path in companions(given):
            key = _identity(path)
            if key in read:
                raise PtqError(f"{option}: {given} would overwrite {read[key]}, which this command reads")
            if key in written:
                raise PtqError(f"{option}: {given} is also the output of {written[key][0]} ({written[key][1]})")
            written[key] = (option, given)


def check_outside(outputs: list[Path], folders: list[Path | None]) -> None:
    """No output is written inside a folder the command reads images from (`--data`, `--calibration-data`):
    the next read would meet ptq's own file among the images."""
    for folder in folders:
        if folder is None or not Path(folder).is_dir():
            continue
        root = Path(folder).resolve()
        for output in outputs:
            if Path(output).resolve().is_relative_to(root):
                raise PtqError(f"{output}: ptq would write it inside {folder}, a folder it reads images from; "
                               "run it from another directory, or move the images")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8", errors="backslashreplace")  # a name no codec takes, shown escaped


def write_bytes(path: Path, data: bytes) -> None:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)
