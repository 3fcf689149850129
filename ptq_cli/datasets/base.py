"""The one dataset interface: splits of labelled uint8 images (N x H x W x C), class names, a content key.

Every format (CIFAR-10 batches, an image folder, an .npz) is one module implementing `Dataset`; services
receive a `Dataset` and never know the format. Like onnxruntime's CalibrationDataReader, nothing here
knows the model: the model's size and channel count are asked for by the caller (`load(split, size, channels)`).
"""

from __future__ import annotations

import hashlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded, cache
from ptq_cli.guards.atomic import atomic_output

TRAIN, VAL, TEST = "train", "val", "test"
SPLITS = (TRAIN, VAL, TEST)
UNLABELLED = -1  # the label of every image of a set without labels (no class names)


@dataclass(frozen=True)
class LabelledImages:
    images: np.ndarray  # (N, H, W, C) uint8
    labels: np.ndarray  # (N,) int64 in 0..len(class_names)-1; UNLABELLED (-1) each in a set without labels
    class_names: tuple[str, ...]  # () for a set without labels
    split: str
    content_sha256: str  # of the source files of this split: any change gives another key

    @property
    def labelled(self) -> bool:
        return bool(self.class_names)


@dataclass(frozen=True)
class SplitImages:
    """A split whose labels and content key are read and whose images are loaded when asked for, at the size and
    channels given: a part at a time (`parts`), or those at some positions (`take`)."""

    dataset: Dataset
    split: str
    size: tuple[int, int] | None
    channels: int | None
    labels: np.ndarray
    class_names: tuple[str, ...]
    content_sha256: str

    @property
    def labelled(self) -> bool:
        return bool(self.class_names)

    def take(self, indices: np.ndarray | None = None) -> np.ndarray:
        """The images at `indices` (positions in the split), or all of them."""
        return self.dataset.load_keyed(self.split, self.content_sha256, self.size, self.channels, indices).images

    def parts(self, images_per_part: int) -> Iterator[tuple[int, np.ndarray]]:
        """(position of its first image, images) of consecutive parts of at most `images_per_part` images; the
        split in one part, as `load` gives it, where it fits."""
        total = len(self.labels)
        if images_per_part >= total:
            yield 0, self.take()
            return
        for start in range(0, total, images_per_part):
            yield start, self.take(np.arange(start, min(start + images_per_part, total)))


