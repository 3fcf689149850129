"""An image folder: ROOT/<split>/<class>/<image> (splits train, test, optional val), or ROOT/<class>/<image>
as a single set, or ROOT/<image> as a single set of unlabelled images (photos whose classes nobody wrote
down: they calibrate a model, and measure a quantized model against its FP32 source). Class names:
ROOT/classes.txt (one per line, in label order) or the sorted folder names."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import numpy as np

from ptq_cli.datasets.base import SPLITS, TEST, UNLABELLED, Dataset
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
# The only decoders Pillow may use, whatever a file's name says: Pillow picks a decoder by content, and some of its
# others hand the file to programs (EPS and PDF to Ghostscript, which runs PostScript). (A camera's multi-picture JPEG opens as JPEG.)
PILLOW_FORMATS = ("PNG", "JPEG", "BMP", "WEBP")
READ_FORMATS = "PNG, JPEG, BMP or WebP"
# What a file that is no such image is, named from its first bytes.
KNOWN_HEADS = ((b"%!PS", "a PostScript file"), (b"\xc5\xd0\xd3\xc6", "an EPS file"), (b"%PDF", "a PDF file"), (b"GIF8", "a GIF image"),
               (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"), (b"\x00\x00\x01\x00", "an icon file"), (b"<", "a text or SVG file"),
               (b"\x89HDF", "an HDF5 file"), (b"PK\x03\x04", "a zip archive"))
CLASSES_FILE = "classes.txt"
# Files image folders carry without being images; everything else that is not an image is an error.
IGNORED = {"thumbs.db", "desktop.ini", CLASSES_FILE}


def is_image_folder(path: Path) -> bool:
    return path.is_dir() and any((child.is_dir() or child.suffix.lower() in IMAGE_SUFFIXES) and not child.name.startswith(".") for child in path.iterdir())


def _images_in(directory: Path) -> list[Path]:
    """The image files of a folder, sorted by name; anything else but the files folders carry is an error."""
    images = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.name.lower() in IGNORED or path.is_dir():
            continue
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise PtqError(f"{path}: not an image file (expected {', '.join(IMAGE_SUFFIXES)})")
        images.append(path)
    return images


class ImageFolder(Dataset):
    format = "folder"
    root_noun = "image folder"
    resizes_on_decode = True
    decoding = "2"  # 2: wide grey (16-bit, float) scaled to 0-255, not clipped

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        folders = _subfolders(self.root)
        named = [name for name in folders if name in SPLITS]
        self._split_dirs = {name: self.root / name for name in named} if named else {TEST: self.root}
        self.single_set = not named
        loose = [path for path in self.root.iterdir() if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES]
        self.labelled = bool(folders)
        if folders and loose:
            raise PtqError(f"{self.root}: holds both class folders and images ({loose[0].name}); "
                           "expected ROOT/<class>/<image> (labelled) or ROOT/<image> (unlabelled), not both")
        if not folders and not loose:
            raise PtqError(f"{self.root}: no class folders or images (expected ROOT/<split>/<class>/<image>, ROOT/<class>/<image> or ROOT/<image>)")
        self._classes = self._read_classes() if folders else ()
        self._files: dict[str, list[tuple[Path, int]]] = {}

    def splits(self) -> tuple[str, ...]:
        return tuple(split for split in SPLITS if split in self._split_dirs)

    def class_names(self) -> tuple[str, ...]:
        return self._classes

    def _read_classes(self) -> tuple[str, ...]:
        per_split = {split: _subfolders(directory) for split, directory in self._split_dirs.items()}
        for split, names in per_split.items():
            if not names:
                raise PtqError(f"{self._split_dirs[split]}: no class folders in it")
        first_split, first = next(iter(per_split.items()))
        bounded.check_count(self._split_dirs[first_split], len(first), bounded.CLASSES, f"{len(first):,} class folders")
        for split, names in per_split.items():
            if names != first:
                only_here = sorted(set(names) - set(first)) or sorted(set(first) - set(names))
                raise PtqError(f"{self._split_dirs[split]}: class folders differ from {self._split_dirs[first_split]} ({', '.join(only_here[:5])})")
        listed = self.root / CLASSES_FILE
        if not listed.is_file():
            return tuple(first)
        listed_names = tuple(line.strip() for line in bounded.read_text(listed, "class list").splitlines() if line.strip())
        if sorted(listed_names) != sorted(first) or len(set(listed_names)) != len(listed_names):
            raise PtqError(f"{listed}: lists {len(listed_names)} classes that are not the {len(first)} class folders")
        return listed_names

    def files(self, split: str) -> list[tuple[Path, int]]:
        """(image path, label) of the split, classes in label order, files sorted by name."""
        if split not in self._files:
            if not self.labelled:
                self._files[split] = [(path, UNLABELLED) for path in _images_in(self.root)]
                return self._files[split]
            found: list[tuple[Path, int]] = []
            for label, name in enumerate(self._classes):
                directory = self._split_dirs[split] / name
                images = _images_in(directory)
                if not images:
                    raise PtqError(f"{directory}: empty class folder")
                found.extend((path, label) for path in images)
            self._files[split] = found
        return self._files[split]

    def labels(self, split: str) -> np.ndarray:
        """From the class folders, without decoding an image (photos differ in size until resized to a model's input)."""
        self.check_split(split)
        return np.array([label for _, label in self.files(split)], dtype=np.int64)

    def source_files(self, split: str) -> list[Path]:
        return [path for path, _ in self.files(split)]

    def content_key(self, split: str) -> str:
        digest = hashlib.sha256("\n".join(self._classes).encode("utf-8", "surrogateescape"))
        for path, label in self.files(split):
            named = os.fsencode(path.relative_to(self.root)) + f"\0{label}\0".encode()
            digest.update(named + bounded.sha256(path, bounded.ARRAY_BYTES, "image file"))
        return digest.hexdigest()

    def _decode(self, split: str, size: tuple[int, int] | None, indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image, UnidentifiedImageError

        listed = self.files(split)
        files = listed if indices is None else [listed[int(index)] for index in indices]
        images: list[np.ndarray] = []
        most = bounded.IMAGE_PIXELS.value()
        Image.MAX_IMAGE_PIXELS = most  # Pillow's own check, before it reads the pixels
        for path, _ in files:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    with bounded.open_regular(path, "image file") as handle, Image.open(handle, formats=PILLOW_FORMATS) as image:
                        width, height = image.size
                        if not width or not height:
                            raise PtqError(f"{path}: an image of {width}x{height} pixels")
                        if width * height > most:
                            raise bounded.IMAGE_PIXELS.refuse(path, f"{width}x{height} pixels")
                        image.load()
                        converted = _eight_bit(image)
            except (Image.DecompressionBombWarning, Image.DecompressionBombError) as error:
                raise bounded.IMAGE_PIXELS.refuse(path, "declares over twice as many pixels") from error
            except UnidentifiedImageError:
                raise PtqError(f"{path}: {_what_it_is(path)}, not a {READ_FORMATS} image; refused") from None
            except BlockingIOError:
                raise bounded.blocked(path, "image file") from None
            except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as error:
                raise PtqError(f"{path}: not a readable image ({first_line(error)})") from error
            if size is not None and converted.size != (size[1], size[0]):
                converted = converted.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(converted, dtype=np.uint8)
            images.append(pixels[..., None] if pixels.ndim == 2 else pixels)
        shapes = {image.shape for image in images}
        if len({shape[:2] for shape in shapes}) > 1:
            examples = ", ".join(f"{h}x{w}" for h, w in sorted({shape[:2] for shape in shapes})[:3])
            raise PtqError(f"{self._split_dirs[split]}: images differ in size ({examples}); give a model so they are resized to its input")
        if len(shapes) > 1:  # grey and colour images mixed: all to RGB
            images = [np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image for image in images]
        labels = np.array([label for _, label in files], dtype=np.int64)
        return np.stack(images), labels


WIDE_GREY = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # Pillow's 16-bit, 32-bit integer and float grey modes


def _eight_bit(image):
    """The image as 8-bit grey or RGB pixels. Wide grey is scaled to 0-255, not clipped there (Pillow's own
    convert clips a 16-bit PNG's 0-65535 to 255): 16-bit by 1/257, float 0-1 by 255."""
    from PIL import Image

    if image.mode not in WIDE_GREY:
        return image.convert("L" if image.mode in ("1", "L") else "RGB")
    values = np.asarray(image, dtype=np.float64)
    if image.mode.startswith("I;16") or (image.mode == "I" and values.size and values.max() > 255):
        values = values / 257.0
    elif image.mode == "F" and values.size and np.nanmax(values) <= 1.0:
        values = values * 255.0
    return Image.fromarray(np.clip(np.rint(np.nan_to_num(values)), 0, 255).astype(np.uint8), "L")


def _what_it_is(path: Path) -> str:
    try:
        with bounded.open_regular(path, "image file") as handle:
            head = (handle.read(16) or b"").lstrip()
    except (PtqError, OSError):
        head = b""
    return next((name for magic, name in KNOWN_HEADS if head.startswith(magic)), "a file of an unknown kind")


def _subfolders(directory: Path) -> list[str]:
    return sorted(child.name for child in directory.iterdir() if child.is_dir() and not child.name.startswith("."))
