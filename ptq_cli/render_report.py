"""The comparison `ptq report` shows (the terminal table, Markdown, charts) and the study's answer `ptq run` and
`ptq quantize` end with: rendering only, from the report service's rows and recommendation."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ptq_cli import settings
from ptq_cli.backends.base import RuntimeProfile
from ptq_cli.quantize.ranges import describe_ranges
from ptq_cli.quantize.rounding import describe_rounding
from ptq_cli.render import (
    SHORT_RUNTIMES,
    SWEEP_COLUMNS,
    delta,
    key_value_table,
    markdown_table,
    milliseconds,
    profile_summary,
    signed,
    size,
    speedup,
    sweep_cells,
    sweep_table,
    sweep_title,
    visible,
)
from ptq_cli.services.make.portability import describe as describe_portability
from ptq_cli.services.make.quantize import QuantizeResult
from ptq_cli.services.make.stem import describe_stem
from ptq_cli.services.measure.benchmark import BenchmarkRecord
from ptq_cli.services.measure.report import AGREEMENT_BUDGET, BASE_RUNTIME, TOP5_BUDGET, DatasetGroup, Recommendation, Report, ReportRow
from ptq_cli.services.quant_settings import describe_cpus, describe_method
from ptq_cli.services.study.pipeline import RunResult

# The Markdown report's main table: what a reader compares, a figure a cell; how each model was made is a section below.
REPORT_COLUMNS = ("Model", "Runtime", "Type", "Top-1", "Delta (McNemar p)", "Agreement top-1 (95% CI) / top-5", "Without VNNI", "Size (reduction)",
                  "Speed-up")
SPEED_COLUMNS = ("Model", "Runtime", "Images/s", "Latency p50 (ms)", "Speed-up at batch 1", "Speed-up vs onnxruntime FP32")
CONFIGURATION_WIDTH = 100  # the configuration's lines, at most


def top1(accuracy: float | None, unit: str = "%") -> str:
    return "-" if accuracy is None else f"{accuracy:.2f}{unit}"


def share(value: float | None) -> str:
    """A percentage to one decimal, as the 80-column table shows agreement ("-" where not measured)."""
    return "-" if value is None else f"{value:.1f}"


def agreement(row: ReportRow) -> str:
    """"91.33% (89.4-93.0) / 99.67%": top-1 agreement, its 95% interval where the record has one, and top-5
    containment with the FP32 source; "-" where not measured."""
    if row.agreement is None:
        return "-"
    interval = "" if row.agreement_low is None or row.agreement_high is None else f" ({row.agreement_low:.1f}-{row.agreement_high:.1f})"
    return f"{row.agreement:.2f}%{interval} / {top1(row.top5)}"


def delta_with_p(row: ReportRow) -> str:
    """"-0.06 (p = 0.61)": the delta in points, and McNemar's p of the images each model alone classifies right."""
    return delta(row.delta) + ("" if row.delta is None or row.delta_p_value is None else f" (p = {row.delta_p_value:.2f})")


def no_vnni(row: ReportRow, short: bool = False) -> str:
    """The top-1 on x86 CPUs without VNNI (the saturating int8 path; without labels, the agreement with FP32):
    "=" where it is the same by proof or for a float model, a figure (* emulated, on the images its own line names; a proof
    measured on other kernels, PyTorch's fbgemm, can round a few images otherwise), "-" where not measured."""
    if row.dtype == "fp32" and row.int8_kernels_vary:
        return "="
    figure_value = row.saturating_accuracy if row.accuracy is not None else row.saturating_agreement
    if figure_value is None:
        return "-"
    if row.saturating_basis.startswith("proof") and figure_value == (row.accuracy if row.accuracy is not None else row.agreement):
        return "=" if short else f"= ({row.saturating_basis})"
    mark = "*" if row.saturating_basis.startswith("emulated") else ""
    decimals = 2 if row.accuracy is not None else 1  # top-1 to two decimals, agreement to one
    figure = f"{figure_value:.{decimals}f}{mark}" if short else f"{figure_value:.{decimals}f}%{mark}"
    return figure if short else f"{figure} ({row.saturating_basis})"


