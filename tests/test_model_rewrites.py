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
