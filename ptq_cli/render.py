"""All presentation: rich renderables for the terminal, Markdown for files, JSON for scripts. No logic here."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ptq_cli.backends.base import CONVERT, FLOAT_KERNEL, INT8_KERNEL, LAYOUT, RuntimeProfile
from ptq_cli.services.fetch import FetchResult
from ptq_cli.services.make.calibration import CalibrationSet
from ptq_cli.services.make.convert import LIMIT as CONVERSION_LIMIT
from ptq_cli.services.make.convert import ConversionResult
from ptq_cli.services.make.export import CArrayExport
from ptq_cli.services.make.prune import PruneResult
from ptq_cli.services.measure.benchmark import BenchmarkRecord, run_key
from ptq_cli.services.measure.evaluation_records import EvaluationRecord
from ptq_cli.services.measure.sweep_records import SweepResult
from ptq_cli.services.quant_settings import short_node
from ptq_cli.services.records import to_json
from ptq_cli.services.study.pipeline import StageOutcome
from ptq_cli.services.study.sensitivity import SensitivityResult
from ptq_cli.services.study.tune import TuneResult, describe
from ptq_cli.x86.cpu import describe_record


def plain(value: Any) -> Any:  # noqa: PLR0911  one return per kind of value
    if hasattr(value, "as_dict"):  # a dataclass that gives its stored form (the settings, with the backend's options beside the rest)
        return plain(value.as_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    return value


def as_json(value: Any) -> str:
    return to_json(plain(value))


def size(num_bytes: int) -> str:
    return f"{num_bytes / 1024:,.1f} KB"


def signed(points: float) -> str:
    return f"{points:+.2f}"


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.1%}"


def speedup(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# Runtimes as the 80-column table names them.
SHORT_RUNTIMES = {"onnxruntime": "ORT", "pytorch": "torch", "openvino": "OV"}


def key_value_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def conversion(result: ConversionResult) -> Table:
    check = result.check
    return key_value_table(
        "Conversion",
        [
            ("source", str(result.source)),
            ("output", f"{result.output} ({size(result.output_size_bytes)})"),
            ("checked on", f"{check.images} test images"),
            ("max |diff|", f"{check.max_abs_diff:.3g} (limit {check.tolerance:.3g}, {CONVERSION_LIMIT})"),
            ("top-1 agreement", f"{check.top1_agreement:.2%}"),
            *(("warning", message) for message in result.warnings),
        ],
    )


def calibration(calibration_set: CalibrationSet, output: Path) -> Group:
    low, high = calibration_set.pixel_range
    drawn = (f"{calibration_set.samples_per_class} per class" if calibration_set.samples_per_class
             else "as even over the classes as the count allows" if calibration_set.class_names else "at random: no labels")
    summary = key_value_table(
        "Calibration set",
        [
            ("output", str(output)),
            ("samples", f"{len(calibration_set.labels)} ({drawn})"),
            ("seed", str(calibration_set.seed)),
            ("drawn from", f"{calibration_set.dataset} ({calibration_set.split})"),
            *((("note", "the set models are judged on (it has no train split); --calibration-data DIR draws from other images"),)
              if calibration_set.judged_on else ()),
            ("images", f"{'x'.join(map(str, calibration_set.images.shape[1:]))} uint8, pixels {low} .. {high} (preprocessed per model when quantizing)"),
        ],
    )
    if not calibration_set.class_names:
        return Group(summary)
    per_class = Table(title="Samples per class", title_justify="left")
    per_class.add_column("class")
    per_class.add_column("samples", justify="right")
    for name, count in calibration_set.per_class_counts.items():
        per_class.add_row(name, str(count))
    return Group(summary, per_class)


REFERENCE_STATUS = {"stale": "its file changed since; evaluate it again", "missing": "its file is gone"}


def evaluation(record: EvaluationRecord, reference: EvaluationRecord | None, classes: list[int] | None, record_file: Path,
               reference_status: str = "ok") -> Group:
    """`classes`: the classes `--per-class` lists (evaluation_records.classes_to_show), None without it."""
    lines: list[Text] = []
    if reference is not None and record.accuracy is not None and reference.accuracy is not None:
        delta = record.accuracy - reference.accuracy
        lines.append(Text.assemble(
            f"  delta vs FP32 {reference.name} ({reference.accuracy:.2f}%): ",
            (signed(delta), "green" if delta >= 0 else "red"),
            " pts",
            paired_text(record.fidelity),
            *(() if reference_status == "ok" else ((f" [FP32 record {reference_status}: {REFERENCE_STATUS[reference_status]}]", "yellow"),)),
        ))
    if record.fidelity is not None:
        lines.append(Text.assemble(*fidelity_text(record)))
    elif record.dtype == "fp32":
        lines.append(Text("  the FP32 reference its quantized models are measured against", style="dim"))
    else:
        lines.append(Text("  no FP32 source to compare with (--against-fp32 MODEL names it)", style="dim"))
    top1: tuple = ("  top-1 ", (f"{record.accuracy:.2f}%", "bold"), f" ({record.correct:,}/{record.images:,})") if record.accuracy is not None else ()
    headline = Group(
        Text.assemble((visible(record.name), "bold"),
                      f"  {record.runtime}{f' ({record.precision})' if record.precision else ''} {record.dtype} on {record.dataset_label}", *top1),
        *lines,
        *_warning_lines(record, reference),
        Text(f"  {record.images_per_second:,.0f} images/s" + ("" if record.timed_natively else " (as this path was reached here, not this CPU's own kernels)")),
    )
    arena = f"; tensor arena {record.arena_bytes:,} bytes (as {record.runtime} measured it)" if record.arena_bytes else ""
    where = int8_path_text(record).removeprefix("; ")
    details = Text(f"  input {record.model_input}; preprocessing {record.preprocessing}{arena}" + (f"\n  {where}" if where else "")
                   + f"\n  record {record_file}", style="dim")
    if classes is None:
        return Group(headline, details)
    return Group(headline, details, _per_class_table(record, reference, classes))


def _per_class_table(record: EvaluationRecord, reference: EvaluationRecord | None, classes: list[int]) -> Table | Text:
    if not record.class_names:
        return Text("  --per-class: these images carry no labels of the model's classes, so there is no accuracy per class "
                    "(the agreement with FP32 above is the measure)", style="yellow")
    shown = "" if len(classes) == len(record.class_names) else f" ({len(classes)} of {len(record.class_names):,} classes: those that lose the most)"
    table = Table(title=f"Per-class accuracy: {record.name}{shown}", title_justify="left")
    for column in ("class", "images", "accuracy", *((f"FP32 ({reference.name})", "delta") if reference is not None else ())):
        table.add_column(column, justify="left" if column == "class" else "right")
    counts = record.images_per_class()
    for index in classes:
        name, accuracy = visible(record.class_names[index]), record.per_class_accuracy[index]
        cells = [name, f"{counts[index]:,}", class_percent(accuracy)]
        if reference is not None:
            other = reference.per_class_accuracy[index]
            cells += [class_percent(other), "-" if accuracy is None or other is None else signed(accuracy - other)]
        table.add_row(*cells)
    return table


def _warning_lines(record: EvaluationRecord, reference: EvaluationRecord | None) -> list[Text]:
    """The record's plausibility warnings, and its FP32 reference's: a delta from a near-chance FP32 figure means nothing."""
    lines = [Text(f"  warning: {warning}", style="yellow") for warning in record.warnings]
    return lines + [Text(f"  warning (its FP32 reference): {warning}", style="yellow") for warning in (reference.warnings if reference else ())]


def fidelity_text(record: EvaluationRecord) -> tuple:
    """"  vs FP32 model.onnx: top-1 agreement 91.3%, top-5 99.0%, SQNR 18.2 dB, KL 0.031" (no labels: the measure)."""
    fidelity = record.fidelity
    if fidelity is None:
        return ()
    sqnr = "identical" if fidelity["sqnr_db"] is None else f"SQNR {fidelity['sqnr_db']:.1f} dB"
    low, high = fidelity.get("top1_agreement_low"), fidelity.get("top1_agreement_high")
    interval = "" if low is None or high is None else f" (95% interval {low:.1f}-{high:.1f}%)"
    return (f"  vs FP32 {Path(fidelity['reference_path']).name} on {fidelity['images']:,} images{'' if record.accuracy is not None else ' (no labels of its classes)'}:"
            "\n  top-1 agreement ", (f"{fidelity['top1_agreement']:.2f}%", "bold"), f"{interval}, top-5 {fidelity['top5_containment']:.2f}%, {sqnr}, "
            f"KL {fidelity['kl_divergence']:.4f}")


def paired_text(fidelity: dict | None) -> str:
    """" (FP32 alone right on 31 images, this model alone on 25; McNemar p = 0.50)", "" where not measured."""
    if not fidelity or fidelity.get("accuracy_delta_p_value") is None:
        return ""
    return (f" (FP32 alone right on {fidelity['fp32_only_right']:,} images, this model alone on {fidelity['model_only_right']:,}; "
            f"McNemar p = {fidelity['accuracy_delta_p_value']:.2f})")


def int8_path_text(record: EvaluationRecord) -> str:
    """"; saturating int8 path (native) on AMD EPYC (avx2)" — which path the figure holds for, and where."""
    where = f" on {describe_record(record.cpu)}" if record.cpu else ""
    if not record.int8_path:
        return f"; measured{where}" if where else ""
    return f"; {record.int8_path} int8 path ({record.int8_basis}){where}"


def class_percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def delta(points: float | None) -> str:
    return "-" if points is None else signed(points)


def visible(name: str) -> str:
    """A name as a terminal shows it: bytes no codec takes (kept as surrogates) as visible escapes, so columns line up."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def markdown_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