def _measured_on(row: ReportRow) -> str:
    return (row.measured_on or "-") + (" (another kind of CPU than this one)" if row.other_cpu else "")


def _name(row: ReportRow) -> str:
    return visible(f"{row.label} ({row.model})" if row.label else row.model)


def _model_cell(row: ReportRow) -> str:
    return _name(row) if row.status == "ok" else f"{_name(row)} ({row.status})"


def _no_vnni_cell(row: ReportRow) -> str:
    """The short form with its unit: "87.17%*", "=", "-"."""
    shown = no_vnni(row, short=True)
    return shown if shown in ("=", "-") else shown.replace("*", "") + "%" + ("*" if shown.endswith("*") else "")


def _eval_mark(row: ReportRow) -> str:
    return "" if row.speed_source == "benchmark" else " (eval)"


def _report_cells(row: ReportRow) -> list[str]:
    reduction = "" if row.size_reduction is None else f" ({-row.size_reduction:+.1%})"
    return [_model_cell(row), _runtime(row), row.dtype, top1(row.accuracy), delta_with_p(row), agreement(row), _no_vnni_cell(row),
            size(row.size_bytes) + reduction, speedup(row.speedup) + (_eval_mark(row) if row.speedup is not None else "")]


def _speed_cells(row: ReportRow) -> list[str]:
    return [_model_cell(row), _runtime(row), f"{row.images_per_second:,.0f}" + _eval_mark(row), milliseconds(row.latency_ms_p50),
            speedup(row.speedup_batch1), speedup(row.speedup_vs_onnxruntime)]


def _top_level_parts(text: str) -> list[str]:
    """`text` split at its commas and semicolons outside parentheses."""
    parts: list[str] = []
    depth, start = 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ",;" and text[index + 1 : index + 2] == " ":
            parts.append(text[start:index].strip())
            start = index + 1
    return [part for part in (*parts, text[start:].strip()) if part]


def without_evidence(configuration: str) -> str:
    """A configuration without the judges' figures ("; judged: image SQNR ... dB"), which records and --json keep."""
    return re.sub(r"; judged: [^()]*(?:\([^()]*\)[^()]*)*(?=\))", "", configuration)


def configuration_lines(configuration: str, width: int = CONFIGURATION_WIDTH) -> list[str]:
    """A configuration in lines of at most `width` characters, broken after a comma or semicolon: the same text,
    between its parts where they fit, inside a part's parentheses where one does not."""
    lines: list[str] = []
    for part in _top_level_parts(configuration):
        words = re.split(r"(?<=[,;]) ", part) if len(part) > width else [part]
        for index, word in enumerate(words):
            joiner = ", " if index == 0 else " "
            if lines and len(lines[-1]) + len(joiner) + len(word) <= width:
                lines[-1] += joiner + word
            else:
                if lines and index == 0:
                    lines[-1] += ","
                lines.append(word if len(word) <= width else shortened(word, width))
    return lines


def _made_lines(row: ReportRow) -> list[str]:
    """How one model was made and fed, and where it was measured, as short lines."""
    lines = [f"**{_model_cell(row)}** on {_runtime(row)}, measured on {_measured_on(row)}", ""]
    fed = ", ".join(part for part in (row.model_input, row.preprocessing and f"preprocessing {row.preprocessing}") if part)
    if fed:
        lines.append(f"- {fed}")
    wrapped = configuration_lines(row.configuration)
    lines += [f"- {wrapped[0]}", *(f"  {line}" for line in wrapped[1:])]
    return [*lines, ""]


def _score(row: ReportRow) -> str:
    """"87.19%, -0.05 pts", or without labels "91.3% agreement with FP32"."""
    if row.accuracy is None:
        return f"{top1(row.agreement)} top-1 agreement with FP32, top-5 {top1(row.top5)}"
    return f"{row.accuracy:.2f}%, {delta(row.delta)} pts"


def _best(advice: Recommendation) -> str:
    """What the best model was ranked by: top-1 with labels of the model's classes, else agreement with FP32."""
    return "Most faithful" if advice.by_agreement else "Best accuracy"


