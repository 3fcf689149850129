"""The whole study on the real ResNet8 and the real CIFAR-10 test set."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import PIPELINE_MODELS, ptq_ok, read_json, record_of

from ptq_cli.quantize.policy import chosen_method

# Per-class top-1 of the FP32 model on test_batch, airplane ... truck (shared/assets/README.md).
FP32_PER_CLASS = [87.7, 95.4, 83.9, 73.4, 87.2, 74.2, 94.6, 90.5, 92.4, 92.6]


def test_converted_fp32_onnx_scores_exactly_the_baseline(pipeline):
    record = record_of(pipeline / "results", "resnet8.onnx")
    assert record["runtime"] == "onnxruntime" and record["dtype"] == "fp32"
    assert record["images"] == 10000 and record["correct"] == 8719
    assert record["accuracy"] == 87.19 and record["dataset_format"] == "cifar10" and record["split"] == "test"
    assert record["per_class_accuracy"] == FP32_PER_CLASS
    assert sum(map(sum, record["confusion_matrix"])) == 10000
    assert record["class_names"][0] == "airplane" and record["class_names"][-1] == "truck"


def test_convert_reports_its_check_as_json(pipeline):
    run = ptq_ok("convert", "--output", "models/again.onnx", "--check-images", "200", "--json", cwd=pipeline)
    result = __import__("json").loads(run.stdout)
    assert result["check"]["images"] == 200
    assert result["check"]["max_abs_diff"] <= 1e-4
    assert result["check"]["top1_agreement"] == 1.0
    assert (pipeline / "models" / "again.onnx").stat().st_size == result["output_size_bytes"]
    (pipeline / "models" / "again.onnx").unlink()


def test_quantized_models_are_accurate_and_small(pipeline):
    fp32 = record_of(pipeline / "results", "resnet8.onnx")
    for dtype in ("int8", "uint8"):
        record = record_of(pipeline / "results", f"resnet8_{dtype}.onnx")
        assert record["dtype"] == dtype
        assert record["accuracy"] > 85.0, record["accuracy"]
        assert record["model_size_bytes"] < 0.45 * fp32["model_size_bytes"]
        settings = record["quantization"]
        assert (settings["dtype"], settings["weight_dtype"]) == (dtype, dtype)
        # --method auto: the activation ranges with the best output on held-out calibration images
        kept = chosen_method(tuple(tuple(score) for score in settings["method_sqnr_db"]))
        assert (settings["method"], settings["percentile"]) == kept and settings["per_channel"] is False
        assert settings["calibration_samples"] == 1000 and settings["calibration_seed"] == 42
        assert record["model_size_bytes"] == (pipeline / "models" / f"resnet8_{dtype}.onnx").stat().st_size


def test_quantize_prints_method_samples_and_output(pipeline):
    run = ptq_ok("quantize", "--dtype", "uint8", "--method", "percentile", "--per-channel", "--weight-dtype", "int8",
                 "--output", "models/extra.onnx", cwd=pipeline)
    assert "percentile 99.999" in run.stdout
    assert "1000 (seed 42" in run.stdout
    assert "models/extra.onnx" in run.stdout and "KB" in run.stdout
    assert "uint8 / int8" in run.stdout and "per-channel" in run.stdout
    (pipeline / "models" / "extra.onnx").unlink()


def test_evaluate_per_class_shows_delta_against_fp32(pipeline):
    run = ptq_ok("evaluate", "--model", "models/resnet8_uint8.onnx", "--per-class", "--results-dir", "results", cwd=pipeline)
    record = record_of(pipeline / "results", "resnet8_uint8.onnx")
    assert "FP32 (resnet8.onnx)" in run.stdout
    # The bird row shows its accuracy, the FP32 one and the signed delta between them.
    bird = record["per_class_accuracy"][2]
    assert re.search(rf"bird\s+│\s+1,000\s+│\s+{bird:.1f}%\s+│\s+83.9%\s+│\s+{re.escape(f'{bird - 83.9:+.2f}')}", run.stdout), run.stdout


def _markdown_rows(text: str, columns: int) -> dict[tuple[str, str], list[str]]:
    """Table rows of `columns` cells by (model, runtime): the ONNX FP32 model has a row on onnxruntime and one on OpenVINO."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| resnet8") and len(cells) == columns:
            rows[(cells[0], cells[1].split()[0])] = cells
    return rows


