"""Tidying of ONNX graphs: static Reshape targets, dead nodes, and one canonical form for converted models."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ptq_cli.errors import PtqError, first_line


def static_reshape_targets(model):
    """Each Reshape whose target is computed at run time (Shape -> Slice -> Concat, as tf2onnx emits for
    Flatten when its own reshape optimizer does not fold it), or is a constant that copies a dimension (0,
    as `x.view(x.size(0), -1)` folds to), gets the constant target [-1, d1, ...].

    onnx2torch's Reshape turns its target tensor into a Python list, so torch.jit.trace would bake in
    the example's batch size and the TorchScript file would reject every other batch size. The constant
    is exact when shape inference knows every output dimension but the batch one, which it takes from
    the input's batch dimension. The Shape arithmetic left without a consumer is then removed.
    """
    import onnx
    from onnx import numpy_helper

    without_torch_import()
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        if subgraph_depth(model.graph) > SYMBOLIC_NESTING:
            raise ValueError("nested too deep for symbolic shape inference")
        with outside_the_working_folder():
            model = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception:  # noqa: BLE001  it raises a bare Exception where it cannot follow a graph (ConvNeXt's LayerNorm as tf2onnx writes it)
        model = onnx.shape_inference.infer_shapes(model)  # fewer shapes known: fewer targets made static, none wrong
    # A constant target is left alone unless it copies a dimension (0): onnx2torch reads that dimension off
    # the input at run time, which torch.fx cannot trace.
    targets = {node.input[1] for node in model.graph.node if node.op_type == "Reshape" and len(node.input) > 1}
    initializers = {tensor.name for tensor in model.graph.initializer if tensor.name in targets and not np.any(numpy_helper.to_array(tensor) == 0)}
    shapes = {info.name: info.type.tensor_type.shape for info in [*model.graph.value_info, *model.graph.output]}
    batch_symbols = {dim.dim_param for value in model.graph.input for dim in value.type.tensor_type.shape.dim[:1] if dim.dim_param}
    rewritten = False
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.input[1] in initializers or node.output[0] not in shapes:
            continue
        dims = shapes[node.output[0]].dim
        if not dims or dims[0].dim_param not in batch_symbols or not all(dim.HasField("dim_value") for dim in dims[1:]):
            continue
        target = numpy_helper.from_array(np.array([-1, *(dim.dim_value for dim in dims[1:])], dtype=np.int64), f"{node.output[0]}__static_shape")
        model.graph.initializer.append(target)
        node.input[1] = target.name
        rewritten = True
    if rewritten:
        drop_dead_nodes(model)
        onnx.checker.check_model(model)
    return model


@contextlib.contextmanager
def outside_the_working_folder() -> Iterator[None]:
    """Runs the block from a scratch folder of ptq's own: onnxruntime's symbolic shape inference saves a graph it cannot
    finish as sym_shape_infer_temp.onnx, its weights in files beside it, in the working folder (the user's) before it raises."""
    before = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="ptq-shapes-") as scratch:
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(before)


def drop_dead_nodes(model) -> None:
    """Remove nodes none of whose outputs is used, until none is left."""
    graph_outputs = {value.name for value in model.graph.output}
    while True:
        used = graph_outputs | {name for node in model.graph.node for name in node.input}
        dead = [node for node in model.graph.node if not any(out in used for out in node.output)]
        if not dead:
            return
        for node in dead:
            model.graph.node.remove(node)