def describe_choices(group: DatasetGroup | None) -> str:
    """The models already made from the same FP32 model, as their records measured them on this CPU."""
    if group is None or group.recommendation is None:
        return "none measured yet from this FP32 model (`ptq run --model` quantizes, evaluates and benchmarks every choice)"
    advice = group.recommendation
    quantized = sum(row.dtype != "fp32" for row in group.rows)
    faithful = f"{_best(advice).lower()} {_name(advice.best_accuracy)} on {_runtime(advice.best_accuracy)} ({_score(advice.best_accuracy)}"
    faithful += f", {advice.best_accuracy.speedup_vs_onnxruntime:.2f}x onnxruntime FP32)" if advice.best_accuracy.speedup_vs_onnxruntime else ")"
    faithful += _tied(advice, group.images)
    fastest = advice.fastest
    quickest = ("" if fastest is None or fastest is advice.best_accuracy else
                f"; fastest within budget {_name(fastest)} on {_runtime(fastest)} ({_score(fastest)}"
                + (f", {fastest.speedup_vs_onnxruntime:.2f}x onnxruntime FP32)" if fastest.speedup_vs_onnxruntime else ")"))
    return f"{quantized} measured on {group.label} (`ptq report` compares them): {faithful}{quickest}"


def _recommendation_lines(group: DatasetGroup) -> list[str]:
    advice = group.recommendation
    if advice is None:
        return []
    fastest = advice.fastest
    budget = (f"agreeing with FP32 on {AGREEMENT_BUDGET:g}% top-1 and {TOP5_BUDGET:g}% top-5" if advice.by_agreement
              else f"within {advice.budget:.2f} points of FP32")
    smallest = advice.smallest
    portable = [f"Right on every x86 CPU: {Path(cost.model_path).name} {cost.portable_sqnr_db:.1f} dB SQNR, {cost.portable_agreement:.1f}% top-1 "
                f"agreement; made for VNNI CPUs alone (--cpus vnni) {cost.vnni_sqnr_db:.1f} dB, {cost.vnni_agreement:.1f}% (against FP32 on "
                f"{cost.images} calibration images on {cost.cpu}, measured by quantize)" for cost in group.portability]
    best = advice.best_accuracy
    return [
        f"{_best(advice)}: {_name(best)} ({_score(best)})" + _indistinguishable(best, group.images) + _tied(advice, group.images),
        f"Smallest: {_name(smallest)} ({size(smallest.size_bytes)}, {_score(smallest)})",
        f"Fastest {budget}: {_name(fastest)} on {_runtime(fastest)} ({fastest.images_per_second:,.0f} images/s"
        + (f", {fastest.speedup_vs_onnxruntime:.2f}x onnxruntime FP32" if fastest.speedup_vs_onnxruntime else "")
        + f", {_score(fastest)}; {without_evidence(fastest.configuration)})"
        + _indistinguishable(fastest, group.images)
        if fastest else f"Fastest {budget}: none",
        *portable,
    ]


def _indistinguishable(row: ReportRow, images: int) -> str:
    """"; its -0.40 points are indistinguishable from FP32 on 500 images (McNemar p 0.50)" where the images measured cannot
    tell its top-1 from its FP32 source's; "" otherwise."""
    if not row.indistinguishable or row.delta is None or row.delta_p_value is None:
        return ""
    return f"; its {row.delta:+.2f} points are indistinguishable from FP32 on {images:,} images (McNemar p {row.delta_p_value:.2f})"


def _tied(advice: Recommendation, images: int) -> str:
    """"; no better than speed.onnx (87.10%) on 10,000 images, image by image (McNemar p 0.42)" where the images measured
    cannot tell the best from the runner-up; "" otherwise."""
    rival = advice.best_rival
    if rival is None or advice.best_rival_p_value is None:
        return ""
    return f"; no better than {_name(rival)} ({_score(rival)}) on {images:,} images, image by image (McNemar p {advice.best_rival_p_value:.2f})"


def _runtime(measured: ReportRow | BenchmarkRecord) -> str:
    """The runtime and, for OpenVINO, its precision hint: "openvino f32"."""
    return measured.runtime + (f" {measured.precision}" if measured.precision else "")


