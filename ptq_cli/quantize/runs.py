"""Runs of parts of a model for the engine's judges: the tensors a choice is judged by, on the exact int8 kernels (the
same codes on every CPU), in chunks within a memory bound, layer by layer where a refinement needs each layer's inputs."""

from __future__ import annotations

import numpy as np

from ptq_cli.model_file import (
    EXACT_PATH_CONFIG,
)
from ptq_cli.transforms.graph import computing_from, computing_only, readers_up_to_quantizers
from ptq_cli.transforms.qdq_edits import private_weight_dequantizers


def probe_session(model, threads: int, exact_kernels: bool = True):
    """A session for quantize's own measurements, on the exact kernels: the same codes on every CPU, VNNI or not.
    Where onnxruntime cannot build the exact session, the default kernels measure instead: the choices stay
    measured, on this CPU's kernels. Without `exact_kernels`: this CPU's own kernels."""
    import onnxruntime as ort

    if not exact_kernels:
        return ort.InferenceSession(model.SerializeToString(), _session_options(threads, exact=False), providers=["CPUExecutionProvider"])

    try:
        exact = private_weight_dequantizers(model).SerializeToString()
        return ort.InferenceSession(exact, _session_options(threads, exact=True), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  onnxruntime's own exception types
        return ort.InferenceSession(model.SerializeToString(), _session_options(threads, exact=False), providers=["CPUExecutionProvider"])


def _session_options(threads: int, exact: bool):
    import onnxruntime as ort

    chosen = ort.SessionOptions()
    if exact:
        chosen.add_session_config_entry(EXACT_PATH_CONFIG, "1")
    chosen.intra_op_num_threads = threads
    chosen.log_severity_level = 4
    chosen.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return chosen


def tensor_batches(input_name: str, images: np.ndarray, threads: int, chunk: int = 16, exact_kernels: bool = True):
    """A `rounding.ActivationSource`: one named tensor of a model, over `images`, a chunk at a time (`probe_session`'s kernels)."""
    import onnx

    def batches(model, name: str):
        cut = computing_only(model, name)  # a layer's input costs only the layers before it
        if cut is not None:
            session = probe_session(cut, threads, exact_kernels)
        else:
            existing = [output.name for output in model.graph.output]
            if name not in existing:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            try:
                session = probe_session(model, threads, exact_kernels)
            finally:
                if name not in existing:
                    model.graph.output.pop()
        for start in range(0, len(images), chunk):
            yield session.run([name], {input_name: images[start : start + chunk]})[0]

    return batches


HELD_ACTIVATIONS_BYTES = 256 << 20  # the quantized model's 8-bit activations one refinement keeps for the layers after, at most


def layer_by_layer_batches(input_name: str, images: np.ndarray, threads: int, chunk: int = 16):
    """A `rounding.ActivationSource` for the quantized model under `rounding.refine`, which asks for its layers' inputs
    in graph order and changes a layer only after reading its input: a layer's input is computed from the 8-bit
    activations (QuantizeLinear outputs) that earlier layers' passes computed, which no later change alters, instead
    of a pass of every layer before it. An activation is let go once every node reading it has run, or, the least
    recently read first, past HELD_ACTIVATIONS_BYTES (a later pass then reaches further back). The same batches as
    `tensor_batches`."""
    single = tensor_batches(input_name, images, threads, chunk)
    held: dict[str, list[np.ndarray]] = {}
    ran: set[str] = set()  # the nodes (by first output) the passes ran

    def batches(model, name: str):
        part = computing_from(model, name, set(held))
        if part is None:
            yield from single(model, name)
            return
        cut, reads, made, leading = part
        for tensor in reads:
            if tensor in held:
                held[tensor] = held.pop(tensor)  # most recently read last
        session, computed = probe_session(cut, threads), []
        for index, start in enumerate(range(0, len(images), chunk)):
            feeds = {tensor: images[start : start + chunk] if tensor == input_name else held[tensor][index] for tensor in reads}
            values = session.run([name, *made], feeds)
            computed.append(values[1:])
            yield values[0]
        ran.update(node.output[0] for node in cut.graph.node)
        ran.difference_update(leading)  # the layer reading `name` runs next, from where these start
        held.update({tensor: [values[position] for values in computed] for position, tensor in enumerate(made)})
        _let_go(held, ran, model)

    return batches


def _let_go(held: dict[str, list[np.ndarray]], ran: set[str], model) -> None:
    """Drop the held activations no later pass reads: those whose readers, and the readers of their float outputs up to
    the next QuantizeLinear outputs, have all run; then the least recently read past HELD_ACTIVATIONS_BYTES."""
    readers = readers_up_to_quantizers(model)
    for tensor in [tensor for tensor in held if all(node.output[0] in ran for node in readers(tensor).values())]:
        del held[tensor]
    while len(held) > 1 and sum(values.nbytes for batches in held.values() for values in batches) > HELD_ACTIVATIONS_BYTES:
        held.pop(next(iter(held)))


FLOAT_INPUTS_BYTES = 256 << 20  # the float model's layer inputs one pass collects for the layers after, at most


def collected_batches(input_name: str, images: np.ndarray, threads: int, coming: list[str], chunk: int = 16):
    """A `rounding.ActivationSource` for the float model, which does not change under the refinement: asked for a
    layer's input, one pass also collects the inputs of the layers `coming` after it, as many as FLOAT_INPUTS_BYTES
    holds, instead of a pass of the layers before each one. The same batches as `tensor_batches`."""
    single = tensor_batches(input_name, images, threads, chunk)
    collected: dict[str, list[np.ndarray]] = {}

    def batches(model, name: str):
        if name not in collected:
            collected.clear()
            names = _fitting(model, name, coming[coming.index(name):] if name in coming else [name], input_name, images, threads)
            cut = computing_only(model, *names) if len(names) > 1 else None
            if cut is None:
                yield from single(model, name)
                return
            parts = chunked_run(cut, names, input_name, images, threads, chunk)
            assert parts is not None  # no byte bound asked
            collected.update({tensor: [part[index] for part in parts] for index, tensor in enumerate(names)})
        yield from collected[name]

    return batches


def _fitting(model, name: str, wanted: list[str], input_name: str, images: np.ndarray, threads: int) -> list[str]:
    """`name` and the tensors after it in `wanted` whose values on all the images fit in FLOAT_INPUTS_BYTES (measured on one image)."""
    wanted = list(dict.fromkeys(wanted))
    cut = computing_only(model, *wanted) if len(wanted) > 1 else None
    if cut is None:
        return [name]
    sizes = [values.nbytes * len(images) for values in probe_session(cut, threads).run(wanted, {input_name: images[:1]})]
    fitting: list[str] = []
    held = 0
    for tensor, size in zip(wanted, sizes, strict=True):
        if fitting and held + size > FLOAT_INPUTS_BYTES:
            break
        fitting.append(tensor)
        held += size
    return fitting


def chunked_run(cut, names: list[str], input_name: str, images: np.ndarray, threads: int, chunk: int,
                max_bytes: int | None = None) -> list[list[np.ndarray]] | None:
    """The tensors `names` as the model `cut` computes them on `images`, a chunk at a time (per chunk, one array a name);
    None once they hold more than `max_bytes`."""
    session, parts, held = probe_session(cut, threads), [], 0
    for start in range(0, len(images), chunk):
        parts.append(session.run(names, {input_name: images[start : start + chunk]}))
        held += sum(values.nbytes for values in parts[-1])
        if max_bytes is not None and held > max_bytes:
            return None
    return parts


def judged_output(model) -> str:
    """The tensor nearest and learned rounding are compared on: the scores before a final Softmax (its
    probabilities hide most of the difference in a few saturated images), else the first output."""
    output = model.graph.output[0].name
    producer = next((node for node in model.graph.node if output in node.output), None)
    return producer.input[0] if producer is not None and producer.op_type in ("Softmax", "LogSoftmax") else output


def judged_in(quantized, judged: str) -> str:
    """The tensor of the quantized model compared with the float model's `judged` one: the same name where the quantized
    graph computes it, else its first output."""
    return judged if judged in {output for node in quantized.graph.node for output in node.output} else quantized.graph.output[0].name


def tensor_outputs(model, name: str, input_name: str, images: np.ndarray, threads: int, chunk: int = 16, exact_kernels: bool = True) -> np.ndarray:
    return np.concatenate(list(tensor_batches(input_name, images, threads, chunk, exact_kernels)(model, name)))