def computing_only(model, name: str, *more: str):
    """A copy of `model` whose outputs are the tensors `name` (and `more`), with only the nodes they depend on (onnxruntime
    runs every node of a graph whatever outputs a call asks for); None where one of them is no node's output or a node
    holds a subgraph (whose outer-scope reads are not among its inputs)."""
    graph = model.graph
    if _holds_subgraphs(graph):
        return None
    producers = {output: node for node in graph.node for output in node.output}
    names = (name, *more)
    if any(wanted not in producers for wanted in names):
        return None
    needed, pending = set(), list(names)
    while pending:
        node = producers.get(pending.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            pending.extend(node.input)
    return _part(model, [node for node in graph.node if id(node) in needed], None, names)


# onnxruntime's symbolic shape inference infers each subgraph again for every level above it (exponential in the
# nesting: 20 nested Ifs never finish); past this depth onnx's own shape inference, which is linear, is used.
SYMBOLIC_NESTING = 2


def subgraph_depth(graph) -> int:
    """How deep control flow (If, Loop, Scan) nests in `graph`: 0 for a graph without subgraphs."""
    deepest, pending = 0, [(graph, 0)]
    while pending:
        current, depth = pending.pop()
        deepest = max(deepest, depth)
        for node in current.node:
            for attribute in node.attribute:
                pending += [(attribute.g, depth + 1)] if attribute.HasField("g") else []
                pending += [(inner, depth + 1) for inner in attribute.graphs]
    return deepest


def _holds_subgraphs(graph) -> bool:
    import onnx

    return any(attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for node in graph.node for attribute in node.attribute)


def _part(model, kept: list, inputs: list | None, outputs: tuple[str, ...]):
    """A copy of `model` with only the nodes `kept`, reading `inputs` (ValueInfoProtos; None: the model's own) and
    computing `outputs`."""
    import onnx

    graph = model.graph
    read = {tensor for node in kept for tensor in node.input}
    made = {tensor for node in kept for tensor in node.output}
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    del cut.graph.node[:], cut.graph.input[:], cut.graph.output[:], cut.graph.initializer[:], cut.graph.value_info[:]
    cut.graph.node.extend(kept)
    cut.graph.input.extend(graph.input if inputs is None else inputs)
    cut.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in outputs)
    cut.graph.initializer.extend(init for init in graph.initializer if init.name in read)
    cut.graph.value_info.extend(value for value in graph.value_info if value.name in made)
    return cut


