"""Learned rounding and bias correction (quantize/rounding.py): its pieces against references (onnxruntime's
Conv, nearest rounding, the pair rule) and `ptq quantize --rounding` end to end on a small convolutional model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from PIL import Image
from synthetic import invoke, one_line_error, quantized_json, two_conv_classifier, two_conv_photos_project

from ptq_cli.quantize import overflow, rounding


def _conv_layer(attributes: dict) -> rounding.Layer:
    return rounding.Layer("conv", "Conv", "x", "x", "w", "s", None, None, None, attributes, helper.make_node("Conv", ["x", "w"], ["y"], **attributes))


def _ort_conv(x: np.ndarray, weight: np.ndarray, attributes: dict) -> np.ndarray:
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attributes)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("attributes, channels, groups", [
    ({"pads": [1, 1, 1, 1]}, 4, 1),
    ({"strides": [2, 2], "pads": [0, 1, 1, 0]}, 4, 1),
    ({"dilations": [2, 2], "pads": [2, 2, 2, 2]}, 4, 1),
    ({"group": 6, "pads": [1, 1, 1, 1], "strides": [2, 2]}, 6, 6),  # depthwise
    ({"group": 2, "auto_pad": "SAME_UPPER", "strides": [2, 2]}, 4, 2),
    ({"auto_pad": "SAME_LOWER"}, 4, 1),
    ({"auto_pad": "VALID", "strides": [3, 2]}, 4, 1),
], ids=["padded", "strided-asymmetric-pads", "dilated", "depthwise", "grouped-same-upper", "same-lower", "valid"])
def test_unfolded_rows_times_the_weight_matrix_are_onnxruntime_s_conv(attributes, channels, groups):
    """What the statistics are taken over: the rows each output sums, in the weight's column order."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, channels, 9, 11)).astype(np.float32)
    weight = rng.standard_normal((6, channels // groups, 3, 3)).astype(np.float32)
    expected = _ort_conv(x, weight, attributes)
    layer = _conv_layer(attributes)
    rows = rounding.unfold(layer, x, weight.shape)  # positions x groups x inputs per group
    matrix = rounding.weight_matrix(layer, weight)  # groups x outputs per group x inputs per group
    got = np.einsum("rgi,goi->rgo", rows, matrix).reshape(2, expected.shape[2], expected.shape[3], 6).transpose(0, 3, 1, 2)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert np.array_equal(rounding.from_matrix(layer, matrix, weight.shape), weight)
    # A sample of the rows, gathered without unfolding the others, is the same rows as the unfolded ones masked.
    keep = rng.random(rounding.row_count(layer, x, weight.shape)) < 0.3
    assert rounding.row_count(layer, x, weight.shape) == len(rows) and 0 < keep.sum() < len(rows)
    assert np.array_equal(rounding.unfold(layer, x, weight.shape, keep), rows[keep])


def _output_error(weights, codes, scale, second) -> float:
    difference = weights - codes * scale[:, :, None]
    return float(np.einsum("gri,gij,grj->", difference, second, difference))


def test_gptq_is_nearest_rounding_when_the_inputs_are_uncorrelated():
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((1, 8, 20))
    scale = np.abs(weights).max(axis=2) / 127
    second = np.diag(rng.uniform(0.5, 2.0, 20))[None]  # no input correlated with another: nothing to feed back
    codes = rounding.gptq(weights, second, scale, np.zeros_like(scale), -127, 127)
    assert np.array_equal(codes, rounding.nearest(weights, scale, np.zeros_like(scale), -127, 127))


@pytest.mark.parametrize("groups, rows, columns", [(1, 16, 40), (12, 1, 9), (1, 4, 300)], ids=["dense", "depthwise", "wide-blocks"])
def test_gptq_lowers_the_output_error_of_correlated_inputs(groups, rows, columns):
    """E||(W - Q) x||^2 over inputs that move together (neighbouring pixels do) falls well below nearest
    rounding's; the codes stay on the grid and within one code of the weight's own over most weights."""
    rng = np.random.default_rng(2)
    mixing = rng.standard_normal((groups, columns, columns)) * 0.3 + np.eye(columns)[None] + 1.0
    samples = np.einsum("ngi,gij->ngj", rng.standard_normal((4000, groups, columns)), mixing)
    second = np.einsum("ngi,ngj->gij", samples, samples) / len(samples)
    weights = rng.standard_normal((groups, rows, columns))
    scale = np.abs(weights).max(axis=2) / 127
    zero = np.zeros_like(scale)
    learned = rounding.gptq(weights, second, scale, zero, -127, 127)
    near = rounding.nearest(weights, scale, zero, -127, 127)
    assert np.array_equal(learned, np.rint(learned)) and learned.min() >= -127 and learned.max() <= 127
    assert _output_error(weights, learned, scale, second) < 0.6 * _output_error(weights, near, scale, second)
    assert np.mean(np.abs(learned - near) <= 1) > 0.95


def test_learned_codes_that_break_the_pair_rule_step_back_only_where_they_must():
    near = np.array([[[64, 63, -10, 5], [100, 20, -60, -60]]], dtype=np.float64)  # channel 0 follows the rule, channel 1 does not
    learned = np.array([[[65, 64, -11, 6], [101, 21, -61, -60]]], dtype=np.float64)  # moved off nearest
    kept, stepped = rounding.keep_pair_rule(learned.copy(), near, depthwise=False)
    assert overflow.is_pair_safe(kept[0, :1]) and kept[0, 0, :2].sum() == 128  # back to the limit, not to nearest
    assert stepped == 1 and np.array_equal(kept[0, 0, 2:], learned[0, 0, 2:])  # the other learned codes stay
    assert np.array_equal(kept[0, 1], learned[0, 1])  # never followed the rule: nothing to keep
    untouched, none = rounding.keep_pair_rule(learned.copy(), near, depthwise=True)
    assert none == 0 and np.array_equal(untouched, learned)


@pytest.mark.parametrize("seed", range(5))
def test_stepping_back_always_ends_pair_safe_and_moves_the_fewest_codes(seed):
    """Random channels at the pair limit, learned codes up to 2 codes off nearest: every channel ends pair-safe."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((1, 32, 27))
    scales = overflow.pair_safe_scales(weights[0])
    near = overflow.quantize_rows(weights[0], scales)[None]
    learned = np.clip(near + rng.integers(-2, 3, near.shape), -127, 127)
    kept, stepped = rounding.keep_pair_rule(learned.copy(), near, depthwise=False)
    assert overflow.is_pair_safe(kept[0])
    assert stepped == int(np.abs(kept - learned).sum()) and np.all(np.abs(kept - learned) <= 2)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return two_conv_photos_project(tmp_path_factory.mktemp("rounding"))


_quantize = quantized_json


def _logits(path: Path, images: np.ndarray) -> np.ndarray:
    """The scores before the Softmax (what rounding is judged on), as onnxruntime computes them."""
    model = onnx.load(str(path))
    producers = {output: node for node in model.graph.node for output in node.output}
    name = next(node.input[0] for node in model.graph.node if node.op_type == "Softmax")
    while producers[name].op_type in ("DequantizeLinear", "QuantizeLinear"):  # the float scores the quantizer read
        name = producers[name].input[0]
    model.graph.output.append(helper.make_empty_tensor_value_info(name))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run([name], {"image": images})[0]


def _quantization_parameters(path: Path) -> dict[str, np.ndarray]:
    """Every scale and zero point of the QDQ model (not the codes)."""
    model = onnx.load(str(path))
    names = {name for node in model.graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear") for name in node.input[1:]}
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.name in names}


def _test_images(root: Path) -> np.ndarray:
    return np.stack([np.asarray(Image.open(path), np.float32).transpose(2, 0, 1) / 255 for path in sorted((root / "test").glob("*.png"))])


@pytest.mark.parametrize("extra", [(), ("--dtype", "uint8"), ("--per-channel", "--overflow-fix", "all-layers")],
                         ids=["int8-per-tensor", "uint8", "per-channel-pair-rule"])
def test_learned_rounding_brings_unseen_images_closer_to_fp32_with_the_same_scales(project, extra):
    name = "_".join(extra).replace("-", "") or "default"
    # One named range for both: `--method auto` would also search the ranges, after the rounding, so differently for each.
    nearest = _quantize(project, f"{name}_nearest.onnx", "--rounding", "nearest", "--method", "minmax", *extra)
    learned = _quantize(project, f"{name}_learned.onnx", "--rounding", "learned", "--method", "minmax", *extra)
    assert nearest["settings"]["rounding"] == "nearest" and learned["settings"]["rounding"] == "learned"
    images = _test_images(project)
    reference = _logits(project / "m.onnx", images)

    def sqnr(model: str) -> float:
        noise = np.sum((reference - _logits(project / model, images)) ** 2)
        return float(10 * np.log10(np.sum(reference**2) / noise))

    assert sqnr(f"{name}_learned.onnx") > sqnr(f"{name}_nearest.onnx") + 3
    before, after = _quantization_parameters(project / f"{name}_nearest.onnx"), _quantization_parameters(project / f"{name}_learned.onnx")
    assert before.keys() == after.keys() and all(np.array_equal(before[key], after[key]) for key in before)  # only codes and biases move
    stored = json.loads({prop.key: prop.value for prop in onnx.load(str(project / f"{name}_learned.onnx")).metadata_props}["ptq.quantization"])
    assert stored["rounding"] == "learned"
    if "all-layers" in extra:  # the pair rule still holds on every layer: proven exact on CPUs without VNNI
        proven, why = overflow.saturation_proof(onnx.load(str(project / f"{name}_learned.onnx")))
        assert proven, why


def test_auto_rounding_keeps_the_rounding_the_held_out_images_prefer_and_says_so(project):
    auto = _quantize(project, "auto.onnx")["settings"]
    nearest_db, learned_db = auto["rounding_nearest_db"], auto["rounding_learned_db"]
    assert nearest_db is not None and learned_db is not None
    assert auto["rounding"] == ("learned" if learned_db > nearest_db else "nearest")
    shown = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                   "--output", "auto_shown.onnx", cwd=project, columns=200)
    assert shown.exit_code == 0 and f"{nearest_db:.1f} dB nearest, {learned_db:.1f} dB learned" in shown.stdout


def test_auto_rounding_judges_by_the_mean_of_each_held_out_image_s_sqnr(project):
    """The figures auto rounding keeps are the held-out images' own SQNRs averaged, not their pooled SQNR, which the
    few images with the largest scores decide (here the brightened ones)."""
    from dataclasses import replace

    from ptq_cli.metrics import image_sqnr_db, sqnr_db
    from ptq_cli.quantize import judges
    from ptq_cli.quantize.policy import held_out_split
    from ptq_cli.services.quant_settings import make_settings

    _quantize(project, "judged_nearest.onnx", "--rounding", "nearest", "--method", "minmax")
    calibration = _test_images(project)
    calibration[3::16] *= 10  # held-out images far brighter than anything calibrated: large scores, far off FP32
    settings = replace(make_settings("int8", method="minmax"), rounding=rounding.AUTO)
    _, judged, _ = judges.refine_rounding(onnx.load(str(project / "judged_nearest.onnx")), str(project / "m.onnx"), calibration, "image",
                                               settings)
    held_out = held_out_split(calibration)[0]
    reference, nearest = _logits(project / "m.onnx", held_out), _logits(project / "judged_nearest.onnx", held_out)
    assert judged.evidence.rounding_nearest_db == round(image_sqnr_db(reference, nearest), 2)
    assert abs(judged.evidence.rounding_nearest_db - sqnr_db(reference, nearest)) > 3


def test_learned_rounding_on_a_backend_that_cannot_take_it_is_refused_in_one_line(project):
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                    "--backend", "pytorch", "--rounding", "learned", "--output", "t.pt", cwd=project)
    one_line_error(result, "--rounding learned")
    assert not (project / "t.pt").exists()


def test_the_output_softmax_and_the_scores_it_reads_stay_float_after_8_bit_inputs_and_weights(project):
    quantized = _quantize(project, "softmax.onnx", "--rounding", "nearest")
    model = onnx.load(str(project / "softmax.onnx"))
    last = next(node for node in model.graph.node if model.graph.output[0].name in node.output)
    assert last.op_type == "Softmax"
    producers = {output: node for node in model.graph.node for output in node.output}
    before = producers[last.input[0]]
    while before.op_type == "Identity":
        before = producers[before.input[0]]
    assert before.op_type == "Gemm"  # the scores come straight from the last layer, not through an 8-bit QuantizeLinear
    assert all(producers[name].op_type == "DequantizeLinear" for name in before.input[:2])  # its input and weights are still 8-bit
    assert any(note.startswith("output scores: left in float") for note in quantized["notes"])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    scores = session.run(None, {"image": _test_images(project)})[0]
    steps = scores * 255
    assert np.mean(np.abs(steps - np.rint(steps)) > 1e-3) > 0.5  # most probabilities fall between the codes of a uint8 output
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-5)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(project / "softmax_optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert "QGemm" in {node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node}  # still an integer kernel


def _scores_head(bias_as_add: bool) -> onnx.ModelProto:
    """x -> Q/DQ -> MatMul (8-bit weights) [-> Add of a constant bias] -> Q/DQ -> Reshape -> Q/DQ -> Softmax -> output,
    and a second output: Relu of the quantized input, through its own Q/DQ."""
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.integers(-127, 128, (8, 5)).astype(np.int8), "w_codes"),
                    numpy_helper.from_array(np.float32(0.01), "w_scale"), numpy_helper.from_array(np.int8(0), "w_zero"),
                    numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(np.int8(0), "z"),
                    numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "bias"),
                    numpy_helper.from_array(np.array([-1, 5], dtype=np.int64), "shape")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]), helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_codes", "w_scale", "w_zero"], ["w"]),
             helper.make_node("MatMul", ["xd", "w"], ["product"])]
    if bias_as_add:
        nodes.append(helper.make_node("Add", ["bias", "product"], ["scores"]))
    else:
        nodes.append(helper.make_node("Identity", ["product"], ["scores"]))
    nodes += [helper.make_node("QuantizeLinear", ["scores", "s", "z"], ["q0"], name="quantize0"),
              helper.make_node("DequantizeLinear", ["q0", "s", "z"], ["scores_d"], name="dequantize0"),
              helper.make_node("Reshape", ["scores_d", "shape"], ["flat"]),
              helper.make_node("QuantizeLinear", ["flat", "s", "z"], ["q1"], name="quantize1"),
              helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["flat_d"], name="dequantize1"),
              helper.make_node("Softmax", ["flat_d"], ["probs"], axis=1)]
    nodes += [helper.make_node("Relu", ["xd"], ["relu"]), helper.make_node("QuantizeLinear", ["relu", "s", "z"], ["rq"]),
              helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["side"])]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, ["n", 5]),
                               helper.make_tensor_value_info("side", onnx.TensorProto.FLOAT, ["n", 8])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)


@pytest.mark.parametrize("bias_as_add", [False, True], ids=["matmul", "matmul-add-bias"])
def test_float_scores_removes_the_roundings_between_the_last_layer_and_the_output_and_nothing_else(bias_as_add):
    from ptq_cli.transforms.qdq_edits import float_scores

    model = _scores_head(bias_as_add)
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32) * 3
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert float_scores(model) == 3  # two between the MatMul and the Softmax, one between the Relu and its output
    onnx.checker.check_model(model)
    assert [node.input[0] for node in model.graph.node if node.op_type == "QuantizeLinear"] == ["x"]  # the layer's input stays 8-bit
    probs, side = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(side, np.maximum(np.clip(np.rint(x / 0.05), -128, 127) * np.float32(0.05), 0))
    expected = _scores_head(bias_as_add)
    for node in list(expected.graph.node):
        if node.name in ("quantize0", "dequantize0", "quantize1", "dequantize1"):
            expected.graph.node.remove(node)
    for node in expected.graph.node:
        node.input[:] = [{"scores_d": "scores", "flat_d": "flat"}.get(name, name) for name in node.input]
    reference = ort.InferenceSession(expected.SerializeToString(), providers=["CPUExecutionProvider"]).run(["probs"], {"x": x})[0]
    np.testing.assert_allclose(probs, reference, rtol=1e-6, atol=1e-7)
    assert np.abs(probs - before[0]).max() > 1e-4  # the rounded scores differed from these


def test_a_refinement_that_fails_leaves_the_nearest_model_and_says_so(project, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure inside the refinement")

    monkeypatch.setattr(rounding, "gptq", broken)
    failed = _quantize(project, "fallback.onnx", "--rounding", "learned")
    assert failed["settings"]["rounding"] == "nearest"
    assert any("not applied (simulated failure" in note for note in failed["notes"])
    _quantize(project, "fallback_nearest.onnx", "--rounding", "nearest")
    codes = [{init.name: numpy_helper.to_array(init) for init in onnx.load(str(project / name)).graph.initializer}
             for name in ("fallback.onnx", "fallback_nearest.onnx")]
    assert codes[0].keys() == codes[1].keys() and all(np.array_equal(codes[0][key], codes[1][key]) for key in codes[0])


def test_biases_that_overshoot_fp32_s_means_are_corrected_again_for_their_own_codes_only(project, monkeypatch):
    """Where learned rounding with biases matched to FP32's means measures no closer than nearest rounding on the held-out
    images (here: every such bias pushed far off), the refinement runs again with each bias taking up its own layer's
    codes' mean error alone, (W - Q) mu_int8, and says so."""
    real, seen = rounding._correct_bias, []

    def overshooting(layer, initializers, *args):
        seen.append(args[-1])
        corrected = real(layer, initializers, *args)
        if corrected and not args[-1]:
            codes = numpy_helper.to_array(initializers[layer.bias_codes])
            initializers[layer.bias_codes].CopyFrom(numpy_helper.from_array((codes + 2**20).astype(np.int32), layer.bias_codes))
        return corrected

    monkeypatch.setattr(rounding, "_correct_bias", overshooting)
    made = _quantize(project, "own_error.onnx", "--method", "minmax")
    assert False in seen and True in seen  # the FP32-matched pass, then the own-error one
    assert any("each bias corrected for its own layer's codes only" in note for note in made["notes"])
    assert made["settings"]["rounding_learned_db"] > -10  # the figure judged is the second pass's, not the pushed biases'


def test_own_error_bias_correction_is_the_layer_s_codes_mean_error_on_its_8_bit_inputs():
    """b' = b + (W - Q) mu_int8, whatever the FP32 inputs' mean; matched to FP32, b' = b + W mu_fp32 - Q mu_int8."""
    weights = np.array([[[0.50, -0.25]]])  # one group, one output channel, two inputs
    codes, scale, zero = np.array([[[5.0, -2.0]]]), np.array([[0.1]]), np.array([[0.0]])
    moments = rounding.Moments(second=np.eye(2)[None], quantized_sum=np.array([[4.0, 8.0]]), float_sum=np.array([[40.0, -20.0]]), rows=4)
    float_node = helper.make_node("Conv", ["x", "w", "b"], ["y"])
    float_initializers = {"b": numpy_helper.from_array(np.array([0.3], np.float32), "b")}
    layer = rounding.Layer("conv", "Conv", "xq", "x", "codes", "scale", None, "bias_codes", "bias_scale", {}, float_node)

    def corrected(own_error: bool) -> float:
        initializers = {"bias_codes": numpy_helper.from_array(np.array([0], np.int32), "bias_codes"),
                        "bias_scale": numpy_helper.from_array(np.array([1e-4], np.float32), "bias_scale")}
        fitted = rounding.Fitted(weights, codes, scale, zero)
        assert rounding._correct_bias(layer, initializers, rounding._float_bias(float_node, float_initializers), fitted, moments, own_error)
        return float(numpy_helper.to_array(initializers["bias_codes"])[0]) * 1e-4

    dequantized, mean_quantized, mean_float = codes[0, 0] * 0.1, np.array([1.0, 2.0]), np.array([10.0, -5.0])
    assert corrected(True) == pytest.approx(0.3 + (weights[0, 0] - dequantized) @ mean_quantized, abs=1e-4)
    assert corrected(False) == pytest.approx(0.3 + weights[0, 0] @ mean_float - dequantized @ mean_quantized, abs=1e-4)


def test_layers_too_wide_to_hold_their_input_moments_keep_nearest_codes(project, monkeypatch):
    monkeypatch.setattr(rounding, "MAX_INPUTS", 8)  # every layer here has more inputs (27, 144, 24)
    wide = _quantize(project, "wide.onnx", "--rounding", "learned")
    assert any("learned rounding: 0 layers" in note for note in wide["notes"])
    _quantize(project, "wide_nearest.onnx", "--rounding", "nearest")
    codes = [{init.name: numpy_helper.to_array(init) for init in onnx.load(str(project / name)).graph.initializer}
             for name in ("wide.onnx", "wide_nearest.onnx")]
    assert all(np.array_equal(codes[0][key], codes[1][key]) for key in codes[0])


@pytest.mark.parametrize("budget", [None, 1])
def test_the_float_model_s_layer_inputs_collected_in_one_pass_are_those_of_a_pass_a_layer(tmp_path, monkeypatch, budget):
    """The float model does not change while the layers are refined: one pass collects the inputs of the coming layers
    (as many as the byte budget holds; with a budget of one byte, a pass a layer), batch for batch what a pass a layer gives."""
    from ptq_cli.quantize import runs

    model = onnx.load(str(two_conv_classifier(tmp_path / "m.onnx")))
    images = np.random.default_rng(0).random((40, 3, 16, 16), dtype=np.float32)
    if budget is not None:
        monkeypatch.setattr(runs, "FLOAT_INPUTS_BYTES", budget)
    passes: list[list[str]] = []
    real_session = runs.probe_session
    monkeypatch.setattr(runs, "probe_session", lambda cut, threads, *kernels: passes.append([value.name for value in cut.graph.output]) or real_session(cut, threads, *kernels))
    coming = ["r1", "flat", "r1"]  # a tensor two layers read is asked for twice
    collected = runs.collected_batches("image", images, 1, coming)
    got = {name: list(collected(model, name)) for name in coming}
    made = list(passes)
    for name in dict.fromkeys(coming):
        expected = list(runs.tensor_batches("image", images, 1)(model, name))
        assert len(got[name]) == len(expected) == 3 and all(np.array_equal(a, b) for a, b in zip(got[name], expected, strict=True)), name
    if budget is None:
        assert made == [["r1", "flat"], ["r1", "flat"]]  # the one-image size probe, then the one pass for both
    else:
        assert made[1::2] == [["r1"], ["flat"], ["r1"]]  # after each size probe, a pass for the one layer asked for


def _residual_classifier(path: Path) -> Path:
    """Conv 3->16 -> Relu (r1) -> Conv 16->16 -> Relu -> + r1 -> Conv 16->24 (stride 2) -> Relu -> mean -> Gemm -> Softmax:
    an activation two layers read (r1), as in every residual network."""
    rng = np.random.default_rng(5)
    initializers = [numpy_helper.from_array(rng.normal(0, scale, shape).astype(np.float32), name) for name, shape, scale in
                    [("w1", (16, 3, 3, 3), 0.3), ("b1", (16,), 0.05), ("w2", (16, 16, 3, 3), 0.1), ("b2", (16,), 0.05),
                     ("w3", (24, 16, 3, 3), 0.1), ("b3", (24,), 0.05), ("w4", (24, 10), 0.5)]]
    nodes = [helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Add", ["r1", "r2"], ["sum"]),
             helper.make_node("Conv", ["sum", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv3"),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("GlobalAveragePool", ["r3"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w4"], ["logits"], name="classifier"),
             helper.make_node("Softmax", ["logits"], ["scores"], axis=1)]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 10])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


