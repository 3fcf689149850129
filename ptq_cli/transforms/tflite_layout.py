"""A full-integer .tflite laid out as a microcontroller holds it: the same computation, bit for bit, in fewer
bytes of flash and of TFLite Micro's tensor arena.

The converter leaves what a fixed-shape model does not need: a Keras Flatten becomes SHAPE, STRIDED_SLICE and
PACK ops computing the RESHAPE's target at run time (each op and tensor costs arena in TFLite Micro), tensors
and buffers nothing reads, and tensor names that join every fused op's name. And TFLite Micro runs the ops in
the file's order, so the order decides which activations are alive together: in a residual block whose
shortcut convolution runs last, the block's input stays alive across its widest convolution.

With the batch left free, the converter writes a dilated convolution as SPACE_TO_BATCH_ND, a plain convolution and
BATCH_TO_SPACE_ND, with the batch-1 shapes of the tensors between them wrong (1 where the blocks make 4): TFLite Micro
sizes those ops from the file's shapes and pads with 0 instead of the zero point, so it computes another function
than LiteRT does. `microcontroller_layout` gives such a convolution its dilation back (the same integer sums: padding
at the zero point adds nothing, as a skipped position), makes each RESHAPE's target a constant (the batch left free),
drops what no output needs, keeps each tensor's first fused name, and orders the ops so that the fewest activation bytes are alive
at once (`low_peak_order`), keeping the file's own order unless TFLite Micro's own arena figure is smaller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ptq_cli.transforms.tflite_graph import is_constant, low_peak_order, op_kind, pack_model, schema_module, step_peaks, unpack_bytes


@dataclass(frozen=True)
class Layout:
    data: bytes
    changes: tuple[str, ...]  # what was done, e.g. "3 shape ops folded into constant RESHAPE targets"


def _fold_shapes(model_object) -> int:
    """Each RESHAPE whose output shape is known but whose target is computed at run time takes it as a constant
    (-1 for the batch); the ops that computed it are then dropped as dead. The number of RESHAPEs changed."""
    schema = schema_module()
    graph = model_object.subgraphs[0]
    folded = 0
    for operator in graph.operators:
        if op_kind(model_object, operator) != "RESHAPE" or len(operator.inputs) < 2 or is_constant(model_object, int(operator.inputs[1])):
            continue
        output = graph.tensors[int(operator.outputs[0])]
        signature = list(output.shapeSignature) if output.shapeSignature is not None and len(output.shapeSignature) else list(output.shape)
        if any(int(dim) < 0 for dim in signature[1:]) or not len(signature):
            continue
        target = np.array([-1, *[int(dim) for dim in signature[1:]]], np.int32)
        buffer = schema.BufferT()
        buffer.data = np.frombuffer(target.tobytes(), np.uint8)
        model_object.buffers.append(buffer)
        tensor = schema.TensorT()
        tensor.shape, tensor.type, tensor.buffer, tensor.name = [len(target)], schema.TensorType.INT32, len(model_object.buffers) - 1, b"shape"
        graph.tensors.append(tensor)
        operator.inputs = [int(operator.inputs[0]), len(graph.tensors) - 1]
        folded += 1
    return folded


def _constant_ints(model_object, index: int) -> np.ndarray | None:
    if index < 0 or not is_constant(model_object, index):
        return None
    tensor = model_object.subgraphs[0].tensors[index]
    return np.frombuffer(np.asarray(model_object.buffers[tensor.buffer].data, np.uint8).tobytes(), np.int32).reshape([int(dim) for dim in tensor.shape])


def _same_grid(graph, first: int, second: int) -> bool:
    """Two tensors on the same int8 grid (scales and zero points), as SPACE_TO_BATCH_ND and BATCH_TO_SPACE_ND keep it."""
    one, other = graph.tensors[first].quantization, graph.tensors[second].quantization
    as_lists = [(list(q.scale), list(q.zeroPoint)) if q is not None and q.scale is not None else None for q in (one, other)]
    return as_lists[0] == as_lists[1]


def _block_steps(model_object, space, batch) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(block, paddings, crops) of a SPACE_TO_BATCH_ND and a BATCH_TO_SPACE_ND over the same 2-D block, all constant;
    None otherwise."""
    block, paddings, crops, block_back = (_constant_ints(model_object, int(index)) for index in (*space.inputs[1:3], batch.inputs[2], batch.inputs[1]))
    if block is None or paddings is None or crops is None or block_back is None or block.shape != (2,) or not np.array_equal(block, block_back):
        return None
    return block, paddings, crops


