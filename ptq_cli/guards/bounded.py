"""Reading the files people pass, within bounds: regular files only (no FIFO, device or /dev/zero behind a
symbolic link), and never more bytes, pixels, dimensions or classes than a limit.

Each limit is raised by an environment variable (docs/security.md, "Limits") for the rare real input that needs more.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ptq_cli.errors import PtqError, first_line

UNBOUNDED = 2**62  # a limit raised past this is no limit; larger numbers overflow the indexes they are compared with


@dataclass(frozen=True)
class Limit:
    env: str
    default: int
    what: str  # "bytes of one model file": worded for the message that names the limit

    def value(self) -> int:
        raw = os.environ.get(self.env, "")
        try:
            value = int(raw) if raw.strip() else self.default
        except ValueError:
            raise PtqError(f"{self.env}: '{raw[:40]}' is not a whole number") from None
        if value < 1:
            raise PtqError(f"{self.env}: {value} would refuse everything; give at least 1 (or leave it unset for {self.default:,})")
        return min(value, UNBOUNDED)  # "as much as there is": beyond what any index or file size can be

    def refuse(self, where: Path | str, found: str) -> PtqError:
        return PtqError(f"{where}: {found}, over the limit of {self.value():,} {self.what} (raise it with {self.env})")


# protobuf cannot hold more than 2 GiB: a larger .onnx keeps its weights in external data files.
MODEL_BYTES = Limit("PTQ_MAX_MODEL_BYTES", 2**31, "bytes for one model file")
# Members of one zip archive ptq reads (a torch.export program's weights are one member each).
ARCHIVE_MEMBERS = Limit("PTQ_MAX_ARCHIVE_MEMBERS", 100_000, "members in one archive")
# What one ONNX model may hold once its external data is read in: protobuf serializes at most 2 GiB, less its framing.
PROTOBUF_BYTES = 2**31 - 2**24
# One array of a dataset .npz, a calibration set or a cache entry (CIFAR-10's training set is 150 MB).
ARRAY_BYTES = Limit("PTQ_MAX_ARRAY_BYTES", 2**31, "bytes for one array")
# Pillow's own decompression-bomb threshold; an 8K photo has 33 million.
IMAGE_PIXELS = Limit("PTQ_MAX_IMAGE_PIXELS", 89_478_485, "pixels in one image")
# ImageNet-21k has 21,841 classes.
CLASSES = Limit("PTQ_MAX_CLASSES", 100_000, "classes")
# One model input of one image (3x2048x2048 is 12.6 million) and one inference call of a fixed batch
# (batch x image; 64 x 3x224x224 is 9.6 million).
INPUT_ELEMENTS = Limit("PTQ_MAX_INPUT_ELEMENTS", 2**24, "values in one image's input")
CALL_ELEMENTS = Limit("PTQ_MAX_CALL_ELEMENTS", 2**26, "input values in one inference call")
# Records, manifests, class lists: text ptq reads whole.
TEXT_BYTES = Limit("PTQ_MAX_TEXT_BYTES", 64 * 2**20, "bytes for a text file")
# One inference call that does not return in this many seconds is reported, not waited on.
CALL_SECONDS = Limit("PTQ_CALL_TIMEOUT", 900, "seconds for one inference call")
# A model `export --c-array` writes as C: microcontrollers' flash holds a few MB; the C text is six times the bytes.
C_ARRAY_BYTES = Limit("PTQ_MAX_C_ARRAY_BYTES", 64 * 2**20, "bytes for a model exported as a C array")
# One phase of a benchmark (batch-1 latency, or throughput) of a group of models: past it, the runs that fit give the figure.
BENCHMARK_SECONDS = Limit("PTQ_BENCHMARK_SECONDS", 300, "seconds for one phase of a benchmark")
# A download that goes on longer than this is stopped, however slowly its bytes keep coming (CIFAR-10 is 170 MB).
DOWNLOAD_SECONDS = Limit("PTQ_DOWNLOAD_TIMEOUT", 1800, "seconds for one download")
# What calibrating may hold at its peak, ptq itself counted as a fixed allowance: onnxruntime's calibrators keep every
# activation of every image they are given (tens of MB an image at 224x224), so images go in chunks.
CALIBRATION_BYTES = Limit("PTQ_CALIBRATION_MEMORY", 2 * 10**9, "bytes of memory for calibrating")
# Images at a model's input size an evaluation holds at once (CIFAR-10's test batch at 224x224 is 1.5 GB): a larger
# split is scored a part at a time.
HELD_IMAGE_BYTES = Limit("PTQ_IMAGES_MEMORY", 2**28, "bytes of images held at once")
LIMITS = (MODEL_BYTES, ARRAY_BYTES, IMAGE_PIXELS, CLASSES, INPUT_ELEMENTS, CALL_ELEMENTS, TEXT_BYTES, CALL_SECONDS, CALIBRATION_BYTES,
          HELD_IMAGE_BYTES, DOWNLOAD_SECONDS, C_ARRAY_BYTES, BENCHMARK_SECONDS, ARCHIVE_MEMBERS)

NPZ_MEMBERS = 1000
JSON_DEPTH = 64  # ptq's own JSON nests a few levels; a record or metadata deeper than this is not ptq's
NPY_HEADER_BYTES = 10_000  # numpy's own default bound on a .npy header


def regular_size(path: Path, what: str = "file") -> int:
    """The size of `path` if it is a regular file (after symbolic links); one line naming it otherwise."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise PtqError(f"{path}: {what} not found") from None
    except OSError as error:
        raise PtqError(f"{path}: cannot read ({error.strerror or error})") from error
    if stat.S_ISDIR(info.st_mode):
        raise PtqError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(info.st_mode):
        device = stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device" if device else "a socket or special file"
        raise PtqError(f"{path}: is {kind}, not a regular {what}")
    return info.st_size