@pytest.mark.parametrize("extra", [(), ("--dtype", "int8"), ("--stem", "float")], ids=["default", "int8", "float-stem"])
def test_layer_inputs_computed_from_the_earlier_layers_8_bit_activations_learn_the_same_codes(project, monkeypatch, extra):
    """Each layer's input is computed from the QuantizeLinear outputs of the passes for the layers before it (which no
    later change alters) instead of from the image: the same model, byte for byte."""
    from ptq_cli.quantize import judges, runs

    _residual_classifier(project / "residual.onnx")
    arguments = ("--model", "residual.onnx", "--rounding", "learned", "--method", "minmax", *extra)
    name = "_".join(extra).replace("-", "") or "default"
    layer_by_layer = _quantize(project, f"residual_{name}.onnx", *arguments)
    monkeypatch.setattr(judges, "layer_by_layer_batches", runs.tensor_batches)
    from_the_image = _quantize(project, f"residual_{name}_image.onnx", *arguments)
    assert layer_by_layer["settings"]["rounding"] == from_the_image["settings"]["rounding"] == "learned"
    assert (project / f"residual_{name}.onnx").read_bytes() == (project / f"residual_{name}_image.onnx").read_bytes()


@pytest.mark.parametrize("budget", [None, 1])
def test_a_layer_s_input_is_computed_from_the_last_8_bit_activations_held(project, monkeypatch, budget):
    """Asked for the layers' inputs in graph order, each pass after the first starts from the 8-bit activations the
    passes before computed, batch for batch the values a pass from the image gives; with one held (a budget of one
    byte), a pass reaches back to the image where it needs an activation let go."""
    from ptq_cli.quantize import runs

    _residual_classifier(project / "residual.onnx")
    _quantize(project, "residual_source.onnx", "--model", "residual.onnx", "--rounding", "nearest", "--method", "minmax", "--stem", "int8")
    model = onnx.load(str(project / "residual_source.onnx"))
    layers = rounding.find_layers(model)
    images = np.random.default_rng(0).random((40, 3, 16, 16), dtype=np.float32)
    if budget is not None:
        monkeypatch.setattr(runs, "HELD_ACTIVATIONS_BYTES", budget)
    passes: list[set[str]] = []
    real_session = runs.probe_session
    monkeypatch.setattr(runs, "probe_session", lambda cut, threads, *kernels: passes.append({node.name for node in cut.graph.node}) or real_session(cut, threads, *kernels))
    source = runs.layer_by_layer_batches("image", images, 1)
    got = {layer.name: list(source(model, layer.quantized_input)) for layer in layers}
    ran_by_layer = list(passes)
    assert len(layers) == 4 and len(ran_by_layer) == 4
    for layer in layers:
        expected = list(runs.tensor_batches("image", images, 1)(model, layer.quantized_input))
        assert len(got[layer.name]) == 3 and all(np.array_equal(a, b) for a, b in zip(got[layer.name], expected, strict=True)), layer.name
    # Layer k's pass runs layer k-1 (its input's producer) and, with the activations held, no layer before it; with one
    # held, conv3's pass needs the residual input r1 again, computed again from the image through the first layer.
    assert [[layer.name for layer in layers if layer.name in ran] for ran in ran_by_layer] == \
        [[], ["conv1"], ["conv2"] if budget is None else ["conv1", "conv2"], ["conv3"]]