def _dilated_padding(schema, options, kernel: list[int], steps: tuple[np.ndarray, np.ndarray, np.ndarray], sizes: tuple[list[int], list[int]]) -> int | None:
    """The padding (SAME or VALID) of the dilated convolution that SPACE_TO_BATCH_ND (`steps`: its block and paddings),
    a VALID stride-1 convolution (`options`, its `kernel` height and width) and BATCH_TO_SPACE_ND (its crops) compute,
    where the input's and the output's height and width are `sizes`; None where they compute no such convolution."""
    block, paddings, crops = (values.reshape(-1, 2) if values.ndim > 1 else values for values in steps)
    if (options.padding != schema.Padding.VALID or (options.strideH, options.strideW) != (1, 1)
            or (options.dilationHFactor, options.dilationWFactor) != (1, 1) or paddings.shape != (2, 2) or np.any(crops[:, 0] != 0)):
        return None
    inputs, outputs = sizes
    spans = [(size - 1) * int(rate) for size, rate in zip(kernel, block, strict=True)]
    if list(paddings[:, 0]) == [span // 2 for span in spans] and outputs == inputs:
        return schema.Padding.SAME
    if not np.any(paddings[:, 0]) and outputs == [size - span for size, span in zip(inputs, spans, strict=True)]:
        return schema.Padding.VALID
    return None


def _fold_dilations(model_object) -> int:
    """Each SPACE_TO_BATCH_ND -> CONV_2D or DEPTHWISE_CONV_2D -> BATCH_TO_SPACE_ND made one dilated convolution, where
    it computes one; the number made."""
    schema, graph = schema_module(), model_object.subgraphs[0]
    readers: dict[int, list] = {}
    for operator in graph.operators:
        for index in operator.inputs:
            readers.setdefault(int(index), []).append(operator)
    outputs, dropped = {int(index) for index in graph.outputs}, []
    for space in graph.operators:
        made = int(space.outputs[0])
        if op_kind(model_object, space) != "SPACE_TO_BATCH_ND" or made in outputs or len(readers.get(made, [])) != 1:
            continue
        convolution = readers[made][0]
        summed = int(convolution.outputs[0])
        if op_kind(model_object, convolution) not in ("CONV_2D", "DEPTHWISE_CONV_2D") or int(convolution.inputs[0]) != made \
                or summed in outputs or len(readers.get(summed, [])) != 1 or op_kind(model_object, readers[summed][0]) != "BATCH_TO_SPACE_ND":
            continue
        batch = readers[summed][0]
        steps = _block_steps(model_object, space, batch)
        source, result = int(space.inputs[0]), int(batch.outputs[0])
        if steps is None or not (_same_grid(graph, source, made) and _same_grid(graph, summed, result)):
            continue
        kernel = [int(dim) for dim in graph.tensors[int(convolution.inputs[1])].shape[1:3]]
        sizes = ([int(dim) for dim in graph.tensors[source].shape[1:3]], [int(dim) for dim in graph.tensors[result].shape[1:3]])
        padding = _dilated_padding(schema, convolution.builtinOptions, kernel, steps, sizes)
        if padding is None:
            continue
        options = convolution.builtinOptions
        options.padding, options.dilationHFactor, options.dilationWFactor = padding, int(steps[0][0]), int(steps[0][1])
        convolution.inputs = [source, *[int(index) for index in convolution.inputs[1:]]]
        convolution.outputs = [result]
        dropped += [space, batch]
    graph.operators = [operator for operator in graph.operators if all(operator is not gone for gone in dropped)]
    return len(dropped) // 2


def _drop_dead(model_object) -> int:
    """Ops no output depends on, then tensors, buffers and operator codes nothing refers to; the ops dropped."""
    graph = model_object.subgraphs[0]
    needed = {int(index) for index in graph.outputs}
    kept = []
    for operator in reversed(graph.operators):
        if any(int(index) in needed for index in operator.outputs):
            kept.append(operator)
            needed.update(int(index) for index in operator.inputs if index >= 0)
    dropped = len(graph.operators) - len(kept)
    graph.operators = kept[::-1]
    used = {int(index) for index in (*graph.inputs, *graph.outputs)}
    for operator in graph.operators:
        used.update(int(index) for index in (*operator.inputs, *operator.outputs) if index >= 0)
    renumbered = {old: new for new, old in enumerate(sorted(used))}
    graph.tensors = [graph.tensors[old] for old in sorted(used)]
    graph.inputs = [renumbered[int(index)] for index in graph.inputs]
    graph.outputs = [renumbered[int(index)] for index in graph.outputs]
    for operator in graph.operators:
        operator.inputs = [renumbered[int(index)] if index >= 0 else int(index) for index in operator.inputs]
        operator.outputs = [renumbered[int(index)] for index in operator.outputs]
    for signature in model_object.signatureDefs or []:
        for mapping in [*(signature.inputs or []), *(signature.outputs or [])]:
            mapping.tensorIndex = renumbered[int(mapping.tensorIndex)]
    buffers = sorted({0} | {int(tensor.buffer) for tensor in graph.tensors} | {int(entry.buffer) for entry in model_object.metadata or []})
    moved = {old: new for new, old in enumerate(buffers)}
    model_object.buffers = [model_object.buffers[old] for old in buffers]
    for tensor in graph.tensors:
        tensor.buffer = moved[int(tensor.buffer)]
    for entry in model_object.metadata or []:
        entry.buffer = moved[int(entry.buffer)]
    codes = sorted({int(operator.opcodeIndex) for operator in graph.operators})
    model_object.operatorCodes = [model_object.operatorCodes[old] for old in codes]
    for operator in graph.operators:
        operator.opcodeIndex = codes.index(int(operator.opcodeIndex))
    return dropped


def _short_names(model_object) -> None:
    """The converter names a fused tensor after every op fused into it ("a;b;c"): the first name stays, numbered
    (":1", ":2") where tensors would share it."""
    graph = model_object.subgraphs[0]
    first = [bytes(tensor.name or b"").split(b";")[0] for tensor in graph.tensors]
    seen: dict[bytes, int] = {}
    for tensor, name in zip(graph.tensors, first, strict=True):
        unique = name
        if first.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            unique = b"%s:%d" % (name, seen[name])
        tensor.name = unique


def microcontroller_layout(data: bytes, arena: Callable[[bytes], int | None] | None = None) -> Layout:
    """The model laid out for a microcontroller; `arena` (TFLite Micro's figure for a flatbuffer, or None) judges
    the op order, the live-byte count standing in where it is not given."""
    schema = schema_module()
    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    if len(model_object.subgraphs) != 1:
        return Layout(data, ())
    changes = []
    dilated = _fold_dilations(model_object)
    if dilated:
        changes.append(f"{dilated} dilated convolution{'s' * (dilated > 1)} written as one op (not SPACE_TO_BATCH_ND and BATCH_TO_SPACE_ND around it)")
    folded = _fold_shapes(model_object)
    dropped = _drop_dead(model_object)
    if folded:
        changes.append(f"{folded} RESHAPE target{'s' * (folded > 1)} made constant ({dropped} shape op{'s' * (dropped != 1)} dropped)")
    _short_names(model_object)
    graph = model_object.subgraphs[0]
    original = list(range(len(graph.operators)))
    scratch = lambda operator: unpack_bytes(model_object, operator)  # noqa: E731
    reordered = low_peak_order(model_object, scratch)
    if reordered != original:
        operators = list(graph.operators)
        counted = max(step_peaks(model_object, original, scratch)), max(step_peaks(model_object, reordered, scratch))
        as_is = pack_model(model_object)
        graph.operators = [operators[position] for position in reordered]
        before, after = counted
        if arena is not None:
            measured_before, measured_after = arena(as_is), arena(pack_model(model_object))
            if measured_before is not None and measured_after is not None:
                before, after = measured_before, measured_after
        if after < before:
            changes.append(f"ops reordered: tensor arena {before:,} -> {after:,} bytes")
        else:
            graph.operators = operators
    return Layout(pack_model(model_object), tuple(changes))
