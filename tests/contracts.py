"""Real test cases with other input contracts: the real ResNet8 behind a conversion put in front of it in
the ONNX graph, as third-party exports look (NCHW, normalised input, fixed batch, old opset, other size)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ptq_cli.inputs import PRESETS


def contract_variant(source: Path, target: Path, preset: str = "cifar10-normalized", batch: int | None = 1, opset: int | None = 9,
                     size: int = 32, fixed_reshape: bool = False) -> Path:
    """The NHWC raw-pixel ResNet8 behind: NCHW input of `size` x `size` (2x2 average pooling down to 32 when
    64), pixels normalised as `preset` says (the graph undoes it), batch fixed at `batch`, at `opset`."""
    model = onnx.load(str(source))
    graph = model.graph
    original = graph.input[0]
    scale, mean, std = PRESETS[preset]
    batch_dim = batch if batch is not None else "N"
    new_input = helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, [batch_dim, 3, size, size])
    consts = {
        "pre_std": np.array(std, np.float32).reshape(1, 3, 1, 1),
        "pre_mean": np.array(mean, np.float32).reshape(1, 3, 1, 1),
        "pre_unscale": np.array(1.0 / scale, np.float32),
    }
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in consts.items())
    nodes = [
        helper.make_node("Mul", ["image", "pre_std"], ["pre_a"]),
        helper.make_node("Add", ["pre_a", "pre_mean"], ["pre_b"]),
        helper.make_node("Mul", ["pre_b", "pre_unscale"], ["pre_c"]),
    ]
    last = "pre_c"
    if size != 32:
        factor = size // 32
        nodes.append(helper.make_node("AveragePool", [last], ["pre_pooled"], kernel_shape=[factor, factor], strides=[factor, factor]))
        last = "pre_pooled"
    nodes.append(helper.make_node("Transpose", [last], [original.name], perm=[0, 2, 3, 1]))
    for node in reversed(nodes):
        graph.node.insert(0, node)
    graph.input.remove(original)
    graph.input.insert(0, new_input)
    output = graph.output[0]
    output.type.tensor_type.shape.dim[0].Clear()
    if batch is not None:
        output.type.tensor_type.shape.dim[0].dim_value = batch
    else:
        output.type.tensor_type.shape.dim[0].dim_param = "N"
    if fixed_reshape:  # a flatten tied to the batch: features x batch, then transposed; the batch cannot be freed
        for position, node in enumerate(graph.node):
            if node.op_type == "Reshape":
                shape_name, flat = node.input[1], node.output[0]
                for init in graph.initializer:
                    if init.name == shape_name:
                        features = int(numpy_helper.to_array(init)[-1])
                        init.CopyFrom(numpy_helper.from_array(np.array([features, batch], np.int64), shape_name))
                node.output[0] = f"{flat}_columns"
                graph.node.insert(position + 1, helper.make_node("Transpose", [node.output[0]], [flat], perm=[1, 0]))
                break
    del graph.value_info[:]
    if opset is not None:
        # onnx's version converter has no down-adapters for most ops; these ops mean the same at opset 9
        # for these shapes (Softmax over the last of 2 axes), so the model is labelled with the old opset.
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = opset
        model.ir_version = min(model.ir_version, 4 if opset <= 9 else model.ir_version)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(target))
    return target
