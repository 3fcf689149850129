"""Space-to-depth for narrow convolutions, so that onnxruntime's x86 int8 kernel runs them at full speed.

onnxruntime's fast x86 int8 convolution (MLAS's indirect "ConvSym" kernel, for uint8 activations and
symmetric int8 weights) needs the input channel count to be a multiple of 4, and runs at about half
speed below 32 output channels. ResNet8 misses both: its RGB stem (3 in) falls back to im2col + GEMM
and took 2.45 ms of the int8 model's 10 ms per 128 images (onnxruntime's profiler, one thread), and its
two 16 -> 16 convolutions took 2 ms each, twice the time per multiply of the 32- and 64-channel ones.

The rewrite groups each run of B pixels along the width into one pixel of B x C channels: a reshape of
the NHWC tensor, free in memory. The input is first padded on the left by the convolution's own left
padding (and on the right to whole blocks), so that output block b reads whole input blocks b, b+1, ...
A stride-1 convolution is then exactly a convolution over the grouped tensor with B x Cin inputs and
B x Cout outputs, whose weights hold the original ones where an input pixel lies under the kernel for an
output pixel, and zeros elsewhere. The products are the same, so the float model computes the same
outputs; each output channel of the new weights holds one original channel's weights, so per-channel
quantization gives it the same scale. The zeros cost file size and multiplies (4/3 more for the
16-channel convolutions), which the fast kernel more than repays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALIGNMENT = 4  # the input-channel multiple MLAS's x86 int8 ConvSym kernels take
# ... and the output channels below which they run at half speed (one vector of 16 channels per pixel
# leaves the kernel waiting on its loads): measured 2.6 ms for a 16->16 3x3 conv on 128 32x32 images,
# 1.8 ms for the same work regrouped as 32->32 over pixel pairs.
MIN_OUTPUT_CHANNELS = 32
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
SUFFIX = "/space_to_depth"  # the rewrite's nodes are named <conv name>/space_to_depth/...; quantized_pads finds its Pads by it


@dataclass(frozen=True)
class Rewrite:
    node: str  # the Conv's name, kept by its replacement (so float-layer exclusions by name still match)
    block: int  # pixels grouped along the width
    input_channels: int  # before; after: block * input_channels
    output_channels: int  # before; after: block * output_channels


def block_size(channels: int) -> int:
    """The fewest pixels whose channels together are a multiple of ALIGNMENT."""
    return ALIGNMENT // math.gcd(channels, ALIGNMENT)


def blocked_weights(weights: np.ndarray, block: int) -> np.ndarray:
    """The weights over blocks of `block` pixels of a stride-1 OIHW kernel, for an input padded on the left by
    the convolution's own left padding (so each output block reads whole input blocks from its own onward).

    Output pixel j of block b reads input pixel i of block b + kb through kernel column
    k = block * kb + i - j; entries whose k falls outside the kernel stay zero."""
    out_channels, in_channels, height, width = weights.shape
    span = (block + width - 2) // block + 1  # input blocks each output block reads
    result = np.zeros((block * out_channels, block * in_channels, height, span), dtype=weights.dtype)
    for j in range(block):
        for i in range(block):
            for kb in range(span):
                k = block * kb + i - j
                if 0 <= k < width:
                    result[j * out_channels:(j + 1) * out_channels, i * in_channels:(i + 1) * in_channels, :, kb] = weights[..., k]
    return result


def _attributes(node) -> dict:
    import onnx

    return {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}


def _static_widths(model) -> dict[str, int]:
    """The width (last dimension) of each 4-D tensor shape inference can tell."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    widths = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info):
        dims = value.type.tensor_type.shape.dim
        if len(dims) == 4 and dims[3].HasField("dim_value"):
            widths[value.name] = dims[3].dim_value
    return widths


