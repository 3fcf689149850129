"""#4: validation split, per-layer sensitivity and accuracy-budget tuning, on the real model and data."""

from __future__ import annotations

import collections
import hashlib
import json

import numpy as np
import onnx
import pytest
from conftest import CIFAR, cifar_split, ptq, ptq_ok, read_json, record_of

from ptq_cli.datasets import cifar10 as cifar
from ptq_cli.services.make.calibration import build_calibration_set
from ptq_cli.services.study.validation import build_validation_set

# ResNet8 (MLPerf Tiny): 9 convolutions (7 on the main path, 2 shortcut projections), 3 residual adds,
# the average pool, the dense layer (a Gemm once batch norm is folded) and the softmax.
RESNET8_LAYERS = {"Conv": 9, "Add": 3, "AveragePool": 1, "Gemm": 1, "Softmax": 1}


def test_validation_split_is_disjoint_from_calibration_and_holds_no_test_image(assets):
    calibration = build_calibration_set(cifar.Cifar10(CIFAR), 100, 42)
    validation = build_validation_set(calibration, cifar.Cifar10(CIFAR), samples_per_class=500)
    assert np.intersect1d(validation.indices, calibration.indices).size == 0
    assert np.bincount(validation.labels, minlength=10).tolist() == [500] * 10
    train = cifar_split("train")
    assert np.array_equal(validation.images, train.images[validation.indices].astype(np.float32))
    test_hashes = {hashlib.sha256(image.tobytes()).digest() for image in cifar_split("test").images}
    calibration_hashes = {hashlib.sha256(image.astype(np.uint8).tobytes()).digest() for image in calibration.images}
    validation_hashes = {hashlib.sha256(image.astype(np.uint8).tobytes()).digest() for image in validation.images}
    assert not validation_hashes & test_hashes
    assert not validation_hashes & calibration_hashes
    again = build_validation_set(calibration, cifar.Cifar10(CIFAR), samples_per_class=500)
    assert np.array_equal(again.indices, validation.indices)


@pytest.fixture()
def train_only_data(tmp_path):
    """CIFAR-10 without its test batch: tuning must work, since it never reads it."""
    data = tmp_path / "train-only"
    data.mkdir()
    for name in (*cifar.TRAIN_BATCHES, cifar.META_FILE):
        (data / name).symlink_to(CIFAR / name)
    return data


def test_tune_with_an_impossible_budget_keeps_the_best_and_never_reads_the_test_batch(fp32_study, train_only_data, tmp_path):
    output = tmp_path / "tuned.onnx"
    run = ptq_ok(
        "tune", "--dtype", "int8", "--max-drop", "0", "--method", "minmax", "--per-tensor", "--max-float-layers", "0", "--stem", "int8",
        "--validation-per-class", "100", "--data-dir", train_only_data, "--output", output, "--results-dir", tmp_path / "results",
        "--json", cwd=fp32_study,
    )
    result = json.loads(run.stdout)
    drops = [candidate["accuracy_drop"] for candidate in result["candidates"]]
    assert min(drops) > 0, drops  # the budget really is out of reach for per-tensor MinMax with an 8-bit stem
    assert result["met_budget"] is False and "no candidate is within 0 points" in result["reason"]
    assert result["chosen"]["validation_accuracy"] == max(c["validation_accuracy"] for c in result["candidates"])
    assert [c["stage"] for c in result["candidates"]] == ["method", "size", "size"]
    assert output.is_file() and read_json(next((tmp_path / "results" / "tuning").glob("tuned.onnx-??????.json")))["met_budget"] is False
    assert result["validation"]["images"] == 1000

    evaluated = ptq_ok("evaluate", "--model", output, "--results-dir", tmp_path / "results", "--json", cwd=fp32_study)
    quantization = json.loads(evaluated.stdout)["quantization"]
    assert quantization["validation"]["accuracy"] == result["chosen"]["validation_accuracy"]
    assert quantization["per_channel"] is False and quantization["method"] == "minmax"

    # The same tuning as text (its candidates read from the store the run above left): the user is told.
    text = ptq("tune", "--dtype", "int8", "--max-drop", "0", "--method", "minmax", "--per-tensor", "--max-float-layers", "0", "--stem", "int8",
               "--validation-per-class", "100", "--data-dir", train_only_data, "--output", tmp_path / "t.onnx", "--results-dir", tmp_path / "results",
               cwd=fp32_study)
    assert text.returncode == 0, text.stderr
    assert "No candidate met the budget" in text.stdout and "kept the most accurate" in text.stdout


