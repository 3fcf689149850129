"""Edits of QDQ graphs after the writer: each int8 tensor's QuantizeLinear/DequantizeLinear pair made private to its
reader (a copy per reader, the same arithmetic), nodes left in float, the output scores kept in float, and the graph that
also gives each image's own activation extremes (`--method per-image`)."""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from ptq_cli.transforms.graph import WEIGHTED_OPS, default_opset, drop_dead_nodes, drop_unused_initializers, fresh_names

# What giving each layer its own weight copy may add, beyond the model's own initializers: a crafted graph that feeds
# one large weight to thousands of nodes is left as it is (onnxruntime then refuses it in one line).
MAX_PRIVATE_COPY_BYTES = 256 << 20


def private_weight_dequantizers(model, max_added_bytes: int = MAX_PRIVATE_COPY_BYTES):
    """The model where each int8 weight's DequantizeLinear feeds one node and owns its scale and zero point: the same
    arithmetic. onnxruntime 1.32's exact-kernel rewrite (session.x64quantprecision) names the uint8 copy of a weight
    after its source, and fails ("Attempt to replace the existing tensor") on the second node that shares one.
    The model itself where nothing is shared, or where the copies would add more than `max_added_bytes`; else a copy."""
    import onnx

    uses = Counter(name for node in model.graph.node for name in node.input) + Counter(value.name for value in model.graph.output)
    weights = {node.output[0]: node for node in _weight_dequantizers(model.graph)}
    if not any(uses[name] > 1 for node in weights.values() for name in (*node.input, node.output[0])):
        return model
    sizes = {init.name: init.ByteSize() for init in model.graph.initializer}
    copied = sum(uses[node.output[0]] * sizes.get(name, 0) for node in weights.values() for name in node.input)
    if copied > sum(sizes.values()) + max_added_bytes:
        return model
    private = onnx.ModelProto()
    private.CopyFrom(model)
    graph = private.graph
    initializers, consumers = {init.name: init for init in graph.initializer}, _readers(graph)
    fresh = fresh_names(set(initializers) | {name for node in graph.node for name in (node.name, *node.output)})
    outputs, private_nodes = {value.name for value in graph.output}, []
    for node in graph.node:
        if node.output[0] not in weights or node.output[0] in outputs:
            private_nodes.append(node)
            continue
        for consumer, slot in consumers.get(node.output[0], []):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name, copy.output[0] = fresh(node.name or node.output[0]), fresh(node.output[0])
            for position, name in enumerate(node.input):
                if name in initializers:
                    tensor = graph.initializer.add()
                    tensor.CopyFrom(initializers[name])
                    tensor.name = copy.input[position] = fresh(name)
            consumer.input[slot] = copy.output[0]
            private_nodes.append(copy)
    del graph.node[:]
    graph.node.extend(private_nodes)
    drop_unused_initializers(private)
    return private


def private_activation_quantizers(model) -> int:
    """In place: each int8 activation's QuantizeLinear -> DequantizeLinear read by several nodes becomes one such pair
    per reader, each owning its scale and zero point: the same arithmetic. On x86, onnxruntime runs an int8 layer on
    integer kernels by shifting its activations to uint8 (its QDQS8ToU8 rewrite), which it does only to a pair with one
    reader, and it merges identical pairs back into one (common subexpression elimination) unless their scales and zero
    points are distinct initializers. Returns how many pairs were added."""
    import onnx

    graph = model.graph
    initializers, readers = {init.name: init for init in graph.initializer}, _readers(graph)
    outputs = {value.name for value in graph.output}
    fresh = fresh_names(set(initializers) | {name for node in graph.node for name in (node.name, *node.output)})

    def copied(node, source: str | None = None):
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name, copy.output[0] = fresh(node.name or node.output[0]), fresh(node.output[0])
        copy.input[0] = source or node.input[0]
        for position in (1, 2):
            tensor = graph.initializer.add()
            tensor.CopyFrom(initializers[node.input[position]])
            tensor.name = copy.input[position] = fresh(node.input[position])
        return copy

    nodes, added = [], 0
    for node in graph.node:
        nodes.append(node)
        pairs = _shared_int8_pair(node, initializers, readers, outputs)
        for dequantize, reader, slot in pairs[1:]:
            quantize = copied(node)
            private = copied(dequantize, quantize.output[0])
            reader.input[slot] = private.output[0]
            nodes += [quantize, private]
            added += 1
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead_nodes(model)
    drop_unused_initializers(model)
    return added