def part_after(model, initializer: str, output: str):
    """(part, reads): the nodes of a QDQ `model` whose values depend on `initializer` (an activation's scale), with the
    float nodes that feed them back to the nearest QuantizeLinear outputs, so that onnxruntime fuses the part as it
    fuses those nodes in the whole model, as a model of its own computing `output`; `reads`, the tensors it takes from
    the rest of the model (QuantizeLinear outputs or the model's inputs), which do not depend on `initializer`.
    None where `output` does not depend on it, a node holds a subgraph, or the part is the whole model or reads nothing."""

    graph = model.graph
    if _holds_subgraphs(graph):
        return None
    initializers = {init.name: init for init in graph.initializer}
    producers = {tensor: node for node in graph.node for tensor in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for tensor in node.input:
            consumers.setdefault(tensor, []).append(node)
    depending = _reached(consumers.get(initializer, []), lambda node: [after for tensor in node.output for after in consumers.get(tensor, [])])
    if output not in {tensor for node in depending.values() for tensor in node.output}:
        return None
    kept, reads, pending = dict(depending), [], list(depending.values())
    while pending:
        for tensor in pending.pop().input:
            producer = producers.get(tensor)
            if not tensor or tensor in initializers or (producer is not None and id(producer) in kept):
                continue
            if producer is None or producer.op_type == "QuantizeLinear":
                if tensor not in reads:
                    reads.append(tensor)
            else:
                kept[id(producer)] = producer
                pending.append(producer)
    if len(kept) == len(graph.node) or not reads:
        return None
    return _part(model, [node for node in graph.node if id(node) in kept], _typed_reads(graph, reads, producers, initializers), (output,)), reads


def _typed_reads(graph, reads: list[str], producers: dict, initializers: dict) -> list:
    """ValueInfoProtos for a part's `reads`: the model's own inputs as they are, QuantizeLinear outputs typed by their zero point."""
    import onnx

    inputs = {value.name: value for value in graph.input}
    typed = []
    for tensor in reads:
        producer = producers.get(tensor)
        zero_point = initializers.get(producer.input[2]) if producer is not None and len(producer.input) > 2 else None
        typed.append(inputs[tensor] if tensor in inputs else
                     onnx.helper.make_tensor_value_info(tensor, zero_point.data_type if zero_point is not None else onnx.TensorProto.UINT8, None))
    return typed


class ComputingPart(NamedTuple):
    model: Any  # the part, a model of its own
    reads: list[str]  # the tensors it takes: QuantizeLinear outputs known, or the model's inputs
    made: tuple[str, ...]  # the QuantizeLinear outputs it computes that nodes outside it, or the `leading` ones, read
    leading: tuple[str, ...]  # the nodes (by first output) that lead from those QuantizeLinear outputs to `name`


def computing_from(model, name: str, known: set[str]) -> ComputingPart | None:
    """The nodes the tensor `name` of a QDQ `model` depends on, back to the tensors in `known` (QuantizeLinear outputs,
    so that onnxruntime fuses the part as it fuses those nodes in the whole model) or the model's inputs, as a model
    computing `name` and the QuantizeLinear outputs it makes that the rest of the model reads (beside the nodes that
    lead from the last of them to `name`, which the layer reading `name` needs again). None where `name` is no node's
    output or a node holds a subgraph."""
    graph = model.graph
    if _holds_subgraphs(graph):
        return None
    producers = {tensor: node for node in graph.node for tensor in node.output}
    if name not in producers:
        return None
    initializers = {init.name: init for init in graph.initializer}
    inputs = {value.name for value in graph.input}
    kept: dict[int, Any] = {}
    reads: list[str] = []
    pending = [name]
    while pending:
        tensor = pending.pop()
        producer = producers.get(tensor)
        if (tensor in known and tensor != name) or producer is None:
            if tensor in known or tensor in inputs:
                reads.append(tensor)
            continue
        if id(producer) not in kept:
            kept[id(producer)] = producer
            pending.extend(read for read in producer.input if read and read not in initializers)
    reads = list(dict.fromkeys(reads))
    nodes = [node for node in graph.node if id(node) in kept]
    leading = _reached([producers[name]], lambda node: [producers[read] for read in node.input if read in producers and id(producers[read]) in kept
                                                         and producers[read].op_type != "QuantizeLinear"])
    readers = readers_up_to_quantizers(model)
    made = tuple(node.output[0] for node in nodes if node.op_type == "QuantizeLinear" and node.output[0] != name
                 and any(key not in kept or key in leading for key in readers(node.output[0])))
    part = _part(model, nodes, _typed_reads(graph, reads, producers, initializers), (name, *made))
    return ComputingPart(part, reads, made, tuple(node.output[0] for node in leading.values()))


def readers_up_to_quantizers(model) -> Callable[[str], dict[int, Any]]:
    """For a tensor of `model`, the nodes that read it, directly or through float nodes, up to the next QuantizeLinear
    nodes (included), by id: what must run again to use the tensor's value anew."""
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node)
    return lambda tensor: _reached(readers.get(tensor, []), lambda node: [] if node.op_type == "QuantizeLinear" else
                                  [after for output in node.output for after in readers.get(output, [])])


def _reached(start: list, following: Callable[[Any], list]) -> dict[int, Any]:
    """The nodes reached from `start` by `following`, by id."""
    found: dict[int, Any] = {}
    pending = list(start)
    while pending:
        node = pending.pop()
        if id(node) not in found:
            found[id(node)] = node
            pending.extend(following(node))
    return found


WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")  # the ONNX layers with weights that quantization, rounding and the pair rule act on


GENERATED_NAME = re.compile(r"^(.*__)(\d+)(:\d+)?$")  # tf2onnx's numbered names, e.g. const_fold_opt__140, conv2d_1/BiasAdd__6:0


