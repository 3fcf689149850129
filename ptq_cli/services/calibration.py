"""A seeded, class-stratified calibration set drawn from the CIFAR-10 training batches only."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli import settings
from ptq_cli.atomic import atomic_output
from ptq_cli.errors import PtqError
from ptq_cli.services import cifar


@dataclass(frozen=True)
class CalibrationSet:
    images: np.ndarray  # (N, 32, 32, 3) float32, 0-255: the model's input format
    labels: np.ndarray  # (N,) int64
    indices: np.ndarray  # (N,) int64 positions in the concatenated training batches
    seed: int
    samples_per_class: int
    source_batches: tuple[str, ...]
    class_names: tuple[str, ...]
    source: str  # where it came from: the .npz path, or "built in memory"

    @property
    def per_class_counts(self) -> dict[str, int]:
        counts = np.bincount(self.labels, minlength=len(self.class_names))
        return {name: int(count) for name, count in zip(self.class_names, counts)}

    @property
    def pixel_range(self) -> tuple[float, float]:
        return float(self.images.min()), float(self.images.max())


def stratified_indices(labels: np.ndarray, samples_per_class: int, seed: int) -> np.ndarray:
    """`samples_per_class` indices of each class, drawn without replacement; same seed, same indices."""
    rng = np.random.default_rng(seed)
    chosen = [
        rng.choice(np.flatnonzero(labels == label), size=samples_per_class, replace=False)
        for label in range(int(labels.max()) + 1)
    ]
    return np.sort(np.concatenate(chosen))


def draw_stratified(labels: np.ndarray, pool: np.ndarray, samples_per_class: int, seed: int, option: str, where: str) -> np.ndarray:
    """`samples_per_class` indices of each class from `pool` (indices into `labels`), or a one-line error
    naming `option` when a class has too few images in the pool."""
    if samples_per_class < 1:
        raise PtqError(f"{option}: must be at least 1, got {samples_per_class}")
    counts = np.bincount(labels[pool], minlength=int(labels.max()) + 1)
    if samples_per_class > int(counts.min()):
        raise PtqError(f"{option}: {samples_per_class} is more than the {int(counts.min())} images of class {int(counts.argmin())} {where}")
    return pool[stratified_indices(labels[pool], samples_per_class, seed)]


def build_calibration_set(data_dir: Path, samples_per_class: int, seed: int) -> CalibrationSet:
    train = cifar.load_train(data_dir)
    everything = np.arange(len(train.labels))
    indices = draw_stratified(train.labels, everything, samples_per_class, seed, "--samples-per-class", f"in {data_dir}")
    return CalibrationSet(
        images=cifar.to_model_input(train.images[indices]),
        labels=train.labels[indices],
        indices=indices,
        seed=seed,
        samples_per_class=samples_per_class,
        source_batches=train.source_batches,
        class_names=train.class_names,
        source="built in memory",
    )


def save_calibration_set(calibration: CalibrationSet, path: Path) -> None:
    with atomic_output(path) as tmp, tmp.open("wb") as handle:
        np.savez(
            handle,
            images=calibration.images,
            labels=calibration.labels,
            indices=calibration.indices,
            seed=np.int64(calibration.seed),
            samples_per_class=np.int64(calibration.samples_per_class),
            source_batches=np.array(calibration.source_batches),
            class_names=np.array(calibration.class_names),
        )


def load_calibration_set(path: Path) -> CalibrationSet:
    path = Path(path)
    if not path.is_file():
        raise PtqError(f"{path}: calibration file not found (make one with `ptq calibrate`)")
    try:
        with np.load(path, allow_pickle=False) as data:
            images = data["images"]
            calibration = CalibrationSet(
                images=images,
                labels=data["labels"],
                indices=data["indices"],
                seed=int(data["seed"]),
                samples_per_class=int(data["samples_per_class"]),
                source_batches=tuple(str(name) for name in data["source_batches"]),
                class_names=tuple(str(name) for name in data["class_names"]),
                source=str(path),
            )
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as error:
        raise PtqError(f"{path}: not a ptq calibration file ({error})") from error
    if images.dtype != np.float32 or images.ndim != 4 or images.shape[1:] != cifar.IMAGE_SHAPE:
        raise PtqError(f"{path}: images are {images.dtype} {images.shape}, expected float32 N x 32 x 32 x 3")
    return calibration


def load_or_build(path: Path | None, data_dir: Path) -> CalibrationSet:
    """The given file; else the default file if `ptq calibrate` wrote it; else the default set, built in memory."""
    if path is not None:
        return load_calibration_set(path)
    if settings.CALIBRATION_FILE.is_file():
        return load_calibration_set(settings.CALIBRATION_FILE)
    return build_calibration_set(data_dir, settings.SAMPLES_PER_CLASS, settings.SEED)


def stratified_subset(calibration: CalibrationSet, samples_per_class: int) -> CalibrationSet:
    """The first `samples_per_class` images of each class of the set: a smaller set drawn from the same
    images, so that anything kept disjoint from the full set stays disjoint from it."""
    if not 1 <= samples_per_class <= calibration.samples_per_class:
        raise PtqError(f"calibration subset: {samples_per_class} per class is not in 1..{calibration.samples_per_class}")
    keep = np.sort(np.concatenate([np.flatnonzero(calibration.labels == label)[:samples_per_class] for label in np.unique(calibration.labels)]))
    return replace(
        calibration,
        images=calibration.images[keep],
        labels=calibration.labels[keep],
        indices=calibration.indices[keep],
        samples_per_class=samples_per_class,
        source=f"{calibration.source} ({samples_per_class} per class)",
    )