def _group_title(group: DatasetGroup) -> str:
    """e.g. "top-1 on 10,000 images of cifar-10-batches-py (test), delta in points vs the 87.19% FP32 baseline (resnet8.onnx)"."""
    baseline = group.baseline
    if baseline is not None and baseline.accuracy is None:
        return (f"agreement with the FP32 model ({baseline.model}) on {group.images:,} images of {group.label} "
                "(no labels of the model's classes: top-1 agreement and top-5 containment, percent)")
    against = (f"delta in points vs the {baseline.accuracy:.2f}% FP32 baseline ({baseline.model}, measured)" if baseline is not None
               else "no FP32 model measured on it")
    return f"top-1 on {group.images:,} images of {group.label}, {against}"


# Narrower than REPORT_COLUMNS so the table fits an 80-column terminal; the Markdown keeps the long names.
# Without labels of the model's classes, agreement with FP32 takes the place of top-1 and its delta.
TERMINAL_COLUMNS = ("Model", "Runs as", "Top-1", "Delta", "Agree", "noVNNI", "KB", "Speed")


TERMINAL_COLUMNS_UNLABELLED = ("Model", "Runs as", "Agree", "Top-5", "noVNNI", "KB", "Speed")


def report(report: Report) -> Group:
    parts: list[Any] = []
    for group in report.groups:
        parts += _group_tables(group)
    parts += [sweep_table(result) for result in report.sweeps]
    if any(row.speed_source == "evaluate" for row in report.rows):
        parts.append(Text(f"Speed: throughput against the FP32 model on the same runtime, from `ptq benchmark` where it measured the file, "
                          f"else from evaluation (batch {settings.EVALUATION_BATCH}); speed-ups compare like with like.", style="dim"))
    if report.rows:
        parts.append(Text(NO_VNNI_NOTE, style="dim"))
        parts.append(Text("Runs as: runtime (" + ", ".join(f"{short} {name}" for name, short in SHORT_RUNTIMES.items())
                          + "), its precision hint where not f32, data type. Agree: top-1 agreement with the FP32 source, percent.", style="dim"))
        parts += [Text(line, style="dim") for line in [*_emulated_lines(report.rows), *_saturating_speed_lines(report.rows), *_batch1_lines(report.rows),
                                                           *_versus_onnxruntime_lines(report.rows),
                                                           *_profile_lines(report.rows)]]
        cpus = sorted({row.measured_on for row in report.rows if row.measured_on})
        if cpus:
            parts.append(Text(f"Measured on: {'; '.join(cpus)}.", style="dim"))
    parts += [Text(line, style="yellow") for line in _status_lines(report)]
    parts += [Text(f"warning: {line}", style="yellow") for line in report.warnings]
    parts += [Text(f"skipped {line}", style="yellow") for line in report.skipped]
    return Group(*parts)


NO_VNNI_NOTE = ("noVNNI: top-1 (without labels, agreement) on x86 CPUs without VNNI (the saturating int8 path); '=' the same by proof (or a float model), "
                "'*' emulated (on the images its line below names), '-' not measured.")


def _emulated_lines(rows: list[ReportRow]) -> list[str]:
    """An emulated figure read against the exact path on the same images (a subset, or the whole split)."""
    return [f"* {_name(row)}: {row.saturating_accuracy:.2f}% on the saturating path against {row.saturating_exact_same_images:.2f}% on the exact "
            f"path, on the same {row.saturating_images:,} images" for row in rows
            if row.saturating_basis.startswith("emulated") and row.saturating_exact_same_images is not None]


def _versus_onnxruntime_lines(rows: list[ReportRow]) -> list[str]:
    """Throughput against onnxruntime's FP32 run, for the models of other runtimes."""
    timed = [f"{_name(row)} ({runs_as(row)}) {speedup(row.speedup_vs_onnxruntime)}" for row in rows
             if row.runtime != BASE_RUNTIME and row.speedup_vs_onnxruntime is not None]
    return [f"* Against onnxruntime's FP32 run (throughput): {', '.join(timed)}"] if timed else []


