"""The comparison of every evaluated model, built from the records alone, one group per dataset."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ptq_cli import backends, settings
from ptq_cli.errors import PtqError
from ptq_cli.metrics import paired_p_value, unpacked_hits
from ptq_cli.services.make import portability
from ptq_cli.services.make.portability import PortabilityCost
from ptq_cli.services.measure.benchmark import BenchmarkRecord, load_benchmarks
from ptq_cli.services.measure.evaluate import refresh_stale
from ptq_cli.services.measure.evaluation_records import OK, EvaluationRecord, fp32_reference, load_records, measured_classes, record_status, reference_for
from ptq_cli.services.measure.sweep_records import SweepResult, load_sweeps
from ptq_cli.services.progress import ProgressBar, no_progress_bar
from ptq_cli.services.quant_settings import describe_model
from ptq_cli.services.records import MeasurementKey, same_feeding
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import plan as int8_plan
from ptq_cli.x86.cpu import ALL, SATURATING

DTYPE_ORDER = {"fp32": 0, "int8": 1, "uint8": 2}
# The recommendation's "fastest" is the fastest model at most this many points below its FP32 source.
ACCURACY_BUDGET = 0.10
# Without labels of the model's classes, "fastest" is the fastest that agrees this closely with its FP32 source:
# top-1 agreement and top-5 containment, percent.
AGREEMENT_BUDGET, TOP5_BUDGET = 90.0, 99.0
# A loss of top-1 whose McNemar p-value (the images it and its FP32 source alone classify right) is at least this is
# no loss the images measured can tell from chance: such a model is within the budget, and said to be indistinguishable.
SIGNIFICANCE = 0.05
BASE_RUNTIME = backends.DEFAULT  # every speed-up is also given against this runtime's run of the FP32 source


@dataclass(frozen=True)
class ReportRow:
    model: str  # file name
    runtime: str
    dtype: str
    configuration: str  # how it was quantized, in a few words
    accuracy: float | None  # None: the images' labels are not the model's classes; agreement is the measure
    delta: float | None  # points vs the FP32 model it was made from (its record on the same dataset)
    reference: str | None  # that FP32 model's file name
    size_bytes: int
    size_reduction: float | None  # fraction saved against the same runtime's FP32 file
    images_per_second: float  # from `ptq benchmark` when it measured this exact file, else from evaluate
    speed_source: str  # "benchmark" or "evaluate"
    speedup: float | None  # against the FP32 model on the same runtime (and precision hint), measured the same way
    latency_ms_p50: float | None  # batch 1, from `ptq benchmark`
    # Set by `ptq tune`, which chose the model on the validation split (training images): its accuracy
    # there and the FP32 model's, to read next to the test accuracy.
    validation_accuracy: float | None = None
    validation_fp32_accuracy: float | None = None
    per_class_accuracy: tuple[float | None, ...] = ()  # percent, in the group's class_names order
    per_class_delta: tuple[float | None, ...] = ()  # points per class against the FP32 model it was made from (as `delta`)
    model_input: str = ""
    preprocessing: str = ""
    status: str = OK  # "stale": the file changed since it was measured; "missing": it is gone
    precision: str | None = None  # OpenVINO's inference precision hint, never left out of a figure
    speedup_vs_onnxruntime: float | None = None  # against the FP32 source run by onnxruntime, measured the same way
    label: str | None = None  # shown instead of the file name (the MLPerf Tiny reference)
    # The x86 int8 paths (cpu.py): the row's figures are the exact path's when measured; the saturating
    # path's (CPUs without VNNI) beside them, with how it was reached (native, proof, emulated subset).
    int8_path: str | None = None
    saturating_accuracy: float | None = None
    saturating_delta: float | None = None  # its loss against the FP32 source, as the row's delta is
    saturating_basis: str = ""
    saturating_images: int | None = None  # how many images its saturating figure is on (a subset when emulated)
    saturating_exact_same_images: float | None = None  # emulated: the exact path's top-1 on those same images
    # Throughput against the FP32 source, both timed on the kernels of x86 CPUs without VNNI on a CPU with VNNI
    # (`ptq benchmark --int8-path saturating`); on a CPU without VNNI, `speedup` is that figure.
    saturating_speedup: float | None = None
    # Where the time goes at the benchmark's batch (`ptq benchmark --profile`): backends.base.RuntimeProfile as a dict.
    profile: dict | None = None
    # Batch 1: the FP32 model's median latency over this one's (both from `ptq benchmark`, same runtime); `speedup` is throughput's.
    speedup_batch1: float | None = None
    cpus: str | None = None  # the CPUs the model is for (`--cpus`), if ptq made it
    arena_bytes: int | None = None  # the working memory its runtime measured for it (TFLM's tensor arena)
    measured_on: str = ""  # the CPU of the row's figures
    other_cpu: bool = False  # measured on a CPU whose int8 path differs from this one's
    int8_kernels_vary: bool = False  # its runtime's x86 int8 kernels differ by CPU (a float model's figure holds on both)
    # Fidelity to the FP32 model (fidelity.Fidelity), on the exact path's figures and the saturating one's.
    agreement: float | None = None  # top-1 agreement, percent
    agreement_low: float | None = None  # its 95% interval (Wilson), percent
    agreement_high: float | None = None
    delta_p_value: float | None = None  # McNemar's, of the images it and its FP32 source alone classify right
    top5: float | None = None  # top-5 containment, percent
    sqnr_db: float | None = None
    saturating_agreement: float | None = None
    saturating_top5: float | None = None
    model_sha256: str = ""  # the file its figures are of
    right_images: str | None = None  # which images it classified right (metrics.packed_hits), for paired comparisons

    @property
    def loses_on_its_cpus(self) -> bool:
        """Whether, on a path its target CPUs take, it loses more than the budget."""
        if self.cpus != ALL:
            return False
        if self.saturating_delta is not None:
            return self.saturating_delta < -ACCURACY_BUDGET
        return self.saturating_agreement is not None and not _faithful(self.saturating_agreement, self.saturating_top5)

    @property
    def within_budget(self) -> bool:
        """Within the budget of its FP32 source: ACCURACY_BUDGET points of top-1, or a loss no larger than chance
        makes on the images measured (McNemar's p at least SIGNIFICANCE), or without labels, agreement."""
        if self.delta is not None:
            return self.delta >= -ACCURACY_BUDGET or self.loss_not_significant
        return self.agreement is not None and _faithful(self.agreement, self.top5)

    @property
    def indistinguishable(self) -> bool:
        """A top-1 other than its FP32 source's by no more than the images measured can tell apart from chance."""
        return self.delta is not None and self.delta != 0 and self.delta_p_value is not None and self.delta_p_value >= SIGNIFICANCE

    @property
    def loss_not_significant(self) -> bool:
        return self.indistinguishable and self.delta is not None and self.delta < 0

    @property
    def score(self) -> float:
        """What "best" ranks by: top-1, else top-1 agreement with FP32."""
        return self.accuracy if self.accuracy is not None else (self.agreement or 0.0)


def _faithful(agreement: float, top5: float | None) -> bool:
    return agreement >= AGREEMENT_BUDGET and (top5 or 0.0) >= TOP5_BUDGET


@dataclass(frozen=True)
class ClassLoss:
    model: str
    class_name: str
    accuracy: float
    reference_accuracy: float
    runtime: str = ""  # the runtime the model's figures are from (the same file can have a row on two)

    @property
    def delta(self) -> float:
        return round(self.accuracy - self.reference_accuracy, 4)


@dataclass(frozen=True)
class Recommendation:
    best_accuracy: ReportRow  # by top-1, or by agreement with FP32 where there are no labels of the model's classes
    smallest: ReportRow
    fastest: ReportRow | None  # the fastest, on any runtime, within the budget of its FP32 source
    budget: float = ACCURACY_BUDGET
    by_agreement: bool = False  # no labels: the budget is AGREEMENT_BUDGET / TOP5_BUDGET
    # The runner-up to best_accuracy when the images measured cannot tell the two apart (McNemar's p, image by image,
    # at least SIGNIFICANCE): "best" is then no claim that it is better. None where the difference is significant.
    best_rival: ReportRow | None = None
    best_rival_p_value: float | None = None


@dataclass(frozen=True)
class ReferenceComparison:
    """A TFLite model of the table against the MLPerf Tiny reference, both measured in it."""

    model: str
    accuracy: float
    accuracy_delta: float  # points vs the reference
    size_bytes: int
    size_delta_bytes: int
    latency_ms_p50: float | None  # batch 1, from `ptq benchmark`
    latency_ratio: float | None  # this model's batch-1 latency / the reference's, when both were benchmarked
    arena_bytes: int | None = None  # the tensor arena its runtime measured (a microcontroller's RAM for it)


@dataclass(frozen=True)
class DatasetGroup:
    """Every model evaluated on one dataset split (same images, by content)."""

    label: str  # e.g. "cifar-10-batches-py (test)"
    dataset: str
    images: int
    rows: list[ReportRow]
    class_names: tuple[str, ...]
    class_losses: list[ClassLoss]  # worst first, quantized models against their FP32 source
    recommendation: Recommendation | None
    baseline: ReportRow | None  # the FP32 model most rows are compared with: its measured accuracy heads the table
    reference: ReportRow | None = None  # the MLPerf Tiny reference row, when it was evaluated on these images
    versus_reference: tuple[ReferenceComparison, ...] = ()  # each other int8 TFLite model against it
    source_sha256: str | None = None  # the float model the group's models were made from
    # What running right on every x86 CPU cost its models where `quantize` measured it (portability.py), by their files.
    portability: tuple[PortabilityCost, ...] = ()


@dataclass(frozen=True)
class Report:
    groups: list[DatasetGroup]
    skipped: list[str]  # records that could not be read
    sweeps: tuple[SweepResult, ...] = ()  # `ptq sweep` results, read from results/sweep/
    # "model (how it was fed): what looks wrong" for every record with a plausibility warning (a top-1 near chance).
    warnings: tuple[str, ...] = ()

    @property
    def rows(self) -> list[ReportRow]:
        return [row for group in self.groups for row in group.rows]


@dataclass(frozen=True)
class Reported:
    """What `ptq report` did: the report, and the files it wrote (records evaluated again, the Markdown, its charts)."""

    report: Report
    written: tuple[Path, ...] = ()


def _speed(record: EvaluationRecord, benchmarks: dict[MeasurementKey, BenchmarkRecord]) -> tuple[float, str]:
    benchmark = benchmarks.get(MeasurementKey.of(record, with_dataset=False))
    if benchmark is not None:
        return benchmark.images_per_second, "benchmark"
    return record.images_per_second, "evaluate"


def _timed_natively(record: EvaluationRecord, saturating: EvaluationRecord | None) -> EvaluationRecord | None:
    """The run whose evaluation speed is the model's on this CPU: the one on the CPU's own int8 kernels. On a CPU
    without VNNI the exact path runs through onnxruntime's exact-kernel switch, slower than what the model runs there;
    None where neither run of the pair was native."""
    if record.timed_natively:
        return record
    return saturating if saturating is not None and saturating.timed_natively else None


def _source_on_its_runtime(record: EvaluationRecord, records: list[EvaluationRecord]) -> EvaluationRecord | None:
    """The FP32 model this one was made from, run on the same runtime at the same precision, or converted to
    that runtime's format from it (what speed and size are compared with); for a model ptq did not make,
    the one float model of its runtime, if one."""
    reference = fp32_reference(records, record)
    if reference is None:
        return None
    same = [other for other in records if reference.model_sha256 in (other.model_sha256, other.source_sha256) and other.dtype == "fp32"
            and other.dataset_sha256 == record.dataset_sha256 and other.runtime == record.runtime and other.precision == record.precision
            and not other.pruning and same_feeding(other, record)]
    return min(same, key=lambda other: (other.int8_path or "", other.model_path), default=None)


def _onnxruntime_fp32(record: EvaluationRecord, records: list[EvaluationRecord]) -> EvaluationRecord | None:
    """The onnxruntime run of the FP32 model this one was made from (or of this very file, for FP32 run elsewhere)."""
    source = record.source_sha256 or record.model_sha256
    return next((other for other in records if other.dtype == "fp32" and other.runtime == BASE_RUNTIME
                 and other.model_sha256 == source and other.dataset_sha256 == record.dataset_sha256 and same_feeding(other, record)), None)


def _ratio(record: EvaluationRecord | None, reference: EvaluationRecord | None, benchmarks: dict[MeasurementKey, BenchmarkRecord]) -> float | None:
    """Throughput against the reference's, only when both come from the same kind of measurement."""
    if record is None or reference is None or reference is record:
        return None
    speed, source = _speed(record, benchmarks)
    reference_speed, reference_source = _speed(reference, benchmarks)
    return round(speed / reference_speed, 3) if reference_source == source and reference_speed > 0 else None


def _latency_ratio(record: EvaluationRecord, reference: EvaluationRecord | None, benchmarks: dict[MeasurementKey, BenchmarkRecord]) -> float | None:
    """Batch 1: the reference's median latency over the model's, where `ptq benchmark` timed both (this CPU's kernels)."""
    if reference is None:
        return None
    timed = [benchmarks.get(MeasurementKey.of(measured, with_dataset=False)) for measured in (record, reference)]
    if timed[0] is None or timed[1] is None or timed[0].latency_ms_p50 <= 0:
        return None
    return round(timed[1].latency_ms_p50 / timed[0].latency_ms_p50, 3)


def _saturating_speedup(record: EvaluationRecord, reference: EvaluationRecord | None, benchmarks: dict[MeasurementKey, BenchmarkRecord]) -> float | None:
    """Throughput against the reference's where both were timed on the kernels of CPUs without VNNI on a CPU with VNNI."""
    if reference is None:
        return None
    timed = [benchmarks.get(replace(MeasurementKey.of(measured, with_dataset=False), int8_path=SATURATING)) for measured in (record, reference)]
    if timed[0] is None or timed[1] is None or timed[1].images_per_second <= 0:
        return None
    return round(timed[0].images_per_second / timed[1].images_per_second, 3)


def _row(record: EvaluationRecord, records: list[EvaluationRecord], benchmarks: dict[MeasurementKey, BenchmarkRecord], status: str,
         saturating: EvaluationRecord | None = None) -> ReportRow:
    reference = fp32_reference(records, record) if (record.dtype != "fp32" or record.source_sha256) else None
    reference = None if reference is not None and reference.model_sha256 == record.model_sha256 else reference
    runtime_fp32 = _source_on_its_runtime(record, records)
    timed = _timed_natively(record, saturating)
    speed, source = _speed(timed or record, benchmarks)
    compared = record if source == "benchmark" else timed  # a benchmark runs this CPU's own kernels; an evaluation only where timed
    speedup = size_reduction = None
    if runtime_fp32 is not None and (runtime_fp32.model_sha256 == record.model_sha256 or record.dtype == "fp32"):
        runtime_fp32 = None  # itself, or a float model: nothing to compare
    speedup_batch1 = None
    if runtime_fp32 is not None:
        speedup = _ratio(compared, runtime_fp32, benchmarks)
        speedup_batch1 = _latency_ratio(record, runtime_fp32, benchmarks)
        size_reduction = round(1.0 - record.model_size_bytes / runtime_fp32.model_size_bytes, 4)
    benchmark = benchmarks.get(MeasurementKey.of(record, with_dataset=False))
    validation = (record.quantization or {}).get("validation") or {}
    return ReportRow(
        model=record.name,
        runtime=record.runtime,
        dtype=record.dtype,
        configuration=describe_model(record.quantization, record.pruning),
        accuracy=record.accuracy,
        size_bytes=record.model_size_bytes,
        arena_bytes=record.arena_bytes,
        size_reduction=size_reduction,
        images_per_second=speed,
        speed_source=source,
        speedup=speedup,
        latency_ms_p50=benchmark.latency_ms_p50 if benchmark else None,
        profile=benchmark.profile if benchmark else None,
        speedup_batch1=speedup_batch1,
        validation_accuracy=validation.get("accuracy"),
        validation_fp32_accuracy=validation.get("fp32_accuracy"),
        per_class_accuracy=tuple(record.per_class_accuracy),
        model_input=record.model_input,
        preprocessing=record.preprocessing,
        status=status,
        precision=record.precision,
        speedup_vs_onnxruntime=_ratio(compared, _onnxruntime_fp32(record, records), benchmarks),
        saturating_speedup=_saturating_speedup(record, runtime_fp32, benchmarks),
        label=record.label,
        model_sha256=record.model_sha256,
        right_images=record.right_images,
        **_against_source(record, reference),
        **_int8_fields(record, saturating, reference),
        **_fidelity_fields(record, saturating),
    )


def _against_source(record: EvaluationRecord, reference: EvaluationRecord | None) -> dict:
    """The row's delta against its FP32 source measured on the same images, overall and per class, and the source's name."""
    if reference is None:
        return {"delta": None, "reference": None}
    delta = None if record.accuracy is None or reference.accuracy is None else round(record.accuracy - reference.accuracy, 4)
    per_class = () if len(reference.per_class_accuracy) != len(record.per_class_accuracy) else tuple(
        None if value is None or base is None else round(value - base, 4)
        for value, base in zip(record.per_class_accuracy, reference.per_class_accuracy, strict=True))
    return {"delta": delta, "reference": reference.name, "per_class_delta": per_class}


def _fidelity_fields(record: EvaluationRecord, saturating: EvaluationRecord | None) -> dict:
    """The row's fidelity figures, and the saturating path's beside them (the record's own where it is that path's)."""
    own = record.fidelity or {}
    fields = {"agreement": own.get("top1_agreement"), "agreement_low": own.get("top1_agreement_low"), "agreement_high": own.get("top1_agreement_high"),
              "delta_p_value": own.get("accuracy_delta_p_value"), "top5": own.get("top5_containment"), "sqnr_db": own.get("sqnr_db")}
    other = saturating if saturating is not None else (record if record.int8_path == SATURATING else None)
    if other is not None and other.fidelity:
        fields.update(saturating_agreement=other.fidelity["top1_agreement"], saturating_top5=other.fidelity["top5_containment"])
    return fields


def _int8_fields(record: EvaluationRecord, saturating: EvaluationRecord | None, reference: EvaluationRecord | None) -> dict:
    if record.int8_path == SATURATING:  # no exact-path figure: the row's own is the saturating one
        saturating = record
    row = backends.TABLE.get(record.runtime)
    fields: dict = {"int8_path": record.int8_path, "int8_kernels_vary": bool(row and row.int8_paths), "cpus": (record.quantization or {}).get("cpus"),
                    "measured_on": cpu_info.describe_record(record.cpu),
                    "other_cpu": int8_plan.measured_on_other_path(record.cpu)}
    if saturating is not None:
        fields.update(saturating_accuracy=saturating.accuracy, saturating_basis=saturating.int8_basis, saturating_images=saturating.images,
                      saturating_exact_same_images=saturating.exact_accuracy_same_images)
        accuracy, other, fp32 = record.accuracy, saturating.accuracy, reference.accuracy if reference is not None else None
        if accuracy is None or other is None or fp32 is None:
            return fields  # no labels (agreement says it: _fidelity_fields), or no FP32 figure to compare with
        if saturating.exact_accuracy_same_images is not None and saturating is not record:  # a subset: its loss against the exact path there
            fields["saturating_delta"] = round(accuracy - fp32 + other - saturating.exact_accuracy_same_images, 4)
        else:
            fields["saturating_delta"] = round(other - fp32, 4)
    return fields


def _class_losses(record: EvaluationRecord, reference: EvaluationRecord) -> list[ClassLoss]:
    """Per class, against the reference; only classes with enough images to say something (measured_classes)."""
    counted = set(measured_classes(record))
    return [
        ClassLoss(record.name, name, accuracy, reference_accuracy, record.runtime + (f" {record.precision}" if record.precision else ""))
        for index, (name, accuracy, reference_accuracy) in enumerate(zip(record.class_names, record.per_class_accuracy,
                                                                         reference.per_class_accuracy, strict=False))
        if accuracy is not None and reference_accuracy is not None and index in counted
    ]


def _group(records: list[EvaluationRecord], benchmarks: dict[MeasurementKey, BenchmarkRecord], worst_classes: int,
           statuses: dict[str, str], root: str | None = None, several: bool = False) -> DatasetGroup:
    records = sorted(records, key=lambda r: (backends.order(r.runtime), DTYPE_ORDER.get(r.dtype, 9), r.name, r.model_path, r.precision or "",
                                             r.int8_path or ""))
    records, saturating = int8_plan.fold_paths(records, lambda r: (r.model_path, r.model_sha256, r.runtime, r.precision))
    rows = [_row(record, records, benchmarks, statuses.get(record.model_path, OK), saturating.get(id(record))) for record in records]
    losses: list[ClassLoss] = []
    for record in records:
        reference = fp32_reference(records, record)
        if record.dtype != "fp32" and reference is not None and record.accuracy is not None and reference.accuracy is not None:
            losses.extend(_class_losses(record, reference))
    losses.sort(key=lambda loss: loss.delta)
    recommendation = _recommend([row for row in rows if row.status == OK], records[0].images)  # never a file whose figures are not its own
    roots = [row for record, row in zip(records, rows, strict=True) if record.model_sha256 == root]
    baseline = min(roots, key=lambda row: (row.runtime != BASE_RUNTIME, row.precision or ""), default=None) \
        or next((row for row in rows if row.dtype == "fp32"), None)
    first = records[0]
    # The reference as a microcontroller scores it, where it was run on such kernels: the comparison a device user reads.
    mlperf = min((row for row in rows if row.label == settings.MLPERF_REFERENCE_LABEL),
                 key=lambda row: not (row.runtime in backends.TABLE and backends.TABLE[row.runtime].runtime.microcontroller), default=None)
    # Several studies on one dataset: each table says which source it holds, by the path it was evaluated at.
    source_path = next((record.model_path for record in records if record.model_sha256 == root), None)
    label = first.dataset_label + (f", models made from {source_path}" if several and source_path else "")
    return DatasetGroup(label, first.dataset, first.images, rows, tuple(first.class_names), losses[:worst_classes],
                        recommendation, baseline, mlperf, _versus_reference(rows, mlperf), root)


def _versus_reference(rows: list[ReportRow], reference: ReportRow | None) -> tuple[ReferenceComparison, ...]:
    if reference is None:
        return ()
    timed = reference.latency_ms_p50
    return tuple(
        ReferenceComparison(row.model, row.accuracy, round(row.accuracy - reference.accuracy, 4), row.size_bytes,
                            row.size_bytes - reference.size_bytes, row.latency_ms_p50,
                            round(row.latency_ms_p50 / timed, 3) if row.latency_ms_p50 and timed else None, row.arena_bytes)
        for row in rows if row.runtime == reference.runtime and row.dtype != "fp32" and row is not reference
        and row.accuracy is not None and reference.accuracy is not None
    )


def _recommend(current: list[ReportRow], images: int) -> Recommendation | None:
    quantized = [row for row in current if row.dtype != "fp32"]
    candidates = quantized or current
    if not candidates:
        return None
    best = max(candidates, key=lambda row: row.score)
    rival, p_value = _rival(best, [row for row in candidates if row is not best], images)
    return Recommendation(best_accuracy=best, smallest=min(candidates, key=lambda row: row.size_bytes),
                          fastest=_fastest_within_budget(quantized), by_agreement=all(row.accuracy is None for row in candidates),
                          best_rival=rival, best_rival_p_value=p_value)


def _rival(best: ReportRow, others: list[ReportRow], images: int) -> tuple[ReportRow | None, float | None]:
    """The runner-up by top-1 and McNemar's p between it and `best` on the images both classified, where that p says
    the images cannot tell them apart; (None, None) where they can, or where the records hold no images right."""
    runner_up = max((row for row in others if row.accuracy is not None and row.right_images), key=lambda row: row.score, default=None)
    if runner_up is None or not best.right_images or best.accuracy is None:
        return None, None
    try:
        p_value = paired_p_value(unpacked_hits(best.right_images, images), unpacked_hits(runner_up.right_images or "", images))
    except ValueError:  # measured on other images than the group's (a subset): not comparable image by image
        return None, None
    return (runner_up, round(p_value, 4)) if p_value >= SIGNIFICANCE else (None, None)


def _fastest_within_budget(rows: list[ReportRow]) -> ReportRow | None:
    """Across runtimes; speeds from `ptq benchmark` (one process, in turns) are preferred to evaluation's."""
    within = [row for row in rows if row.within_budget and not row.loses_on_its_cpus]
    benchmarked = [row for row in within if row.speed_source == "benchmark"]
    return max(benchmarked or within, key=lambda row: row.images_per_second, default=None)


def _root(record: EvaluationRecord, records: list[EvaluationRecord]) -> str | None:
    """The float model at the start of the chain a model was made through (FP32 -> pruned -> int8), or None
    for a quantized model ptq did not make."""
    seen = set()
    while record.model_sha256 not in seen:
        seen.add(record.model_sha256)
        source = reference_for(record, records)
        if source is None:
            return record.model_sha256 if record.dtype == "fp32" else record.source_sha256
        record = source
    return record.model_sha256


def _studies(records: list[EvaluationRecord]) -> dict[str | None, list[EvaluationRecord]]:
    """A dataset's records by the float model they were made from: several studies in one results folder
    each compared with their own source. A quantized model ptq did not make (the MLPerf Tiny reference)
    joins the study its one float model leads, or the largest."""
    studies: dict[str | None, list[EvaluationRecord]] = {}
    loose = []
    for record in records:
        root = _root(record, records)
        if root is None:
            loose.append(record)
        else:
            studies.setdefault(root, []).append(record)
    if loose:
        ordered = sorted(studies, key=lambda root: (-len(studies[root]), min(r.model_path for r in studies[root])))
        for record in loose:
            reference = fp32_reference(records, record)
            home = _root(reference, records) if reference is not None else (ordered[0] if ordered else None)
            studies.setdefault(home, []).append(record)
    return studies


def build_report(
    records: list[EvaluationRecord],
    skipped: list[str] | None = None,
    benchmarks: dict[MeasurementKey, BenchmarkRecord] | None = None,
    worst_classes: int = 5,
    sweeps: list[SweepResult] | None = None,
    statuses: dict[str, str] | None = None,
) -> Report:
    """`statuses`: record_status by model path (every row "ok" when not given)."""
    # A dataset's records by how their images were fed: figures of one feeding are never compared with another's.
    by_dataset: dict[tuple[str, str], list[EvaluationRecord]] = {}
    for record in records:
        by_dataset.setdefault((record.dataset_sha256 or record.dataset, MeasurementKey.of(record).feeding), []).append(record)
    fed_apart = {dataset for dataset, _ in by_dataset if sum(other == dataset for other, _ in by_dataset) > 1}
    groups = []
    for (dataset, _), dataset_records in by_dataset.items():
        studies = _studies(dataset_records)
        made = [_group(members, benchmarks or {}, worst_classes, statuses or {}, root, len(studies) > 1) for root, members in studies.items()]
        if dataset in fed_apart:  # the same images fed another way too: each table says how its images were fed
            made = [replace(group, label=f"{group.label}, fed as {dataset_records[0].preprocessing}") for group in made]
        groups += made
    groups.sort(key=lambda group: (-len(group.rows), group.label))  # the main study first
    warnings = tuple(dict.fromkeys(f"{record.name} ({record.preprocessing}): {warning}" for record in records for warning in record.warnings))
    return Report(groups, list(skipped or []), tuple(sweeps or ()), warnings)


# The charts of `report --plot`, named after the Markdown report: two reports in one folder keep their own.
CHARTS = {"per_class": "per_class_delta", "tradeoff": "accuracy_vs_speed_and_size", "sweep": "sweep_accuracy_vs_compressed_size"}


def chart_paths(markdown: Path) -> dict[str, Path]:
    markdown = Path(markdown)
    return {key: markdown.with_name(f"{markdown.stem}_{name}.png") for key, name in CHARTS.items()}


def input_files(results_dir: Path) -> list[Path]:
    """What a report reads: the files under the results folder."""
    return [path for path in Path(results_dir).rglob("*") if path.is_file()] if Path(results_dir).is_dir() else []


def report_from_results(results_dir: Path) -> Report:
    """The report of the records under `results_dir`, each row checked against the file now on disk."""
    record_set = load_records(results_dir)
    sweeps, skipped_sweeps = load_sweeps(results_dir)
    statuses = {record.model_path: record_status(record) for record in record_set.records}
    skipped = record_set.skipped + skipped_sweeps
    benchmarks = load_benchmarks(results_dir, skipped)
    costs = portability.load_all(results_dir, skipped)
    report = build_report(record_set.records, skipped, benchmarks, sweeps=sweeps, statuses=statuses)
    groups = [replace(group, portability=tuple({row.model_sha256: costs[row.model_sha256] for row in group.rows
                                                if row.status == OK and row.model_sha256 in costs}.values())) for group in report.groups]
    return replace(report, groups=groups)


def measured_from(results_dir: Path, source_sha256: str, leaving_out: Path | None = None) -> DatasetGroup | None:
    """What the records under `results_dir` measured of the models made from one float model on this CPU's int8
    path (the largest dataset where several), without `leaving_out` (a file just rewritten: its record is stale):
    the choices a user has already measured, read, never recomputed."""
    if not Path(results_dir).is_dir():  # nothing measured yet
        return None
    groups = [group for group in report_from_results(results_dir).groups if group.source_sha256 == source_sha256]
    for group in groups:
        rows = [row for row in group.rows if row.status == OK and not row.other_cpu
                and (leaving_out is None or row.model != Path(leaving_out).name)]
        if any(row.dtype != "fp32" for row in rows):
            return replace(group, rows=rows, recommendation=_recommend(rows, group.images))
    return None


def run(results_dir: Path, refresh: bool = False, threads: int | None = None, progress_bar: ProgressBar = no_progress_bar) -> Reported:
    """`ptq report`: the models whose files changed since their records evaluated again first (with `refresh`), then
    the report of the records; a PtqError where there are none to read. Reported.written: the records rewritten."""
    refreshed: list[Path] = []
    if refresh:
        with progress_bar("Evaluating the models that changed since their records"):
            refreshed = refresh_stale(results_dir, threads)
    report = report_from_results(results_dir)
    if not report.rows:
        reason = f" ({report.skipped[0]})" if report.skipped else " (run `ptq evaluate` first)"
        raise PtqError(f"{results_dir}: no readable evaluation records{reason}")
    return Reported(report, tuple(refreshed))