def canonical_names(model):
    """Renumber tf2onnx's generated names (tensors, symbolic dimensions) in graph order; sort initializers by name.

    tf2onnx numbers the constants it folds in the order it meets them in a Python set, which changes
    with the interpreter's hash seed: without this, two conversions of one .h5 differ byte for byte.
    """
    graph = model.graph
    values = (*graph.input, *graph.output, *graph.value_info)
    dims = [dim for value in values for dim in value.type.tensor_type.shape.dim if dim.dim_param]
    order = [name for node in graph.node for name in (*node.input, *node.output)] + [init.name for init in graph.initializer]
    order += [dim.dim_param for dim in dims]
    renamed: dict[str, str] = {}
    for name in order:
        match = GENERATED_NAME.match(name)
        if match and name not in renamed:
            renamed[name] = f"{match.group(1)}{len(renamed) + 1}{match.group(3) or ''}"
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
        match = GENERATED_NAME.match(node.name)
        if match:  # a node's own name can carry a counter of tf2onnx's that no tensor shares (it grows within one process)
            renamed.setdefault(node.name, f"{match.group(1)}{len(renamed) + 1}{match.group(3) or ''}")
            node.name = renamed[node.name]
    for value in (*graph.initializer, *values):
        value.name = renamed.get(value.name, value.name)
    for dim in dims:
        dim.dim_param = renamed.get(dim.dim_param, dim.dim_param)
    initializers = sorted(graph.initializer, key=lambda init: init.name)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return model


def generated_node_names(model):
    """A copy of `model` whose every node, in subgraphs too, is named `node_<n>`: names ptq chose itself.

    onnx2torch names its torch modules after the ONNX nodes, and torch.fx writes module names unescaped into the
    Python source it generates and runs: a node name from the file would be code. Tensors keep their names
    (onnx2torch makes its own placeholder and buffer names; torch.fx sanitizes the rest)."""
    import onnx

    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    counter = 0
    graphs = [renamed.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            node.name = f"node_{counter}"
            counter += 1
            for attribute in node.attribute:
                graphs += [attribute.g] if attribute.HasField("g") else []
                graphs += list(attribute.graphs)
    for function in renamed.functions:
        for node in function.node:
            node.name = f"node_{counter}"
            counter += 1
    return renamed


def dense_initializers(model, max_bytes: int):
    """`model` with its sparse initializers (ONNX's sparse_initializer) as ordinary dense ones: the quantizers
    and converters read dense weights only. A dense form over `max_bytes` is refused (a few indices may declare
    gigabytes)."""
    from onnx import numpy_helper

    for sparse in list(model.graph.sparse_initializer):
        dims = [int(dim) for dim in sparse.dims]
        values = numpy_helper.to_array(sparse.values)
        indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
        name = sparse.values.name
        size = int(np.prod(dims)) if dims else 1
        if any(dim < 0 for dim in dims) or size * values.dtype.itemsize > max_bytes:
            raise PtqError(f"{model.graph.name or 'model'}: sparse weights '{name[:80]}' are {dims} when dense, over {max_bytes:,} bytes")
        if indices.ndim == 2:  # coordinates, one row per value
            indices = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(-1)
        if indices.size != values.size or (indices.size and (indices.min() < 0 or indices.max() >= size)):
            raise PtqError(f"{model.graph.name or 'model'}: sparse weights '{name[:80]}' have indices outside their {dims}")
        dense = np.zeros(size, dtype=values.dtype)
        dense[indices.reshape(-1)] = values.reshape(-1)
        model.graph.initializer.append(numpy_helper.from_array(dense.reshape(dims), name))
    del model.graph.sparse_initializer[:]
    return model


def drop_unused_initializers(model) -> None:
    used = {name for node in model.graph.node for name in node.input} | {value.name for value in model.graph.output}
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def fresh_names(taken: set[str]) -> Callable[[str], str]:
    """Names not yet in `taken`, each `name__privateN`."""
    counts: Counter[str] = Counter()

    def fresh(name: str) -> str:
        counts[name] += 1
        while f"{name}__private{counts[name]}" in taken:
            counts[name] += 1
        taken.add(f"{name}__private{counts[name]}")
        return f"{name}__private{counts[name]}"

    return fresh


def canonical(model):
    """One form for a tf2onnx conversion, whatever tf2onnx's optimizers did this time.

    tf2onnx does not always fold Keras' Flatten into a constant Reshape target (on one machine, or in one
    run out of several, it leaves Shape -> Slice -> Concat), and it numbers the constants it folds in a
    hash-seed-dependent order. Folding the target here, dropping what that leaves unused, naming every
    Reshape target after its node and renumbering the generated names makes two conversions of one .h5
    byte-identical.
    """
    model = static_reshape_targets(model)
    del model.graph.value_info[:]  # shape inference's annotations; tf2onnx writes none
    drop_dead_nodes(model)
    drop_unused_initializers(model)
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        target = initializers.get(node.input[1]) if node.op_type == "Reshape" else None
        if target is not None and sum(name == target.name for other in model.graph.node for name in other.input) == 1:
            target.name = node.input[1] = f"{node.output[0]}__static_shape"
    return canonical_names(model)


def symbolic_batch(model, batch: int | None = None):
    """A copy of `model` whose inputs' and outputs' first dimension is the symbolic 'N' and whose inferred
    intermediate shapes are dropped; with the fixed `batch`, each constant Reshape target that starts with it takes
    its first dimension from the input instead (tf2onnx writes a Keras Flatten as a Reshape to [1, 1000]). Whether
    the copy still computes the same is for the caller to check."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for value in [*copy.graph.input, *copy.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_param = "N"
    del copy.graph.value_info[:]
    if batch is not None:
        _free_reshape_batches(copy, batch)
    return copy


def _constant_arrays(graph, names: set[str]) -> dict[str, np.ndarray]:
    """The constant tensors called `names`, from the graph's initializers and its Constant nodes (the weights are not read)."""
    from onnx import numpy_helper

    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer if init.name in names}
    for node in graph.node:
        for attribute in node.attribute if node.op_type == "Constant" and node.output[0] in names else ():
            if attribute.name == "value":
                arrays[node.output[0]] = numpy_helper.to_array(attribute.t)
            elif attribute.name == "value_ints":
                arrays[node.output[0]] = np.array(list(attribute.ints), np.int64)
    return arrays


