"""A full-integer .tflite laid out as a microcontroller holds it: the same computation, bit for bit, in fewer
bytes of flash and of TFLite Micro's tensor arena.

The converter leaves what a fixed-shape model does not need: a Keras Flatten becomes SHAPE, STRIDED_SLICE and
PACK ops computing the RESHAPE's target at run time (each op and tensor costs arena in TFLite Micro), tensors
and buffers nothing reads, and tensor names that join every fused op's name. And TFLite Micro runs the ops in
the file's order, so the order decides which activations are alive together: in a residual block whose
shortcut convolution runs last, the block's input stays alive across its widest convolution.

`microcontroller_layout` makes each RESHAPE's target a constant (the batch left free), drops what no output
needs, keeps each tensor's first fused name, and orders the ops so that the fewest activation bytes are alive
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