def open_regular(path: Path, what: str = "file") -> BinaryIO:
    """`path` opened for reading if it is a regular file, in a way no read can block.

    The name is checked before it is opened (opening a FIFO waits for a writer), the opened file again (the name
    may have changed meanwhile), and reads are non-blocking: a "regular" file of a pseudo file system that would
    wait for data (/proc/kmsg) raises BlockingIOError, which `read_all` words as one line."""
    path = Path(path)
    regular_size(path, what)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        raise PtqError(f"{path}: cannot read ({error.strerror or error})") from error
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise PtqError(f"{path}: changed into a special file while opened, not a regular {what}")
    return os.fdopen(descriptor, "rb")


def blocked(path: Path | str, what: str = "file") -> PtqError:
    return PtqError(f"{path}: waits for data when read (a special file of the system, not a regular {what}); refused")


def pieces(handle: BinaryIO, path: Path, what: str, most: int, piece_bytes: int = 2**20) -> Iterator[bytes]:
    """An open file's bytes in pieces, at most `most` in all; a read that would wait, or fails, is one line."""
    left = most
    try:
        while left > 0:
            piece = handle.read(min(left, piece_bytes))
            if piece is None:  # a non-blocking read with nothing to give yet
                raise BlockingIOError
            if not piece:
                return
            left -= len(piece)
            yield piece
    except BlockingIOError:
        raise blocked(path, what) from None
    except OSError as error:
        raise PtqError(f"{path}: cannot read ({error.strerror or error})") from error


def read_all(handle: BinaryIO, path: Path, limit: Limit, what: str, expected: int = 0) -> bytes:
    """At most `limit` bytes of an open file, or one line saying it holds more or would block. In pieces of the size it
    had: a raised limit never becomes one huge buffer."""
    data = b"".join(pieces(handle, path, what, limit.value() + 1, max(expected + 1, 2**20)))
    if len(data) > limit.value():
        raise limit.refuse(path, "grew while read" if expected <= limit.value() else f"over {limit.value():,} bytes")
    return data