def _free_reshape_batches(model, batch: int) -> None:
    """Each Reshape whose constant target starts with `batch` reads a target of its own starting with -1 (or 0, the
    input's first dimension, where the target already holds a -1); the targets no node reads any more are removed."""
    from onnx import TensorProto, helper, numpy_helper

    graph, replaced = model.graph, set()
    constants = _constant_arrays(graph, {node.input[1] for node in graph.node if node.op_type == "Reshape" and len(node.input) > 1})
    for index, node in enumerate(graph.node):
        target = constants.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        allow_zero = any(attribute.name == "allowzero" and attribute.i for attribute in node.attribute)
        if target is None or target.ndim != 1 or not len(target) or target[0] != batch or (allow_zero and -1 in target[1:]):
            continue
        freed = target.astype(np.int64)
        freed[0] = 0 if -1 in target[1:] else -1
        name = f"{node.input[1]}__batch_free_{index}"
        graph.initializer.append(numpy_helper.from_array(freed, name))
        if model.ir_version < 4:  # an initializer is also a graph input there
            graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT64, list(freed.shape)))
        replaced.add(node.input[1])
        node.input[1] = name
    unused = replaced - {name for node in graph.node for name in node.input} - {value.name for value in graph.output}
    for kept in (graph.initializer, graph.input):
        survivors = [entry for entry in kept if entry.name not in unused]
        del kept[:]
        kept.extend(survivors)
    survivors = [node for node in graph.node if not (node.op_type == "Constant" and node.output[0] in unused)]
    del graph.node[:]
    graph.node.extend(survivors)


def fixed_input_size(model, name: str, shape: tuple[int, ...]):
    """The model with input `name` declared as `shape` (one image's dimensions, the batch kept) where its declared
    dimensions are open: a model that takes any height and width, fixed to the size it is used at (--input-size)."""
    for value in model.graph.input:
        if value.name != name:
            continue
        for dim, size in zip(list(value.type.tensor_type.shape.dim)[1:], shape, strict=True):
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                dim.Clear()
                dim.dim_value = int(size)
    return model