@pytest.mark.parametrize("shape", [(5_000, 96, 9), (3_000, 1, 288), (4_000, 7, 1), (200_000, 1, 1), (0, 4, 9)])
def test_the_float_sums_of_layer_rows_are_bit_for_bit_those_of_a_float64_copy(shape):
    """Bias correction's float sums skip the float64 copy of the rows: the same sum to the last bit (rows of large and
    small magnitudes, where another order of the additions would round otherwise)."""
    from ptq_cli.quantize.rounding import _row_sum

    rng = np.random.default_rng(len(shape) + shape[0])
    rows = (rng.normal(size=shape) * rng.choice([1e-3, 1.0, 1e4], size=shape)).astype(np.float32)
    assert np.array_equal(_row_sum(rows), rows.astype(np.float64).sum(axis=0))


@pytest.mark.parametrize("shape", [(1_500, 672, 25), (5_000, 96, 9), (3_000, 1, 1_152), (4_000, 4, 72), (40_000, 8, 1), (20_000, 1, 1), (0, 3, 9)])
def test_the_input_moments_are_bit_for_bit_those_of_groups_first_float64_rows(shape):
    """Learned rounding's x x^T and x sums per group, from the rows as they are unfolded: to the last bit what the
    groups-first float64 copy gives to batched BLAS (depthwise, pointwise, grouped and one-input layers)."""
    from ptq_cli.quantize.rounding import Moments

    rng = np.random.default_rng(shape[0] + shape[1])
    rows = (rng.normal(size=shape) * rng.choice([1e-3, 1.0, 1e4], size=shape)).astype(np.float32)
    moments = Moments()
    moments.add(rows)
    grouped = np.ascontiguousarray(rows.astype(np.float64).transpose(1, 0, 2))  # the reference: groups x rows x inputs
    assert np.array_equal(moments.second, np.matmul(grouped.transpose(0, 2, 1), grouped))
    assert np.array_equal(moments.quantized_sum, grouped.sum(axis=1)) and moments.rows == shape[0]


