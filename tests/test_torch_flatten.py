"""A Flatten computed at run time (Shape -> Slice -> Concat -> Reshape) must survive tracing to TorchScript.

tf2onnx emits that chain when its reshape optimizer does not fold it (seen on a CI machine); traced as is,
the TorchScript file only accepted the batch size it was traced with.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ptq_cli.backends.pytorch import onnx_to_graph_module, save_torchscript
from ptq_cli.inputs import NHWC, ModelInput
from ptq_cli.services.models import load_model as load_torchscript
from ptq_cli.transforms.graph import static_reshape_targets


def dynamic_flatten_classifier():
    """NHWC 32x32x3 -> Conv -> Relu -> AveragePool -> runtime-shaped Flatten -> MatMul -> Softmax."""
    rng = np.random.default_rng(0)
    constants = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.standard_normal((4 * 2 * 2, 10)).astype(np.float32), "dense_w"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "minus_one"),
    ]
    nodes = [
        helper.make_node("Transpose", ["input"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "conv_w"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("AveragePool", ["relu"], ["pooled"], kernel_shape=[16, 16], strides=[16, 16]),
        helper.make_node("Shape", ["pooled"], ["pooled_shape"]),
        helper.make_node("Slice", ["pooled_shape", "zero", "one", "zero"], ["batch"]),
        helper.make_node("Concat", ["batch", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["pooled", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "dense_w"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "dynamic_flatten",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 32, 32, 3])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        constants,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_runtime_flatten_becomes_a_constant_minus_one_target():
    model = static_reshape_targets(dynamic_flatten_classifier())
    reshape = next(node for node in model.graph.node if node.op_type == "Reshape")
    target = next(tensor for tensor in model.graph.initializer if tensor.name == reshape.input[1])
    assert numpy_helper.to_array(target).tolist() == [-1, 16]
    assert not {"Shape", "Slice", "Concat"} & {node.op_type for node in model.graph.node}


@pytest.mark.parametrize("fold", [True, False])
def test_torchscript_traced_on_one_batch_size_runs_any_other(tmp_path, fold):
    model = dynamic_flatten_classifier()
    images = np.random.default_rng(1).uniform(0, 255, (20, 32, 32, 3)).astype(np.float32)
    path = tmp_path / "flatten.pt"
    described = ModelInput("input", NHWC, 3, 32, 32, None)
    save_torchscript(onnx_to_graph_module(model, fold=fold), path, images[:8], {}, described)

    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"input": images})[0]
    scripted = torch.jit.load(str(path))
    for batch in (1, 3, 20):
        with torch.no_grad():
            produced = scripted(torch.from_numpy(images[:batch])).numpy()
        np.testing.assert_allclose(produced, expected[:batch], atol=1e-5)
    np.testing.assert_allclose(load_torchscript(path).predict(images), expected, atol=1e-5)