def default_opset(model) -> int:
    return next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), 0)


def upgrade_opset(model, minimum: int, target: int):
    """(model, note): models below `minimum` converted to `target` with onnx's own version converter."""
    import onnx
    from onnx import version_converter

    from ptq_cli.errors import PtqError

    opset = default_opset(model)
    if opset >= minimum:
        return model, None
    try:
        upgraded = version_converter.convert_version(model, target)
        _raise_ir_version(upgraded)
        onnx.checker.check_model(upgraded)
    except Exception as error:  # the converter raises RuntimeError or its own adapter errors
        raise PtqError(f"{model.graph.name or 'model'}: opset {opset} could not be upgraded to {target} ({first_line(error)})") from error
    return upgraded, f"opset {opset} upgraded to {target} (onnx.version_converter): quantization needs opset {minimum} or later"


def _raise_ir_version(model) -> None:
    """onnx's version converter keeps the IR version, and IR version 3 (opset 8 and before) lists every initializer
    among the graph's inputs, so the initializers quantization adds would lack theirs: the upgraded model takes the
    IR version its opsets need, and its initializers stop being inputs (constants again, as quantization needs)."""
    import onnx

    needed = onnx.helper.find_min_ir_version_for(list(model.opset_import))
    if model.ir_version >= needed:
        return
    model.ir_version = needed
    initializers = {init.name for init in model.graph.initializer}
    inputs = [value for value in model.graph.input if value.name not in initializers]
    del model.graph.input[:]
    model.graph.input.extend(inputs)


