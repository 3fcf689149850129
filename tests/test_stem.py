"""The stem (the layers the image enters first) left in float where its 8-bit weights alone ruin the output:
measured per model and settings (services/make/stem.py), on every backend that can keep a layer in float."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from synthetic import cancelling_stem_classifier, grey_folder, invoke, one_line_error

from ptq_cli.backends import openvino
from ptq_cli.services.make import stem


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """ruined.onnx (a stem 8-bit weights ruin), plain.onnx (one they do not), grey/ and cal/ (unlabelled grey PNGs)."""
    root = tmp_path_factory.mktemp("stem")
    cancelling_stem_classifier(root / "ruined.onnx")
    cancelling_stem_classifier(root / "plain.onnx", cancelling=False)
    grey_folder(root / "grey", 24)
    grey_folder(root / "cal", 24, seed=1)
    return root


def _quantize(root: Path, model: str, output: str, *extra: str) -> dict:
    result = invoke("quantize", "--model", model, "--data", "grey", "--calibration-data", "cal", "--output", output, "--json", *extra, cwd=root)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _sqnr(root: Path, model: str, fp32: str = "ruined.onnx") -> float:
    result = invoke("evaluate", "--model", model, "--data", "grey", "--against-fp32", fp32,
                    "--results-dir", "results", "--json", cwd=root)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["fidelity"]["sqnr_db"]


def _stem_weight(path: Path) -> np.ndarray | None:
    """The stem Conv's weight as the QDQ model dequantizes it; None where it is a float initializer."""
    model = onnx.load(str(path))
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    conv = next(node for node in model.graph.node if node.op_type == "Conv")
    if conv.input[1] in initializers:
        return None
    dequantize = producers[conv.input[1]]
    codes, scale = initializers[dequantize.input[0]].astype(np.float64), initializers[dequantize.input[1]].astype(np.float64)
    zero = initializers[dequantize.input[2]].astype(np.float64) if len(dequantize.input) > 2 else 0.0
    if scale.ndim:  # per output channel
        scale, zero = scale.reshape(-1, 1, 1, 1), np.reshape(zero, (-1, 1, 1, 1))
    return (codes - zero) * scale


def test_a_stem_its_8_bit_weights_ruin_stays_float_and_the_model_is_closer_to_fp32(project):
    auto = _quantize(project, "ruined.onnx", "ruined_auto.onnx")
    assert auto["settings"]["stem"] == "float" and auto["settings"]["stem_sqnr_db"] < stem.STEM_FLOAT_BELOW_DB
    assert _stem_weight(project / "ruined_auto.onnx") is None  # the stem's weights are the float ones
    forced = _quantize(project, "ruined.onnx", "ruined_int8.onnx", "--stem", "int8")
    assert forced["settings"]["stem"] == "int8" and forced["settings"]["stem_sqnr_db"] is None  # named: not measured
    assert _stem_weight(project / "ruined_int8.onnx") is not None
    assert _sqnr(project, "ruined_auto.onnx") > _sqnr(project, "ruined_int8.onnx") + 10
    shown = invoke("quantize", "--model", "ruined.onnx", "--data", "grey", "--calibration-data", "cal", "--output", "ruined_shown.onnx", cwd=project, columns=80)
    assert shown.exit_code == 0 and "below 25 dB" in shown.stdout


def test_a_stem_8_bit_weights_barely_touch_stays_int8(project):
    auto = _quantize(project, "plain.onnx", "plain_auto.onnx")
    assert auto["settings"]["stem"] == "int8" and auto["settings"]["stem_sqnr_db"] >= stem.STEM_FLOAT_BELOW_DB
    assert _stem_weight(project / "plain_auto.onnx") is not None


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("cpus", ["all", "vnni", "uint8"], ids=["pair-rule", "full-range", "uint8-weights"])
def test_the_measured_stem_weights_are_onnxruntime_s_own(project, per_channel, cpus):
    """The measurement rounds the stem's weights as onnxruntime's quantizer does: pair rule, uint8 included."""
    output = f"plain_{cpus}_{per_channel}.onnx"
    types = ("--dtype", "uint8") if cpus == "uint8" else ("--dtype", "int8", "--cpus", cpus)
    _quantize(project, "plain.onnx", output, "--stem", "int8", *types, "--per-channel" if per_channel else "--per-tensor")
    dequantized = _stem_weight(project / output)
    weight = next(numpy_helper.to_array(init) for init in onnx.load(str(project / "plain.onnx")).graph.initializer if init.name == "stem_w")
    ours = stem.int8_weights(weight, "Conv", False, per_channel, cpus == "all", unsigned=cpus == "uint8")
    np.testing.assert_allclose(ours, dequantized, rtol=1e-6, atol=1e-9)
    plain = stem.int8_weights(weight, "Conv", False, per_channel, False, unsigned=cpus == "uint8")
    assert np.array_equal(ours, plain) == (cpus != "all")  # the pair rule moved the scales


@pytest.mark.parametrize("backend,suffix,method", [("pytorch", ".pt", ()), *[
    pytest.param("openvino", ".xml", method, marks=pytest.mark.skipif(not openvino.available(), reason="openvino not installed"))
    for method in ((), ("--method", "nncf"))]])
