"""The report a person reads: a main table of at most 9 columns with one speed-up, no table cell over 100 characters,
each model's configuration in short lines below it, per-class losses naming the runtime, and charts of per-class
deltas and of accuracy against speed and size (the Pareto front)."""

from __future__ import annotations

import re
from pathlib import Path

from synthetic import conv_classifier, image_folder, ok

from ptq_cli.render_charts import pareto_front
from ptq_cli.render_report import REPORT_COLUMNS, configuration_lines, without_evidence

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tables(markdown: str) -> list[list[list[str]]]:
    tables, current = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


def test_the_markdown_report_has_a_short_main_table_and_each_models_configuration_below(tmp_path, monkeypatch):
    conv_classifier(tmp_path / "m.onnx")
    image_folder(tmp_path / "images", per_class=8)
    for dtype in ("int8", "uint8"):
        ok("quantize", "--model", "m.onnx", "--data", "images", "--dtype", dtype, "--output", f"m_{dtype}.onnx", cwd=tmp_path)
    ok("evaluate", "--model", "m.onnx", "--model", "m_int8.onnx", "--model", "m_uint8.onnx", "--data", "images", "--per-class", cwd=tmp_path)
    shown = ok("report", "--markdown", "report.md", "--plot", cwd=tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    tables = _tables(markdown)
    main = tables[0]
    assert tuple(main[0]) == REPORT_COLUMNS and len(main[0]) <= 9
    assert sum("speed-up" in header.lower() for header in main[0]) == 1
    assert {row[0] for row in main[2:]} == {"m.onnx", "m_int8.onnx", "m_uint8.onnx"}
    assert all(len(cell) <= 100 for table in tables for row in table for cell in row)
    made = markdown[markdown.index("### How each model was made"):].split("\n### ")[0].split("\n## ")[0]
    for model in ("m_int8.onnx", "m_uint8.onnx"):
        assert f"**{model}** on onnxruntime" in made
    assert all(len(line) <= 102 for line in made.splitlines() if line.startswith(("- ", "  ")))  # "- " or its indent, then 100
    losses = next((table for table in tables if table[0][:2] == ["Model", "Runtime"] and "Class" in table[0]), None)
    assert losses is None or all(row[1] == "onnxruntime" for row in losses[2:])
    # The terminal table: one speed-up column too, within 9.
    header = next(line for line in shown.stdout.splitlines() if "Runs as" in line)
    assert len(header.split()) <= 9 and "xORT" not in header and "img/s" not in header
    charts = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert sorted(charts) == ["report_accuracy_vs_speed_and_size.png", "report_per_class_delta.png"]
    assert all((tmp_path / chart).read_bytes().startswith(PNG_SIGNATURE) for chart in charts)
    # The docs' Benchmarks page and the README's table come from the same records, by a script.
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_page", Path(__file__).resolve().parent.parent / "tools" / "benchmarks_page.py")
    page_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page_tool)
    monkeypatch.chdir(tmp_path)  # the records name their models relative to the study's folder
    from ptq_cli.services.measure.report import run

    study = run(tmp_path / "results").report
    page = page_tool.render(study)
    assert page.startswith("# Benchmarks") and "| m_int8.onnx | onnxruntime | int8 |" in page
    table = page_tool.readme_table(study)
    readme = f"before\n{page_tool.BEGIN}\nold\n{page_tool.END}\nafter\n"
    rewritten = page_tool._with_readme_table(readme, table)
    assert rewritten.startswith("before\n") and rewritten.endswith(f"{page_tool.END}\nafter\n") and "old" not in rewritten
    assert "| m_uint8.onnx | onnxruntime uint8 |" in rewritten


def test_configuration_lines_keep_the_text_and_break_between_its_parts():
    configuration = ("QDQ a:int8 w:int8, per-tensor, minmax, 1000 samples, float stem, searched ranges, learned rounding, all CPUs (first-layer "
                     "pair rule; judged: image SQNR on held-out calibration images: all-layers 27.1, first-layer 31.5, first-layer on the "
                     "saturating path 31.5 dB)")
    lines = configuration_lines(configuration, width=70)
    assert all(len(line) <= 70 for line in lines)
    assert " ".join(lines) == configuration
    assert lines[0].startswith("QDQ a:int8 w:int8, per-tensor") and lines[0].endswith(",")
    assert without_evidence(configuration).endswith("all CPUs (first-layer pair rule)")


def test_the_pareto_front_keeps_the_points_no_other_beats_on_both():
    points = [(1.0, 87.2), (2.0, 87.1), (1.5, 87.0), (2.5, 86.9), (0.5, 87.2), (2.5, 86.5)]
    assert pareto_front(points) == [0, 1, 3]
