"""An average pool over the whole map (one value per channel, as Keras' AveragePooling2D before a classifier exports)
stays in float on the onnxruntime route (and so OpenVINO's) and on PyTorch's: both libraries give a pool's output its
input's scale, which leaves the pooled features a few codes of the maps' range; the layer reading them then quantizes
them on their own range, as after a GlobalAveragePool."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import helper, numpy_helper
from synthetic import invoke, png_images, scores_before_softmax, smooth_photos, two_conv_classifier

from ptq_cli.metrics import sqnr_db
from ptq_cli.transforms.graph import whole_map_average_pools


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pools")
    two_conv_classifier(root / "global.onnx")
    two_conv_classifier(root / "average.onnx", pool="AveragePool")
    smooth_photos(root / "cal", 120, seed=1)
    smooth_photos(root / "test", 16, seed=2)
    return root


def _quantize(root: Path, model: str, output: str, *extra: str) -> dict:
    result = invoke("quantize", "--model", model, "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                    "--method", "minmax", "--output", output, "--json", *extra, cwd=root)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _maps_and_features_scales(path: Path) -> tuple[float, float]:
    """(the scale of the maps the AveragePool reads, the scale the classifier reads the pooled features at)."""
    model = onnx.load(str(path))
    producers = {output: node for node in model.graph.node for output in node.output}
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    pool = next(node for node in model.graph.node if node.op_type == "AveragePool")
    classifier = next(node for node in model.graph.node if node.op_type == "Gemm")
    maps, features = producers[pool.input[0]], producers[classifier.input[0]]
    assert maps.op_type == features.op_type == "DequantizeLinear"
    return float(initializers[maps.input[1]]), float(initializers[features.input[1]])


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_onnxruntime_quantizes_an_average_pool_over_the_whole_map_as_a_global_average_pool(project, dtype):
    global_pool = _quantize(project, "global.onnx", f"global_{dtype}.onnx", "--dtype", dtype, "--rounding", "nearest")
    average = _quantize(project, "average.onnx", f"average_{dtype}.onnx", "--dtype", dtype, "--rounding", "nearest")
    assert any(note.startswith("average pool") for note in average["notes"])
    assert not any(note.startswith("average pool") for note in global_pool["notes"])
    maps_scale, features_scale = _maps_and_features_scales(project / f"average_{dtype}.onnx")
    assert features_scale < 0.8 * maps_scale  # the mean of a map spans less than the map
    images = png_images(project / "test")
    averaged, global_scores = (scores_before_softmax(onnx.load(str(project / name)), images) for name in (f"average_{dtype}.onnx", f"global_{dtype}.onnx"))
    assert sqnr_db(global_scores, averaged) > 60  # the same scores


def test_pytorch_leaves_whole_map_averages_in_float_closer_to_fp32_than_torch_ao_s_shared_scale(project, monkeypatch):
    """torch.ao gives an average pool's output, and a mean's (onnx2torch's GlobalAveragePool), its input's scale."""
    import onnxruntime as ort

    from ptq_cli.backends import pytorch
    from ptq_cli.services.models import load_model

    images = png_images(project / "test")
    fp32 = ort.InferenceSession(str(project / "global.onnx"), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    measured = {}
    for name in ("global", "average"):
        result = _quantize(project, f"{name}.onnx", f"{name}.pt", "--backend", "pytorch")
        assert any(note.startswith("average pool") for note in result["notes"])
        measured[name] = sqnr_db(fp32, load_model(project / f"{name}.pt").predict(images))
    monkeypatch.setattr(pytorch, "whole_map_pools", lambda _module, _example: [])
    _quantize(project, "average.onnx", "shared.pt", "--backend", "pytorch")
    shared = sqnr_db(fp32, load_model(project / "shared.pt").predict(images))
    assert measured["average"] == pytest.approx(measured["global"], abs=0.5)
    assert measured["average"] > shared + 2  # shared: torch.ao's own, the features at the maps' scale


def test_only_average_pools_that_leave_one_value_per_channel_are_whole_map_pools():
    nodes = [helper.make_node("AveragePool", ["x"], ["smoothed"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="smoothing"),
             helper.make_node("AveragePool", ["smoothed"], ["strided"], kernel_shape=[2, 2], strides=[2, 2], name="halving"),
             helper.make_node("AveragePool", ["strided"], ["pooled"], kernel_shape=[3, 3], strides=[3, 3], name="whole"),
             helper.make_node("MaxPool", ["strided"], ["maxed"], kernel_shape=[3, 3], name="max")]
    graph = helper.make_graph(nodes, "pools", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 6, 6])],
                              [helper.make_tensor_value_info("pooled", onnx.TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("maxed", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    assert [node.name for node in whole_map_average_pools(model)] == ["whole"]


def test_only_torch_averages_that_leave_one_value_per_channel_are_whole_map_pools():
    import torch

    from ptq_cli.backends.pytorch import whole_map_pools

    layers = torch.nn.Sequential(torch.nn.AvgPool2d(3, stride=1, padding=1), torch.nn.AvgPool2d(2), torch.nn.MaxPool2d(3, stride=1, padding=1),
                                 torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    assert whole_map_pools(torch.fx.symbolic_trace(layers), torch.zeros(2, 4, 6, 6)) == ["3"]


def test_pytorch_says_how_close_its_model_is_to_fp32_on_calibration_images(project):
    """The figure in the note is the saved model's own against FP32's: measured again here from the files, on every
    fourth calibration image (a model torch.ao wrecks is said at once, not found at evaluate)."""
    import re

    import onnxruntime as ort

    from ptq_cli.services.models import load_model

    result = _quantize(project, "global.onnx", "said.pt", "--backend", "pytorch", "--calibration-size", "120")
    said = [note for note in result["notes"] if note.startswith("output SQNR against FP32")]
    assert len(said) == 1
    count, figure = re.fullmatch(r"output SQNR against FP32 on (\d+) calibration images: (-?[\d.]+) dB", said[0]).groups()
    images = png_images(project / "cal")
    assert len(images) == 120 and int(count) == 30
    assert result["settings"]["calibration_samples"] == 120
    fp32 = ort.InferenceSession(str(project / "global.onnx"), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    ours = load_model(project / "said.pt").predict(images)
    assert 10 < float(figure) < 80
    assert float(figure) == pytest.approx(sqnr_db(fp32[::4], ours[::4]), abs=0.5)