def read_span(handle: BinaryIO, path: Path, offset: int, length: int, what: str = "file") -> bytes:
    """Exactly `length` bytes from `offset` of an open file (open_regular), or one line saying why not."""
    pieces, left = [], length
    try:
        handle.seek(offset)
        while left > 0:
            piece = handle.read(min(left, 2**24))
            if piece is None:
                raise BlockingIOError
            if not piece:
                raise PtqError(f"{path}: shrank while read ({length - left:,} of the {length:,} bytes at {offset:,})")
            pieces.append(piece)
            left -= len(piece)
    except BlockingIOError:
        raise blocked(path, what) from None
    except OSError as error:
        raise PtqError(f"{path}: cannot read ({error.strerror or error})") from error
    return b"".join(pieces)


def read_head(path: Path, count: int, what: str = "file") -> bytes:
    """The first `count` bytes (fewer if the file is shorter) of a regular file, never a read that waits."""
    with open_regular(path, what) as handle:
        try:
            head = handle.read(count)
        except BlockingIOError:
            head = None
        except OSError as error:
            raise PtqError(f"{path}: cannot read ({error.strerror or error})") from error
    if head is None:
        raise blocked(path, what)
    return head


def read_bytes(path: Path, limit: Limit = MODEL_BYTES, what: str = "file") -> bytes:
    """The bytes of a regular file no larger than `limit`, read with a bound even if it grows meanwhile."""
    path = Path(path)
    size = regular_size(path, what)
    if size > limit.value():
        raise limit.refuse(path, f"{size:,} bytes")
    with open_regular(path, what) as handle:
        return read_all(handle, path, limit, what, size)


def sha256(path: Path, limit: Limit = ARRAY_BYTES, what: str = "file") -> bytes:
    """The sha256 digest of a regular file no larger than `limit`, read in pieces."""
    path = Path(path)
    size = regular_size(path, what)
    if size > limit.value():
        raise limit.refuse(path, f"{size:,} bytes")
    digest, read = hashlib.sha256(), 0
    with open_regular(path, what) as handle:
        for piece in pieces(handle, path, what, limit.value() + 1):
            digest.update(piece)
            read += len(piece)
    if read > limit.value():
        raise limit.refuse(path, "grew while read")
    return digest.digest()


def read_text(path: Path, what: str = "file") -> str:
    try:
        return read_bytes(path, TEXT_BYTES, what).decode("utf-8-sig")  # a byte-order mark (Windows editors) is not part of the text
    except UnicodeDecodeError as error:
        raise PtqError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error


class JsonRefused(ValueError):
    """JSON over ptq's bounds: a ValueError, as any unreadable JSON is to the code reading it."""


def json_loads(text: str | bytes, **options: Any) -> Any:
    """json.loads within bounds: at most TEXT_BYTES, nested at most JSON_DEPTH deep (the parser's own recursion
    is caught, never a RecursionError traceback)."""
    if len(text) > TEXT_BYTES.value():
        raise JsonRefused(f"{len(text):,} bytes of JSON, over {TEXT_BYTES.value():,} ({TEXT_BYTES.env})")
    try:
        value = json.loads(text, **options)
    except RecursionError:
        raise JsonRefused(f"JSON nested deeper than {JSON_DEPTH} levels") from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > JSON_DEPTH:
                raise JsonRefused(f"JSON nested deeper than {JSON_DEPTH} levels")
            pending += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item) if isinstance(child, dict | list)]
    return value


def check_count(where: Path | str, count: int, limit: Limit, found: str) -> None:
    if count > limit.value():
        raise limit.refuse(where, found)


