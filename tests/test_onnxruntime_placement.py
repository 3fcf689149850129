"""onnxruntime's placement: the float graph rewritten into ops its x86 integer kernels run (whole-map ReduceMean as
GlobalAveragePool, HardSigmoid and HardSwish spelled out), and multiplications by a constant folded into the scale
before them, so that a MobileNetV3-like block runs without float round trips and no less faithfully."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from synthetic import colour_images, colours_npz, ok, squeeze_excite_classifier

from ptq_cli.transforms.integer_forms import hard_activations_spelled_out, reduce_means_as_global_pools
from ptq_cli.transforms.qdq_edits import folded_constant_scalings


def _run(model, images: np.ndarray, output: str | None = None) -> np.ndarray:
    if output is not None and output not in {value.name for value in model.graph.output}:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.output.append(helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([output] if output else None, {session.get_inputs()[0].name: images})[0]


def _images(count: int = 12) -> np.ndarray:
    images, _ = colour_images(count // 3, size=16, seed=4)
    return images.transpose(0, 3, 1, 2).astype(np.float32) / 255


def _sqnr(reference: np.ndarray, other: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference**2) / max(np.sum((reference - other) ** 2), 1e-30)))


def test_the_rewrites_compute_what_the_float_graph_computes_with_ops_onnxruntime_quantizes(tmp_path):
    model = onnx.load(str(squeeze_excite_classifier(tmp_path / "se.onnx")))
    model = onnx.shape_inference.infer_shapes(model)  # the ranks quant_pre_process annotates
    images = _images()
    before = _run(model, images, "logits")
    assert reduce_means_as_global_pools(model) == ["se_mean", "pool"]
    assert sorted(hard_activations_spelled_out(model)) == ["hardswish1", "se_gate"]
    onnx.checker.check_model(model)
    kinds = collections.Counter(node.op_type for node in model.graph.node)
    assert not {"ReduceMean", "HardSigmoid", "HardSwish"} & set(kinds)
    assert kinds["GlobalAveragePool"] == 2
    np.testing.assert_allclose(_run(model, images, "logits"), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("axes", "keepdims", "opset"), [([1], 1, 13), ([2, 3], 0, 13), ([2], 1, 13), ([2, 3], 1, 18), ([-1, -2], 1, 13)])
def test_a_reduce_mean_becomes_a_global_pool_only_where_it_averages_the_whole_map_and_keeps_its_dimensions(axes, keepdims, opset):
    inputs = ["x", "axes"] if opset >= 18 else ["x"]
    attributes = {"keepdims": keepdims} | ({} if opset >= 18 else {"axes": axes})
    initializers = [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if opset >= 18 else []
    graph = helper.make_graph([helper.make_node("ReduceMean", inputs, ["y"], name="mean", **attributes)], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 5, 6])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], initializers)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    x = np.random.default_rng(0).normal(size=(2, 4, 5, 6)).astype(np.float32)
    before = _run(model, x)
    whole_map = sorted(axis % 4 for axis in axes) == [2, 3] and keepdims == 1
    assert reduce_means_as_global_pools(model) == (["mean"] if whole_map else [])
    np.testing.assert_allclose(_run(model, x), before, rtol=1e-5, atol=1e-6)


def test_constant_multiplications_fold_into_the_scale_before_them_and_lose_nothing(tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    model = onnx.shape_inference.infer_shapes(onnx.load(str(squeeze_excite_classifier(tmp_path / "se.onnx"))))
    reduce_means_as_global_pools(model)
    hard_activations_spelled_out(model)
    onnx.save(model, str(tmp_path / "rewritten.onnx"))
    images = _images(30)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"image": images[index : index + 1]} for index in range(len(images))])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(tmp_path / "rewritten.onnx"), str(tmp_path / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    quantized = onnx.load(str(tmp_path / "qdq.onnx"))
    unfolded = _run(quantized, images, "logits")
    assert folded_constant_scalings(quantized) == 3  # x * alpha of the HardSwish and the HardSigmoid spelled out, and the Keras-style / 6
    onnx.checker.check_model(quantized)
    producers = {out: node for node in quantized.graph.node for out in node.output}
    for node in quantized.graph.node:  # no product or quotient by a constant is left
        if node.op_type in ("Mul", "Div"):
            assert all(producers[name].op_type == "DequantizeLinear" and producers[name].input[0] not in {i.name for i in quantized.graph.initializer}
                       for name in node.input), node.name
    reference = _run(model, images, "logits")
    assert _sqnr(reference, _run(quantized, images, "logits")) >= _sqnr(reference, unfolded) - 0.1


def test_ptq_quantize_runs_a_squeeze_excite_block_on_integer_kernels_only(tmp_path):
    """onnxruntime's optimized graph of ptq's model: every convolution, product, sum and pool on its integer kernels,
    no float op between a DequantizeLinear and a QuantizeLinear but the stem's input and the output's Softmax."""
    squeeze_excite_classifier(tmp_path / "se.onnx")
    colours_npz(tmp_path / "colours.npz", per_class=10, train_images=colour_images(10, size=16, seed=1)[0],
                test_images=colour_images(10, size=16, seed=2)[0])
    made = json.loads(ok("quantize", "--model", "se.onnx", "--data", "colours.npz", "--preprocess", "unit", "--json", cwd=tmp_path).stdout)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / made["output"]), options, providers=["CPUExecutionProvider"])
    kinds = collections.Counter(node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    assert kinds["QLinearConv"] == 4 and kinds["QLinearGlobalAveragePool"] == 2 and kinds["QLinearMul"] == 3, kinds
    assert not {"ReduceMean", "HardSigmoid", "HardSwish", "Mul", "Div", "Add", "Clip"} & set(kinds), kinds
    # quantize says where the time goes, from onnxruntime's profiler: the four convolutions and the Gemm on integer kernels
    profile = made["profile"]
    assert (profile["convolutions"], profile["int8_convolutions"], profile["batch_size"]) == (5, 5, 1)
    assert {op["op"] for op in profile["ops"] if op["kind"] == "int8"} >= {"QLinearConv", "QLinearMul", "QLinearAdd", "QLinearGlobalAveragePool"}
    assert "5 of 5 convolutions and matrix products run int8" in " ".join(ok("quantize", "--model", "se.onnx", "--data", "colours.npz", "--preprocess",
                                                                            "unit", "--output", "again.onnx", cwd=tmp_path).stdout.split())