SWEEP_COLUMNS = ("Sparsity", "Achieved", "FP32 pruned", "Quantized", "Delta", "Size", "Gzipped", "FP32 gzipped")
# The same columns, narrow enough for an 80-column terminal (sizes in KB).
TERMINAL_SWEEP_COLUMNS = ("Sparsity", "Zeros", "FP32", "Quant.", "Delta", "KB", "gz KB", "FP32 gz")


def sweep_cells(result: SweepResult, unit: str = " KB") -> list[list[str]]:
    kilobytes = lambda num_bytes: f"{num_bytes / 1024:,.1f}{unit}"  # noqa: E731
    return [
        [f"{point.sparsity:.0%}", percent(point.achieved_sparsity), f"{point.fp32_accuracy:.2f}%", f"{point.accuracy:.2f}%", signed(point.delta),
         kilobytes(point.size_bytes), kilobytes(point.compressed_bytes), kilobytes(point.fp32_compressed_bytes)]
        for point in result.points
    ]


def sweep_title(result: SweepResult) -> str:
    dense = [name for name, flag in (("first conv", result.exclude_first), ("classifier", result.exclude_classifier)) if flag]
    refit = ", kept weights re-fitted" if result.reconstruct else ""
    return (f"Prune ({result.scope} magnitude{refit}{', dense: ' + ', '.join(dense) if dense else ''}) then quantize "
            f"({result.quantization}): {result.source}")


