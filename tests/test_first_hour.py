"""A new user's first commands on their own model and a folder of photos without labels (issue 35): the FP32
model evaluates, and benchmark needs no images. In-process, synthetic model and photos."""

from __future__ import annotations

import json

import pytest
from synthetic import channel_mean_classifier, invoke, photo_folder

from ptq_cli import settings


@pytest.fixture
def newcomer(tmp_path, monkeypatch):
    """A model and unlabelled photos, and no study assets where ptq looks by default."""
    monkeypatch.setenv(settings.ASSETS_ENV, str(tmp_path / "no-assets"))
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    channel_mean_classifier(tmp_path / "yours.onnx", size=32, classes=19)
    photo_folder(tmp_path / "my_images", count=12, size=48)
    return tmp_path


def test_the_fp32_model_evaluates_on_photos_without_labels_as_the_reference(newcomer):
    result = invoke("evaluate", "--model", "yours.onnx", "--data", "my_images", "--results-dir", "res", "--json", cwd=newcomer)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert (record["dtype"], record["images"], record["accuracy"], record["fidelity"]) == ("fp32", 12, None, None)
    assert "FP32 reference" in invoke("evaluate", "--model", "yours.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer).stdout
    report = invoke("report", "--results-dir", "res", "--json", cwd=newcomer)  # its record reads back
    assert report.exit_code == 0, report.output
    assert [row["model"] for row in json.loads(report.stdout)["groups"][0]["rows"]] == ["yours.onnx"]


def test_a_quantized_model_without_labels_or_source_is_still_refused_in_one_line(newcomer):
    """The quantized model's own source is found from its metadata; with the source gone there is nothing to measure against."""
    photo_folder(newcomer / "other_photos", count=12, size=48, seed=5)
    made = invoke("quantize", "--model", "yours.onnx", "--data", "my_images", "--calibration-data", "other_photos", "--output", "q.onnx", cwd=newcomer)
    assert made.exit_code == 0, made.output
    assert invoke("evaluate", "--model", "q.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer).exit_code == 0
    (newcomer / "yours.onnx").unlink()
    result = invoke("evaluate", "--model", "q.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer)
    assert result.exit_code == 2 and "--against-fp32" in result.output


def test_benchmark_without_data_feeds_synthetic_pixels_and_says_so(newcomer):
    from ptq_cli.services.measure.benchmark import SYNTHETIC_INPUTS

    result = invoke("benchmark", "--model", "yours.onnx", "--runs", "3", "--results-dir", "res", "--json", cwd=newcomer)
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)
    assert record["inputs"] == SYNTHETIC_INPUTS and record["images_per_second"] > 0
    assert "synthetic pixels" in invoke("benchmark", "--model", "yours.onnx", "--runs", "3", "--results-dir", "res", cwd=newcomer).stdout
    too_many = invoke("benchmark", "--model", "yours.onnx", "--batch-size", str(10**9), "--results-dir", "res", cwd=newcomer)
    assert too_many.exit_code == 2 and "PTQ_MAX_CALL_ELEMENTS" in too_many.output  # a batch past the call limit: one line, no allocation
    given = json.loads(invoke("benchmark", "--model", "yours.onnx", "--data", "my_images", "--runs", "3", "--results-dir", "res", "--json",
                              cwd=newcomer).stdout)
    assert "my_images" in given[0]["inputs"] and given[0]["inputs"] != SYNTHETIC_INPUTS


def test_a_quantized_model_ptq_did_not_make_is_described_from_its_graph(newcomer):
    """Plain onnxruntime quantize_static (QDQ, uint8 activations, int8 per-channel weights): the report reads that
    off the graph, never "float"."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"image": np.random.default_rng(seed).random((1, 3, 32, 32), dtype=np.float32) * 255} for seed in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(newcomer / "yours.onnx"), str(newcomer / "theirs.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True)
    result = invoke("evaluate", "--model", "theirs.onnx", "--data", "my_images", "--against-fp32", "yours.onnx", "--results-dir", "res", "--json",
                    cwd=newcomer)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["quantization"]["made_by"] == "another tool"
    rows = {row["model"]: row for row in json.loads(invoke("report", "--results-dir", "res", "--json", cwd=newcomer).stdout)["groups"][0]["rows"]}
    assert rows["theirs.onnx"]["configuration"] == "QDQ a:uint8 w:int8, per-channel (made by another tool)"
