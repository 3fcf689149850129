"""CIFAR-10 in its official python-pickle layout: data_batch_1..5 (train), test_batch (test), batches.meta."""

from __future__ import annotations

import codecs
import io
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptq_cli.guards import bounded

try:  # numpy 2 pickles name numpy._core; the official batches, numpy 1's numpy.core
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
from ptq_cli.datasets.base import TEST, TRAIN, Dataset, file_digest
from ptq_cli.errors import PtqError, first_line

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META_FILE = "batches.meta"
NUM_CLASSES = 10
TEST_IMAGES_PER_CLASS = 1000
BATCHES = {TRAIN: TRAIN_BATCHES, TEST: (TEST_BATCH,)}


def is_cifar_directory(path: Path) -> bool:
    return path.is_dir() and ((path / META_FILE).exists() or (path / TEST_BATCH).exists() or (path / TRAIN_BATCHES[0]).exists())


class Cifar10(Dataset):
    format = "cifar10"
    root_noun = "CIFAR-10 data directory"

    def splits(self) -> tuple[str, ...]:
        present = tuple(split for split, names in BATCHES.items() if all((self.root / name).exists() for name in names))
        if not present:
            raise PtqError(f"{self.root}: neither the training batches nor test_batch are there")
        return present

    def class_names(self) -> tuple[str, ...]:
        return load_class_names(self.root)

    def source_files(self, split: str) -> list[Path]:
        return [self.root / META_FILE, *(self.root / name for name in BATCHES[split])]

    def content_key(self, split: str) -> str:
        return file_digest(self.source_files(split))

    def _decode(self, split: str, _size: tuple[int, int] | None, indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        parts = [load_batch(self.root / name) for name in BATCHES[split]]
        images, labels = np.concatenate([images for images, _ in parts]), np.concatenate([labels for _, labels in parts])
        return (images, labels) if indices is None else (images[indices], labels[indices])


class _Refused(pickle.UnpicklingError):
    """A pickle naming a class or function a CIFAR-10 batch never holds."""


class _CifarUnpickler(pickle.Unpickler):
    """Only what a CIFAR-10 batch is made of (dicts, lists, bytes, numbers, a uint8 numpy array): a pickle
    naming any other class or function is refused before anything of it runs."""

    ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("_codecs", "encode"),  # how protocol 2 writes bytes from Python 3: codecs.encode(str, "latin1")
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self.ALLOWED:
            raise _Refused(f"it names {module}.{name}, which a CIFAR-10 batch never holds; refused without running it")
        return {"ndarray": np.ndarray, "dtype": np.dtype, "_reconstruct": _reconstruct, "encode": codecs.encode}[name]


def _unpickle(path: Path) -> object:
    data = bounded.read_bytes(path, bounded.ARRAY_BYTES, "CIFAR-10 file")
    try:
        return _CifarUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, ImportError, MemoryError,
            RecursionError, OverflowError, UnicodeDecodeError) as error:
        reason = first_line(error)
        raise PtqError(f"{path}: not a readable CIFAR-10 pickle ({reason})" if isinstance(error, _Refused)
                       else f"{path}: not a readable CIFAR-10 pickle (truncated or corrupt: {reason})") from error


def load_class_names(data_dir: Path) -> tuple[str, ...]:
    path = Path(data_dir) / META_FILE
    meta = _unpickle(path)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != NUM_CLASSES:
        raise PtqError(f"{path}: no list of {NUM_CLASSES} label_names in it")
    return tuple(name.decode(errors="replace") if isinstance(name, bytes) else str(name) for name in names)


def load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file as (uint8 NHWC images, int64 labels), with its structure checked."""
    batch = _unpickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise PtqError(f"{path}: not a CIFAR-10 batch (no b'data' and b'labels' keys)")
    # The official batches hold an array and a list of ints. Anything else is refused before numpy makes it an array:
    # a list of references to one row would allocate gigabytes from a small file.
    if not isinstance(batch[b"data"], np.ndarray):
        raise PtqError(f"{path}: b'data' is a {type(batch[b'data']).__name__}, not the uint8 array a CIFAR-10 batch holds")
    raw_labels = batch[b"labels"]
    if not isinstance(raw_labels, np.ndarray) and not (isinstance(raw_labels, list) and all(type(label) is int for label in raw_labels)):
        raise PtqError(f"{path}: b'labels' is not a list of integers")
    try:
        data = np.asarray(batch[b"data"])
        labels = np.asarray(raw_labels)
    except (TypeError, ValueError, OverflowError) as error:
        raise PtqError(f"{path}: b'data' or b'labels' is not an array ({error})") from error
    if labels.size and labels.dtype.kind not in "iu":
        raise PtqError(f"{path}: b'labels' are {labels.dtype}, not integers")
    labels = labels.astype(np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise PtqError(f"{path}: b'data' is {data.dtype} {data.shape}, expected uint8 N x 3072")
    if labels.shape != (data.shape[0],):
        raise PtqError(f"{path}: {labels.shape[0] if labels.ndim else 0} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise PtqError(f"{path}: labels outside 0..{NUM_CLASSES - 1}")
    # Rows are planar R, G, B planes of 32x32: to NHWC.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


@dataclass(frozen=True)
class DirectorySummary:
    data_dir: Path
    train_images: int
    test_images: int
    class_names: tuple[str, ...]


def validate_directory(data_dir: Path) -> DirectorySummary:
    """Check a CIFAR-10 directory by structure, not by file hash (rebuilt copies differ in b'filenames'):
    every batch's keys, shapes and label range, the ten class names, and 1,000 test images per class."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise PtqError(f"{data_dir}: CIFAR-10 data directory not found")
    class_names = load_class_names(data_dir)
    train_images = sum(len(load_batch(data_dir / name)[1]) for name in TRAIN_BATCHES)
    _, test_labels = load_batch(data_dir / TEST_BATCH)
    per_class = np.bincount(test_labels, minlength=NUM_CLASSES)
    if not (per_class == TEST_IMAGES_PER_CLASS).all():
        raise PtqError(f"{data_dir / TEST_BATCH}: {per_class.tolist()} images per class, expected {TEST_IMAGES_PER_CLASS} of each")
    return DirectorySummary(data_dir, train_images, len(test_labels), class_names)