def _readers(graph) -> dict[str, list[tuple[Any, int]]]:
    """By tensor name, each node reading it and the input slot it reads it at."""
    readers: dict[str, list[tuple[Any, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))
    return readers


def _shared_int8_pair(node, initializers: dict, readers: dict[str, list[tuple[Any, int]]], outputs: set[str]) -> list[tuple[Any, Any, int]]:
    """(DequantizeLinear, reader, input slot) for each reader of `node`'s pairs, if `node` quantizes an activation to int8
    (scale and zero point initializers) and only DequantizeLinear nodes read it, none a graph output; else []."""
    import onnx

    if node.op_type != "QuantizeLinear" or len(node.input) < 3 or node.input[0] in initializers or node.output[0] in outputs:
        return []
    zero_point, scale = initializers.get(node.input[2]), initializers.get(node.input[1])
    if zero_point is None or scale is None or zero_point.data_type != onnx.TensorProto.INT8:
        return []
    dequantizers = [reader for reader, _ in readers.get(node.output[0], [])]
    if any(reader.op_type != "DequantizeLinear" or reader.output[0] in outputs or len(reader.input) < 3
           or not all(name in initializers for name in reader.input[1:3]) for reader in dequantizers):
        return []
    return [(dequantize, reader, slot) for dequantize in dequantizers for reader, slot in readers.get(dequantize.output[0], [])]


def _weight_dequantizers(graph) -> list:
    """The DequantizeLinear nodes of int8 initializers (the weights onnxruntime's exact kernels convert)."""
    import onnx

    int8 = {init.name for init in graph.initializer if init.data_type == onnx.TensorProto.INT8}
    return [node for node in graph.node if node.op_type == "DequantizeLinear" and node.input[0] in int8]


def keep_float_layers(model, float_nodes) -> int:
    """Give each float Conv/Gemm of a QDQ model that reads a per-tensor DequantizeLinear its own
    DequantizeLinear, the same scale and zero point repeated along the channels (axis 1): the same values,
    but onnxruntime's load-time WeightBiasQuantization, which quantizes the float weights of a Conv/Gemm
    between a per-tensor DequantizeLinear and a QuantizeLinear (symmetric, per tensor, full range), takes
    only per-tensor inputs, so the layer stays float. Returns how many (opset 13 and later: per-axis needs it)."""
    from onnx import helper, numpy_helper

    if next((opset.version for opset in model.opset_import if opset.domain in ("", "ai.onnx")), 0) < 13:
        return 0
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    kept, floating = 0, set(float_nodes)
    for node in [node for node in graph.node if node.name in floating and node.op_type in ("Conv", "Gemm")]:
        dequantize = producers.get(node.input[0])
        weight = initializers.get(node.input[1]) if len(node.input) > 1 else None
        if dequantize is None or dequantize.op_type != "DequantizeLinear" or weight is None or len(dequantize.input) < 3:
            continue
        scale, zero = (initializers.get(name) for name in dequantize.input[1:3])
        if scale is None or zero is None or numpy_helper.to_array(scale).size != 1:
            continue
        attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
        dims = list(weight.dims)
        channels = dims[1] * int(attributes.get("group", 1)) if node.op_type == "Conv" else (dims[1] if attributes.get("transB") else dims[0])
        prefix = f"{node.name}_float_input"
        graph.initializer.extend([
            numpy_helper.from_array(np.repeat(numpy_helper.to_array(scale).reshape(1), channels), f"{prefix}_scale"),
            numpy_helper.from_array(np.repeat(numpy_helper.to_array(zero).reshape(1), channels), f"{prefix}_zero_point"),
        ])
        own = helper.make_node("DequantizeLinear", [dequantize.input[0], f"{prefix}_scale", f"{prefix}_zero_point"], [prefix], name=prefix, axis=1)
        graph.node.insert(list(graph.node).index(node), own)
        node.input[0] = prefix
        kept += 1
    return kept


SCORE_PASS_THROUGH = ("Softmax", "LogSoftmax", "Reshape", "Flatten", "Squeeze", "Identity")  # the scores' values or their order, nothing mixed in


def float_scores(model) -> int:
    """Remove the QuantizeLinear -> DequantizeLinear pairs between a QDQ model's outputs and the last weighted layer
    before them (through a final Softmax, shape-only ops and an Add or Mul of a constant, such as a separate bias):
    the scores are still computed from 8-bit inputs and weights, but no longer rounded to 256 levels before the
    caller reads them. onnxruntime fuses such a Gemm into a QGemm with a float output, so it costs no speed.
    Each pair becomes an Identity, so every tensor keeps its name. Returns how many pairs were removed."""
    from onnx import helper

    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    constants = {init.name for init in graph.initializer} | {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    consumers = {output.name: 1 for output in graph.output}  # a graph output is read by the caller
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1

    def is_constant(name: str) -> bool:
        node = producers.get(name)
        return name in constants or (node is not None and node.op_type == "DequantizeLinear" and node.input[0] in constants)

    pairs: dict[str, tuple] = {}  # by the DequantizeLinear's output: outputs may share a tail
    for output in graph.output:
        node = producers.get(output.name)
        while node is not None and node.op_type not in WEIGHTED_OPS:
            if node.op_type == "DequantizeLinear":
                quantize = producers.get(node.input[0])
                if quantize is None or quantize.op_type != "QuantizeLinear" or consumers.get(quantize.output[0]) != 1 or is_constant(quantize.input[0]):
                    break
                pairs[node.output[0]] = (quantize, node)
                node = producers.get(quantize.input[0])
            elif node.op_type in SCORE_PASS_THROUGH:
                node = producers.get(node.input[0])
            elif node.op_type in ("Add", "Mul") and len(node.input) == 2 and sum(is_constant(name) for name in node.input) == 1:
                node = producers.get(next(name for name in node.input if not is_constant(name)))
            else:
                break
    for quantize, dequantize in pairs.values():
        graph.node.insert(list(graph.node).index(dequantize), helper.make_node("Identity", [quantize.input[0]], [dequantize.output[0]],
                                                                               name=f"{dequantize.output[0]}_float_scores"))
        graph.node.remove(dequantize)
        graph.node.remove(quantize)
    return len(pairs)


class ImageExtremes(NamedTuple):
    model: Any  # the graph, its outputs replaced by two per activation: its minimum and its maximum over each image
    activations: list[str]  # in the order of those output pairs
    # Those whose first axis shape inference shows is the batch; for the others it lost track of the batch (a Reshape to
    # -1, a broadcast against one), and a run tells (onnxruntime backend, `_image_extremes`).
    known: frozenset[str] = frozenset()


def with_image_extremes(model) -> ImageExtremes:
    """A copy of `model` that gives, for each float activation whose first axis is the batch (the input's), its
    smallest and largest value over each image (ReduceMin/ReduceMax over every other axis): two floats per image and
    activation, where the activations themselves could take gigabytes. Where the input's batch is symbolic, so are
    the activations whose first axis shape inference cannot name (`ImageExtremes.known` holds the others)."""
    import onnx
    from onnx import TensorProto, helper

    inferred = onnx.shape_inference.infer_shapes(model)
    batch = _first_axis(model.graph.input[0])
    initializers = {init.name for init in model.graph.initializer}
    computed = {name for node in model.graph.node for name in node.output} | {value.name for value in model.graph.input}
    values = [] if batch is None else [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    unnamed = isinstance(batch, str)  # a symbolic batch: an activation's unknown or other symbolic first axis may be it
    ranks = {value.name: len(value.type.tensor_type.shape.dim)  # value_info may still name tensors a rewrite removed
             for value in values if value.name in computed - initializers and value.type.tensor_type.elem_type == TensorProto.FLOAT
             and len(value.type.tensor_type.shape.dim) >= 2 and (_first_axis(value) == batch or unnamed and not isinstance(_first_axis(value), int))}
    known = frozenset(value.name for value in values if value.name in ranks and _first_axis(value) == batch)
    augmented = onnx.ModelProto.FromString(model.SerializeToString())
    del augmented.graph.output[:]
    fresh = fresh_names({name for node in model.graph.node for name in node.output} | initializers)
    axes_input = default_opset(model) >= 18  # ReduceMin/ReduceMax take their axes as an input from opset 18
    axes = {rank: fresh(f"ptq_extremes_axes_{rank}") for rank in set(ranks.values())}
    if axes_input:
        augmented.graph.initializer.extend(helper.make_tensor(name, TensorProto.INT64, [rank - 1], range(1, rank)) for rank, name in axes.items())
    for name, rank in ranks.items():
        for op in ("ReduceMin", "ReduceMax"):
            extreme = fresh(f"{name}_{op}")
            augmented.graph.node.append(helper.make_node(op, [name, axes[rank]], [extreme], keepdims=0) if axes_input
                                        else helper.make_node(op, [name], [extreme], keepdims=0, axes=list(range(1, rank))))
            augmented.graph.output.append(helper.make_tensor_value_info(extreme, TensorProto.FLOAT, None))
    return ImageExtremes(augmented, list(ranks), known)


def _first_axis(value) -> str | int | None:
    dims = value.type.tensor_type.shape.dim
    if not dims:
        return None
    return dims[0].dim_param or (dims[0].dim_value if dims[0].HasField("dim_value") else None)


def _positive_scalar(name: str, producers: dict, initializers: dict) -> float | None:
    """The value of `name` where it is one positive number: an initializer, a Constant, or a DequantizeLinear of an
    initializer (a quantized operand); else None."""
    from onnx import numpy_helper

    node = producers.get(name)
    if node is None and name in initializers:
        value = numpy_helper.to_array(initializers[name]).astype(np.float64)
    elif node is not None and node.op_type == "Constant":
        value = next((numpy_helper.to_array(attribute.t).astype(np.float64) for attribute in node.attribute if attribute.name == "value"), np.zeros(2))
    elif node is not None and node.op_type == "DequantizeLinear" and all(part in initializers for part in node.input):
        quantized, scale, *zero = (numpy_helper.to_array(initializers[part]).astype(np.float64) for part in node.input)
        value = (quantized - (zero[0] if zero else 0.0)) * scale if scale.size == 1 and (not zero or zero[0].size == 1) else np.zeros(2)
    else:
        return None
    if value.size != 1:
        return None
    number = float(value.reshape(-1)[0])
    return number if number > 0 and np.isfinite(number) else None


def _scaling(node, producers: dict, initializers: dict) -> tuple[Any, float] | None:
    """(the DequantizeLinear of the activation, the factor) where `node` multiplies an activation dequantized per
    tensor by a positive constant, or divides it by one; else None."""
    if node.domain not in ("", "ai.onnx") or len(node.input) != 2 or node.op_type not in ("Mul", "Div"):
        return None
    slots = (0, 1) if node.op_type == "Mul" else (0,)
    for slot in slots:
        factor, source = _positive_scalar(node.input[1 - slot], producers, initializers), producers.get(node.input[slot])
        if (factor is not None and source is not None and source.op_type == "DequantizeLinear" and source.input[1] in initializers
                and int(np.prod(initializers[source.input[1]].dims)) == 1):  # a per-tensor scale
            return source, factor if node.op_type == "Mul" else 1.0 / factor
    return None


def _requantized_readers(node, readers: dict[str, list[tuple[Any, int]]], outputs: set[str]) -> list | None:
    """The DequantizeLinear nodes that read `node`'s output through its one reader, a QuantizeLinear; None where
    anything else reads it or it is a graph output."""
    quantizers = [reader for reader, _ in readers.get(node.output[0], [])]
    if node.output[0] in outputs or len(quantizers) != 1 or quantizers[0].op_type != "QuantizeLinear" or quantizers[0].output[0] in outputs:
        return None
    dequantizers = [reader for reader, _ in readers.get(quantizers[0].output[0], [])]
    if not dequantizers or any(reader.op_type != "DequantizeLinear" or reader.output[0] in outputs for reader in dequantizers):
        return None
    return dequantizers


def folded_constant_scalings(model) -> int:
    """In place: each Mul (or Div) of a quantized activation by a positive one-element constant (HardSwish's and
    hard-sigmoid's x * 1/6 or x / 6, a rescaling of the input), whose output is quantized and read only through
    DequantizeLinear, is folded into a DequantizeLinear of the activation's codes with the scale multiplied: the
    product rounded onto a third grid becomes exact, and onnxruntime runs one QLinearMul (or a float Div between
    conversions) fewer. Returns the nodes folded."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers, readers = {init.name: init for init in graph.initializer}, _readers(graph)
    producers = {out: node for node in graph.node for out in node.output}
    outputs = {value.name for value in graph.output}
    fresh = fresh_names(set(initializers) | {name for node in graph.node for name in (node.name, *node.output)})
    folded, added = 0, []
    for node in list(graph.node):
        found = _scaling(node, producers, initializers)
        dequantizers = _requantized_readers(node, readers, outputs) if found else None
        if found is None or dequantizers is None:
            continue
        source, factor = found
        scale = numpy_helper.to_array(initializers[source.input[1]])
        scale_name = fresh(f"{source.input[1]}_times_{node.name or node.output[0]}")
        graph.initializer.append(numpy_helper.from_array((scale * np.float32(factor)).astype(scale.dtype), scale_name))
        scaled = helper.make_node("DequantizeLinear", [source.input[0], scale_name, *source.input[2:]], [fresh(node.output[0])],
                                  name=fresh(node.name or node.output[0]))
        scaled.attribute.extend(source.attribute)
        added.append((node, scaled))
        for dequantize in dequantizers:
            for reader, position in readers.get(dequantize.output[0], []):
                reader.input[position] = scaled.output[0]
        folded += 1
    for mul, scaled in added:  # each beside the Mul it replaces, so the graph stays in order
        graph.node.insert(list(graph.node).index(mul), scaled)
    drop_dead_nodes(model)
    drop_unused_initializers(model)
    return folded
