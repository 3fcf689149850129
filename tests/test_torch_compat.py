"""onnx2torch must import and convert on the CPU-only torch, with no working torchvision installed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import importlib.util, sys
import numpy as np, onnx, onnxruntime as ort, torch
from onnx import helper, numpy_helper, TensorProto
from ptq_cli.transforms.torch_compat import import_onnx2torch

weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
graph = helper.make_graph(
    [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
    "tiny",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
    [numpy_helper.from_array(weight, "w")],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
onnx2torch = import_onnx2torch()
x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
converted = onnx2torch.convert(model)(torch.from_numpy(x)).detach().numpy()
expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
print("max_diff", float(np.abs(converted - expected).max()))
import torchvision
print("stand_in", getattr(torchvision, "__ptq_stand_in__", False))
try:
    torchvision.ops.nms(None, None, 0.5)
except NotImplementedError as error:
    print("nms", error)
"""


def test_onnx2torch_imports_and_converts_in_a_fresh_interpreter():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert float(lines["max_diff"]) < 1e-5
    # This project installs no torchvision, so the stand-in must be what onnx2torch got.
    assert lines["stand_in"] == "True"
    assert "does not install" in lines["nms"]
