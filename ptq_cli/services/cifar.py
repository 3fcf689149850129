"""The one loader of CIFAR-10 (official python-pickle layout)."""

from __future__ import annotations

import hashlib
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptq_cli import settings
from ptq_cli.atomic import atomic_output
from ptq_cli.errors import PtqError

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META_FILE = "batches.meta"
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
TEST_IMAGES_PER_CLASS = 1000


@dataclass(frozen=True)
class CifarSplit:
    images: np.ndarray  # (N, 32, 32, 3) uint8, NHWC
    labels: np.ndarray  # (N,) int64 in 0..9
    class_names: tuple[str, ...]
    source_batches: tuple[str, ...]


def to_model_input(images: np.ndarray) -> np.ndarray:
    """The model's input format: NHWC float32 raw pixels 0-255, no normalisation."""
    return images.astype(np.float32)


def _check_dir(data_dir: Path) -> None:
    if not data_dir.is_dir():
        raise PtqError(f"{data_dir}: CIFAR-10 data directory not found")


def _unpickle(path: Path) -> object:
    if not path.is_file():
        raise PtqError(f"{path}: missing CIFAR-10 file")
    try:
        with path.open("rb") as handle:
            return pickle.load(handle, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise PtqError(f"{path}: not a readable CIFAR-10 pickle (truncated or corrupt: {error or type(error).__name__})") from error


def load_class_names(data_dir: Path) -> tuple[str, ...]:
    data_dir = Path(data_dir)
    _check_dir(data_dir)
    path = data_dir / META_FILE
    meta = _unpickle(path)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != NUM_CLASSES:
        raise PtqError(f"{path}: no list of {NUM_CLASSES} label_names in it")
    return tuple(name.decode() if isinstance(name, bytes) else str(name) for name in names)


def load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file as (uint8 NHWC images, int64 labels), with its structure checked."""
    batch = _unpickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise PtqError(f"{path}: not a CIFAR-10 batch (no b'data' and b'labels' keys)")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise PtqError(f"{path}: b'data' is {data.dtype} {data.shape}, expected uint8 N x 3072")
    if labels.shape != (data.shape[0],):
        raise PtqError(f"{path}: {labels.shape[0]} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise PtqError(f"{path}: labels outside 0..{NUM_CLASSES - 1}")
    # Rows are planar R, G, B planes of 32x32: to NHWC.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _decode(data_dir: Path, batch_names: tuple[str, ...]) -> CifarSplit:
    class_names = load_class_names(data_dir)
    parts = [load_batch(data_dir / name) for name in batch_names]
    return CifarSplit(
        images=np.concatenate([images for images, _ in parts]),
        labels=np.concatenate([labels for _, labels in parts]),
        class_names=class_names,
        source_batches=batch_names,
    )


def _content_key(paths: list[Path]) -> str:
    """sha256 over the files' bytes: any change to any file gives another key, so nothing stale is served.

    Hashing all six files takes about 0.14 s here; unpickling the training batches takes about 0.9 s.
    """
    digest = hashlib.sha256()
    for path in paths:
        if not path.is_file():
            raise PtqError(f"{path}: missing CIFAR-10 file")
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _load(data_dir: Path, batch_names: tuple[str, ...]) -> CifarSplit:
    """Decoded arrays from the cache when the source files are byte-identical, else decode and cache."""
    data_dir = Path(data_dir)
    _check_dir(data_dir)
    key = _content_key([data_dir / META_FILE, *(data_dir / name for name in batch_names)])
    cached = settings.cache_dir() / f"cifar10-{key[:40]}.npz"
    try:
        with np.load(cached, allow_pickle=False) as arrays:
            return CifarSplit(arrays["images"], arrays["labels"], tuple(arrays["class_names"].tolist()), batch_names)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass  # not cached yet, or an unreadable cache file: decode again
    split = _decode(data_dir, batch_names)
    try:
        with atomic_output(cached) as tmp, tmp.open("wb") as handle:
            np.savez(handle, images=split.images, labels=split.labels, class_names=np.array(split.class_names))
    except PtqError:
        pass  # a read-only cache only costs speed
    return split


def load_train(data_dir: Path) -> CifarSplit:
    """The 50,000 training images: the only source of calibration data."""
    return _load(data_dir, TRAIN_BATCHES)


def load_test(data_dir: Path) -> CifarSplit:
    """The 10,000 test images: only ever used to evaluate."""
    return _load(data_dir, (TEST_BATCH,))


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
    class_names = load_class_names(data_dir)
    train_images = sum(len(load_batch(data_dir / name)[1]) for name in TRAIN_BATCHES)
    _, test_labels = load_batch(data_dir / TEST_BATCH)
    per_class = np.bincount(test_labels, minlength=NUM_CLASSES)
    if not (per_class == TEST_IMAGES_PER_CLASS).all():
        raise PtqError(f"{data_dir / TEST_BATCH}: {per_class.tolist()} images per class, expected {TEST_IMAGES_PER_CLASS} of each")
    return DirectorySummary(data_dir, train_images, len(test_labels), class_names)
