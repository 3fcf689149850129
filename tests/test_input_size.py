"""A model that leaves its input's height and width open (a dynamic-axes export, as Hugging Face Optimum writes
`pixel_values`: batch, channels, height and width all symbolic) is fed at the size --input-size gives, on every
command and backend; its layout is read off the graph; the models made from it declare that size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from synthetic import conv_classifier, image_folder, invoke, one_line_error

from ptq_cli import settings

OPEN_DIMS = ["batch_size", "num_channels", "height", "width"]


def open_input(path: Path, nhwc: bool = False) -> Path:
    """tests/synthetic's conv classifier with every input dimension symbolic; with `nhwc`, read through a
    Transpose NHWC -> NCHW first, as tf2onnx writes a Keras model."""
    model = onnx.load(str(path))
    if nhwc:
        model.graph.node.insert(0, helper.make_node("Transpose", ["pixels"], ["image"], perm=[0, 3, 1, 2]))
        model.graph.input[0].name = "pixels"
    for dim, name in zip(model.graph.input[0].type.tensor_type.shape.dim, OPEN_DIMS, strict=True):
        dim.Clear()
        dim.dim_param = name
    onnx.save(model, str(path))
    return path


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    open_input(conv_classifier(tmp_path / "open.onnx"))
    open_input(conv_classifier(tmp_path / "open_nhwc.onnx"), nhwc=True)
    conv_classifier(tmp_path / "fixed.onnx")
    image_folder(tmp_path / "photos", per_class=4, size=12)
    return tmp_path


def evaluated(project: Path, model: str, *options: str) -> dict:
    result = invoke("evaluate", "--model", model, "--data", "photos", "--json", *options, cwd=project)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def declared(path: Path) -> list:
    return [dim.dim_value or dim.dim_param for dim in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]


@pytest.mark.parametrize("model, layout", [("open.onnx", "NCHW 3x8x8"), ("open_nhwc.onnx", "NHWC 8x8x3")])
def test_an_open_height_and_width_is_asked_for_then_fed_at_that_size_in_the_layout_the_graph_reads(project, model, layout):
    one_line_error(invoke("evaluate", "--model", model, "--data", "photos", cwd=project), "--input-size")
    at_8 = evaluated(project, model, "--input-size", "8")
    assert at_8["model_input"].startswith(layout) and at_8["images"] == 12 and at_8["accuracy"] == 100.0
    assert evaluated(project, model, "--input-size", "16x12")["model_input"].startswith(layout.replace("8x8", "16x12"))


def test_models_made_from_it_declare_the_size_and_need_no_option_again(project):
    one_line_error(invoke("quantize", "--model", "open.onnx", "--data", "photos", cwd=project), "--input-size")
    made = invoke("quantize", "--model", "open.onnx", "--data", "photos", "--input-size", "8", "--no-portability-cost", cwd=project)
    assert made.exit_code == 0, made.output
    assert declared(project / "open_uint8_speed.onnx") == ["batch_size", 3, 8, 8]
    assert declared(project / "open.onnx") == OPEN_DIMS  # the user's file is never changed
    fp32 = evaluated(project, "open.onnx", "--input-size", "8")
    quantized = evaluated(project, "open_uint8_speed.onnx")  # its FP32 source measured again at the stored size
    assert quantized["model_input"].startswith("NCHW 3x8x8") and quantized["fidelity"]["top1_agreement"] == 100.0
    assert quantized["source_sha256"] == fp32["model_sha256"]
    converted = invoke("convert", "--onnx", "open.onnx", "--torch", "open.pt", "--data", "photos", "--input-size", "8", cwd=project)
    assert converted.exit_code == 0, converted.output
    assert evaluated(project, "open.pt")["model_input"].startswith("NCHW 3x8x8")


def test_openvino_reshapes_an_open_input_to_the_size_given(project):
    pytest.importorskip("openvino")
    one_line_error(invoke("evaluate", "--model", "open_nhwc.onnx", "--runtime", "openvino", "--data", "photos", cwd=project), "--input-size")
    on_openvino = evaluated(project, "open_nhwc.onnx", "--runtime", "openvino", "--input-size", "8")
    assert on_openvino["model_input"].startswith("NHWC 8x8x3") and on_openvino["accuracy"] == 100.0


def test_the_study_runs_on_it_with_the_size(project):
    run = invoke("run", "--model", "open.onnx", "--data", "photos", "--input-size", "8", "--no-pytorch", "--no-openvino", "--no-benchmark",
                 "--json", cwd=project)
    assert run.exit_code == 0, run.output
    calibration = np.load(project / "calibration" / "open_calib.npz")
    assert calibration["images"].shape[1:3] == (8, 8)  # drawn at the size given, not the photos' 12 x 12
    assert declared(project / "models" / "open_int8.onnx") == ["batch_size", 3, 8, 8]
    # Without a model, the size to draw the images at.
    drawn = invoke("calibrate", "--data", "photos", "--input-size", "6x5", "--output", "at_6x5.npz", cwd=project)
    assert drawn.exit_code == 0, drawn.output
    assert np.load(project / "at_6x5.npz")["images"].shape[1:3] == (6, 5)


@pytest.mark.parametrize("size, mentions", [("0", "--input-size"), ("8x8x8", "--input-size"), ("big", "--input-size"), ("16", "declares")])
def test_a_size_that_is_not_one_or_contradicts_the_model_is_refused(project, size, mentions):
    one_line_error(invoke("evaluate", "--model", "fixed.onnx", "--data", "photos", "--input-size", size, cwd=project), mentions)


def test_a_pruned_copy_keeps_the_open_input_and_the_size_it_was_given(project):
    # The synthetic Conv has no kernel_shape (optional in ONNX): the re-fit reads it from the weights.
    pruned = invoke("prune", "--model", "open.onnx", "--data", "photos", "--input-size", "8", "--sparsity", "0.3", "--output", "open_p30.onnx", cwd=project)
    assert pruned.exit_code == 0, pruned.output
    assert declared(project / "open_p30.onnx") == OPEN_DIMS  # a float model ptq wrote keeps its contract, and stores the size
    assert evaluated(project, "open_p30.onnx")["model_input"].startswith("NCHW 3x8x8")
