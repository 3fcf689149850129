"""The report's charts (`ptq report --plot`), PNGs beside the Markdown: each 8-bit model's per-class delta against
FP32, accuracy against speed and size with the Pareto front, and a sweep's accuracy against compressed size. Drawing
only: every figure comes from the report service."""

from __future__ import annotations

from pathlib import Path

from ptq_cli.guards.atomic import atomic_output
from ptq_cli.render import visible
from ptq_cli.render_report import runs_as
from ptq_cli.services.measure.report import BASE_RUNTIME, DatasetGroup, Report, ReportRow


def write_charts(report: Report, paths: dict[str, Path]) -> list[Path]:
    """PNG charts beside the Markdown report (matplotlib, its non-interactive Agg backend): each 8-bit model's per-class
    delta against FP32, its accuracy against speed and size with the models no other beats on both (the Pareto
    front), and (when a sweep was run) accuracy against compressed size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    main = report.groups[0] if report.groups else None
    if main is not None and "per_class" in paths:
        figure = _per_class_deltas(plt, main)
        if figure is not None:
            written.append(_save(figure, paths["per_class"]))
    if main is not None and "tradeoff" in paths:
        figure = _tradeoff(plt, main)
        if figure is not None:
            written.append(_save(figure, paths["tradeoff"]))
    if report.sweeps and "sweep" in paths:
        figure, axes = plt.subplots(figsize=(8, 5))
        for result in report.sweeps:
            for label, sizes, accuracies in (
                (f"{result.dtype} ({result.scope})", [p.compressed_bytes for p in result.points], [p.accuracy for p in result.points]),
                (f"fp32 pruned ({result.scope})", [p.fp32_compressed_bytes for p in result.points], [p.fp32_accuracy for p in result.points]),
            ):
                axes.plot([s / 1024 for s in sizes], accuracies, marker="o", label=label)
                for point, x, y in zip(result.points, sizes, accuracies, strict=True):
                    axes.annotate(f"{point.sparsity:.0%}", (x / 1024, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
        baseline = report.sweeps[0].fp32_accuracy
        if baseline is not None:
            axes.axhline(baseline, color="gray", linestyle="--", linewidth=1, label=f"FP32 baseline {baseline:.2f}%")
        axes.set_xlabel("gzip -9 size of the model file (KB)")
        axes.set_ylabel("top-1 accuracy (%)")
        axes.set_title("Prune then quantize: accuracy against compressed size (labels: sparsity)")
        axes.legend(fontsize="small")
        axes.grid(alpha=0.3)
        written.append(_save(figure, paths["sweep"]))
    return written


def _chart_label(row: ReportRow) -> str:
    name = f"{row.label} ({row.model})" if row.label else row.model
    return f"{visible(name)} ({runs_as(row)})"


def _per_class_deltas(plt, group: DatasetGroup):
    """A heat map: a row per 8-bit model, a column per class, each cell its points against its own FP32 source's
    class accuracy on the same images (red: lost, blue: gained), written in the cell."""
    import numpy as np

    rows = [row for row in group.rows if row.dtype != "fp32" and len(row.per_class_delta) == len(group.class_names)]
    if not rows:
        return None
    deltas = np.array([[np.nan if value is None else value for value in row.per_class_delta] for row in rows])
    bound = max(1.0, float(np.nanmax(np.abs(deltas))) if np.isfinite(deltas).any() else 1.0)
    figure, axes = plt.subplots(figsize=(max(9.0, 5.0 + 0.9 * len(group.class_names)), 1.4 + 0.45 * len(rows)))
    image = axes.imshow(deltas, cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto")
    axes.set_xticks(range(len(group.class_names)), group.class_names, rotation=30, ha="right")
    axes.set_yticks(range(len(rows)), [_chart_label(row) for row in rows])
    for (y, x), value in np.ndenumerate(deltas):
        if np.isfinite(value):
            axes.text(x, y, f"{value:+.1f}", ha="center", va="center", fontsize="small", color="white" if abs(value) > 0.6 * bound else "black")
    figure.colorbar(image, ax=axes, label="points against FP32")
    axes.set_title("Per-class accuracy against each model's FP32 source, points")
    return figure


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """The indexes of the points no other point beats on both coordinates (higher is better on both), by the first."""
    order = sorted(range(len(points)), key=lambda index: (-points[index][0], -points[index][1]))
    front, best = [], float("-inf")
    for index in order:
        if points[index][1] > best:
            front.append(index)
            best = points[index][1]
    return sorted(front, key=lambda index: points[index][0])


def _tradeoff(plt, group: DatasetGroup):
    """Top-1 (or agreement with FP32, without labels) against speed-up over onnxruntime's FP32 run and against size,
    each model a labelled point, the Pareto front drawn through the models no other beats on both."""
    labelled = any(row.accuracy is not None for row in group.rows)
    score = (lambda row: row.accuracy) if labelled else (lambda row: row.agreement)
    rows = [row for row in group.rows if score(row) is not None]
    if len(rows) < 2:
        return None
    figure, (speed_axes, size_axes) = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    # One baseline for every point: onnxruntime's FP32 run (itself at 1x), never a runtime's own FP32.
    onnxruntime_fp32 = [row for row in rows if row.dtype == "fp32" and row.runtime == BASE_RUNTIME]
    timed = [row for row in rows if row.speedup_vs_onnxruntime is not None or row in onnxruntime_fp32]
    speed = [(row.speedup_vs_onnxruntime or 1.0, score(row)) for row in timed]
    size_points = [(-row.size_bytes / 1024, score(row)) for row in rows]
    for axes, chosen, points, sign, xlabel in ((speed_axes, timed, speed, 1, "throughput against onnxruntime FP32 (x)"),
                                               (size_axes, rows, size_points, -1, "model size (KB)")):
        colours = plt.get_cmap("tab20")
        placed: list[tuple[float, float]] = []
        for index, (row, (x, y)) in enumerate(zip(chosen, points, strict=True)):
            axes.scatter(sign * x, y, color=colours(index % 20), zorder=3)
            # A label near one already placed moves down a line, so that labels of close points do not overlap.
            near = sum(abs(x - other_x) < 0.15 * max(abs(x), 1e-9) and abs(y - other_y) < 0.02 for other_x, other_y in placed)
            placed.append((x, y))
            axes.annotate(_chart_label(row), (sign * x, y), textcoords="offset points", xytext=(4, 3 - 9 * near), fontsize="x-small")
        front = pareto_front(points)
        axes.plot([sign * points[index][0] for index in front], [points[index][1] for index in front], color="gray", linestyle="--",
                  linewidth=1, zorder=2, label="Pareto front")
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small", loc="lower right")
    speed_axes.set_ylabel("top-1 (%)" if labelled else "top-1 agreement with FP32 (%)")
    figure.suptitle(f"Accuracy against speed and size: {group.label}")
    return figure


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    with atomic_output(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)
    return path