def sweep_table(result: SweepResult) -> Table:
    table = Table(title=sweep_title(result), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in TERMINAL_SWEEP_COLUMNS:
        table.add_column(column, justify="right", no_wrap=True)
    for cells in sweep_cells(result, unit=""):
        table.add_row(*cells)
    return table


def sweep(result: SweepResult) -> Group:
    table = sweep_table(result)
    baseline = "-" if result.fp32_accuracy is None else f"{result.fp32_accuracy:.2f}%"
    note = (f"Delta: quantized top-1 vs the unpruned FP32 model ({baseline}, measured). 'FP32 pruned': what pruning alone leaves (no fine-tuning). "
            f"Gzipped: gzip -9 of the file. Record: {result.record}")
    return Group(table, Text(note, style="dim"))


def pruning(result: PruneResult) -> Group:
    table = Table(title=f"Pruned {result.source} -> {result.output}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("Layer", "Op", "Weights", "Zeros", "Sparsity"):
        table.add_column(column, justify="left" if column in ("Layer", "Op") else "right", no_wrap=True)
    for layer in result.layers:
        table.add_row(layer.node, layer.op_type, f"{layer.parameters:,}", f"{layer.zeros:,}",
                      percent(layer.sparsity) if layer.pruned else f"{percent(layer.sparsity)} (kept)")
    settings = result.settings
    summary = (f"Requested {settings.sparsity:.0%} ({settings.scope}); achieved {result.pruned_sparsity:.2%} over the pruned layers, "
               f"{result.overall_sparsity:.2%} over all weights; {size(result.output_size_bytes)}.")
    return Group(table, Text(summary))


def profile_summary(profile: RuntimeProfile) -> str:
    """e.g. "8 of 9 convolutions run int8; time: 62% int8 kernels, 9% float (Conv, Add), 17% converting, 12% moving data"."""
    parts = []
    for kind, words in ((INT8_KERNEL, "int8 kernels"), (FLOAT_KERNEL, "float"), (CONVERT, "converting"), (LAYOUT, "moving data")):
        share = profile.share(kind)
        if share >= 0.005:
            named = [op.op for op in profile.ops if op.kind == kind][:3] if kind != INT8_KERNEL else []
            parts.append(f"{share:.0%} {words}" + (f" ({', '.join(named)})" if named else ""))
    return f"{profile.int8_convolutions} of {profile.convolutions} convolutions and matrix products run int8; time: {', '.join(parts)}"


def profile_table(name: str, profile: RuntimeProfile) -> Table:
    total = sum(op.milliseconds for op in profile.ops) or 1.0
    table = Table(title=f"{name}: where the time goes (batch {profile.batch_size}, {profile.runs} runs; {profile.source})", title_justify="left",
                  box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)
    for column, justify in (("Op", "left"), ("Runs in", "left"), ("Nodes", "right"), ("ms a run", "right"), ("Share", "right")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for op in profile.ops:
        table.add_row(op.op, op.kind, str(op.nodes), f"{op.milliseconds:.3f}", f"{op.milliseconds / total:.1%}")
    return table


def benchmarks(records: list[BenchmarkRecord], speedups: dict[tuple, float | None], with_profiles: bool = False) -> Table | Group:
    settings = sorted({(record.batch_size, record.threads) for record in records})
    where = "; ".join(f"throughput at batch {batch}, {threads} thread{'s' if threads > 1 else ''}" for batch, threads in settings)
    table = Table(title=f"Benchmark: latency at batch 1, {where}", title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    # As the report's table: numbers never cut, the file name folds on a narrow terminal.
    table.add_column("Model", overflow="fold", min_width=12)
    table.add_column("Runs as", no_wrap=True)
    for column in ("p50 ms", "p95 ms", "p99 ms", "img/s", "Speed"):
        table.add_column(column, justify="right", no_wrap=True)
    for record in records:
        runs_as = " ".join(part for part in (SHORT_RUNTIMES.get(record.runtime, record.runtime), record.precision, record.dtype) if part)
        table.add_row(
            record.name, runs_as,
            milliseconds(record.latency_ms_p50), milliseconds(record.latency_ms_p95),
            milliseconds(record.latency_ms_p99), f"{record.images_per_second:,.0f}", speedup(speedups.get(run_key(record))),
        )
    fed = [f"inputs: {'; '.join(sorted({record.inputs for record in records if record.inputs}))}"] if any(record.inputs for record in records) else []
    kernels = [f"kernels of x86 CPUs without VNNI (saturating int8 path): {basis}" for basis in sorted({record.int8_basis for record in records if record.int8_basis})]
    budget = [f"{record.name}: {record.runs:,} of the {record.runs_asked:,} runs asked fit its time budget (PTQ_BENCHMARK_SECONDS); its figures are "
              "theirs" for record in records if record.runs_asked]
    if fed or kernels or budget:
        table.caption, table.caption_justify = "\n".join([*fed, *kernels, *budget]), "left"
    if not with_profiles:
        return table
    found = [(record.name, profile) for record in records if (profile := record.runtime_profile()) is not None]
    unprofiled = [Text(f"{record.name}: its runtime ({record.runtime}) has no profiler ptq reads") for record in records if record.profile is None]
    return Group(table, *(item for name, profile in found for item in (Text(""), profile_table(name, profile), Text(profile_summary(profile)))),
                 *unprofiled)


def fetched(result: FetchResult) -> Group:
    lines = []
    for asset in result.assets:
        origin = "" if asset.source == str(asset.destination) else f" (from {asset.source})"
        lines.append(Text.assemble((f"{asset.asset}: ", "bold"), f"{asset.action} {asset.destination}{origin}"))
        lines.append(Text(f"  checked: {asset.summary}", style="dim"))
    return Group(*lines)


def stage_line(index: int, total: int, name: str, outcome: StageOutcome | None) -> str:
    """A stage as it starts ("[3/27] quantize m.onnx ...") and as it ends (the same, then its seconds), for a log."""
    line = f"[{index + 1}/{total}] {name} ..."
    if outcome is None:
        return line
    if outcome.left_out is not None:
        return f"{line} failed, its backend left out: {outcome.left_out}"
    return f"{line} {outcome.seconds:.1f} s" if outcome.ran else f"{line} up to date"


def stage_label(label: str, outcome: StageOutcome) -> str:
    """A finished stage in the terminal's progress display (rich markup; `label` escaped)."""
    if outcome.left_out is not None:
        return f"[yellow]{label} (failed: its backend left out)[/yellow]"
    return label if outcome.ran else f"[dim]{label} (up to date)[/dim]"


def sensitivity(result: SensitivityResult, record_file: Path) -> Group:
    table = Table(
        title=f"Per-layer sensitivity of {result.model.name}: one layer quantized ({describe(result.settings)}), the rest float",
        title_justify="left",
        caption=f"Validation split: {result.validation['images']:,} training images, FP32 {result.fp32_validation_accuracy:.2f}%. Worst first.",
        caption_justify="left",
    )
    table.add_column("Layer", overflow="fold")
    for name in ("Op", "Output SQNR dB", "Val top-1", "Delta"):
        table.add_column(name, justify="left" if name == "Op" else "right")
    for layer in result.layers:
        table.add_row(layer.node, layer.op_type, f"{layer.output_sqnr_db:.1f}", f"{layer.validation_accuracy:.2f}%", signed(-layer.accuracy_drop))
    return Group(table, Text(f"Record: {record_file}"))


def _short_configuration(settings) -> str:
    floats = f" float:{','.join(short_node(name) for name in settings.float_nodes)}" if settings.float_nodes else ""
    own = f" {settings.options.describe()}" if settings.options.describe() else ""
    granularity = "channel" if settings.per_channel else "tensor"
    method = f"p{settings.percentile:g}" if settings.method == "percentile" else settings.method
    return f"w:{settings.weight_dtype} {granularity} {method} n={settings.calibration_samples}{own}{floats}"


def tuning(result: TuneResult) -> Group:
    table = Table(
        title=f"ptq tune {result.dtype} ({result.chosen.settings.backend}): validation split, FP32 {result.fp32_validation_accuracy:.2f}%, budget {result.max_drop:g} points",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
    )
    table.add_column("Stage")
    table.add_column("Configuration", overflow="fold")
    for name in ("Val", "Delta", "SQNR", "KB", "of FP32", "OK"):
        table.add_column(name, justify="right")
    for candidate in result.candidates:
        mark = "yes" if candidate.within_budget and not candidate.rejected else ("size" if candidate.rejected else "no")
        style = "bold green" if candidate is result.chosen else None
        table.add_row(candidate.stage, _short_configuration(candidate.settings), f"{candidate.validation_accuracy:.2f}",
                      signed(-candidate.accuracy_drop), f"{candidate.output_sqnr_db:.1f}", f"{candidate.size_bytes / 1024:.1f}",
                      f"{candidate.size_ratio:.1%}", mark, style=style)
    verdict = Text("Budget met.", style="green") if result.met_budget else Text("No candidate met the budget.", style="yellow")
    return Group(
        table,
        Text.assemble(verdict, f" {result.reason}."),
        Text(f"Chosen: {result.chosen.label} -> {result.output} (validation {result.chosen.validation_accuracy:.2f}%)"),
        Text(f"Record: {result.record}. Judge it on the test set with: ptq evaluate --model {result.output}"),
    )


def exported(result: CArrayExport) -> Text:
    arena = f", {result.symbol.upper()}_ARENA_BYTES {result.arena_bytes:,} (TFLite Micro's tensor arena)" if result.arena_bytes else ""
    return Text(f"{result.model.name} ({result.size_bytes:,} bytes) -> {result.source} and {result.header}: "
                f"const unsigned char {result.symbol}[], {result.symbol}_len{arena}")
