"""A .tflite's graph through the flatbuffer object API: the schema, writing a model back, naming its ops, and
which activation bytes are alive together while TFLite Micro runs its ops in a given order."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np


def schema_module():
    from ai_edge_litert import schema_py_generated as schema

    return schema


def pack_model(model_object) -> bytes:
    import flatbuffers

    builder = flatbuffers.Builder(0)
    builder.Finish(model_object.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def op_kind(model_object, operator) -> str:
    """The builtin op's name ("CONV_2D"), "custom" for a custom op; for any schema module's object API model."""
    code = model_object.operatorCodes[operator.opcodeIndex]
    return _op_names().get(max(code.builtinCode, code.deprecatedBuiltinCode), "custom")


@functools.cache
def _op_names() -> dict[int, str]:
    return {value: name for name, value in vars(schema_module().BuiltinOperator).items() if not name.startswith("_")}


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int4 codes (any shape, values -8..7) as TFLite stores them: two a byte, the first in the low nibble."""
    flat = codes.astype(np.int8).reshape(-1)
    if len(flat) % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    return ((flat[0::2].astype(np.uint8) & 0x0F) | ((flat[1::2].astype(np.uint8) & 0x0F) << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: list[int]) -> np.ndarray:
    """The int4 codes (int64, `shape`) a TFLite INT4 buffer holds: pack_int4 undone."""
    packed = np.asarray(packed, np.uint8)
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[: int(np.prod(shape))].astype(np.int64)
    return np.where(nibbles > 7, nibbles - 16, nibbles).reshape(shape)


BYTES = {"INT8": 1, "UINT8": 1, "INT16": 2, "INT32": 4, "FLOAT32": 4, "INT64": 8, "BOOL": 1, "FLOAT16": 2}


def _type_bytes(tensor_type: int) -> int:
    names = {value: name for name, value in vars(schema_module().TensorType).items() if not name.startswith("_")}
    return BYTES.get(names.get(tensor_type, ""), 4)


def activation_bytes(graph, index: int) -> int:
    tensor = graph.tensors[index]
    return int(np.prod([max(int(dim), 1) for dim in tensor.shape] if tensor.shape is not None else [1])) * _type_bytes(tensor.type)


def unpack_bytes(model_object, operator) -> int:
    """The scratch TFLite Micro takes while the op runs: a CONV_2D with an int4 filter unpacks it to int8."""
    schema = schema_module()
    graph = model_object.subgraphs[0]
    if op_kind(model_object, operator) != "CONV_2D" or len(operator.inputs) < 2:
        return 0
    weight = graph.tensors[int(operator.inputs[1])]
    return int(np.prod([int(dim) for dim in weight.shape])) if weight.type == schema.TensorType.INT4 else 0


def is_constant(model_object, index: int) -> bool:
    buffer = model_object.buffers[model_object.subgraphs[0].tensors[index].buffer]
    return buffer.data is not None and len(buffer.data) > 0


def step_peaks(model_object, order: list[int], scratch: Callable[[Any], int] | None = None) -> list[int]:
    """Per op in `order` (indices into the graph's operators): the activation bytes alive while it runs (its
    inputs, its outputs, everything still to be read later, the graph's inputs and outputs), plus its scratch."""
    graph = model_object.subgraphs[0]
    operators = [graph.operators[position] for position in order]
    born, dies = {int(index): 0 for index in graph.inputs}, {int(index): len(order) for index in graph.outputs}
    for step, operator in enumerate(operators):
        for index in operator.outputs:
            born.setdefault(int(index), step)
        for index in operator.inputs:
            if index >= 0 and not is_constant(model_object, int(index)):
                dies[int(index)] = max(dies.get(int(index), step), step)
    sizes = {index: activation_bytes(graph, index) for index in born}
    return [sum(size for index, size in sizes.items() if born[index] <= step <= dies.get(index, born[index]))
            + (scratch(operator) if scratch else 0) for step, operator in enumerate(operators)]


def low_peak_order(model_object, scratch: Callable[[Any], int] | None = None) -> list[int]:
    """A topological order of the ops that runs, among those ready, the one whose step keeps the fewest bytes
    alive (then the one that frees most, then the file's order)."""
    graph = model_object.subgraphs[0]
    operators = graph.operators
    producer = {int(index): position for position, operator in enumerate(operators) for index in operator.outputs}
    readers: dict[int, set[int]] = {}
    for position, operator in enumerate(operators):
        for index in operator.inputs:
            if index >= 0 and int(index) in producer:
                readers.setdefault(int(index), set()).add(position)
    alive = {int(index): activation_bytes(graph, int(index)) for index in graph.inputs}
    outputs = {int(index) for index in graph.outputs}
    done: list[int] = []
    left = set(range(len(operators)))
    while left:
        ready = [position for position in sorted(left)
                 if all(index < 0 or int(index) not in producer or producer[int(index)] in done for index in operators[position].inputs)]

        def cost(position: int) -> tuple[int, int, int]:
            operator = operators[position]
            made = sum(activation_bytes(graph, int(index)) for index in operator.outputs)
            freed = sum(alive.get(int(index), 0) for index in set(operator.inputs)
                        if index >= 0 and int(index) not in outputs and readers.get(int(index), set()) - set(done) == {position})
            return sum(alive.values()) + made + (scratch(operator) if scratch else 0), made - freed, position

        chosen = min(ready, key=cost)
        operator = operators[chosen]
        for index in set(operator.inputs):
            if index >= 0 and int(index) not in outputs and readers.get(int(index), set()) - set(done) == {chosen}:
                alive.pop(int(index), None)
        alive.update({int(index): activation_bytes(graph, int(index)) for index in operator.outputs})
        done.append(chosen)
        left.remove(chosen)
    return done