def test_every_backend_that_leaves_layers_float_keeps_the_stem_float(project, backend, suffix, method):
    auto = _quantize(project, "ruined.onnx", f"ruined_{backend}{suffix}", "--backend", backend, *method)
    assert auto["settings"]["stem"] == "float"
    _quantize(project, "ruined.onnx", f"ruined_{backend}_int8{suffix}", "--backend", backend, "--stem", "int8", *method)
    assert _sqnr(project, f"ruined_{backend}{suffix}") > _sqnr(project, f"ruined_{backend}_int8{suffix}") + 10


def test_litert_refuses_a_float_stem_in_one_line(project):
    result = invoke("quantize", "--model", "ruined.onnx", "--data", "grey", "--calibration-data", "cal", "--backend", "litert", "--stem", "float", cwd=project)
    assert result.exit_code == 2
    one_line_error(result, "--stem float: --backend litert quantizes every layer to int8")


def test_the_openvino_stem_is_the_first_weighted_layer_of_the_converted_model(project):
    if not openvino.available():
        pytest.skip("openvino not installed")
    converted = openvino._convert(onnx.load(str(project / "ruined.onnx")))
    assert openvino._stem_layers(converted) == openvino._weighted_layers(converted)[:1]


def test_the_stem_is_found_along_the_image_s_values_not_its_shape():
    """A flatten written as Reshape(x, Concat(Shape(image)[0], -1)): the classifier after it reads the input's
    shape, not its values, and is not part of the stem."""
    from onnx import helper

    from ptq_cli.quantize import overflow
    from ptq_cli.quantize.qdq import stem_nodes

    nodes = [helper.make_node("Conv", ["image", "w"], ["conv"], name="stem"),
             helper.make_node("GlobalAveragePool", ["conv"], ["pooled"], name="pool"),
             helper.make_node("Shape", ["image"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "zero"], ["batch"], name="batch", axis=0),
             helper.make_node("Concat", ["batch", "minus_one"], ["target"], name="target", axis=0),
             helper.make_node("Reshape", ["pooled", "target"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "g"], ["scores"], name="classifier")]
    graph = helper.make_graph(nodes, "shaped", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w"), numpy_helper.from_array(np.ones((4, 3), np.float32), "g"),
                               numpy_helper.from_array(np.array([0], np.int64), "zero"), numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert [node.name for node in overflow.first_layers(model)] == ["stem"]
    assert stem_nodes(model) == ["stem"]


def _two_convolutions(path: Path) -> Path:
    """image -> Conv A (3->4, its filters 0 and 1 equal) -> Relu -> Conv B (1x1: +1 on channel 0, -1 on channel
    1, which cancel, and weights of about 0.004 carrying the signal) -> global mean -> 4 scores. B's weights in
    8 bits per tensor lose the signal."""
    from onnx import helper

    rng = np.random.default_rng(3)
    first = rng.normal(0, 0.1, (4, 3, 3, 3)).astype(np.float32)
    first[1] = first[0]
    second = rng.uniform(0.002, 0.006, (4, 4, 1, 1)).astype(np.float32)
    second[:, 0], second[:, 1] = 1.0, -1.0
    nodes = [helper.make_node("Conv", ["image", "a_w"], ["a"], name="A", pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["a_relu"], name="A_relu"),
             helper.make_node("Conv", ["a_relu", "b_w"], ["b"], name="B"), helper.make_node("GlobalAveragePool", ["b"], ["pooled"], name="pool"),
             helper.make_node("Flatten", ["pooled"], ["scores"], name="flatten")]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 4])],
                              [numpy_helper.from_array(first, "a_w"), numpy_helper.from_array(second, "b_w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def test_a_float_layer_inside_the_graph_stays_float_when_onnxruntime_loads_it(project, tmp_path):
    """onnxruntime quantizes at load time the float weights of a Conv between a DequantizeLinear and a
    QuantizeLinear (per tensor, which loses B's signal): a layer ptq leaves in float must run in float."""
    import dataclasses

    import onnxruntime as ort

    from ptq_cli import inputs
    from ptq_cli.services import quant_settings
    from ptq_cli.services.make import quantize as quantize_service
    from ptq_cli.services.make.calibration import for_model

    model = _two_convolutions(tmp_path / "two.onnx")
    flags = inputs.PreprocessingFlags()
    source = quantize_service.load_source(model, flags)
    calibration = for_model(model, project / "grey", project / "cal", flags=flags)
    settings = dataclasses.replace(quant_settings.make_settings(stem="int8"), float_nodes=("B",))
    quantize_service.quantize_source(source, tmp_path / "q.onnx", quantize_service.with_calibration(settings, calibration), calibration)
    images = source.loaded.prepare(calibration.images[:8])

    def scores(level) -> np.ndarray:
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        return ort.InferenceSession(str(tmp_path / "q.onnx"), options, providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]

    as_written = scores(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)  # the QDQ graph computed as it reads: B in float
    loaded = scores(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert np.abs(loaded - as_written).max() <= 0.05 * np.abs(as_written).max()