def _batch1_lines(rows: list[ReportRow]) -> list[str]:
    """Speed-ups at batch 1 (latency), beside the table's throughput ones."""
    timed = [f"{_name(row)} {speedup(row.speedup_batch1)}" for row in rows if row.speedup_batch1 is not None]
    return [f"* At batch 1 (median latency against the FP32 source's): {', '.join(timed)}"] if timed else []


def _profile_lines(rows: list[ReportRow]) -> list[str]:
    """Where each profiled model's time goes (`ptq benchmark --profile`)."""
    return [f"* {_name(row)}: {profile_summary(profile)} (batch {profile.batch_size}, `ptq benchmark --profile`)"
            for row in rows if row.profile is not None for profile in (RuntimeProfile.from_stored(row.profile),)]


def _saturating_speed_lines(rows: list[ReportRow]) -> list[str]:
    """Speed-ups timed on the kernels of x86 CPUs without VNNI (`ptq benchmark --int8-path saturating`), beside the row's own."""
    return [f"* {_name(row)}: {row.saturating_speedup:.2f}x its FP32 source on the kernels of x86 CPUs without VNNI (AVX2; "
            "`ptq benchmark --int8-path saturating`)" for row in rows if row.saturating_speedup is not None]


def _status_lines(report: Report) -> list[str]:
    lines = []
    elsewhere = sorted({f"{row.model} ({row.measured_on})" for row in report.rows if row.other_cpu})
    if elsewhere:
        lines.append(f"measured on another kind of CPU than this one: {', '.join(elsewhere)}")
    stale = sorted({row.model for row in report.rows if row.status == "stale"})
    missing = sorted({row.model for row in report.rows if row.status == "missing"})
    if stale:
        lines.append(f"stale: {', '.join(stale)} changed since evaluated; its figures are not the file's "
                     "(`ptq report --refresh` evaluates it again)")
    if missing:
        lines.append(f"missing: {', '.join(missing)} no longer exists; its figures are kept for reference")
    return lines


def shared_stem(names: list[str]) -> str:
    """What every file name starts with, cut after its last '_' or before its '.' ("efficientnet_lite0"), or ""
    when that would say little (under 6 characters or a single model)."""
    if len(names) < 2:
        return ""
    prefix = os.path.commonprefix(names)
    cut = max(prefix.rfind("_"), prefix.rfind("."), prefix.rfind("-"))
    stem = prefix if all(name[len(prefix):len(prefix) + 1] in "._-" for name in names) else prefix[:cut]
    return stem if len(stem) >= 6 else ""


TABLE_WIDTH = 80  # the terminal table fits it, whatever the terminal


def shortened(name: str, width: int) -> str:
    """`name` cut at the last word boundary (space, '_', '.', '-') that leaves room for "…", never inside a word
    unless it is one word."""
    if len(name) <= width:
        return name
    room = name[: max(width - 1, 1)]
    cut = max(room.rfind(mark) for mark in " _.-")
    return (room[:cut] if cut > 0 else room).rstrip() + "…"


