"""The records of `ptq sweep` (services/study/sweep.py): one per model, dtype and pruning scope, read by
the report."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.services.records import from_dict, record_files

SWEEP_DIR = "sweep"  # under the results directory


@dataclass(frozen=True)
class SweepPoint:
    sparsity: float  # requested
    achieved_sparsity: float  # zeros among the pruned layers' weights
    fp32_model: str  # the pruned FP32 model (the source itself at sparsity 0)
    fp32_accuracy: float  # what pruning alone leaves
    fp32_size_bytes: int
    fp32_compressed_bytes: int
    model: str  # the pruned, then quantized model
    accuracy: float
    delta: float  # points against the unpruned FP32 model, measured in the same sweep
    size_bytes: int
    compressed_bytes: int  # gzip -9


@dataclass(frozen=True)
class SweepResult:
    source: str
    dtype: str
    scope: str
    exclude_first: bool
    exclude_classifier: bool
    reconstruct: bool  # kept weights re-fitted on the calibration images
    quantization: str  # the quantization settings, in a few words
    points: list[SweepPoint]
    record: str  # where this result is stored
    fp32_accuracy: float | None = None  # the unpruned FP32 model's, the reference of every delta
    dataset: str = ""


def read_sweep(path: Path) -> SweepResult:
    try:
        data = bounded.json_loads(bounded.read_text(Path(path), "record"))
        points = [from_dict(SweepPoint, point) for point in data["points"]]
        return replace(from_dict(SweepResult, {**data, "points": []}), points=points)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise PtqError(f"{path}: not a ptq sweep record ({error})") from error


def load_sweeps(results_dir: Path) -> tuple[list[SweepResult], list[str]]:
    """Every sweep record under results_dir/sweep; unreadable ones are skipped and named."""
    sweeps, skipped = [], []
    for path in record_files(Path(results_dir) / SWEEP_DIR):
        try:
            sweeps.append(read_sweep(path))
        except PtqError as error:
            skipped.append(str(error))
    return sweeps, skipped
