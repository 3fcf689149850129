"""Prune, then quantize, then evaluate, for several sparsities: what pruning before int8 costs and saves.

Every point uses the same calibration set and quantization settings. Each pruned FP32 model is
evaluated too, so the table separates what pruning alone costs from what quantization adds. The
compressed size (gzip -9 of the file) is the point of pruning before int8: zeros compress.
"""

from __future__ import annotations

import gzip
from dataclasses import replace
from pathlib import Path

from ptq_cli import backends
from ptq_cli.datasets import Dataset
from ptq_cli.errors import PtqError
from ptq_cli.guards.atomic import check_writable
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.services.make import prune as prune_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.services.make.calibration import CalibrationSet
from ptq_cli.services.measure import evaluate as evaluate_service
from ptq_cli.services.measure.sweep_records import SWEEP_DIR, SweepPoint, SweepResult
from ptq_cli.services.progress import ProgressCallback, Steps
from ptq_cli.services.quant_settings import describe_quantization
from ptq_cli.services.records import write_record


def parse_sparsities(text: str) -> tuple[float, ...]:
    """'0,0.3,0.5' -> (0.0, 0.3, 0.5), each checked to be in [0, 1)."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise PtqError(f"--sparsity: '{text}' is not a comma-separated list of numbers") from error
    if not values:
        raise PtqError("--sparsity: give at least one value, e.g. 0,0.3,0.5,0.7")
    for value in values:
        prune_service.make_settings(value)  # the range check, with its message
    return tuple(sorted(set(values)))


def gzip_size(path: Path) -> int:
    return len(gzip.compress(Path(path).read_bytes(), compresslevel=9, mtime=0))


class _Accuracies:
    """Top-1 of each model file on the dataset, each evaluated once."""

    def __init__(self, dataset: Dataset, flags: PreprocessingFlags | None) -> None:
        self.dataset, self.flags = dataset, flags
        self.evaluations: dict[Path, evaluate_service.EvaluationRecord] = {}

    def __call__(self, path: Path) -> float:
        if path not in self.evaluations:
            self.evaluations[path] = evaluate_service.evaluate_model(path, self.dataset, flags=self.flags)
        measured = self.evaluations[path].accuracy
        if measured is None:
            raise PtqError(f"{self.dataset.root}: its labels are not the classes of {path}; the sweep compares top-1, which needs them")
        return measured


def sweep(  # noqa: PLR0913,PLR0917  the options of `ptq sweep`, one each
    model_path: Path,
    sparsities: tuple[float, ...],
    quantization: quantize_service.QuantizationSettings,
    calibration: CalibrationSet,
    dataset: Dataset,
    models_dir: Path,
    results_dir: Path,
    pruning: prune_service.PruningSettings | None = None,
    progress: ProgressCallback | None = None,
    flags: PreprocessingFlags | None = None,
) -> SweepResult:
    """`pruning` gives the scope, exclusions and re-fit; its sparsity is replaced by each of `sparsities`."""
    pruning = pruning or prune_service.make_settings(0.0)
    model_path = Path(model_path)
    if quantization.backend != backends.DEFAULT:
        raise PtqError(f"--backend: the sweep quantizes with {backends.DEFAULT} (pruned ONNX models in, ONNX out)")
    record = Path(results_dir) / SWEEP_DIR / f"{model_path.stem}_{quantization.dtype}_{pruning.scope}.json"
    check_writable(record)
    accuracy = _Accuracies(dataset, flags)
    points = []
    step = Steps(2 * len(sparsities) + sum(1 for value in sparsities if value > 0), progress)
    reference = accuracy(model_path)

    for sparsity in sparsities:
        fp32 = model_path
        achieved = 0.0
        if sparsity > 0:
            fp32 = Path(models_dir) / prune_service.default_output(model_path, sparsity, pruning.scope).name
            achieved = prune_service.prune_calibrated(model_path, fp32, replace(pruning, sparsity=sparsity), calibration.images, flags).pruned_sparsity
            step()
        quantized = Path(models_dir) / f"{fp32.stem}_{quantization.dtype}{fp32.suffix}"
        quantize_service.quantize(fp32, quantized, quantization, calibration, flags)
        step()
        points.append(_point(sparsity, achieved, fp32, accuracy(fp32), quantized, accuracy(quantized), reference))
        step()
    result = SweepResult(
        source=str(model_path), dtype=quantization.dtype, scope=pruning.scope, exclude_first=pruning.exclude_first,
        exclude_classifier=pruning.exclude_classifier, reconstruct=pruning.reconstruct,
        quantization=describe_quantization(quantization.as_dict() | {"calibration_samples": len(calibration.labels)}),
        points=points, record=str(record), fp32_accuracy=reference, dataset=str(dataset.root),
    )
    write_record(record, result)
    return result


def _point(sparsity: float, achieved: float, fp32: Path, fp32_accuracy: float, quantized: Path, accuracy: float, reference: float) -> SweepPoint:
    return SweepPoint(
        sparsity=sparsity,
        achieved_sparsity=round(achieved, 4),
        fp32_model=str(fp32),
        fp32_accuracy=fp32_accuracy,
        fp32_size_bytes=fp32.stat().st_size,
        fp32_compressed_bytes=gzip_size(fp32),
        model=str(quantized),
        accuracy=accuracy,
        delta=round(accuracy - reference, 4),
        size_bytes=quantized.stat().st_size,
        compressed_bytes=gzip_size(quantized),
    )