def images_per_call(per_image: int, wanted: int) -> int:
    """At most `wanted` images, and no more than CALL_ELEMENTS input values, in one inference call."""
    return max(1, min(wanted, CALL_ELEMENTS.value() // max(1, per_image)))


def check_input(where: Path | str, shape: tuple[int, ...] | list[int]) -> None:
    """A model input (one image, without the batch) and, for a fixed batch, one call, within the limits."""
    dims = [int(dim) for dim in shape]
    if any(dim <= 0 for dim in dims[1:]):
        raise PtqError(f"{where}: declared input {list(dims)} has an empty dimension")
    per_image = math.prod(dims[1:])
    check_count(where, per_image, INPUT_ELEMENTS, f"declared input {'x'.join(map(str, dims[1:]))} has {per_image:,} values an image")
    if dims and dims[0] > 0:
        check_count(where, dims[0] * per_image, CALL_ELEMENTS, f"a fixed batch of {dims[0]:,} is {dims[0] * per_image:,} input values a call")


def npz_arrays(path: Path, names: tuple[str, ...] | None = None, what: str = ".npz") -> dict[str, np.ndarray]:
    """The arrays of an .npz (all, or those of `names` that are present), read without pickles and within
    ARRAY_BYTES each: every member must be a .npy, and its header is checked before anything is allocated."""
    path = Path(path)
    regular_size(path, what)
    try:
        with open_regular(path, what) as raw, zipfile.ZipFile(raw) as archive:
            members = archive.infolist()
            if len(members) > NPZ_MEMBERS:
                raise PtqError(f"{path}: {len(members):,} members, more than an {what} of arrays holds ({NPZ_MEMBERS})")
            found = {}
            for member in members:
                if not member.filename.endswith(".npy") or member.is_dir():
                    raise PtqError(f"{path}: member '{member.filename}' is not a .npy array")
                found[member.filename[: -len(".npy")]] = member
            wanted = {name: member for name, member in found.items() if names is None or name in names}
            # Each member, then all together, sized from their headers before any is inflated.
            declared = {name: _declared(path, archive, member, name) for name, member in wanted.items()}
            total = sum(declared.values())
            if total > ARRAY_BYTES.value():
                raise ARRAY_BYTES.refuse(path, f"its arrays are {total:,} bytes together")
            return {name: _read_member(path, archive, member, name, declared[name]) for name, member in wanted.items()}
    except PtqError:
        raise
    except zipfile.BadZipFile as error:
        hint = " (a .npy renamed .npz?)" if _is_npy(path) else ""
        raise PtqError(f"{path}: not a readable {what} ({error}){hint}") from error
    except (OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as error:
        raise PtqError(f"{path}: not a readable {what} ({first_line(error)})") from error


def _is_npy(path: Path) -> bool:
    try:
        return read_head(path, 6) == b"\x93NUMPY"
    except (PtqError, OSError):
        return False


def _declared(path: Path, archive: zipfile.ZipFile, member: zipfile.ZipInfo, name: str) -> int:
    """The bytes a member's .npy header declares, read without inflating its data; object arrays, negative
    dimensions and a member over ARRAY_BYTES refused."""
    where = f"{path}: '{name}'"
    with archive.open(member) as handle:
        version = np.lib.format.read_magic(handle)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = reader(handle, max_header_size=NPY_HEADER_BYTES)
    if dtype.hasobject:
        raise PtqError(f"{where} holds Python objects; ptq reads numeric and string arrays only")
    if any(dim < 0 for dim in shape):
        raise PtqError(f"{where} declares a negative dimension")
    size = math.prod(shape) * dtype.itemsize
    if size > ARRAY_BYTES.value():
        raise ARRAY_BYTES.refuse(path, f"'{name}' is {size:,} bytes")
    return size


def _read_member(path: Path, archive: zipfile.ZipFile, member: zipfile.ZipInfo, name: str, size: int) -> np.ndarray:
    """The member's array, of the `size` its header declared (_declared)."""
    if size > member.file_size:
        raise PtqError(f"{path}: '{name}' declares {size:,} bytes of data but holds {member.file_size:,}")
    with archive.open(member) as handle:
        return np.lib.format.read_array(handle, allow_pickle=False, max_header_size=NPY_HEADER_BYTES)

