"""FP32 -> FP32 rewrites before quantizing: tf2onnx's unfolded batch norm (Conv -> Mul -> Add, depthwise too) and its
TF "same" Pad are folded into the convolution by onnxruntime's own pre-processing, so the quantized graph has no
8-bit step between a convolution and its batch norm."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from PIL import Image
from synthetic import invoke, smooth_photos


def _tf2onnx_depthwise_block(path: Path) -> Path:
    """NCHW 3x16x16 -> Pad (TF "same") -> depthwise Conv 3x3 -> Mul (BN scale) -> Add (BN shift) -> Clip(0, 6) -> pointwise Conv -> mean -> MatMul."""
    rng = np.random.default_rng(0)
    constants = {"dw_w": rng.normal(0, 0.5, (3, 1, 3, 3)), "bn_scale": rng.uniform(0.5, 2.0, (1, 3, 1, 1)), "bn_shift": rng.normal(0, 0.2, (1, 3, 1, 1)),
                 "pw_w": rng.normal(0, 0.5, (8, 3, 1, 1)), "dense_w": rng.normal(0, 0.5, (8, 4)), "zero": np.float32(0), "six": np.float32(6)}
    initializers = [numpy_helper.from_array(np.asarray(value, np.float32), name) for name, value in constants.items()]
    initializers.append(numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"))
    initializers.append(numpy_helper.from_array(np.array([2, 3], np.int64), "axes"))
    nodes = [helper.make_node("Pad", ["image", "pads"], ["padded"]),
             helper.make_node("Conv", ["padded", "dw_w"], ["dw"], group=3),
             helper.make_node("Mul", ["dw", "bn_scale"], ["scaled"]),
             helper.make_node("Add", ["scaled", "bn_shift"], ["shifted"]),
             helper.make_node("Clip", ["shifted", "zero", "six"], ["relu6"]),
             helper.make_node("Conv", ["relu6", "pw_w"], ["pw"]),
             helper.make_node("ReduceMean", ["pw"], ["pooled"], axes=[2, 3], keepdims=0),
             helper.make_node("MatMul", ["pooled", "dense_w"], ["scores"])]
    graph = helper.make_graph(nodes, "tf2onnx_block", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 4])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def test_batch_norm_mul_add_and_same_pads_are_folded_into_the_convolution_before_quantizing(tmp_path):
    _tf2onnx_depthwise_block(tmp_path / "m.onnx")
    smooth_photos(tmp_path / "photos", 16, seed=1)
    result = invoke("quantize", "--model", "m.onnx", "--data", "photos", "--calibration-data", "photos", "--preprocess", "unit",
                    "--output", "q.onnx", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    kinds = [node.op_type for node in quantized.graph.node]
    assert "Mul" not in kinds and "Add" not in kinds and "Pad" not in kinds  # folded: nothing between a Conv and its Clip
    producers = {output: node for node in quantized.graph.node for output in node.output}
    for clip in (node for node in quantized.graph.node if node.op_type == "Clip"):
        source = producers[clip.input[0]]
        while source.op_type in ("QuantizeLinear", "DequantizeLinear"):
            source = producers[source.input[0]]
        assert source.op_type == "Conv"
    images = np.stack([np.asarray(Image.open(path), np.float32).transpose(2, 0, 1) / 255 for path in sorted((tmp_path / "photos").glob("*.png"))])
    reference = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    assert 10 * np.log10(np.sum(reference**2) / np.sum((reference - got) ** 2)) > 25
    assert json.loads(result.stdout)["settings"]["preprocess"] is True


def test_a_tensor_is_read_from_the_nodes_it_depends_on_alone_with_the_values_of_the_whole_graph(tmp_path):
    """Learned rounding reads each layer's input: onnxruntime runs every node of a graph whatever a call asks for, so
    the graph is cut to the nodes that tensor depends on; the values are the whole graph's, bit for bit."""
    from ptq_cli.transforms.graph import computing_only

    rng = np.random.default_rng(0)
    weights = {name: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("w1", (4, 3, 3, 3)), ("w2", (4, 4, 3, 3)), ("w3", (4, 4, 1, 1)))}
    nodes = [helper.make_node("Conv", ["image", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]), helper.make_node("Conv", ["r1", "w3"], ["c3"]),
             helper.make_node("Add", ["c2", "c3"], ["sum"]), helper.make_node("GlobalAveragePool", ["sum"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["scores"])]
    graph = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 4])], list(weights.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    images = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    whole = onnx.ModelProto()
    whole.CopyFrom(model)
    whole.graph.output.append(helper.make_empty_tensor_value_info("r1"))
    expected = ort.InferenceSession(whole.SerializeToString(), providers=["CPUExecutionProvider"]).run(["r1"], {"image": images})[0]
    cut = computing_only(model, "r1")
    assert [node.output[0] for node in cut.graph.node] == ["c1", "r1"] and [init.name for init in cut.graph.initializer] == ["w1"]
    got = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    assert np.array_equal(got, expected)
    assert [node.output[0] for node in computing_only(model, "c3").graph.node] == ["c1", "r1", "c3"]  # not the other branch
    assert computing_only(model, "image") is None  # a graph input: no node makes it
    assert [output.name for output in model.graph.output] == ["scores"] and len(model.graph.node) == 7  # the model untouched
