"""The comparison of every evaluated model, built from the evaluation records alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ptq_cli.services.benchmark import BenchmarkRecord, load_benchmarks
from ptq_cli.services.evaluate import EvaluationRecord, fp32_reference, load_records
from ptq_cli.services.sweep import SweepResult, load_sweeps
from ptq_cli.settings import BASELINE_ACCURACY

FRAMEWORK_ORDER = {"onnxruntime": 0, "pytorch": 1}
DTYPE_ORDER = {"fp32": 0, "int8": 1, "uint8": 2}


@dataclass(frozen=True)
class ReportRow:
    model: str  # file name
    framework: str
    dtype: str
    configuration: str  # how it was quantized, in a few words
    accuracy: float
    delta: float  # points vs BASELINE_ACCURACY
    size_bytes: int
    size_reduction: float | None  # fraction saved against the same framework's FP32 file
    images_per_second: float  # from `ptq benchmark` when it measured this exact file, else from evaluate
    speed_source: str  # "benchmark" or "evaluate"
    speedup: float | None  # against the same framework's FP32 model, measured the same way
    latency_ms_p50: float | None  # batch 1, from `ptq benchmark`
    # Set by `ptq tune`, which chose the model on the validation split (training images): its accuracy
    # there and the FP32 model's, to read next to the test accuracy.
    validation_accuracy: float | None = None
    validation_fp32_accuracy: float | None = None
    per_class_accuracy: tuple[float, ...] = ()  # percent, in Report.class_names order


@dataclass(frozen=True)
class ClassLoss:
    model: str
    class_name: str
    accuracy: float
    reference_accuracy: float

    @property
    def delta(self) -> float:
        return round(self.accuracy - self.reference_accuracy, 4)


@dataclass(frozen=True)
class Recommendation:
    best_accuracy: ReportRow
    smallest: ReportRow
    fastest: ReportRow


@dataclass(frozen=True)
class Report:
    baseline: float
    rows: list[ReportRow]
    class_losses: list[ClassLoss]  # worst first, quantized models against their FP32 reference
    recommendation: Recommendation | None
    skipped: list[str]  # records that could not be read
    class_names: tuple[str, ...] = ()
    sweeps: tuple[SweepResult, ...] = ()  # `ptq sweep` results, read from results/sweep/


def describe_pruning(pruning: dict | None) -> str:
    if not pruning:
        return ""
    kept = [name for name, flag in (("first conv", pruning.get("exclude_first")), ("classifier", pruning.get("exclude_classifier"))) if flag]
    refit = " re-fitted" if pruning.get("reconstruct") else ""
    return f"pruned {pruning['sparsity']:.0%} {pruning['scope']}{refit}" + (f" (dense: {', '.join(kept)})" if kept else "")


def describe_model(settings: dict | None, pruning: dict | None = None) -> str:
    """How a model was made, in a few words: its pruning, then its quantization."""
    return ", ".join(part for part in (describe_pruning(pruning), describe_quantization(settings)) if part)


def describe_quantization(settings: dict | None) -> str:
    if not settings:
        return "float"
    # PyTorch's x86 kernels pair unsigned activations with signed weights whatever the model is called.
    types = "a:quint8 w:qint8" if settings.get("format") == "FX" else f"a:{settings['dtype']} w:{settings.get('weight_dtype', settings['dtype'])}"
    parts = [
        f"{settings.get('format', 'QDQ')} {types}",
        "per-channel" if settings.get("per_channel") else "per-tensor",
        settings.get("method", "?") + (f" {settings['percentile']:g}" if settings.get("percentile") else ""),
        f"{settings.get('calibration_samples', '?')} samples",
    ]
    short = lambda name: name.split("/")[-2] if "/" in name else name  # noqa: E731  (tf2onnx names: model_1/conv2d_1/BiasAdd)
    if settings.get("float_nodes"):
        parts.append("float: " + ", ".join(short(name) for name in settings["float_nodes"]))
    if settings.get("space_to_depth_convs"):
        parts.append("space-to-depth: " + ", ".join(short(rewrite["node"]) for rewrite in settings["space_to_depth_convs"]))
    return ", ".join(parts)


def _speed(record: EvaluationRecord, benchmarks: dict[str, BenchmarkRecord]) -> tuple[float, str]:
    benchmark = benchmarks.get(record.model_sha256)
    if benchmark is not None:
        return benchmark.images_per_second, "benchmark"
    return record.images_per_second, "evaluate"


def _row(record: EvaluationRecord, reference: EvaluationRecord | None, benchmarks: dict[str, BenchmarkRecord]) -> ReportRow:
    is_reference = reference is not None and reference.model_path == record.model_path
    comparable = reference is not None and not is_reference
    speed, source = _speed(record, benchmarks)
    speedup = None
    if comparable:
        reference_speed, reference_source = _speed(reference, benchmarks)
        speedup = round(speed / reference_speed, 3) if reference_source == source else None
    benchmark = benchmarks.get(record.model_sha256)
    validation = (record.quantization or {}).get("validation") or {}
    return ReportRow(
        model=record.name,
        framework=record.framework,
        dtype=record.dtype,
        configuration=describe_model(record.quantization, record.pruning),
        accuracy=record.accuracy,
        delta=round(record.accuracy - BASELINE_ACCURACY, 4),
        size_bytes=record.model_size_bytes,
        size_reduction=round(1.0 - record.model_size_bytes / reference.model_size_bytes, 4) if comparable else None,
        images_per_second=speed,
        speed_source=source,
        speedup=speedup,
        latency_ms_p50=benchmark.latency_ms_p50 if benchmark else None,
        validation_accuracy=validation.get("accuracy"),
        validation_fp32_accuracy=validation.get("fp32_accuracy"),
        per_class_accuracy=tuple(record.per_class_accuracy),
    )


def _class_losses(record: EvaluationRecord, reference: EvaluationRecord) -> list[ClassLoss]:
    return [
        ClassLoss(record.name, name, accuracy, reference_accuracy)
        for name, accuracy, reference_accuracy in zip(record.class_names, record.per_class_accuracy, reference.per_class_accuracy)
    ]


def build_report(
    records: list[EvaluationRecord],
    skipped: list[str] | None = None,
    benchmarks: dict[str, BenchmarkRecord] | None = None,
    worst_classes: int = 5,
    sweeps: list[SweepResult] | None = None,
) -> Report:
    records = sorted(records, key=lambda r: (FRAMEWORK_ORDER.get(r.framework, 9), DTYPE_ORDER.get(r.dtype, 9), r.name))
    references = {record.model_path: fp32_reference(records, record.framework) for record in records}
    rows = [_row(record, references[record.model_path], benchmarks or {}) for record in records]

    losses: list[ClassLoss] = []
    for record in records:
        reference = references[record.model_path]
        if record.dtype != "fp32" and reference is not None:
            losses.extend(_class_losses(record, reference))
    losses.sort(key=lambda loss: loss.delta)

    quantized = [row for row in rows if row.dtype != "fp32"]
    candidates = quantized or rows
    recommendation = (
        Recommendation(
            best_accuracy=max(candidates, key=lambda row: row.accuracy),
            smallest=min(candidates, key=lambda row: row.size_bytes),
            fastest=max(candidates, key=lambda row: row.images_per_second),
        )
        if candidates
        else None
    )
    class_names = tuple(records[0].class_names) if records else ()
    return Report(BASELINE_ACCURACY, rows, losses[:worst_classes], recommendation, list(skipped or []), class_names, tuple(sweeps or ()))


def report_from_results(results_dir: Path) -> Report:
    record_set = load_records(results_dir)
    sweeps, skipped_sweeps = load_sweeps(results_dir)
    return build_report(record_set.records, record_set.skipped + skipped_sweeps, load_benchmarks(results_dir), sweeps=sweeps)
