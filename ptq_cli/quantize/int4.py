"""4-bit weights for a full-integer TFLite model: its int8 convolution and fully-connected filters become int4,
rounded by GPTQ against the calibration images, activations staying int8.

Plain rounding to 4 bits ruins a small network (ResNet8 fell to 83.4% with the stem kept in 8 bits, docs); so
each layer, in graph order, gets per output channel the clipping (a fraction of its largest weight) and the
4-bit codes that leave the least output error, E||(W - Q) x||^2 over the inputs the model (its earlier layers
already 4-bit) gives it on the calibration images (`rounding.gptq`, the same closed form the onnxruntime models
use), then a bias that takes up the mean output error. A layer may instead aim at the int8 model's output from
the int8 model's own inputs, so that it takes up the error of the 4-bit layers before it (GPTAQ's asymmetric
calibration); it overfits where images are few, so held-out calibration images choose, layer by layer. The
weights GPTQ starts from are the int8 model's own:
at 1/16 of a 4-bit step, their rounding is not what costs. TFLite's INT4 tensors hold two codes a byte, low
nibble first; TFLite Micro and LiteRT run them on their int8 kernels (a test checks the same scores as the
codes held in int8).

The stem (the first weighted layer, which the image enters) stays in 8 bits, and so do the layers TFLite Micro
has no int4 kernel for: its FULLY_CONNECTED refuses an int4 filter under int8 input (tflite-micro's
fully_connected_common.cc), and depthwise convolutions are left as they are. TFLite Micro unpacks an int4 filter
to int8 in its tensor arena while the layer runs; a layer where that would keep more bytes alive than the int8
model ever does (ResNet8's second convolution, beside three 16 KB activations) stays in 8 bits too, so that 4-bit
weights save flash without asking for more RAM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ptq_cli.quantize.rounding import DAMPING, gptq
from ptq_cli.transforms.tflite_graph import low_peak_order, op_kind, pack_int4, pack_model, schema_module, step_peaks
from ptq_cli.transforms.tflm_kernels import reference_codes

QMIN, QMAX = -8, 7  # int4, symmetric scales (zero point 0, as TFLite's weights)
CLIPPINGS = np.arange(0.6, 1.0001, 0.05)  # fractions of a channel's largest weight tried as its 4-bit range
BATCH = 100  # images a batch while summing a layer's rows
WEIGHTED = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
INT4_KERNELS = ("CONV_2D",)  # the ops whose int4 filters TFLite Micro runs (checked by a test on its interpreter)


@dataclass(frozen=True)
class Mixed:
    """A flash budget: `fits(model bytes)` says whether a model is within it (as it will be written), `judge(model
    bytes)` how close its outputs come to the float model's (SQNR, dB) on images it was not rounded on."""

    fits: Callable[[bytes], bool]
    judge: Callable[[bytes], float]


@dataclass(frozen=True)
class Int4Result:
    data: bytes  # the model with int4 filters
    layers: tuple[str, ...]  # the layers made 4-bit, e.g. "CONV_2D 64x3x3x64"
    kept: tuple[str, ...]  # the weighted layers kept in 8 bits, and why
    compensating: tuple[str, ...] = ()  # the 4-bit layers aimed at the int8 model's outputs (held-out images chose it)


