"""The validation split every tuning decision is made on: training images only, never calibration ones.

This module, and everything that tunes (sensitivity, tune), reads CIFAR-10 through `cifar.load_train`
alone; the test batch is left to `evaluate`, which judges the final choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptq_cli import settings
from ptq_cli.errors import PtqError
from ptq_cli.services import cifar
from ptq_cli.services.calibration import CalibrationSet, draw_stratified
from ptq_cli.services.models import LoadedModel

EVALUATION_BATCH = 1000


@dataclass(frozen=True)
class ValidationSet:
    images: np.ndarray  # (N, 32, 32, 3) float32 0-255, the model's input format
    labels: np.ndarray  # (N,) int64
    indices: np.ndarray  # positions in the concatenated training batches, disjoint from the calibration set's
    seed: int
    samples_per_class: int
    source_batches: tuple[str, ...]

    def describe(self) -> dict:
        return {
            "images": int(len(self.labels)),
            "samples_per_class": self.samples_per_class,
            "seed": self.seed,
            "source_batches": list(self.source_batches),
        }


def build_validation_set(
    calibration: CalibrationSet,
    data_dir: Path,
    samples_per_class: int = settings.VALIDATION_PER_CLASS,
    seed: int = settings.VALIDATION_SEED,
) -> ValidationSet:
    """A seeded, class-stratified sample of the training images the calibration set does not use."""
    train = cifar.load_train(data_dir)
    if len(calibration.indices) and int(calibration.indices.max()) >= len(train.labels):
        raise PtqError(f"{calibration.source}: calibration indices do not fit the training batches of {data_dir}")
    available = np.setdiff1d(np.arange(len(train.labels)), calibration.indices)
    indices = draw_stratified(train.labels, available, samples_per_class, seed, "--validation-per-class",
                              "left in the training batches after the calibration set")
    if np.intersect1d(indices, calibration.indices).size:  # by construction impossible; kept as a guard
        raise PtqError("validation split overlaps the calibration set")
    return ValidationSet(
        images=cifar.to_model_input(train.images[indices]),
        labels=train.labels[indices],
        indices=indices,
        seed=seed,
        samples_per_class=samples_per_class,
        source_batches=train.source_batches,
    )


@dataclass(frozen=True)
class ValidationScore:
    accuracy: float  # top-1, percent
    images_per_second: float
    outputs: np.ndarray  # (N, 10) the model's scores, for comparisons such as SQNR


def score(model: LoadedModel, validation: ValidationSet) -> ValidationScore:
    began = time.perf_counter()
    outputs = np.concatenate(
        [model.predict(validation.images[start : start + EVALUATION_BATCH]) for start in range(0, len(validation.labels), EVALUATION_BATCH)]
    )
    seconds = time.perf_counter() - began
    accuracy = 100.0 * float(np.mean(outputs.argmax(axis=1) == validation.labels))
    return ValidationScore(round(accuracy, 4), round(len(outputs) / seconds, 1), outputs)


def sqnr_db(reference: np.ndarray, approximation: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB; higher is better, inf when identical."""
    noise = float(np.sum((reference.astype(np.float64) - approximation) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(signal / noise)
