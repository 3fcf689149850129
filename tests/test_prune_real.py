"""`ptq prune`, `ptq sweep` and `ptq report --plot` on the real ResNet8."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from conftest import assert_clean_failure, ptq, ptq_ok, read_json
from onnx import numpy_helper

from ptq_cli.services.make.prune import weight_layers

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _initializers(path) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in onnx.load(str(path)).graph.initializer}


def _weights(path) -> list[str]:
    return [weight for _, weight in weight_layers(onnx.load(str(path)))]


@pytest.mark.parametrize("scope, refit", [("global", "--reconstruct"), ("layer", "--no-reconstruct")])
def test_prune_reaches_the_sparsity_and_touches_only_weights(tmp_path, pipeline, scope, refit):
    source = pipeline / "models" / "resnet8.onnx"
    run = ptq_ok("prune", "--model", source, "--sparsity", "0.5", "--scope", scope, "--exclude-first", refit, "--output", "p.onnx", "--json",
                 cwd=pipeline if refit == "--reconstruct" else tmp_path)  # the study directory has the calibration set
    if refit == "--reconstruct":
        (pipeline / "p.onnx").rename(tmp_path / "p.onnx")
    result = json.loads(run.stdout)
    before, after = _initializers(source), _initializers(tmp_path / "p.onnx")
    weights = _weights(source)
    assert len(weights) == 10  # 9 Conv + the classifier MatMul
    first = weights[0]
    assert np.array_equal(after[first], before[first])  # --exclude-first
    pruned = [name for name in weights if name != first]
    zeros = sum(int(np.sum(after[name] == 0)) for name in pruned)
    total = sum(after[name].size for name in pruned)
    assert abs(zeros / total - 0.5) <= 0.01
    assert abs(result["pruned_sparsity"] - zeros / total) < 1e-9
    if scope == "layer":
        for name in pruned:
            assert abs(np.mean(after[name] == 0) - 0.5) <= 0.01, name
    removed = np.concatenate([before[name][after[name] == 0] for name in pruned])
    kept = np.concatenate([before[name][after[name] != 0] for name in pruned])
    if scope == "global":  # only the smallest magnitudes go, across all pruned layers
        assert np.abs(removed).max() <= np.abs(kept).min()
    for name in pruned:
        if scope == "layer":  # ... or within each layer
            assert np.abs(before[name][after[name] == 0]).max() <= np.abs(before[name][after[name] != 0]).min()
        kept_after, kept_before = after[name][after[name] != 0], before[name][after[name] != 0]
        if refit == "--no-reconstruct":
            assert np.array_equal(kept_after, kept_before), name  # magnitude pruning alone keeps the rest as it was
        else:
            assert not np.array_equal(kept_after, kept_before), name  # re-fitted on the calibration images
    for name in set(before) - set(weights):  # biases, batch-norm scales and shifts, shapes: untouched
        assert np.array_equal(after[name], before[name]), name
    onnx.checker.check_model(onnx.load(str(tmp_path / "p.onnx")))


def test_prune_text_output_names_every_layer_and_the_sparsity_reached(tmp_path, resnet8_onnx):
    run = ptq_ok("prune", "--model", resnet8_onnx, "--sparsity", "0.3", "--scope", "layer", "--no-reconstruct",
                 "--exclude-classifier", "--output", "p.onnx", cwd=tmp_path)
    assert "Requested 30% (layer); achieved 30.00% over the pruned layers" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if " Conv " in line or " MatMul " in line]
    assert [row[1] for row in rows] == ["Conv"] * 9 + ["MatMul"]
    assert all(abs(float(row[4].rstrip("%")) - 30) <= 1 for row in rows[:9])  # each convolution at 30% (layer scope)
    assert rows[-1][4:] == ["0.0%", "(kept)"]  # --exclude-classifier


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1"])
def test_sparsity_outside_zero_one_is_refused(tmp_path, resnet8_onnx, value):
    run = ptq("prune", "--model", resnet8_onnx, "--sparsity", value, "--output", "p.onnx", cwd=tmp_path)
    assert_clean_failure(run, 2, "--sparsity")
    run = ptq("sweep", "--model", resnet8_onnx, "--sparsity", f"0,{value}", cwd=tmp_path)
    assert_clean_failure(run, 2, "--sparsity")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def swept(pipeline):
    """`ptq sweep --sparsity 0,0.3,0.5 --dtype int8 --method minmax` in the study directory, then `ptq report --plot`
    (MinMax: the sweep's own work, without judging each point's activation ranges again)."""
    run = ptq_ok("sweep", "--sparsity", "0,0.3,0.5", "--dtype", "int8", "--method", "minmax", "--json", cwd=pipeline)
    return json.loads(run.stdout)


def test_sweep_30_percent_then_int8_stays_within_half_a_point(swept, pipeline):
    points = {point["sparsity"]: point for point in swept["points"]}
    assert sorted(points) == [0.0, 0.3, 0.5]
    assert points[0.3]["accuracy"] >= 87.19 - 0.5
    assert abs(points[0.3]["achieved_sparsity"] - 0.3) <= 0.01
    assert points[0.0]["fp32_accuracy"] == 87.19  # sparsity 0 is the unpruned model
    # zeros compress: the more pruned, the smaller the gzipped int8 file, at the same file size
    assert points[0.5]["compressed_bytes"] < points[0.3]["compressed_bytes"] < points[0.0]["compressed_bytes"]
    assert read_json(pipeline / "results" / "sweep" / "resnet8_int8_global.json")["points"] == swept["points"]
    quantized = pipeline / "models" / "sweep" / "resnet8_pruned30_int8.onnx"
    metadata = {prop.key: prop.value for prop in onnx.load(str(quantized)).metadata_props}
    assert json.loads(metadata["ptq.pruning"])["sparsity"] == 0.3  # the quantized model still says it was pruned


def test_report_plot_writes_png_charts_linked_from_the_markdown(swept, pipeline):
    run = ptq_ok("report", "--plot", cwd=pipeline)
    markdown = (pipeline / "reports" / "QUANTIZATION_ANALYSIS.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert sorted(links) == ["QUANTIZATION_ANALYSIS_accuracy_vs_speed_and_size.png", "QUANTIZATION_ANALYSIS_per_class_delta.png",
                             "QUANTIZATION_ANALYSIS_sweep_accuracy_vs_compressed_size.png"]
    for link in links:
        data = (pipeline / "reports" / link).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, link
    assert "Prune (global magnitude, kept weights re-fitted) then quantize" in markdown
    assert "| 30% |" in markdown
    assert "charts:" in run.stdout