def unfold_conv(inputs: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int], same: bool) -> np.ndarray:
    """NHWC inputs -> the rows a CONV_2D output sums over, in its filter's (row, column, channel) order."""
    _, height, width, _ = inputs.shape
    if same:  # TFLite's SAME: the extra padding at the end
        pads = [max((-(-size // stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
                for size, k, stride, dilation in zip((height, width), kernel, strides, dilations, strict=True)]
        inputs = np.pad(inputs, ((0, 0), (pads[0] // 2, pads[0] - pads[0] // 2), (pads[1] // 2, pads[1] - pads[1] // 2), (0, 0)))
    span = ((kernel[0] - 1) * dilations[0] + 1, (kernel[1] - 1) * dilations[1] + 1)
    windows = np.lib.stride_tricks.sliding_window_view(inputs, span, axis=(1, 2))[:, ::strides[0], ::strides[1], :, ::dilations[0], ::dilations[1]]
    return windows.transpose(0, 1, 2, 4, 5, 3).reshape(-1, kernel[0] * kernel[1] * inputs.shape[3])


def tensor_codes(data: bytes, tensors: list[int], images: np.ndarray) -> dict[int, tuple[np.ndarray, float, int]]:
    """Each of `tensors` as the model (`data`) computes it on `images` (its int8 input) by the reference kernels
    (tflm_kernels.reference_codes), in one pass: (its integer codes, scale, zero point)."""
    graph = schema_module().Model.GetRootAs(data, 0).Subgraphs(0)
    codes = reference_codes(data, {int(graph.Inputs(0)): images}, tensors)
    grids = {tensor: graph.Tensors(tensor).Quantization() for tensor in tensors}
    return {tensor: (codes[tensor], float(grids[tensor].Scale(0)), int(grids[tensor].ZeroPoint(0))) for tensor in tensors}


def dequantized(codes: tuple[np.ndarray, float, int]) -> np.ndarray:
    values, scale, zero_point = codes
    return (values.astype(np.float32) - zero_point) * scale


def layer_inputs(data: bytes, tensor: int, images: np.ndarray) -> np.ndarray:
    """The values (dequantized) the model feeds tensor `tensor` on `images` (the model's int8 input), by the reference kernels."""
    return dequantized(tensor_codes(data, [tensor], images)[tensor])


ORIGINAL_BYTES = 256 * 2**20  # codes of the int8 model's layer inputs held at once


def held_bytes(graph, tensor: int, images: int) -> int:
    """The bytes of an activation tensor's codes on `images` images."""
    schema = schema_module()
    widths = {schema.TensorType.INT8: 1, schema.TensorType.UINT8: 1, schema.TensorType.INT16: 2}
    return int(np.prod(graph.tensors[tensor].shape[1:])) * images * widths.get(graph.tensors[tensor].type, 4)


class OriginalInputs:
    """The unchanged int8 model's input to each layer, in order: one interpreter pass collects the inputs of as many of
    the coming layers as ORIGINAL_BYTES holds, rather than one pass a layer (the model does not change under them)."""

    def __init__(self, data: bytes, graph, tensors: list[int], images: np.ndarray) -> None:
        """`graph`: the subgraph of `data`, as the caller parsed it (its activation tensors' shapes and types)."""
        self.data, self.images, self.tensors = data, images, list(dict.fromkeys(tensors))
        self.sizes = {tensor: held_bytes(graph, tensor, len(images)) for tensor in self.tensors}
        self.kept: dict[int, tuple[np.ndarray, float, int]] = {}

    def __call__(self, tensor: int) -> np.ndarray:
        if tensor not in self.kept:
            coming = self.tensors[self.tensors.index(tensor):] if tensor in self.tensors else [tensor]
            chosen, held_bytes = [tensor], self.sizes.get(tensor, 0)
            for following in coming[1:]:
                held_bytes += self.sizes[following]
                if held_bytes > ORIGINAL_BYTES:
                    break
                chosen.append(following)
            self.kept = {}  # the earlier layers' inputs go before the next ones are collected
            self.kept = tensor_codes(self.data, chosen, self.images)
        return dequantized(self.kept[tensor])


CURRENT_BYTES = 512 * 2**20  # codes of the tensors CurrentInputs keeps between layers, at most


class _NotFed(Exception):
    """A stretch of the model reads a tensor CurrentInputs did not keep (or none): it runs the cut model instead."""


class CurrentInputs:
    """Each weighted layer's input, in graph order, as the model (`model_object`, whose layers the caller changes
    one by one after reading their inputs) computes it now on `images` (its int8 input), by the reference
    kernels (tflm_kernels.reference_codes). The operators before a layer whose input was read do not change again, so each read runs only the
    operators since the previous one, from the tensors it kept (those later operators read); the same values as
    the model cut at the layer's input (`up_to`), in one pass over the model in all. Past CURRENT_BYTES it runs
    the cut model each time."""

    def __init__(self, model_object, images: np.ndarray) -> None:
        graph = model_object.subgraphs[0]
        self.model_object, self.images, self.position = model_object, images, 0
        self.kept: dict[int, np.ndarray] | None = {int(graph.inputs[0]): images} if len(graph.inputs) == 1 else None
        self.constant = {index for index, tensor in enumerate(graph.tensors)
                         if tensor.buffer and model_object.buffers[tensor.buffer].data is not None and len(model_object.buffers[tensor.buffer].data)}

    def __call__(self, operator) -> np.ndarray:
        """The values (dequantized) the model feeds `operator`'s first input now."""
        graph, tensor = self.model_object.subgraphs[0], int(operator.inputs[0])
        position = next(index for index, candidate in enumerate(graph.operators) if candidate is operator)
        if self.kept is not None and position >= self.position:
            live = self._live_before(position)
            if sum(held_bytes(graph, index, len(self.images)) for index in live) <= CURRENT_BYTES:
                with contextlib.suppress(_NotFed):
                    self.kept, self.position = self._run(self.position, position, live), position
                    scale, zero_point = graph.tensors[tensor].quantization.scale, graph.tensors[tensor].quantization.zeroPoint
                    return dequantized((self.kept[tensor], float(scale[0]), int(zero_point[0])))
        self.kept = None
        return layer_inputs(up_to(self.model_object, tensor), tensor, self.images)

    def _live_before(self, position: int) -> list[int]:
        """The activations made before operator `position` (or the model's input) that it or a later one reads."""
        graph = self.model_object.subgraphs[0]
        made = {int(index) for operator in graph.operators[:position] for index in operator.outputs} | {int(index) for index in graph.inputs}
        read = {int(index) for operator in graph.operators[position:] for index in operator.inputs if index >= 0}
        return sorted((made & read) - self.constant)

    def _run(self, start: int, stop: int, live: list[int]) -> dict[int, np.ndarray]:
        """The `live` tensors' codes, running operators start..stop-1 on the kept tensors they read."""
        graph = self.model_object.subgraphs[0]
        assert self.kept is not None
        segment = graph.operators[start:stop]
        made = {int(index) for operator in segment for index in operator.outputs}
        wanted = [index for index in live if index in made]
        if not wanted:
            return {index: self.kept[index] for index in live}
        fed = sorted({int(index) for operator in segment for index in operator.inputs if index >= 0} - made - self.constant)
        if not fed or not set(fed) <= set(self.kept):
            raise _NotFed
        saved = graph.inputs, graph.outputs, graph.operators, self.model_object.signatureDefs
        graph.inputs, graph.outputs, graph.operators, self.model_object.signatureDefs = fed, wanted, segment, []
        try:
            data = pack_model(self.model_object)
        finally:
            graph.inputs, graph.outputs, graph.operators, self.model_object.signatureDefs = saved
        computed = reference_codes(data, {tensor: self.kept[tensor] for tensor in fed}, wanted)
        return {**{index: self.kept[index] for index in live if index not in made}, **computed}


def _unfolded(inputs: np.ndarray, operator, kind: str, shape: list[int]) -> np.ndarray:
    """The rows (float64) a CONV_2D or FULLY_CONNECTED output sums over, in its filter's order, from its input values."""
    if kind == "CONV_2D":
        options = operator.builtinOptions
        rows = unfold_conv(inputs, (shape[1], shape[2]), (options.strideH, options.strideW), (options.dilationHFactor, options.dilationWFactor),
                           options.padding == schema_module().Padding.SAME)
    else:
        rows = inputs.reshape(-1, int(np.prod(shape[1:])))
    return rows.astype(np.float64)


def up_to(model_object, tensor: int) -> bytes:
    """The model as far as the operator that makes `tensor`, which becomes its output: what the operators after
    it would compute is not needed to read it (each operator's result depends on its inputs alone)."""
    graph = model_object.subgraphs[0]
    operators, outputs = graph.operators, graph.outputs
    last = max((position for position, operator in enumerate(operators) if tensor in list(operator.outputs)), default=None)
    if last is None:  # a graph input
        return pack_model(model_object)
    graph.operators, graph.outputs = operators[: last + 1], [tensor]
    try:
        return pack_model(model_object)
    finally:
        graph.operators, graph.outputs = operators, outputs


def layer_rows(current: CurrentInputs, operator, kind: str, shape: list[int]) -> np.ndarray:
    """The rows (float64) a CONV_2D or FULLY_CONNECTED output sums over, in its filter's order, as the model (its
    earlier layers as they are now) feeds the operator on the images."""
    return _unfolded(current(operator), operator, kind, shape)


@dataclass(frozen=True)
class LayerFeeds:
    """What a layer's 4-bit filter is fitted on: the inputs the int8 model fed its layers (`original`) and those the model
    as it is now feeds them (`current`), on the same images (`current.images`), and which of those judge the fit (`held`)."""

    original: OriginalInputs
    current: CurrentInputs
    held: np.ndarray


def layer_moments(feeds: LayerFeeds, operator, kind: str, shape: list[int]) -> tuple[tuple[np.ndarray, int], tuple[np.ndarray, int]]:
    """((sum, rows) on the images `feeds.held` leaves out, (sum, rows) on those it marks): the sums of z z^T over a
    layer's rows, z = [x; x'; 1], x the row the int8 model feeds it and x' the one the model as it is now feeds it.
    Summed image batch by image batch, so memory stays that of one batch's rows."""
    tensor = int(operator.inputs[0])
    original_inputs, current_inputs = feeds.original(tensor), feeds.current(operator)
    width = 2 * int(np.prod(shape[1:])) + 1
    sums, counts = [np.zeros((width, width)) for _ in range(2)], [0, 0]
    held = feeds.held
    for start in range(0, len(feeds.current.images), BATCH):
        part = slice(start, start + BATCH)
        for group, mask in enumerate((~held[part], held[part])):
            if mask.any():
                pair = [_unfolded(inputs[part][mask], operator, kind, shape) for inputs in (original_inputs, current_inputs)]
                rows = np.concatenate([*pair, np.ones((len(pair[0]), 1))], axis=1)
                sums[group] += rows.T @ rows
                counts[group] += len(rows)
    return (sums[0], counts[0]), (sums[1], counts[1])


def weighted_ops(model_object) -> list[tuple[str, Any]]:
    return [(op_kind(model_object, operator), operator) for operator in model_object.subgraphs[0].operators
            if op_kind(model_object, operator) in WEIGHTED]


def _codes(weights: np.ndarray, second: np.ndarray, per_tensor: bool) -> tuple[np.ndarray, np.ndarray]:
    """(int4 codes, scales): per channel, the clipping whose GPTQ codes leave the least output error (GPTQ rounds
    each output channel on its own, so each channel may keep the codes of its own best clipping)."""
    largest = np.abs(weights).max(axis=1)
    largest = np.full_like(largest, largest.max()) if per_tensor else largest
    largest[largest == 0] = 1.0
    best, codes, scales = np.full(len(weights), np.inf), np.zeros_like(weights), largest / QMAX
    for clipping in CLIPPINGS:
        scale = largest * clipping / QMAX
        trial = gptq(weights[None], second[None], scale[None], np.zeros((1, len(weights))), QMIN, QMAX)[0]
        error = weights - trial * scale[:, None]
        cost = np.einsum("ok,kl,ol->o", error, second, error)
        better = np.full(len(cost), cost.sum() < best.sum()) if per_tensor else cost < best
        best[better], codes[better], scales[better] = cost[better], trial[better], scale[better]
    return codes, scales


def _fit(weights: np.ndarray, bias: np.ndarray, moments: np.ndarray, per_tensor: bool, compensate: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int4 codes, scales, float bias) for a layer (float `weights` outputs x inputs, float `bias`) from the second
    moments of [x; x'; 1] (layer_moments). Plain: GPTQ aims Q at W on the inputs x' the layer now gets. Compensating
    (GPTAQ's asymmetric calibration): it aims at the int8 model's output W x, through the least-squares weights
    W + W E[(x - x') x'^T] E[x' x'^T]^-1, so that a layer takes up the error of the 4-bit layers before it. The
    damping only tempers that correction: written as W E[x x'^T] (H + damping)^-1, it would also shrink W where
    the inputs vary little (docs: the cost, measured). Either way the bias takes up the mean output error."""
    inputs = weights.shape[1]
    cross, second = moments[:inputs, inputs : 2 * inputs], moments[inputs : 2 * inputs, inputs : 2 * inputs]
    original_mean, current_mean = moments[:inputs, -1], moments[inputs : 2 * inputs, -1]
    aimed = weights
    if compensate:
        damped = second + DAMPING * max(float(np.mean(np.diag(second))), 1e-12) * np.eye(inputs)
        aimed = weights + np.linalg.solve(damped, (weights @ (cross - second)).T).T  # H symmetric
    codes, scales = _codes(aimed, second, per_tensor)
    return codes, scales, bias + weights @ original_mean - (codes * scales[:, None]) @ current_mean if compensate else \
        bias + (weights - codes * scales[:, None]) @ current_mean


def _output_error(weights: np.ndarray, bias: np.ndarray, fitted: tuple[np.ndarray, np.ndarray, np.ndarray], moments: np.ndarray) -> float:
    """E||W x + b - (Q x' + b')||^2 under `moments`: how far the 4-bit layer's outputs are from the int8 model's."""
    codes, scales, new_bias = fitted
    difference = np.concatenate([weights, -codes * scales[:, None], (bias - new_bias)[:, None]], axis=1)
    return float(np.einsum("ok,kl,ol->", difference, moments, difference))


def _chosen_fit(weights: np.ndarray, bias: np.ndarray, moments: tuple[tuple[np.ndarray, int], tuple[np.ndarray, int]],
                per_tensor: bool) -> tuple[bool, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(compensating?, the fit on every image): compensating where, fitted on the rest, it leaves the held-out
    images' outputs closer to the int8 model's than the plain fit does; it overfits where images are few."""
    (rest, rest_rows), (held, held_rows) = moments
    everything = (rest + held) / max(rest_rows + held_rows, 1)
    if not held_rows or not rest_rows:
        return False, _fit(weights, bias, everything, per_tensor, compensate=False)
    errors = [_output_error(weights, bias, _fit(weights, bias, rest / rest_rows, per_tensor, compensate), held / held_rows) for compensate in (False, True)]
    compensate = errors[1] < errors[0]
    return compensate, _fit(weights, bias, everything, per_tensor, compensate)


def arena_neutral(model_object, candidates: list[Any]) -> set[int]:
    """The ids of the `candidates` (operators) whose filters can be int4 without TFLite Micro keeping more bytes
    alive than the int8 model does in its leaner op order: the unpacked filter counts while its layer runs."""
    operators = model_object.subgraphs[0].operators
    plain = min(max(step_peaks(model_object, order)) for order in (list(range(len(operators))), low_peak_order(model_object)))
    chosen = {id(operator) for operator in candidates}
    while True:
        def unpacked(operator, chosen=frozenset(chosen)) -> int:
            if id(operator) not in chosen:
                return 0
            return int(np.prod([int(dim) for dim in model_object.subgraphs[0].tensors[int(operator.inputs[1])].shape]))

        order = low_peak_order(model_object, unpacked)
        over = {id(operators[position]) for position, peak in zip(order, step_peaks(model_object, order, unpacked), strict=True)
                if peak > plain and id(operators[position]) in chosen}
        if not over:
            return chosen
        chosen -= over


def _state(model_object, operator) -> tuple:
    """What int4 changes in a layer (its filter's and bias's data, type and scales), to put back later."""
    graph = model_object.subgraphs[0]
    weight, bias = graph.tensors[int(operator.inputs[1])], graph.tensors[int(operator.inputs[2])]
    return (weight, bias, model_object.buffers[weight.buffer].data, weight.type, list(weight.quantization.scale),
            list(weight.quantization.zeroPoint), model_object.buffers[bias.buffer].data, list(bias.quantization.scale))


def _restore(model_object, state: tuple) -> None:
    weight, bias, weight_data, weight_type, scales, zero_points, bias_data, bias_scales = state
    model_object.buffers[weight.buffer].data, weight.type = weight_data, weight_type
    weight.quantization.scale, weight.quantization.zeroPoint = scales, zero_points
    model_object.buffers[bias.buffer].data, bias.quantization.scale = bias_data, bias_scales


def _back_to_8_bits(model_object, states: dict[str, tuple[tuple, tuple]], mixed: Mixed) -> dict[str, float]:
    """Layers put back to their int8 filters while the model fits the budget, each time the one whose 8 bits
    gain most SQNR per byte of flash: their names and gains (dB)."""
    chosen: dict[str, float] = {}
    current = mixed.judge(pack_model(model_object))
    while True:
        best: tuple[float, float, str] | None = None
        size = len(pack_model(model_object))
        for name, (int8_state, int4_state) in states.items():
            if name in chosen:
                continue
            _restore(model_object, int8_state)
            data = pack_model(model_object)
            if mixed.fits(data):
                gain = mixed.judge(data) - current
                if gain > 0 and (best is None or gain / max(len(data) - size, 1) > best[0]):
                    best = (gain / max(len(data) - size, 1), gain, name)
            _restore(model_object, int4_state)
        if best is None:
            return chosen
        _restore(model_object, states[best[2]][0])
        current += best[1]
        chosen[best[2]] = best[1]


def _stays_int8(graph, position: int, kind: str, operator) -> str:
    """Why a weighted layer cannot take int4 filters ("" where it can)."""
    weight = graph.tensors[int(operator.inputs[1])]
    return ("the stem" if position == 0 else f"TFLite Micro has no int4 {kind}" if kind not in INT4_KERNELS
            else "not an int8 filter with a bias" if weight.type != schema_module().TensorType.INT8 or len(operator.inputs) < 3 or operator.inputs[2] < 0
            else "")


def _layer_to_int4(feeds: LayerFeeds, operator, kind: str) -> bool:
    """The layer's filter rewritten in int4 in the model `feeds.current` reads, fitted on the images, its bias following;
    whether the fit compensates for the earlier 4-bit layers."""
    model_object = feeds.current.model_object
    graph = model_object.subgraphs[0]
    input_tensor, weight_tensor, bias_tensor = (int(index) for index in operator.inputs[:3])
    weight, bias = graph.tensors[weight_tensor], graph.tensors[bias_tensor]
    shape = [int(dim) for dim in weight.shape]
    int8_scales = np.asarray(weight.quantization.scale, np.float64)
    per_tensor = len(int8_scales) == 1
    codes8 = np.frombuffer(bytes(model_object.buffers[weight.buffer].data), np.int8).astype(np.float64).reshape(shape[0], -1)
    weights = codes8 * np.broadcast_to(int8_scales, (shape[0],))[:, None]
    input_scale = float(graph.tensors[input_tensor].quantization.scale[0])
    int8_bias = np.frombuffer(bytes(model_object.buffers[bias.buffer].data), np.int32).astype(np.float64) * input_scale * np.broadcast_to(
        int8_scales, (shape[0],))
    compensate, (codes, scales, float_bias) = _chosen_fit(weights, int8_bias, layer_moments(feeds, operator, kind, shape), per_tensor)
    # The bias's scale follows the weights' (TFLite: input scale x weight scale).
    bias_codes = np.clip(np.rint(float_bias / (input_scale * scales)), np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
    model_object.buffers[bias.buffer].data = np.frombuffer(bias_codes.tobytes(), np.uint8)
    stored_scales = scales[:1] if per_tensor else scales
    bias.quantization.scale = list(input_scale * stored_scales)
    model_object.buffers[weight.buffer].data = pack_int4(codes.reshape(shape))
    weight.type = schema_module().TensorType.INT4
    weight.quantization.scale = list(stored_scales)
    weight.quantization.zeroPoint = [0] * len(stored_scales)
    return compensate


def to_int4(data: bytes, images: np.ndarray, progress: Callable[[int, int], None] | None = None, mixed: Mixed | None = None,  # noqa: PLR0913,PLR0917
            held: np.ndarray | None = None, eight_bit: dict[int, str] | None = None, original: OriginalInputs | None = None) -> Int4Result:
    """The model (`data`, a full-integer .tflite) with its filters in int4, refined on `images` (its int8 input);
    `held` marks the images that judge, layer by layer, whether compensating for the earlier 4-bit layers helps;
    with `mixed`, the layers whose 4 bits cost most then go back to 8 bits within its flash budget; `eight_bit`
    keeps layers (their places among the weighted layers) in 8 bits, for the reason given; `original`: the int8
    model's layer inputs a first pass over the same `data` and `images` collected."""
    schema = schema_module()
    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph = model_object.subgraphs[0]
    layers, made, kept, compensating = weighted_ops(model_object), [], [], []
    held = np.zeros(len(images), bool) if held is None else held
    states: dict[str, tuple[tuple, tuple]] = {}  # a 4-bit layer's name -> (its int8 state, its int4 state)
    positions: dict[str, int] = {}  # a 4-bit layer's name -> its place among the weighted layers
    eight_bit = eight_bit or {}

    fits = arena_neutral(model_object, [operator for position, (kind, operator) in enumerate(layers) if not _stays_int8(graph, position, kind, operator)])
    original = original or OriginalInputs(data, graph, [int(operator.inputs[0]) for position, (_, operator) in enumerate(layers)
                                                        if id(operator) in fits and position not in eight_bit], images)
    current = CurrentInputs(model_object, images)
    feeds = LayerFeeds(original, current, held)
    for position, (kind, operator) in enumerate(layers):
        shape = [int(dim) for dim in graph.tensors[int(operator.inputs[1])].shape]
        name = f"{kind} {'x'.join(map(str, shape))}"
        why = _stays_int8(graph, position, kind, operator) or ("unpacked to int8 while it runs, it would enlarge TFLite Micro's tensor arena"
                                                   if id(operator) not in fits else eight_bit.get(position, ""))
        if why:
            kept.append(f"{name} ({why})")
            continue
        int8_state = _state(model_object, operator)
        compensate = _layer_to_int4(feeds, operator, kind)
        name = f"{name} #{position}" if name in states else name
        states[name], positions[name] = (int8_state, _state(model_object, operator)), position
        made.append(name)
        if compensate:
            compensating.append(name)
        if progress:
            progress(position + 1, len(layers))
    if mixed is not None:
        back = _back_to_8_bits(model_object, states, mixed)
        if back and compensating:  # the later layers took up the error of layers now back in 8 bits: fit them again without it
            return to_int4(data, images, progress, held=held,
                           eight_bit={positions[name]: f"+{gain:.2f} dB in 8 bits, within the flash budget" for name, gain in back.items()},
                           original=original)
        kept += [f"{name} (+{gain:.2f} dB in 8 bits, within the flash budget)" for name, gain in back.items()]
        made = [name for name in made if name not in back]
    return Int4Result(pack_model(model_object), tuple(made), tuple(kept), tuple(name for name in compensating if name in made))
