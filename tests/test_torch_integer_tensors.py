"""tf2onnx graphs compute with int64 tensors (a Squeeze's axes, a Pad's pads) that onnx2torch keeps as
constants; torch.ao put observers on them and failed (`histc` on Long, then "Quantize only works on Float
Tensor"). The PyTorch backend leaves every integer tensor unobserved."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from synthetic import invoke, smooth_photos


def _squeeze_head_classifier(path: Path) -> Path:
    """NHWC 16x16x3 -> Transpose -> Conv -> Clip(0, 6) -> GlobalAveragePool -> Squeeze(axes: int64 [2, 3]) -> MatMul -> Softmax,
    the head tf2onnx writes for a Keras MobileNet."""
    rng = np.random.default_rng(0)
    constants = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "conv_w"),
                 numpy_helper.from_array(rng.normal(0, 0.5, (8, 5)).astype(np.float32), "dense_w"),
                 numpy_helper.from_array(np.array([2, 3], np.int64), "axes"),
                 numpy_helper.from_array(np.float32(0.0), "zero"), numpy_helper.from_array(np.float32(6.0), "six")]
    nodes = [helper.make_node("Transpose", ["input"], ["nchw"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["nchw", "conv_w"], ["conv"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["conv", "zero", "six"], ["relu6"]),
             helper.make_node("GlobalAveragePool", ["relu6"], ["pooled"]),
             helper.make_node("Squeeze", ["pooled", "axes"], ["flat"]),
             helper.make_node("MatMul", ["flat", "dense_w"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["scores"], axis=1)]
    graph = helper.make_graph(nodes, "squeeze_head", [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["N", 16, 16, 3])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 5])], constants)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


@pytest.mark.parametrize("method", ["histogram", "minmax"])
def test_pytorch_quantizes_a_graph_with_int64_constants_and_stays_close_to_fp32(tmp_path, method):
    _squeeze_head_classifier(tmp_path / "m.onnx")
    smooth_photos(tmp_path / "photos", 24, seed=1)
    result = invoke("quantize", "--model", "m.onnx", "--data", "photos", "--calibration-data", "photos", "--preprocess", "unit",
                    "--backend", "pytorch", "--method", method, "--output", "m.pt", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    evaluated = invoke("evaluate", "--model", "m.pt", "--data", "photos", "--against-fp32", "m.onnx", "--results-dir", "r", "--json", cwd=tmp_path)
    assert evaluated.exit_code == 0, evaluated.output
    record = json.loads(evaluated.stdout)
    record = record[0] if isinstance(record, list) else record
    assert record["fidelity"]["sqnr_db"] > 20