@pytest.mark.parametrize("auto_pad", ["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize(("kernel", "stride", "dilation"), [(1, 1, 1), (3, 2, 1), (5, 1, 2), (3, 3, 1)])
def test_a_convolution_s_row_count_is_the_number_of_rows_it_unfolds(auto_pad, kernel, stride, dilation):
    """The rows a layer's sample is drawn over, counted from the geometry alone, are the rows unfolding gives."""
    from ptq_cli.quantize.rounding import Layer, row_count, unfold

    attributes = {"strides": [stride, stride], "dilations": [dilation, dilation], "auto_pad": auto_pad,
                  **({"pads": [1, 2, 0, 1]} if auto_pad == "NOTSET" else {})}
    layer = Layer("conv", "Conv", "x", "x", "w", "s", None, None, None, attributes, None)
    inputs = np.zeros((2, 3, 11, 9), np.float32)
    assert row_count(layer, inputs, (4, 3, kernel, kernel)) == len(unfold(layer, inputs, (4, 3, kernel, kernel)))


@pytest.mark.parametrize("attributes, groups", [({}, 1), ({"group": 2}, 2), ({"auto_pad": "SAME_UPPER"}, 1), ({"strides": [2, 2]}, 1),
                                                ({"pads": [1, 0, 0, 1]}, 1)],
                         ids=["pointwise", "grouped", "same-upper", "strided", "padded"])
def test_a_1x1_convolution_s_rows_are_its_input_s_positions_as_onnxruntime_convolves_them(attributes, groups):
    """A 1x1 convolution of stride 1 without padding is unfolded from its input's positions directly (no padded copy, no
    windows): the same rows, whole or sampled, as onnxruntime's convolution reads; strided or padded ones through windows."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 7, 5)).astype(np.float32)
    weight = rng.standard_normal((6, 4 // groups, 1, 1)).astype(np.float32)
    expected = _ort_conv(x, weight, attributes)
    layer = _conv_layer(attributes)
    rows = rounding.unfold(layer, x, weight.shape)
    got = np.einsum("rgi,goi->rgo", rows, rounding.weight_matrix(layer, weight))
    np.testing.assert_allclose(got.reshape(3, expected.shape[2], expected.shape[3], 6).transpose(0, 3, 1, 2), expected, rtol=1e-4, atol=1e-4)
    keep = rng.random(rounding.row_count(layer, x, weight.shape)) < 0.4
    assert np.array_equal(rounding.unfold(layer, x, weight.shape, keep), rows[keep])
    assert rounding._pointwise(layer, x, weight.shape) == (attributes.get("strides") is None and attributes.get("pads") is None)


@pytest.mark.parametrize("depthwise", [True, False])
def test_a_depthwise_layer_s_statistics_are_drawn_from_fewer_rows(monkeypatch, depthwise):
    """Each group of a depthwise convolution reads its own channel's window alone (H is k^2 x k^2): its rows are drawn
    within DEPTHWISE_ROWS, every other layer's within MAX_ROWS."""
    monkeypatch.setattr(rounding, "DEPTHWISE_ROWS", 200)
    monkeypatch.setattr(rounding, "MAX_ROWS", 2000)
    channels = 4
    attributes = {"group": channels, "pads": [1, 1, 1, 1]} if depthwise else {"pads": [1, 1, 1, 1]}
    weight_shape = (channels, 1, 3, 3) if depthwise else (channels, channels, 3, 3)
    inputs = np.random.default_rng(2).standard_normal((20, channels, 16, 16)).astype(np.float32)  # 5,120 rows
    parts = list(rounding._sampled_rows(_conv_layer(attributes), iter([inputs[:10], inputs[10:]]), weight_shape, 20, np.random.default_rng(3)))
    drawn = sum(len(part) for part in parts)
    assert (100 < drawn < 300) if depthwise else (1700 < drawn < 2300), drawn