def test_report_markdown_has_one_row_per_record_with_its_numbers(pipeline):
    ptq_ok("report", "--markdown", "out/analysis.md", cwd=pipeline)
    text = (pipeline / "out" / "analysis.md").read_text()
    main, speeds = text.split("### Speed")[0], text.split("### Speed")[1].split("###")[0]
    rows, speed_rows = _markdown_rows(main, 9), _markdown_rows(speeds, 6)
    every = list(map(read_json, (pipeline / "results").glob("*@*.json")))
    # One row per model and runtime: an 8-bit model's figures are its exact path's, its saturating path's beside them.
    by_path = {(Path(record["model_path"]).name, record["runtime"], record.get("int8_path")): record for record in every if not record.get("label")}
    records = {(name, runtime): by_path.get((name, runtime, "exact"), record) for (name, runtime, _), record in by_path.items()}
    # The MLPerf Tiny reference, run with LiteRT from the assets, reproduces MLCommons' 86.97% and is named as such.
    (reference,) = [record for record in every if record.get("label") and record["runtime"] == "litert"]
    assert (reference["label"], reference["runtime"], reference["dtype"], reference["correct"]) == ("MLPerf Tiny reference int8", "litert", "int8", 8697)
    assert "| MLPerf Tiny reference int8 (pretrainedResnet_quant.tflite) | litert | int8 |" in text
    assert set(rows) == set(records) == set(speed_rows) and {name for name, _ in records} == set(PIPELINE_MODELS)
    fp32_size = {runtime: record["model_size_bytes"] for (name, runtime), record in records.items() if record["dtype"] == "fp32"}
    for key, record in records.items():
        model, runtime, dtype, accuracy, delta, agreement, no_vnni, size, _speedup = rows[key]
        speed = speed_rows[key][2]
        # Fidelity to the FP32 source, measured wherever the model names its source file and that file is unchanged.
        fidelity = record.get("fidelity")
        interval = f" ({fidelity['top1_agreement_low']:.1f}-{fidelity['top1_agreement_high']:.1f})" if fidelity else ""
        assert agreement == ("-" if fidelity is None else f"{fidelity['top1_agreement']:.2f}%{interval} / {fidelity['top5_containment']:.2f}%"), agreement
        saturating = by_path.get((key[0], key[1], "saturating"))
        if record["dtype"] == "fp32" and record["runtime"] in ("onnxruntime", "pytorch"):
            assert no_vnni == "="
        elif saturating is not None:
            assert no_vnni.startswith(f"{saturating['accuracy']:.2f}%") or no_vnni == "=", no_vnni
        else:
            assert no_vnni == "-"
        assert f"**{model}** on {runtime}" in text and f"measured on {record['cpu']['model']}" in text
        # OpenVINO rows name their precision hint beside the runtime: a bf16 figure is never plain FP32.
        assert (runtime, dtype) == (record["runtime"] + (f" {record['precision']}" if record.get("precision") else ""), record["dtype"])
        assert accuracy == f"{record['accuracy']:.2f}%"
        # Every model made from another is compared with its measured source (87.19%); the Keras export is the reference.
        # With McNemar's p of the images it and FP32 alone classify right, where its record measured them.
        p_value = "" if fidelity is None else f" (p = {fidelity['accuracy_delta_p_value']:.2f})"
        assert delta == ("-" if record["source_sha256"] is None else f"{record['accuracy'] - 87.19:+.2f}{p_value}"), delta
        # No benchmark in this directory: the speed is the evaluation run on this CPU's own kernels (on a CPU without VNNI
        # the exact path's record is onnxruntime's exact-kernel switch, and the saturating one is native).
        native = [run for run in (record, saturating) if run is not None and run.get("int8_basis", "") in ("", "native")]
        assert speed == f"{(native or [record])[0]['images_per_second']:,.0f} (eval)"
        kilobytes = f"{record['model_size_bytes'] / 1024:,.1f} KB"
        if record["dtype"] != "fp32" and record["runtime"] in fp32_size:  # the reduction as stored in the report
            assert size == f"{kilobytes} ({-round(1 - record['model_size_bytes'] / fp32_size[record['runtime']], 4):+.1%})"
        else:
            assert size == kilobytes  # TFLite: no FP32 .tflite of the same runtime to compare with


def test_report_bare_markdown_flag_writes_the_default_file(pipeline):
    run = ptq_ok("report", "--markdown", cwd=pipeline)
    path = pipeline / "reports" / "QUANTIZATION_ANALYSIS.md"
    assert path.is_file() and "reports/QUANTIZATION_ANALYSIS.md" in run.stdout
    assert "## Recommendation" in path.read_text()
    assert "Best accuracy:" in run.stdout and "Classes that lose the most" in run.stdout


def test_report_json_matches_records(pipeline):
    report = __import__("json").loads(ptq_ok("report", "--json", cwd=pipeline).stdout)
    (study,) = report["groups"]  # one dataset evaluated: one table
    by_model = {row["model"]: row for row in study["rows"]}
    uint8 = record_of(pipeline / "results", "resnet8_uint8.onnx")
    assert by_model["resnet8_uint8.onnx"]["accuracy"] == uint8["accuracy"]
    assert by_model["resnet8.onnx"]["size_reduction"] is None
    assert study["recommendation"]["best_accuracy"]["dtype"] in ("int8", "uint8")
