"""The validation split every tuning decision is made on: training images only, never calibration ones.

This module, and everything that tunes (sensitivity, tune), reads the dataset's calibration split
alone (`Dataset.calibration_split`); the test split is left to `evaluate`, which judges the final choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli import settings
from ptq_cli.backends.base import LoadedModel
from ptq_cli.datasets import Dataset
from ptq_cli.errors import PtqError
from ptq_cli.services.make.calibration import CalibrationSet, DataSource, draw_stratified
from ptq_cli.services.models import check_classes
from ptq_cli.services.progress import ProgressBar, no_progress_bar


@dataclass(frozen=True)
class ValidationSet:
    images: np.ndarray  # (N, H, W, C) uint8 pixels
    labels: np.ndarray  # (N,) int64; UNLABELLED (-1) for images without labels until labels_from_fp32
    indices: np.ndarray  # positions in the dataset split, disjoint from the calibration set's
    seed: int
    samples_per_class: int
    dataset: str
    split: str
    class_names: tuple[str, ...] = ()  # what its labels name: scoring checks the model gives as many scores; () without labels

    def describe(self) -> dict:
        return {
            "images": int(len(self.labels)),
            "samples_per_class": self.samples_per_class,
            "seed": self.seed,
            "dataset": self.dataset,
            "split": self.split,
        }


def build_validation_set(
    calibration: CalibrationSet,
    dataset: Dataset,
    samples_per_class: int = settings.VALIDATION_PER_CLASS,
    seed: int = settings.VALIDATION_SEED,
) -> ValidationSet:
    """A seeded, class-stratified sample of the split's images the calibration set does not use."""
    split = dataset.calibration_split()
    labels = dataset.labels(split)
    if len(calibration.indices) and int(calibration.indices.max()) >= len(labels):
        raise PtqError(f"{calibration.source}: calibration indices do not fit the {split} split of {dataset.root}")
    available = np.setdiff1d(np.arange(len(labels)), calibration.indices)
    if not dataset.class_names():  # as many images as ten classes would give, or all that are left; scored against FP32 (labels_from_fp32)
        if not len(available):
            raise PtqError(f"{dataset.root}: no images left for validation after the calibration set (give fewer --calibration-size)")
        rng = np.random.default_rng(seed)
        indices = np.sort(rng.choice(available, size=min(len(available), 10 * samples_per_class), replace=False))
    else:
        indices = draw_stratified(labels, available, samples_per_class, seed, "--validation-per-class",
                                  f"left in the {split} split after the calibration set", len(dataset.class_names()))
    if np.intersect1d(indices, calibration.indices).size:  # by construction impossible; kept as a guard
        raise PtqError("validation split overlaps the calibration set")
    source = dataset.load(split, calibration.images.shape[1:3], indices=indices)
    if calibration.dataset_sha256 and calibration.dataset_sha256 != source.content_sha256:
        raise PtqError(f"{calibration.source}: drawn from other images than the {split} split of {dataset.root}; "
                       "make the calibration set from this dataset (ptq calibrate) to keep validation disjoint from it")
    return ValidationSet(source.images, source.labels, indices, seed, samples_per_class, str(dataset.root), split, tuple(source.class_names))


@dataclass(frozen=True)
class ValidationScore:
    accuracy: float  # top-1, percent
    images_per_second: float
    outputs: np.ndarray  # (N, classes) the model's scores, for comparisons such as SQNR


def score(model: LoadedModel, validation: ValidationSet) -> ValidationScore:
    """Top-1 on the validation images (whose labels must be the model's classes) and the raw scores."""
    if validation.class_names:
        check_classes(model.info.path, model.num_classes, validation.class_names, validation.dataset)
    prepared = model.prepare(validation.images)
    began = time.perf_counter()
    step = settings.EVALUATION_BATCH
    outputs = np.concatenate([model.predict(prepared[start : start + step]) for start in range(0, len(prepared), step)])
    seconds = time.perf_counter() - began
    accuracy = 100.0 * float(np.mean(outputs.argmax(axis=1) == validation.labels))
    return ValidationScore(round(accuracy, 4), round(len(outputs) / seconds, 1), outputs)


def labels_from_fp32(validation: ValidationSet, fp32: ValidationScore) -> tuple[ValidationSet, ValidationScore]:
    """A set without labels, labelled with the FP32 model's own top-1 classes: every later score is then the
    top-1 agreement with FP32, and FP32's own is 100%. A labelled set is returned as it is."""
    if validation.class_names:
        return validation, fp32
    labels = fp32.outputs.argmax(axis=1)
    return replace(validation, labels=labels), replace(fp32, accuracy=100.0)


def calibration_and_validation(model: Path, source: DataSource, saved: Path | None, per_class: int,
                               progress_bar: ProgressBar = no_progress_bar) -> tuple[CalibrationSet, ValidationSet]:
    """The calibration set for `model` (`saved`, else drawn from `source`) and the validation split drawn beside it
    from training images it does not hold: what sensitivity and tune judge on, never the test set."""
    with progress_bar("Loading the calibration set"):
        calibration = source.calibration_set(model, saved)
    with progress_bar("Drawing the validation split (training images only)"):
        return calibration, build_validation_set(calibration, source.validation_dataset(), per_class)
