"""A seeded calibration set drawn from a dataset's training split (never its test split): class-stratified
where the images have labels, uniform where they have none. Calibration reads no label otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ptq_cli import settings
from ptq_cli.datasets import Dataset, open_dataset
from ptq_cli.datasets.base import UNLABELLED
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import atomic_output, check_outputs
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.services import models as models_service


@dataclass(frozen=True)
class CalibrationSet:
    images: np.ndarray  # (N, H, W, C) uint8 pixels, as the dataset holds them; the model's preprocessing comes later
    labels: np.ndarray  # (N,) int64; UNLABELLED (-1) each for images without labels
    indices: np.ndarray  # (N,) int64 positions in the dataset split
    seed: int
    samples_per_class: int  # 0: drawn by count (--calibration-size, or a set without labels), not per class
    dataset: str  # the dataset's path
    split: str  # the split drawn from
    dataset_sha256: str  # content key of that split: a validation split is drawn from the same images
    class_names: tuple[str, ...]
    source: str  # where it came from: the .npz path, or "built in memory"
    judged_on: bool = False  # drawn from the images its models are judged on (one set, no --calibration-data)

    @property
    def per_class_counts(self) -> dict[str, int]:
        if not self.class_names:
            return {}
        counts = np.bincount(self.labels, minlength=len(self.class_names))
        return {name: int(count) for name, count in zip(self.class_names, counts, strict=False)}

    @property
    def pixel_range(self) -> tuple[int, int]:
        return int(self.images.min()), int(self.images.max())


def stratified_indices(labels: np.ndarray, samples_per_class: int, seed: int) -> np.ndarray:
    """`samples_per_class` indices of each class, drawn without replacement; same seed, same indices."""
    rng = np.random.default_rng(seed)
    chosen = [
        rng.choice(np.flatnonzero(labels == label), size=samples_per_class, replace=False)
        for label in range(int(labels.max()) + 1)
        if np.any(labels == label)
    ]
    return np.sort(np.concatenate(chosen))


def draw_stratified(labels: np.ndarray, pool: np.ndarray, samples_per_class: int, seed: int, option: str, where: str, classes: int) -> np.ndarray:
    """`samples_per_class` indices of each class from `pool` (indices into `labels`), or a one-line error
    naming `option` when a class has too few images in the pool."""
    if samples_per_class < 1:
        raise PtqError(f"{option}: must be at least 1, got {samples_per_class}")
    counts = np.bincount(labels[pool], minlength=classes) if len(pool) else np.zeros(classes, np.int64)
    # Classes the images do not show (a small set) are not drawn from; each class they show gives as many.
    present = np.flatnonzero(counts) if counts.any() else np.arange(classes)
    fewest = present[np.argmin(counts[present])]
    if samples_per_class > int(counts[fewest]):
        raise PtqError(f"{option}: {samples_per_class} is more than the {int(counts[fewest])} images of class {int(fewest)} {where}")
    return pool[stratified_indices(labels[pool], samples_per_class, seed)]


def check_seed(seed: int) -> int:
    if not 0 <= seed < 2**32:
        raise PtqError(f"--seed: must be in 0..{2**32 - 1}, got {seed}")
    return seed


def sized_indices(labels: np.ndarray, count: int, seed: int, where: str) -> np.ndarray:
    """`count` indices (--calibration-size): as even over the classes as `count` allows (the remainder to
    classes drawn with `seed`), or uniform where the images have no labels."""
    if not 1 <= count <= len(labels):
        raise PtqError(f"--calibration-size: {count} is not in 1..{len(labels)}, the images {where}")
    rng = np.random.default_rng(seed)
    if len(labels) == 0 or labels.min() < 0:
        return np.sort(rng.choice(len(labels), size=count, replace=False))
    classes = np.unique(labels)
    wanted = np.full(len(classes), count // len(classes))
    wanted[rng.permutation(len(classes))[: count % len(classes)]] += 1
    chosen = []
    for label, take in zip(classes, wanted, strict=True):
        members = np.flatnonzero(labels == label)
        if take > len(members):
            raise PtqError(f"--calibration-size: {count} images would take {take} of class {int(label)}, which has {len(members)} {where}; "
                           "give fewer, or --samples-per-class")
        chosen.append(rng.choice(members, size=take, replace=False))
    return np.sort(np.concatenate(chosen))


def default_samples_per_class(dataset: Dataset, labels: np.ndarray | None = None) -> int:
    """settings.SAMPLES_PER_CLASS, or every image of the smallest class the split shows when it has fewer
    (`labels`: the calibration split's, if already read)."""
    labels = dataset.labels(dataset.calibration_split()) if labels is None else labels
    counts = np.bincount(labels, minlength=len(dataset.class_names()))
    shown = counts[counts > 0]  # classes without images in the split are not drawn from
    return max(1, min(settings.SAMPLES_PER_CLASS, int(shown.min()) if shown.size else 1))


def build_calibration_set(dataset: Dataset, samples_per_class: int | None, seed: int, size: tuple[int, int] | None = None,
                          count: int | None = None) -> CalibrationSet:
    """`size` (H, W): resize to the model's input (needed when a folder's images differ in size).
    `count` (--calibration-size): that many images in all; else `samples_per_class`, whose default is
    settings.SAMPLES_PER_CLASS (or all images of the smallest class if it has fewer). A set without labels
    is drawn by count: settings.CALIBRATION_IMAGES, or all its images if it has fewer."""
    check_seed(seed)
    if count is not None and samples_per_class is not None:
        raise PtqError("--calibration-size and --samples-per-class: give one of them")
    split = dataset.calibration_split()
    labels = dataset.labels(split)
    where = f"in {dataset.root} ({split})"
    if not dataset.class_names():
        if samples_per_class is not None:
            raise PtqError(f"--samples-per-class: {dataset.root} has no labels (no class folders); give --calibration-size")
        count = min(len(labels), settings.CALIBRATION_IMAGES) if count is None else count
    if count is not None:
        indices, samples_per_class = sized_indices(labels, count, seed, where), 0
    else:
        samples_per_class = default_samples_per_class(dataset, labels) if samples_per_class is None else samples_per_class
        indices = draw_stratified(labels, np.arange(len(labels)), samples_per_class, seed, "--samples-per-class", where, len(dataset.class_names()))
    images = dataset.load(split, size, indices=indices)  # the drawn images alone resized
    return CalibrationSet(
        images=images.images,
        labels=images.labels,
        indices=indices,
        seed=seed,
        samples_per_class=samples_per_class,
        dataset=str(dataset.root),
        split=split,
        dataset_sha256=images.content_sha256,
        class_names=images.class_names,
        source="built in memory",
    )


@dataclass(frozen=True)
class SavedCalibration:
    """What `ptq calibrate` made: the set, and the file it went to."""

    calibration: CalibrationSet
    output: Path

    @property
    def written(self) -> tuple[Path, ...]:
        return (self.output,)


def draw_and_save(model: Path | None, data: Path, calibration_data: Path | None, output: Path,  # noqa: PLR0913,PLR0917  `ptq calibrate`'s options, one each
                  samples_per_class: int | None = None, seed: int = settings.SEED, count: int | None = None,
                  flags: PreprocessingFlags | None = None) -> SavedCalibration:
    """A seeded, stratified calibration set drawn from the training images (at `model`'s input size, or the
    one `flags` gives a model that leaves it open), saved to `output`."""
    check_seed(seed)
    check_outputs([("--output", output, (".npz",))], [model, data, calibration_data])
    calibration = for_model(model, data, calibration_data, samples_per_class, seed, flags=flags, count=count)
    save_calibration_set(calibration, output)
    return SavedCalibration(calibration, Path(output))


def save_calibration_set(calibration: CalibrationSet, path: Path) -> None:
    with atomic_output(path) as tmp, tmp.open("wb") as handle:
        np.savez(
            handle,
            images=calibration.images,
            labels=calibration.labels,
            indices=calibration.indices,
            seed=np.int64(calibration.seed),
            samples_per_class=np.int64(calibration.samples_per_class),
            dataset=np.array(calibration.dataset),
            split=np.array(calibration.split),
            dataset_sha256=np.array(calibration.dataset_sha256),
            class_names=np.array(calibration.class_names),
            judged_on=np.bool_(calibration.judged_on),
        )


def load_calibration_set(path: Path) -> CalibrationSet:
    path = Path(path)
    if not path.is_file():
        raise PtqError(f"{path}: calibration file not found (make one with `ptq calibrate`)")
    data = bounded.npz_arrays(path, what="calibration file")
    try:
        images, labels = data["images"], data["labels"]
        calibration = CalibrationSet(
            images=images,
            labels=labels,
            indices=data["indices"],
            seed=int(data["seed"]),
            samples_per_class=int(data["samples_per_class"]),
            dataset=str(data["dataset"]) if "dataset" in data else "",
            split=str(data["split"]) if "split" in data else "train",
            dataset_sha256=str(data["dataset_sha256"]) if "dataset_sha256" in data else "",
            class_names=tuple(str(name) for name in np.atleast_1d(data["class_names"])),
            source=str(path),
            judged_on=bool(data["judged_on"]) if "judged_on" in data else False,
        )
    except (ValueError, KeyError, TypeError, OverflowError) as error:
        raise PtqError(f"{path}: not a ptq calibration file ({'no ' + str(error) if isinstance(error, KeyError) else error})") from error
    bounded.check_count(path, len(calibration.class_names), bounded.CLASSES, f"{len(calibration.class_names):,} class names")
    if images.ndim != 4 or images.shape[3] not in (1, 3, 4) or 0 in images.shape[:3]:
        raise PtqError(f"{path}: images are {images.dtype} {images.shape}, expected N x H x W x C pixels (N > 0)")
    if images.dtype != np.uint8:
        # ptq 0.2 stored float32 0-255 pixels: accepted when that is exactly what they are.
        if images.dtype != np.float32 or not np.all(np.isfinite(images)) or images.min() < 0 or images.max() > 255 or np.any(images != np.round(images)):
            raise PtqError(f"{path}: images are {images.dtype}, expected uint8 pixels 0-255 (or ptq 0.2's float32 0-255)")
        calibration = replace(calibration, images=images.astype(np.uint8))
    if labels.ndim != 1 or len(labels) != len(images) or np.shape(calibration.indices) != (len(images),) or labels.dtype.kind not in "iu":
        labels_fit = False
    elif calibration.class_names:
        labels_fit = bool(labels.min() >= 0 and labels.max() < len(calibration.class_names))
    else:  # images without labels
        labels_fit = bool(np.all(labels == UNLABELLED))
    if not labels_fit:
        raise PtqError(f"{path}: labels do not match the {len(images)} images and {len(calibration.class_names)} classes")
    return calibration


def calibration_dataset(data: Path, calibration_data: Path | None = None, validation: bool = False) -> Dataset:
    """Where calibration (and tuning's validation) images come from: `calibration_data`, else `data`'s train
    split. A set with no train split calibrates on its own images (which the calibration set's source says);
    tuning's `validation` images are never the images models are judged on."""
    if calibration_data is not None:
        return open_dataset(calibration_data)
    dataset = open_dataset(data)
    if dataset.single_set and validation:
        raise PtqError(f"{data}: one set of images with no train split: tuning on it would choose on the images models are judged on; "
                       "give --calibration-data")
    return dataset


def for_model(model: Path | None, data: Path, calibration_data: Path | None = None, samples_per_class: int | None = None,  # noqa: PLR0913,PLR0917  every way a command names its calibration images
              seed: int = settings.SEED, saved: Path | None = None, reuse_default: bool = False,
              flags: PreprocessingFlags | None = None, count: int | None = None, size: tuple[int, int] | None = None) -> CalibrationSet:
    """The calibration set for a model: the `saved` file; else, with `reuse_default`, the default file if
    `ptq calibrate` wrote it from the same dataset; else drawn now at the model's input size (without a model,
    the size `flags` gives, else the images' own; `size`: the model's, already read). The one way every command and `ptq run` get their calibration set."""
    if saved is not None:
        if count is not None:
            raise PtqError(f"--calibration-size: {saved} is a calibration set already drawn; give one or the other")
        return load_calibration_set(saved)
    dataset = calibration_dataset(data, calibration_data)
    if reuse_default and count is None and settings.CALIBRATION_FILE.is_file():
        found = load_calibration_set(settings.CALIBRATION_FILE)
        if Path(found.dataset).resolve() == dataset.root.resolve():
            return found
    size = size or (models_service.input_of(model, flags).size if model is not None else (flags.size if flags else None))
    drawn = build_calibration_set(dataset, samples_per_class, seed, size, count)
    return replace(drawn, judged_on=True) if calibration_data is None and dataset.single_set else drawn


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


@dataclass(frozen=True)
class DataSource:
    """Where a command's images come from and how they are fed: the dataset, a folder of calibration images of their
    own if given, the preprocessing flags, and how many calibration images in all (None: the default)."""

    data: Path
    calibration_data: Path | None = None
    flags: PreprocessingFlags = field(default_factory=PreprocessingFlags)
    calibration_size: int | None = None

    def calibration_set(self, model: Path, saved: Path | None = None) -> CalibrationSet:
        """The calibration images for `model`: `saved` (a `ptq calibrate` file) if given, else drawn from the data."""
        return for_model(model, self.data, self.calibration_data, saved=saved, reuse_default=True, flags=self.flags, count=self.calibration_size)

    def validation_dataset(self) -> Dataset:
        """Where tuning's validation images come from: never the images models are judged on."""
        return calibration_dataset(self.data, self.calibration_data, validation=True)