def depthwise_convs(model) -> list[str]:
    """The depthwise convolutions of a graph (one group per input channel, more than one channel): one weight
    scale for all their channels leaves most of them a few codes (MobileNet, EfficientNet)."""
    names = []
    weights = {init.name: tuple(init.dims) for init in model.graph.initializer}
    for node in model.graph.node:
        shape = weights.get(node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 else None
        if shape is not None and len(shape) == 4 and depthwise_multiplier(node, shape):
            names.append(node.name or node.output[0])
    return names


def depthwise_multiplier(node, weight_dims) -> int:
    """Output channels per group of a Conv with one input channel per group and more than one group
    (a depthwise convolution; 1 for the plain kind), else 0."""
    group = next((attribute.i for attribute in node.attribute if attribute.name == "group"), 1)
    dims = tuple(weight_dims)
    if node.op_type != "Conv" or group <= 1 or len(dims) < 3 or dims[1] != 1 or dims[0] < group:
        return 0
    return dims[0] // group


def whole_map_average_pools(model) -> list:
    """The AveragePool nodes that leave one value per channel (their output's spatial dimensions are all 1, by shape
    inference): a global average pool written as AveragePool, as Keras' AveragePooling2D before a classifier exports.
    onnxruntime's QDQ quantizer gives an AveragePool's output its input's scale; an average over a whole map spans
    a fraction of that range, so the features the classifier reads would keep a few codes of it."""
    import onnx

    pools = [node for node in model.graph.node if node.op_type == "AveragePool" and node.output]
    if not pools:
        return []

    def shapes(graph) -> dict:
        return {value.name: value.type.tensor_type.shape.dim for value in (*graph.value_info, *graph.output)}

    known = shapes(model.graph)  # quant_pre_process's shape inference annotates the graph it writes
    if any(pool.output[0] not in known for pool in pools):
        # A copy of the whole model, so only where the annotations do not tell; a model over protobuf's 2 GB, or one
        # the checker rejects, keeps what is annotated.
        with contextlib.suppress(Exception):
            known = shapes(onnx.shape_inference.infer_shapes(model).graph)
    return [pool for pool in pools if (dims := known.get(pool.output[0])) is not None and len(dims) > 2
            and all(dim.HasField("dim_value") and dim.dim_value == 1 for dim in dims[2:])]


def clamped_activations(model) -> list[str]:
    """The Clip nodes with a finite upper bound (ReLU6 and its kin): their outputs pile up at the top code,
    where pairs of u8 x s8 products overflow on x86 CPUs without VNNI far more often than after a ReLU."""
    from onnx import numpy_helper

    constants = {init.name: init for init in model.graph.initializer}
    constants.update({node.output[0]: attribute.t for node in model.graph.node if node.op_type == "Constant"
                      for attribute in node.attribute if attribute.name == "value"})
    names = []
    for node in model.graph.node:
        if node.op_type != "Clip":
            continue
        bound = next((attribute.f for attribute in node.attribute if attribute.name == "max"), None)  # opset < 11
        if bound is None and len(node.input) > 2 and node.input[2] in constants:
            values = numpy_helper.to_array(constants[node.input[2]])
            bound = float(values.reshape(-1)[0]) if values.size == 1 else None
        if bound is not None and np.isfinite(bound):
            names.append(node.name or node.output[0])
    return names


TORCH_HELPERS = "onnxruntime.tools.pytorch_export_helpers"


def without_torch_import() -> None:
    """Imports onnxruntime.tools (its shape inference) without the torch import its package makes, where torch is
    installed, for a helper of its own ptq never calls (3.5 s of a `ptq quantize` that runs no torch): while the package
    is first imported, that helper's module is a stand-in whose one name imports the real module when called."""
    import importlib
    import sys
    import types

    if "onnxruntime.tools" in sys.modules or "torch" in sys.modules or TORCH_HELPERS in sys.modules:
        return
    stand_in = types.ModuleType(TORCH_HELPERS)

    def infer_input_info(*args, **kwargs):
        return importlib.import_module(TORCH_HELPERS).infer_input_info(*args, **kwargs)

    stand_in.infer_input_info = infer_input_info  # type: ignore[attr-defined]
    sys.modules[TORCH_HELPERS] = stand_in
    try:
        importlib.import_module("onnxruntime.tools")
    except ImportError:  # an onnxruntime whose package wants more of the helper: imported whole by the caller, torch and all
        sys.modules.pop("onnxruntime.tools", None)
    finally:
        if sys.modules.get(TORCH_HELPERS) is stand_in:
            del sys.modules[TORCH_HELPERS]  # an import of it from now on is the real one


def preprocess(model, output: Path | str) -> None:
    """onnxruntime's recommended pre-quantization step: shape inference plus its basic graph optimizer,
    which folds the batch-norm Mul/Add after each Conv into the Conv. `output` is in a folder of ptq's own."""
    import onnx
    from onnxruntime.quantization import quant_pre_process

    without_torch_import()  # quant_pre_process imports onnxruntime.tools
    try:
        if subgraph_depth(model.graph) > SYMBOLIC_NESTING:
            raise ValueError("nested too deep for symbolic shape inference")
        with outside_the_working_folder():
            quant_pre_process(model, str(Path(output).resolve()))
        return
    except Exception:  # noqa: BLE001  its symbolic shape inference cannot follow every graph (a Reshape to a computed shape, as
        pass  # transformers export): onnx's own shape inference then, as quant_pre_process offers
    given = Path(output).with_name(Path(output).stem + ".given.onnx")  # from a file: given a ModelProto, that path strips its weights
    try:
        onnx.save(model, str(given))
        with outside_the_working_folder():
            quant_pre_process(str(given.resolve()), str(Path(output).resolve()), skip_symbolic_shape=True)
    except Exception as error:  # shape inference and the optimizer raise many types
        raise PtqError(f"{model.graph.name or 'model'}: onnxruntime's quant_pre_process failed ({first_line(error)})") from error


def preprocessed(model, workdir: Path):
    """`preprocess` into workdir/preprocessed.onnx, loaded (the graph quantize_static will see)."""
    import onnx

    path = Path(workdir) / "preprocessed.onnx"
    preprocess(model, path)
    return onnx.load(str(path))