def test_sensitivity_lists_every_quantizable_layer_worst_first(fp32_study, train_only_data, tmp_path):
    run = ptq_ok(
        "sensitivity", "--dtype", "int8", "--method", "minmax", "--validation-per-class", "50", "--data-dir", train_only_data,
        "--results-dir", tmp_path / "results", "--json", cwd=fp32_study,
    )
    result = json.loads(run.stdout)
    layers = result["layers"]
    assert collections.Counter(layer["op_type"] for layer in layers) == RESNET8_LAYERS
    assert len({layer["node"] for layer in layers}) == len(layers)
    # JSON has no infinity: an output unchanged by quantizing the layer (infinite SQNR) is null.
    sqnr = [np.inf if layer["output_sqnr_db"] is None else layer["output_sqnr_db"] for layer in layers]
    assert sqnr == sorted(sqnr)
    # Quantizing a convolution alone must cost something, however little.
    assert all(layer["output_sqnr_db"] is not None for layer in layers if layer["op_type"] == "Conv")
    assert read_json(tmp_path / "results" / "sensitivity" / "resnet8_int8.json")["layers"] == layers


def test_tune_pytorch_path_writes_torchscript_with_its_validation_score(fp32_study, train_only_data, tmp_path):
    output = tmp_path / "tuned.pt"
    run = ptq_ok(
        "tune", "--backend", "pytorch", "--max-drop", "5", "--method", "histogram", "--per-channel", "--validation-per-class", "100",
        "--data-dir", train_only_data, "--output", output, "--results-dir", tmp_path / "results", "--json", cwd=fp32_study,
    )
    result = json.loads(run.stdout)
    assert {c["settings"]["backend"] for c in result["candidates"]} == {"pytorch"}
    assert [c["stage"] for c in result["candidates"]] == ["method", "size", "size"]  # no float-layer stage in FX
    assert result["met_budget"] is True
    # within the budget, the candidate closest to FP32 is kept
    eligible = [c for c in result["candidates"] if c["within_budget"]]
    assert result["chosen"]["output_sqnr_db"] == max(c["output_sqnr_db"] for c in eligible)
    evaluated = json.loads(ptq_ok("evaluate", "--model", output, "--results-dir", tmp_path / "results", "--json", cwd=fp32_study).stdout)
    assert evaluated["runtime"] == "pytorch" and evaluated["dtype"] == "int8"
    assert evaluated["quantization"]["validation"]["accuracy"] == result["chosen"]["validation_accuracy"]


def test_tune_on_two_ray_workers_chooses_and_writes_what_it_does_in_one_process(fp32_study, train_only_data, tmp_path):
    """Issue 38's target: ResNet8 tuned with --workers 2 gives the same choice and byte-identical model as in-process
    (MinMax, per-channel; two calibration sizes. The float-layer stage on Ray, its layers ranked there, is
    test_workers.py's, on a synthetic model, with tune's default methods)."""
    pytest.importorskip("ray")
    tune = ("tune", "--max-drop", "0.05", "--method", "minmax", "--per-channel", "--max-float-layers", "0",
            "--validation-per-class", "20", "--data-dir", train_only_data, "--json")
    runs = {}
    for name, extra in (("here", ()), ("ray", ("--workers", "2"))):
        output = tmp_path / f"{name}.onnx"
        result = json.loads(ptq_ok(*tune, *extra, "--output", output, "--results-dir", tmp_path / name, cwd=fp32_study).stdout)
        runs[name] = (result["chosen"]["settings"], [(c["stage"], c["settings"], c["validation_accuracy"], c["output_sqnr_db"], c["size_bytes"])
                                                       for c in result["candidates"]], output.read_bytes())
    assert len(runs["here"][1]) >= 2
    # Part by part, so that a failure shows which differs: the choice, the candidates' scores, then the bytes.
    assert runs["ray"][0] == runs["here"][0], "chosen settings"
    assert runs["ray"][1] == runs["here"][1], "candidates"
    ray_model, here_model = (onnx.load_from_string(runs[name][2]) for name in ("ray", "here"))
    assert {p.key: p.value for p in ray_model.metadata_props} == {p.key: p.value for p in here_model.metadata_props}
    assert runs["ray"][2] == runs["here"][2], "model bytes"


def test_resnet8_evaluated_in_shards_on_two_ray_workers_writes_the_record_of_one_process(pipeline, tmp_path):
    """Issue 38, sharded evaluation: the 10,000 test images in shards on two workers give the record `ptq run` wrote
    in one process: counts, confusion matrix and fidelity sums."""
    pytest.importorskip("ray")
    here = record_of(pipeline / "results", "resnet8_int8.onnx")
    there = json.loads(ptq_ok("evaluate", "--model", "models/resnet8_int8.onnx", "--results-dir", tmp_path / "there", "--workers", "2", "--json",
                              cwd=pipeline).stdout)
    assert here["images"] == 10_000
    for key in ("correct", "accuracy", "confusion_matrix", "per_class_accuracy", "fidelity", "int8_path", "model_sha256"):
        assert there[key] == here[key], key