def _main_table(group: DatasetGroup) -> Group:
    """Numbers never wrap nor get cut. File names lose the stem they share (said in the title); a name that still
    does not fit the 80 columns is shortened at a word boundary, marked (a), (b)... and given in full below the table.
    One speed-up, against the FP32 model on the same runtime; against onnxruntime's FP32 run is a line below."""
    labelled = group.baseline is None or group.baseline.accuracy is not None or any(row.accuracy is not None for row in group.rows)
    stem = shared_stem([row.model for row in group.rows if not row.label])
    columns = TERMINAL_COLUMNS if labelled else TERMINAL_COLUMNS_UNLABELLED
    names, cells = [], []
    for row in group.rows:
        name = _model_cell(row)
        names.append("*" + name[len(stem):] if stem and not row.label and name.startswith(stem) else name)
        scores = ([top1(row.accuracy, ""), delta(row.delta), share(row.agreement)] if labelled else [share(row.agreement), share(row.top5)])
        cells.append([runs_as(row), *scores, no_vnni(row, short=True), f"{row.size_bytes / 1024:,.0f}", speedup(row.speedup)])
    widths = [max([len(column), *(len(row[index]) for row in cells)]) for index, column in enumerate(columns[1:])]
    room = max(TABLE_WIDTH - sum(widths) - len(widths), 12)  # one space between columns
    keys: dict[str, str] = {}  # full name -> its mark
    table = Table(title=f"Quantization report: {_group_title(group)}" + (f". Models: {stem}*" if stem else ""), title_justify="left",
                  box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for column in columns:
        header = f"{stem}*" if column == "Model" and stem else column
        table.add_column(header, justify="left" if column in columns[:2] else "right", no_wrap=True,
                         min_width=min(room, max(len(name) for name in [header, *names])) if column == "Model" else None)
    for name, row_cells in zip(names, cells, strict=True):
        shown = name
        if len(name) > room:
            mark = keys.setdefault(name, f" ({chr(ord('a') + len(keys) % 26)})")
            shown = shortened(name, room - len(mark)) + mark
        table.add_row(Text(shown), *(Text(cell) for cell in row_cells))
    return Group(table, *(Text(f"{mark.strip()} {name}", style="dim") for name, mark in keys.items()))


def runs_as(row: ReportRow) -> str:
    """"OV int8": the runtime, its precision hint where it is not f32 (bf16 would change the figures), the data type."""
    precision = row.precision if row.precision not in (None, "", "f32") else None
    return " ".join(part for part in (SHORT_RUNTIMES.get(row.runtime, row.runtime), precision, row.dtype) if part)


def _group_tables(group: DatasetGroup) -> list[Any]:
    table = _main_table(group)
    configurations = Table(title="How each model was made and timed", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    configurations.add_column("Model", overflow="fold", min_width=12)
    configurations.add_column("Configuration", min_width=12)
    configurations.add_column("Val / test", justify="right", no_wrap=True)
    configurations.add_column("p50 ms", justify="right", no_wrap=True)
    for row in group.rows:
        configurations.add_row(_model_cell(row), without_evidence(row.configuration), _validation_and_test(row), milliseconds(row.latency_ms_p50))
    parts: list[Any] = [table, configurations]
    if group.class_losses:
        losses = Table(title="Classes that lose the most (vs each model's FP32 source)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("Model", "Class", "Accuracy", "FP32", "Delta"):
            losses.add_column(column, justify="left" if column in ("Model", "Class") else "right")
        for loss in group.class_losses:
            losses.add_row(loss.model, loss.class_name, f"{loss.accuracy:.1f}%", f"{loss.reference_accuracy:.1f}%", signed(loss.delta))
        parts.append(losses)
    if group.versus_reference and group.reference is not None:
        title = f"TFLite models vs the {group.reference.label} ({group.reference.model}), both on {_runtime(group.reference)}"
        versus = Table(title=title, title_justify="left",
                       box=box.SIMPLE_HEAD, pad_edge=False)
        for column in VERSUS_REFERENCE_COLUMNS:
            versus.add_column(column, justify="left" if column == "Model" else "right", no_wrap=column != "Model")
        for cells in _versus_reference_cells(group):
            versus.add_row(*cells)
        parts.append(versus)
    parts += [Text(line) for line in _recommendation_lines(group)]
    return parts


VERSUS_REFERENCE_COLUMNS = ("Model", "Top-1", "vs reference", "Bytes (flash)", "vs reference", "Arena bytes (RAM)", "p50 ms (batch 1)", "vs reference")


def _versus_reference_cells(group: DatasetGroup) -> list[list[str]]:
    reference = group.reference
    if reference is None:
        return []
    rows = [[f"{reference.label} (reference)", f"{reference.accuracy:.2f}%", "-", f"{reference.size_bytes:,}", "-",
             _bytes(reference.arena_bytes), milliseconds(reference.latency_ms_p50), "-"]]
    rows += [[comparison.model, f"{comparison.accuracy:.2f}%", signed(comparison.accuracy_delta), f"{comparison.size_bytes:,}",
              f"{comparison.size_delta_bytes:+,}", _bytes(comparison.arena_bytes), milliseconds(comparison.latency_ms_p50),
              "-" if comparison.latency_ratio is None else f"{comparison.latency_ratio:.2f}x"] for comparison in group.versus_reference]
    return rows


def _bytes(count: int | None) -> str:
    return "-" if count is None else f"{count:,}"


def _validation_and_test(row: ReportRow) -> str:
    """Validation accuracy (tuned models only) next to test accuracy."""
    validation = "-" if row.validation_accuracy is None else f"{row.validation_accuracy:.2f}%"
    return f"{validation} / {top1(row.accuracy)}"


def _group_markdown(group: DatasetGroup) -> list[str]:
    """One group's section: its table, how each model was configured, the classes that lose most, the
    comparison with the reference, the recommendation."""
    lines = ["", f"## {_group_title(group)[0].upper()}{_group_title(group)[1:]}", ""]
    lines += markdown_table(REPORT_COLUMNS, [_report_cells(row) for row in group.rows])
    lines += ["", "### Speed", "", "Images/s at `ptq benchmark`'s batch size ('(eval)': during evaluation instead); latency at batch 1.", ""]
    lines += markdown_table(SPEED_COLUMNS, [_speed_cells(row) for row in group.rows])
    lines += ["", "### How each model was made", ""]
    for row in group.rows:
        lines += _made_lines(row)
    tuned = [row for row in group.rows if row.validation_accuracy is not None]
    if tuned:
        lines += ["### Tuned models on the validation split", "",
                  "Validation: the training-image split `ptq tune` decided on; the test split only judged the choice.", ""]
        lines += markdown_table(("Model", "Runtime", "Validation top-1", "FP32 on validation", "Test top-1"),
                                [[row.model, _runtime(row), top1(row.validation_accuracy), top1(row.validation_fp32_accuracy), top1(row.accuracy)]
                                 for row in tuned])
    if group.class_losses:
        lines += ["", "### Classes that lose the most", ""]
        lines += markdown_table(
            ("Model", "Runtime", "Class", "Accuracy", "FP32", "Delta"),
            [[loss.model, loss.runtime or "-", loss.class_name, f"{loss.accuracy:.1f}%", f"{loss.reference_accuracy:.1f}%", signed(loss.delta)]
             for loss in group.class_losses],
        )
    if group.versus_reference and group.reference is not None:
        lines += ["", f"### TFLite models vs the {group.reference.label}, both on {_runtime(group.reference)}", "",
                  "Points and bytes against the reference; latency at batch 1 from `ptq benchmark`, as a ratio to the reference's "
                  "(below 1: faster).", ""]
        lines += markdown_table(VERSUS_REFERENCE_COLUMNS, _versus_reference_cells(group))
    recommendation = _recommendation_lines(group)
    if recommendation:
        lines += ["", "### Recommendation", ""] + [f"- {line}" for line in recommendation]
    return lines


def report_markdown(report: Report, charts: list[Path] | None = None) -> str:
    lines = [
        "# Quantization analysis",
        "",
        "- **Delta**: points against the FP32 model each model was made from, on the same images, fed the same way.",
        "- **Agreement**: the share of images whose top-1 class is the FP32 source's, and whose FP32 top-1 class is in the",
        "  model's top 5 (no labels needed: where the images' labels are not the model's classes, it is the measure).",
        "- **Without VNNI**: top-1 on x86 CPUs without VNNI (the saturating int8 path); '=' the same by proof or for a float",
        "  model, '*' emulated (on the images its line below names), '-' not measured.",
        "- **Size** and **speed-up**: against the FP32 model on the same runtime; the speed-up is throughput from `ptq benchmark`",
        f"  ('(eval)': measured during evaluation, batch {settings.EVALUATION_BATCH}); the Speed table has batch 1.",
    ]
    status = _status_lines(report)
    if status:
        lines += [""] + [f"**{line}**" for line in status]
    for group in report.groups:
        lines += _group_markdown(group)
    speeds = _saturating_speed_lines(report.rows)
    if speeds:
        lines += ["", "## Speed on x86 CPUs without VNNI", ""] + [line.replace("* ", "- ", 1) for line in speeds]
    profiles = _profile_lines(report.rows)
    if profiles:
        lines += ["", "## Where the time goes", ""] + [line.replace("* ", "- ", 1) for line in profiles]
    for result in report.sweeps:
        lines += ["", f"## {sweep_title(result)}", "",
                  "'FP32 pruned' is what pruning alone leaves (no fine-tuning); 'Quantized' is that model after quantization, "
                  "'Delta' its distance to the unpruned FP32 model; gzipped sizes are gzip -9 of the files.", ""]
        lines += markdown_table(SWEEP_COLUMNS, sweep_cells(result))
    if charts:
        lines += ["", "## Charts", ""] + [f"![{path.stem.replace('_', ' ')}]({path.name})" for path in charts]
    if report.warnings:
        lines += ["", "## Warnings", ""] + [f"- {line}" for line in report.warnings]
    if report.skipped:
        lines += ["", "## Skipped records", ""] + [f"- {line}" for line in report.skipped]
    return "\n".join(lines) + "\n"


def quantization(result: QuantizeResult) -> Table:
    settings, evidence = result.settings, result.settings.evidence
    return key_value_table(
        "Quantization",
        [
            ("model", str(result.source)),
            ("input", f"{result.model_input}; preprocessing {result.preprocessing}"),
            *(("note", note) for note in result.notes),
            ("backend", f"{settings.backend} ({settings.format})"),
            ("activations / weights", f"{settings.dtype} / {settings.weight_dtype}"),
            ("granularity", "per-channel" if settings.per_channel else "per-tensor"),
            ("CPUs", describe_cpus(settings.as_dict()) or "-"),
            ("stem", describe_stem(settings.stem, evidence.stem_sqnr_db)),
            ("rounding", describe_rounding(settings.rounding, evidence.rounding_nearest_db, evidence.rounding_learned_db)),
            *((("portability", describe_portability(result.portability)),) if result.portability else ()),
            ("other choices", describe_choices(result.measured_choices)),
            *(((f"{settings.backend} options", settings.options.describe()),) if settings.options.describe() else ()),
            ("calibration method", describe_method(settings.method, settings.percentile, evidence.method_sqnr_db, evidence.method_rounded_db)),
            *((("activation ranges", ranges_row),) if (ranges_row := describe_ranges(settings.ranges, evidence.ranges_calibrated_db,
                                                                                      evidence.ranges_searched_db)) else ()),
            ("calibration samples", f"{settings.calibration_samples} (seed {settings.calibration_seed}, {settings.calibration_source})"),
            *(
                ("space-to-depth", f"{rewrite.node}: {rewrite.input_channels}->{rewrite.output_channels} channels as "
                                   f"{rewrite.block * rewrite.input_channels}->{rewrite.block * rewrite.output_channels} ({rewrite.block}-pixel blocks)")
                for rewrite in result.space_to_depth
            ),
            ("output", f"{result.output} ({size(result.output_size_bytes)}, {result.size_ratio:.1%} of {size(result.source_size_bytes)})"),
            *((("where the time goes", f"{profile_summary(result.profile)} (batch 1, this CPU; ptq benchmark --profile for each op)"),)
              if result.profile else ()),
        ],
    )


def pipeline_run(result: RunResult) -> Group:
    table = Table(title="ptq run", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
    table.add_column("Stage", ratio=1)  # wraps between words; its outputs are in the manifest
    table.add_column("Ran", justify="right", no_wrap=True)
    for stage in result.stages:
        ran_for = (Text("failed", style="yellow") if stage.left_out is not None else
                   Text(f"{stage.seconds:.1f} s") if stage.ran else Text("up to date", style="dim"))
        table.add_row(Text(stage.name), ran_for)
    ran = len(result.ran)
    summary = (
        f"{ran} of {len(result.stages)} stages ran in {result.wall_seconds:.1f} s; manifest: {result.manifest}"
        if ran
        else f"All {len(result.stages)} stages up to date ({result.wall_seconds:.1f} s); nothing written (--force runs them again)."
    )
    parts: list[Any] = [table, Text(summary)]
    parts += [Text(f"Left out of the study: {backend} ({why}); --no-{backend} leaves it out without trying.", style="yellow")
              for backend, why in result.left_out.items()]
    for group in result.report.groups if result.report else []:
        parts += ["", _main_table(group)]  # the study's answer, without asking for `ptq report`
    return Group(*parts)
