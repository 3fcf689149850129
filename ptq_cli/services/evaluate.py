"""Top-1 accuracy on the full CIFAR-10 test set, written as one JSON record per model."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import ptq_cli
from ptq_cli.errors import PtqError
from ptq_cli.services import cifar
from ptq_cli.services.models import load_model, resolve_threads
from ptq_cli.services.progress import ProgressCallback
from ptq_cli.services.records import from_dict, write_record
from ptq_cli.settings import BASELINE_ACCURACY, MANIFEST_NAME

RECORD_SCHEMA = 1


@dataclass(frozen=True)
class EvaluationRecord:
    """What `evaluate` measured for one model file; `report` reads these and computes nothing new."""

    model_path: str
    model_sha256: str
    model_size_bytes: int
    framework: str
    dtype: str
    quantization: dict | None
    dataset: str
    images: int
    correct: int
    accuracy: float  # top-1, percent
    delta_vs_baseline: float  # percentage points against BASELINE_ACCURACY
    class_names: list[str]
    per_class_accuracy: list[float]  # percent, in class_names order
    confusion_matrix: list[list[int]]  # rows: true class, columns: predicted class
    images_per_second: float  # inference only, at batch_size
    batch_size: int
    threads: int
    timestamp: str
    tool_version: str
    schema: int = RECORD_SCHEMA
    pruning: dict | None = None  # how `ptq prune` pruned the model (or its FP32 source), if it did

    @property
    def name(self) -> str:
        return Path(self.model_path).name


def evaluate_model(
    model_path: Path,
    data_dir: Path,
    batch_size: int = 1000,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
) -> EvaluationRecord:
    if batch_size < 1:
        raise PtqError(f"--batch-size: must be at least 1, got {batch_size}")
    model = load_model(model_path, threads)
    test = cifar.load_test(data_dir)
    total = len(test.labels)
    predictions = np.empty(total, dtype=np.int64)
    inference_seconds = 0.0
    for start in range(0, total, batch_size):
        batch = cifar.to_model_input(test.images[start : start + batch_size])
        began = time.perf_counter()
        scores = model.predict(batch)
        inference_seconds += time.perf_counter() - began
        predictions[start : start + len(batch)] = scores.argmax(axis=1)
        if progress:
            progress(start + len(batch), total)

    num_classes = len(test.class_names)
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(confusion, (test.labels, predictions), 1)
    correct = int(np.trace(confusion))
    accuracy = 100.0 * correct / total
    per_class = 100.0 * np.diag(confusion) / confusion.sum(axis=1)
    return EvaluationRecord(
        model_path=str(model.info.path),
        model_sha256=model.info.sha256,
        model_size_bytes=model.info.size_bytes,
        framework=model.info.framework,
        dtype=model.info.dtype,
        quantization=model.info.quantization,
        dataset=str(Path(data_dir) / cifar.TEST_BATCH),
        images=total,
        correct=correct,
        accuracy=round(accuracy, 4),
        delta_vs_baseline=round(accuracy - BASELINE_ACCURACY, 4),
        class_names=list(test.class_names),
        per_class_accuracy=[round(float(value), 4) for value in per_class],
        confusion_matrix=confusion.tolist(),
        images_per_second=round(total / inference_seconds, 1),
        batch_size=batch_size,
        threads=resolve_threads(threads),
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        tool_version=ptq_cli.__version__,
        pruning=model.info.pruning,
    )


def record_path(results_dir: Path, model_path: Path | str) -> Path:
    """results/resnet8.onnx.json: the suffix keeps ONNX and TorchScript models of one name apart."""
    return Path(results_dir) / f"{Path(model_path).name}.json"


def save_record(record: EvaluationRecord, results_dir: Path) -> Path:
    path = record_path(results_dir, record.model_path)
    return write_record(path, record)


def read_record(path: Path) -> EvaluationRecord:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return from_dict(EvaluationRecord, data)
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise PtqError(f"{path}: not a ptq evaluation record ({error})") from error


@dataclass(frozen=True)
class RecordSet:
    records: list[EvaluationRecord]
    skipped: list[str]  # one line per unreadable file: "path: problem"


def load_records(results_dir: Path) -> RecordSet:
    """Every record under `results_dir`; unreadable ones are skipped and named, never fatal."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise PtqError(f"{results_dir}: results directory not found (run `ptq evaluate` first)")
    records, skipped = [], []
    for path in sorted(results_dir.glob("*.json")):
        if path.name == MANIFEST_NAME:
            continue
        try:
            records.append(read_record(path))
        except PtqError as error:
            skipped.append(str(error))
    return RecordSet(records, skipped)


def fp32_reference(records: list[EvaluationRecord], framework: str) -> EvaluationRecord | None:
    """The float model to compare against: the same framework's if there is one, else any float model."""
    floats = [record for record in records if record.dtype == "fp32" and not record.pruning]
    same = [record for record in floats if record.framework == framework]
    return (same or floats or [None])[0]
