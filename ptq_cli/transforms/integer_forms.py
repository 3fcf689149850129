"""Float graphs rewritten into ops onnxruntime runs on integer kernels once quantized, computing the same values:

- an average over a whole map written as ReduceMean (Keras' squeeze-excitation and GlobalAveragePooling2D, as tf2onnx
  exports them) as GlobalAveragePool: onnxruntime fuses the latter between a DequantizeLinear and a QuantizeLinear
  into its QLinearGlobalAveragePool but runs a ReduceMean in float, converted from 8 bits and back (ten round trips
  in a MobileNetV3). The writer quantizes a GlobalAveragePool's output on its own calibrated range (not its input's,
  as for AveragePool), so the pooled features keep their resolution;
- HardSigmoid as clip(x * alpha + beta, 0, 1) and HardSwish as x times that: onnxruntime has no integer kernel for
  either, but runs the Add on its QLinearAdd, the Clip within the quantizer's range, the product on QLinearMul, and
  the multiplication by alpha is folded into a scale after the writer (qdq_edits.folded_constant_scalings).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ptq_cli.transforms.graph import fresh_names


def _constants(graph) -> dict[str, Any]:
    from onnx import numpy_helper

    found: dict[str, Any] = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    found[node.output[0]] = numpy_helper.to_array(attribute.t)
    return found


def _ranks(model) -> dict[str, int]:
    """Each tensor's rank where the graph's annotations (quant_pre_process's shape inference) give one."""
    values = (*model.graph.input, *model.graph.value_info, *model.graph.output)
    return {value.name: len(value.type.tensor_type.shape.dim) for value in values if value.type.tensor_type.HasField("shape")}


def _whole_map_axes(node, constants: dict[str, Any], rank: int | None) -> bool:
    """Whether the ReduceMean averages every axis after the channels (all of them, and only those), keeping them."""
    attributes = {attribute.name: attribute for attribute in node.attribute}
    if "keepdims" in attributes and attributes["keepdims"].i != 1:
        return False
    if "noop_with_empty_axes" in attributes and attributes["noop_with_empty_axes"].i != 0:
        return False
    if "axes" in attributes:  # opset < 18
        axes = list(attributes["axes"].ints)
    elif len(node.input) > 1 and node.input[1] in constants:
        axes = [int(axis) for axis in constants[node.input[1]].reshape(-1)]
    else:
        return False
    if rank is None or rank < 3:
        return False
    return sorted(axis % rank for axis in axes) == list(range(2, rank))


def reduce_means_as_global_pools(model) -> list[str]:
    """Rewrite in place each ReduceMean that averages a whole map per channel, keeping its dimensions, as a
    GlobalAveragePool of the same name and output; the names of the nodes rewritten."""
    from onnx import helper

    constants, ranks = _constants(model.graph), _ranks(model)
    rewritten = []
    for node in model.graph.node:
        if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        if not _whole_map_axes(node, constants, ranks.get(node.input[0])):
            continue
        rewritten.append(node.name or node.output[0])
        node.CopyFrom(helper.make_node("GlobalAveragePool", [node.input[0]], list(node.output), name=node.name))
    return rewritten


def _attribute(node, name: str, default: float) -> float:
    return next((attribute.f for attribute in node.attribute if attribute.name == name), default)


def hard_activations_spelled_out(model) -> list[str]:
    """Rewrite in place each HardSigmoid as Mul(x, alpha) -> Add(beta) -> Clip(0, 1), and each HardSwish as x times
    the same (alpha 1/6, beta 1/2), the last node keeping the output's name; the names of the nodes rewritten."""
    from onnx import helper, numpy_helper

    graph, rewritten, spelled = model.graph, [], []
    fresh = fresh_names({init.name for init in graph.initializer} | {name for node in graph.node for name in (node.name, *node.output, *node.input)})
    for node in graph.node:
        if node.op_type not in ("HardSigmoid", "HardSwish") or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
            spelled.append(node)
            continue
        swish = node.op_type == "HardSwish"
        alpha, beta = (1.0 / 6, 0.5) if swish else (_attribute(node, "alpha", 0.2), _attribute(node, "beta", 0.5))
        base = node.name or node.output[0]
        constants = {part: fresh(f"{base}/{part}") for part in ("alpha", "beta", "low", "high")}
        for part, value in zip(constants, (alpha, beta, 0.0, 1.0), strict=True):
            graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), constants[part]))
        scaled, shifted, gate = fresh(f"{base}/scaled"), fresh(f"{base}/shifted"), node.output[0] if not swish else fresh(f"{base}/gate")
        spelled += [helper.make_node("Mul", [node.input[0], constants["alpha"]], [scaled], name=fresh(f"{base}/mul")),
                    helper.make_node("Add", [scaled, constants["beta"]], [shifted], name=fresh(f"{base}/add")),
                    helper.make_node("Clip", [shifted, constants["low"], constants["high"]], [gate], name=fresh(f"{base}/clip") if swish else base)]
        if swish:
            spelled.append(helper.make_node("Mul", [node.input[0], gate], list(node.output), name=base))
        rewritten.append(base)
    if rewritten:
        del graph.node[:]
        graph.node.extend(spelled)
    return rewritten