class Dataset(ABC):
    """Labelled images in one of the formats people keep them in."""

    format: str = "?"
    labelled: bool = True  # False: images without labels (class_names() is empty, every label UNLABELLED)
    names_its_classes: bool = True  # False: labels numbered only, so the classes may be more than the highest label says
    # What its root is, in a user's words, and whether it is one file (else a directory): opening it checks that first.
    root_noun: str = "data"
    root_is_file: bool = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not (self.root.is_file() if self.root_is_file else self.root.is_dir()):
            raise PtqError(f"{self.root}: {self.root_noun} not found")

    @abstractmethod
    def splits(self) -> tuple[str, ...]:
        """The splits this dataset has, of TRAIN, VAL, TEST; a single-set source has only TEST."""

    @abstractmethod
    def class_names(self) -> tuple[str, ...]: ...

    @abstractmethod
    def source_files(self, split: str) -> list[Path]:
        """The files the split is read from."""

    @abstractmethod
    def content_key(self, split: str) -> str:
        """sha256 over the bytes of the split's source files (cheap next to decoding them)."""

    @abstractmethod
    def _decode(self, split: str, size: tuple[int, int] | None, indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 N x H x W x C images, int64 labels) of the split, resized to `size` (H, W) if the
        format cannot hold images of different sizes in one array otherwise; only the images at `indices`
        (positions in the split) when given (`load` asks so of formats that resize on decode)."""

    # A source with one unnamed set of images (an .npz, a folder of class folders): it serves as the
    # evaluation set, and as calibration data only when pointed at by --calibration-data.
    single_set: bool = False
    # Formats whose images may differ in size decode straight to the size asked for (cached per size);
    # the others are cached as they are and resized after loading.
    resizes_on_decode: bool = False
    # How this format's decoder turns files into pixels, part of its cache entries' seal: a decoder that changes
    # what it makes of a file changes this, and entries it made before are decoded again.
    decoding: str = "1"

    def evaluation_split(self) -> str:
        """The split models are judged on: test, else val."""
        for split in (TEST, VAL):
            if split in self.splits():
                return split
        raise PtqError(f"{self.root}: no test or val split to evaluate on")

    def calibration_split(self) -> str:
        """The split calibration (and tuning's validation) images are drawn from: train, or the only set."""
        if TRAIN in self.splits():
            return TRAIN
        if self.single_set:
            return TEST
        raise PtqError(f"{self.root}: no train split to draw calibration images from (give --calibration-data)")

    def slug(self, split: str) -> str:
        return split_slug(self.root, split)

    def check_split(self, split: str) -> None:
        if split not in self.splits():
            raise PtqError(f"{self.root}: no '{split}' split (it has: {', '.join(self.splits())})")

    def labels(self, split: str) -> np.ndarray:
        """The split's labels, in the order `load` gives its images (what callers draw indices from)."""
        return self.load(split).labels

    def load(self, split: str, size: tuple[int, int] | None = None, channels: int | None = None,
             indices: np.ndarray | None = None) -> LabelledImages:
        """The split's images (only those at `indices`, positions in the split, when given), resized to `size`
        (H, W) and converted to `channels` (1 or 3) when given: a few images drawn from many are resized alone.

        Decoded (and resized) arrays are cached under the split's content key, with a digest of the
        arrays checked on every load: a changed source or a damaged cache file is never served."""
        self.check_split(split)
        return self.load_keyed(split, self.content_key(split), size, channels, indices)

    def open_split(self, split: str, size: tuple[int, int] | None = None, channels: int | None = None) -> SplitImages:
        """The split's labels and content key now, its images (at `size` and `channels`) when asked for: a part at
        a time, so that what is held is a part and not the split."""
        self.check_split(split)
        return SplitImages(self, split, size, channels, self.labels(split), self.class_names(), self.content_key(split))

    def load_keyed(self, split: str, key: str, size: tuple[int, int] | None, channels: int | None,  # noqa: PLR0913,PLR0917  load's options, and the content key read before
                   indices: np.ndarray | None) -> LabelledImages:
        """`load` with the split's content key already read (`open_split`'s parts: the files hashed once, not per part)."""
        decode_size = (int(size[0]), int(size[1])) if size is not None and self.resizes_on_decode else None
        # Where decoding is the cost (photos), drawn images are decoded alone unless the whole split is cached at this
        # size and small enough to hold.
        alone = indices is not None and self.resizes_on_decode and not self._whole_split_holdable(split, key, decode_size)
        if alone:
            images, labels = self._decoded(split, key, decode_size, indices)
        else:
            images, labels = self._decoded(split, key, decode_size)
            if indices is not None:
                images, labels = images[indices], labels[indices]
        if size is not None and images.shape[1:3] != tuple(size):
            images = resize(images, size)
        names = self.class_names()
        if not names and labels.size and np.any(labels != UNLABELLED):
            raise PtqError(f"{self.root}: labels without class names in the {split} split")
        if names and labels.size and (labels.min() < 0 or labels.max() >= len(names)):
            raise PtqError(f"{self.root}: labels outside 0..{len(names) - 1} in the {split} split")
        if channels is not None:
            images = convert_channels(images, channels, self.root)
        return LabelledImages(images, labels, names, split, key)

    def _entry(self, split: str, key: str, decode_size: tuple[int, int] | None, indices: np.ndarray | None) -> tuple[Path | None, str]:
        """(the cache file, its seal) of the split decoded at `decode_size`, or of the images at `indices` alone."""
        shape = f"{decode_size[0]}x{decode_size[1]}" if decode_size else "native"
        if indices is not None:
            shape += "-" + hashlib.sha256(np.asarray(indices, np.int64).tobytes()).hexdigest()[:16]
        cache_dir = cache.directory(self.root)
        entry = cache_dir / f"{self.format}-{key[:40]}-{split}-{shape}.npz" if cache_dir is not None else None
        return entry, f"{self.format}:{self.decoding}:{key}:{split}:{shape}"

    def _whole_split_holdable(self, split: str, key: str, decode_size: tuple[int, int] | None) -> bool:
        entry, _ = self._entry(split, key, decode_size, None)
        return entry is not None and entry.is_file() and entry.stat().st_size <= bounded.HELD_IMAGE_BYTES.value()

    def _decoded(self, split: str, key: str, decode_size: tuple[int, int] | None,
                 indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The split's images (those at `indices` alone, when given) from the cache, else decoded and cached."""
        entry, sealed_as = self._entry(split, key, decode_size, indices)
        cached = read_cache(entry, sealed_as) if entry is not None else None
        if cached is not None:
            return cached
        images, labels = self._decode(split, decode_size, indices)
        if 0 in images.shape[1:3]:
            raise PtqError(f"{self.root}: the {split} split's images are {images.shape[1]}x{images.shape[2]} pixels")
        if entry is not None:
            write_cache(entry, sealed_as, images, labels)
        return images, labels


def file_digest(paths: list[Path]) -> str:
    """sha256 over names and bytes of the files, in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.fsencode(path.name) + b"\0" + bounded.sha256(path, bounded.ARRAY_BYTES, "data file"))
    return digest.hexdigest()


def _arrays_digest(images: np.ndarray, labels: np.ndarray) -> str:
    digest = hashlib.sha256(str((images.dtype, images.shape, labels.dtype, labels.shape)).encode())
    digest.update(np.ascontiguousarray(images).data)
    digest.update(np.ascontiguousarray(labels).data)
    return digest.hexdigest()


def read_cache(path: Path, source_key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached arrays if the file is readable and sealed (cache.seal) for these arrays and this source."""
    try:
        arrays = bounded.npz_arrays(path, ("images", "labels", "digest"))
        images, labels, stored = arrays["images"], arrays["labels"], str(arrays["digest"])
    except (PtqError, KeyError):
        return None  # not cached yet, or unreadable: decode again
    if images.dtype != np.uint8 or images.ndim != 4 or labels.ndim != 1 or len(labels) != len(images) or labels.dtype.kind not in "iu":
        return None
    return (images, labels.astype(np.int64)) if cache.sealed(stored, source_key, _arrays_digest(images, labels)) else None


def write_cache(path: Path, source_key: str, images: np.ndarray, labels: np.ndarray) -> None:
    try:
        seal = cache.seal(source_key, _arrays_digest(images, labels))
        with atomic_output(path) as tmp, tmp.open("wb") as handle:
            np.savez(handle, images=images, labels=labels, digest=np.array(seal))
    except (PtqError, OSError):
        pass  # a read-only or full cache only costs speed


def resize(images: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of uint8 NHWC images to (H, W) with Pillow, as image loaders of training code do."""
    from PIL import Image

    height, width = size
    out = np.empty((len(images), height, width, images.shape[3]), dtype=np.uint8)
    for index, image in enumerate(images):
        pixels = image[:, :, 0] if image.shape[2] == 1 else image
        resized = np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR))
        out[index] = resized.reshape(height, width, -1)
    return out


def convert_channels(images: np.ndarray, channels: int, where: Path | str) -> np.ndarray:
    """Grey to RGB by repetition, RGB to grey with ITU-R 601 weights (Pillow's "L"), RGBA loses alpha."""
    have = images.shape[3]
    if have == channels:
        return images
    if have == 4:
        images, have = images[..., :3], 3
        if channels == 3:
            return np.ascontiguousarray(images)
    if have == 1 and channels == 3:
        return np.ascontiguousarray(np.repeat(images, 3, axis=3))
    if have == 3 and channels == 1:
        grey = images.astype(np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
        return np.clip(np.rint(grey), 0, 255).astype(np.uint8)[..., None]
    raise PtqError(f"{where}: images have {have} channels; the model takes {channels}")


def split_slug(root: Path, split: str) -> str:
    """A file-name-safe name of a dataset split, unique per location: `cifar-10-batches-py-test-1a2b3c`."""
    where = hashlib.sha256(os.fsencode(Path(root).resolve())).hexdigest()[:6]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(root).stem or "data")[:60]  # the digest tells long names apart
    return f"{stem}-{split}-{where}"