def _eligible(attributes: dict, weights: np.ndarray | None, width: int | None) -> int | None:
    """The block size for this Conv, or None when the rewrite does not apply (or is not needed)."""
    if weights is None or weights.ndim != 4:
        return None
    if weights.shape[2:] == (1, 1):
        return None  # a pointwise Conv is one GEMM to MLAS already: regrouped it only gains zeros (docs: ImageNet-size classifiers)
    out_channels, in_channels = weights.shape[:2]
    block = max(block_size(in_channels), -(-MIN_OUTPUT_CHANNELS // out_channels))
    if block == 1:
        return None  # the kernel takes it as it is
    block = 1 << (block - 1).bit_length()  # a power of two, so both channel conditions still hold
    pads = attributes.get("pads", [0, 0, 0, 0])
    plain = (
        attributes.get("group", 1) == 1
        and all(value == 1 for value in attributes.get("strides", [1, 1]))
        and all(value == 1 for value in attributes.get("dilations", [1, 1]))
        and attributes.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    )
    # The output must keep the input's width ("same" padding), so output blocks match input blocks.
    same_width = pads[1] + pads[3] == weights.shape[3] - 1
    return block if plain and same_width and width is not None and width % block == 0 else None


def space_to_depth_convs(model, skip: frozenset[str] | set[str] = frozenset()):
    """(model, rewrites): every eligible Conv (not named in `skip`) regrouped; the model is changed in place.

    A Conv whose only consumer is a Relu takes it along, so the quantizer still fuses the pair."""
    import onnx
    from onnx import numpy_helper

    from ptq_cli.transforms.graph import drop_dead_nodes, drop_unused_initializers

    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    widths = _static_widths(model)
    graph_outputs = {value.name for value in graph.output}
    rewrites: list[Rewrite] = []
    # By output name: the graph's node list changes under the loop.
    for key in [node.output[0] for node in graph.node if node.op_type == "Conv" and node.name not in skip]:
        conv = next(node for node in graph.node if node.op_type == "Conv" and node.output[0] == key)
        if conv.input[1] not in initializers:
            continue  # weights computed in the graph: not regrouped
        weights = numpy_helper.to_array(initializers[conv.input[1]])
        has_bias = len(conv.input) > 2 and bool(conv.input[2])
        if has_bias and conv.input[2] not in initializers:
            continue
        block = _eligible(_attributes(conv), weights, widths.get(conv.input[0]))
        if block is None:
            continue
        bias = numpy_helper.to_array(initializers[conv.input[2]]) if has_bias else np.zeros(weights.shape[0], weights.dtype)
        consumers = [node for node in graph.node if conv.output[0] in node.input]
        relu = consumers[0] if len(consumers) == 1 and consumers[0].op_type == "Relu" and conv.output[0] not in graph_outputs else None
        _regroup(graph, conv, relu, weights, bias, block, widths[conv.input[0]])
        rewrites.append(Rewrite(conv.name, block, weights.shape[1], weights.shape[0]))
    if rewrites:
        drop_dead_nodes(model)
        drop_unused_initializers(model)
        del graph.value_info[:]  # the rewritten tensors' old annotations no longer hold
        onnx.checker.check_model(model)
    return model, rewrites


def _regroup(graph, conv, relu, weights: np.ndarray, bias: np.ndarray, block: int, width: int) -> None:
    """Replace `conv` (and `relu`) by: pad -> group B pixels -> blocked Conv (-> Relu) -> ungroup."""
    from onnx import helper, numpy_helper

    out_channels, in_channels, height, _ = weights.shape
    pads = _attributes(conv).get("pads", [0, 0, 0, 0])
    new_weights = blocked_weights(weights, block)
    # Padded on the left by the conv's own left pad, and on the right to whole blocks: each output block
    # then reads new_weights.shape[3] whole input blocks from its own onward.
    padded = width + block * (new_weights.shape[3] - 1)
    prefix = f"{conv.name or conv.output[0]}{SUFFIX}"

    def constant(name: str, value: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(value, f"{prefix}/{name}"))
        return f"{prefix}/{name}"

    nodes = list(graph.node)
    producer = next((node for node in nodes if conv.input[0] in node.output), None)
    chain = []
    if producer is not None and producer.op_type == "Transpose" and _attributes(producer).get("perm") == TO_NCHW:
        nhwc = producer.input[0]  # tf2onnx's NHWC -> NCHW transpose at the input: undo it instead of adding one
    else:
        nhwc = f"{prefix}/nhwc"
        chain.append(helper.make_node("Transpose", [conv.input[0]], [nhwc], name=f"{prefix}/to_nhwc", perm=TO_NHWC))
    # Reshape target 0 keeps that dimension (N, H), -1 takes the rest: no static batch or height is needed.
    chain += [
        helper.make_node("Pad", [nhwc, constant("pads", np.array([0, 0, pads[1], 0, 0, 0, padded - width - pads[1], 0], np.int64))],
                         [f"{prefix}/padded"], name=f"{prefix}/pad", mode="constant"),
        helper.make_node("Reshape", [f"{prefix}/padded", constant("grouped_shape", np.array([0, 0, -1, block * in_channels], np.int64))],
                         [f"{prefix}/grouped"], name=f"{prefix}/group"),
        helper.make_node("Transpose", [f"{prefix}/grouped"], [f"{prefix}/grouped_nchw"], name=f"{prefix}/grouped_to_nchw", perm=TO_NCHW),
        helper.make_node("Conv", [f"{prefix}/grouped_nchw", constant("weights", new_weights), constant("bias", np.tile(bias, block))],
                         [f"{prefix}/conv"], name=conv.name, kernel_shape=[height, new_weights.shape[3]], pads=[pads[0], 0, pads[2], 0]),
    ]
    last = f"{prefix}/conv"
    if relu is not None:
        chain.append(helper.make_node("Relu", [last], [f"{prefix}/relu"], name=relu.name))
        last = f"{prefix}/relu"
    chain += [
        helper.make_node("Transpose", [last], [f"{prefix}/out_nhwc"], name=f"{prefix}/out_to_nhwc", perm=TO_NHWC),
        helper.make_node("Reshape", [f"{prefix}/out_nhwc", constant("ungrouped_shape", np.array([0, 0, -1, out_channels], np.int64))],
                         [f"{prefix}/ungrouped"], name=f"{prefix}/ungroup"),
        helper.make_node("Transpose", [f"{prefix}/ungrouped"], [(relu or conv).output[0]], name=f"{prefix}/out_to_nchw", perm=TO_NCHW),
    ]
    position = nodes.index(conv)
    graph.node.remove(conv)
    if relu is not None:
        graph.node.remove(relu)
    for node in reversed(chain):
        graph.node.insert(position, node)


def quantized_pads(model) -> int:
    """Run the rewrite's Pads on the 8-bit tensors of a QDQ model; returns how many.

    The quantizer leaves each as DequantizeLinear -> Pad -> QuantizeLinear with one scale and zero point
    on both sides, which onnxruntime runs in float (measured 0.9 ms for one 16-channel Pad of 128 images,
    against 0.11 ms in uint8). Padding the 8-bit tensor with its zero point (the code of 0.0) is the same."""
    from onnx import numpy_helper

    from ptq_cli.transforms.graph import drop_dead_nodes, drop_unused_initializers

    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}

    def value(name: str):
        return numpy_helper.to_array(initializers[name]) if name in initializers else None

    fused = 0
    for pad in [node for node in graph.node if node.op_type == "Pad" and node.name.endswith(f"{SUFFIX}/pad")]:
        dequantize = producers.get(pad.input[0])
        consumers = [node for node in graph.node if pad.output[0] in node.input]
        if dequantize is None or dequantize.op_type != "DequantizeLinear" or len(consumers) != 1 or consumers[0].op_type != "QuantizeLinear":
            continue
        quantize = consumers[0]
        scales, zero_points = (value(dequantize.input[1]), value(quantize.input[1])), (value(dequantize.input[2]), value(quantize.input[2]))
        if any(item is None for item in (*scales, *zero_points)) or not (np.array_equal(*scales) and np.array_equal(*zero_points)):
            continue
        pads = pad.input[1]
        del pad.input[:]
        pad.input.extend([dequantize.input[0], pads, dequantize.input[2]])  # constant value: the zero point
        pad.output[0] = quantize.output[0]
        graph.node.remove(quantize)
        fused += 1
    if fused:
        drop_dead_nodes(model)
        drop_unused_initializers(model)
    return fused
