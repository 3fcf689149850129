"""Datasets: one interface (`Dataset`), one module per format, and `open_dataset` to pick by layout."""

from __future__ import annotations

from pathlib import Path

from ptq_cli.datasets.base import TEST, TRAIN, VAL, Dataset, LabelledImages, SplitImages
from ptq_cli.datasets.cifar10 import Cifar10, is_cifar_directory
from ptq_cli.datasets.folder import ImageFolder, is_image_folder
from ptq_cli.datasets.npz import NpzDataset
from ptq_cli.errors import PtqError

FORMATS = {Cifar10.format: Cifar10, ImageFolder.format: ImageFolder, NpzDataset.format: NpzDataset}

__all__ = ["TEST", "TRAIN", "VAL", "Dataset", "LabelledImages", "SplitImages", "FORMATS", "open_dataset"]


def open_dataset(path: Path) -> Dataset:
    """The dataset at `path`, its format told by its layout: CIFAR-10 python batches, an .npz, or an image folder."""
    path = Path(path)
    if not path.exists():
        raise PtqError(f"{path}: dataset not found")
    if path.is_file():
        if path.suffix.lower() == ".npz":
            return NpzDataset(path)
        raise PtqError(f"{path}: not a dataset (expected a CIFAR-10 batches directory, an image folder or an .npz)")
    if is_cifar_directory(path):
        return Cifar10(path)
    if is_image_folder(path):
        return ImageFolder(path)
    raise PtqError(f"{path}: neither CIFAR-10 batches nor an image folder (ROOT/<split>/<class>/<image>) are in it")
