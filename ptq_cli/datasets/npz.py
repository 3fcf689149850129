"""A NumPy .npz of labelled images: `images` (uint8 N x H x W x C, or N x H x W for grey) and `labels`,
optional `class_names`; a single set. With `train_images`/`train_labels` (and `test_`, `val_` likewise)
it holds several splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ptq_cli.datasets.base import SPLITS, TEST, Dataset, file_digest
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded


class NpzDataset(Dataset):
    format = "npz"
    root_noun = ".npz file"
    root_is_file = True

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        arrays = bounded.npz_arrays(self.root)  # every member checked once, labels and names kept
        self._keys = set(arrays)
        names = arrays.get("class_names")
        label_arrays = [arrays[key] for key in self._keys if key == "labels" or key.endswith("_labels")]
        if "images" in self._keys:
            self._prefixes = {TEST: ""}
            self.single_set = True
        else:
            self._prefixes = {split: f"{split}_" for split in SPLITS if f"{split}_images" in self._keys}
        if not self._prefixes:
            raise PtqError(f"{self.root}: no 'images' array (keys: {', '.join(sorted(self._keys)) or 'none'}); expected images, labels[, class_names]")
        for prefix in self._prefixes.values():
            if f"{prefix}labels" not in self._keys:
                raise PtqError(f"{self.root}: '{prefix}images' without '{prefix}labels'")
        if names is not None:
            if names.ndim != 1 or names.dtype.kind not in "US":
                raise PtqError(f"{self.root}: 'class_names' is not a list of strings")
            bounded.check_count(self.root, len(names), bounded.CLASSES, f"{len(names):,} class names")
            # Byte strings (dtype S, as numpy keeps Python 2's str) are names too, never "b'...'".
            self._classes = tuple(name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name) for name in names.tolist())
        else:
            highest = max((int(labels.max()) for labels in label_arrays if labels.size and labels.dtype.kind in "iu"), default=0)
            bounded.check_count(self.root, highest + 1, bounded.CLASSES, f"label {highest:,} means {highest + 1:,} classes")
            self._classes = tuple(str(index) for index in range(highest + 1))
            self.names_its_classes = False

    def splits(self) -> tuple[str, ...]:
        return tuple(split for split in SPLITS if split in self._prefixes)

    def class_names(self) -> tuple[str, ...]:
        return self._classes

    def source_files(self, _split: str) -> list[Path]:
        return [self.root]

    def content_key(self, split: str) -> str:
        return file_digest([self.root]) + f":{split}"

    def _decode(self, split: str, _size: tuple[int, int] | None, indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        prefix = self._prefixes[split]
        arrays = bounded.npz_arrays(self.root, (f"{prefix}images", f"{prefix}labels"))
        images, labels = arrays[f"{prefix}images"], arrays[f"{prefix}labels"]
        if images.ndim == 3:
            images = images[..., None]
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] not in (1, 3, 4) or 0 in images.shape[:3]:
            raise PtqError(f"{self.root}: '{prefix}images' is {images.dtype} {images.shape}, expected uint8 N x H x W x C (C 1, 3 or 4, N, H, W > 0)")
        bounded.check_count(self.root, images.shape[1] * images.shape[2], bounded.IMAGE_PIXELS, f"images of {images.shape[1]}x{images.shape[2]}")
        if labels.dtype.kind not in "iu" or labels.shape != (len(images),):
            raise PtqError(f"{self.root}: '{prefix}labels' is {labels.dtype} {labels.shape}, expected {len(images)} integer labels")
        chosen = slice(None) if indices is None else indices
        return np.ascontiguousarray(images[chosen]), labels.astype(np.int64)[chosen]
