"""Learned rounding and bias correction of a QDQ model's weights, layer by layer, from calibration images.

Rounding each weight to its nearest code is best for that weight alone, not for the layer's output: the
errors of one output channel's weights add up over the inputs they multiply. GPTQ (Frantar et al. 2022,
after Optimal Brain Quantization) rounds a layer's weights one input at a time and moves each rounding
error onto the weights not yet rounded, through the inverse of the inputs' second moments H = E[x x^T]:
a closed-form minimisation of the layer's output error E||(W - Q) x||^2. Each layer sees the inputs the
quantized model gives it (the layers before it already refined), and its bias then takes up the mean
output error against FP32 (empirical bias correction, Nagel et al. 2019): b' = b + W mu_fp32 - Q mu_int8.

Scales, zero points and types stay as quantization chose them: only the integer weight codes and the
int32 biases change. A channel whose codes followed the pair rule still does (`overflow.is_pair_safe`): where
the error feedback would break it, learned codes step back towards zero one code at a time, so a model proven
exact on x86 CPUs without VNNI stays proven.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ptq_cli.quantize.overflow import PAIR_LIMIT, is_depthwise, is_pair_safe, pair_sums, weight_rows
from ptq_cli.transforms.graph import WEIGHTED_OPS, depthwise_multiplier

LEARNED, NEAREST, AUTO = "learned", "nearest", "auto"
ROUNDING_CHOICES = (AUTO, LEARNED, NEAREST)
DAMPING = 0.01  # of the mean diagonal of H, as in GPTQ: keeps H invertible where inputs are correlated or dead
BLOCK = 128  # columns rounded between two full error updates (GPTQ's lazy batch)
ROW_BUDGET = 8_000_000  # floats of unfolded input rows held at once
MAX_ROWS = 65_536  # rows (output positions) a layer's statistics are drawn from, at most
# A depthwise convolution's rows, at most: each channel reads only its own kernel window, so its H is k^2 x k^2 (25 x 25
# at 5x5), which this many rows estimate as well as MAX_ROWS do a 1x1 convolution's hundreds of inputs, at an eighth of
# the time (the depthwise layers took three quarters of EfficientNet-Lite0's input moments).
DEPTHWISE_ROWS = 8_192
MAX_INPUTS = 8_192  # inputs per group at most: H is inputs x inputs float64 (512 MB here); wider layers keep nearest codes


@dataclass(frozen=True)
class Layer:
    """A weighted node of a QDQ model whose input and weight both come from a DequantizeLinear."""

    name: str
    op_type: str
    quantized_input: str  # the DequantizeLinear output it reads
    float_input: str  # the same tensor in the float graph (what the QuantizeLinear quantized)
    codes: str  # initializer of the integer weight codes
    scale: str
    zero_point: str | None
    bias_codes: str | None  # int32 bias initializer, when the bias is dequantized from one
    bias_scale: str | None
    attributes: dict
    node: Any = field(compare=False, repr=False)  # the NodeProto


@dataclass(frozen=True)
class LayerResult:
    name: str
    codes_changed: int  # weight codes that differ from nearest rounding
    codes: int
    codes_stepped_back: int  # learned codes moved one step towards zero to keep the pair rule
    bias_corrected: bool


def _attributes(node) -> dict:
    from onnx import helper

    return {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}


def find_layers(model) -> list[Layer]:
    """The QDQ model's refinable layers in graph order: 2-D Conv, Gemm (no transA, alpha = beta = 1) and
    MatMul with a constant 2-D weight, reading a quantized activation."""
    initializers = {init.name for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    layers = []
    for node in model.graph.node:
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2:
            continue
        attributes = _attributes(node)
        if node.op_type == "Gemm" and (attributes.get("transA") or attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0):
            continue
        weight_dq, input_dq = producers.get(node.input[1]), producers.get(node.input[0])
        if weight_dq is None or weight_dq.op_type != "DequantizeLinear" or weight_dq.input[0] not in initializers:
            continue
        if input_dq is None or input_dq.op_type != "DequantizeLinear":
            continue
        quantize = producers.get(input_dq.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear":
            continue
        bias_codes = bias_scale = None
        if len(node.input) > 2 and node.input[2]:
            bias_dq = producers.get(node.input[2])
            if bias_dq is None or bias_dq.op_type != "DequantizeLinear" or bias_dq.input[0] not in initializers:
                continue  # a float bias: onnxruntime would not fuse this layer as ptq expects
            bias_codes, bias_scale = bias_dq.input[0], bias_dq.input[1]
        layers.append(Layer(node.name, node.op_type, node.input[0], quantize.input[0], weight_dq.input[0], weight_dq.input[1],
                            weight_dq.input[2] if len(weight_dq.input) > 2 and weight_dq.input[2] else None, bias_codes, bias_scale, attributes, node))
    return layers


def _pads(attributes: dict, in_hw: tuple[int, int], kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) zero padding, from `pads` or `auto_pad`."""
    auto = attributes.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        total = []
        for size, k, s, d in zip(in_hw, kernel, strides, dilations, strict=True):
            out = -(-size // s)
            total.append(max(0, (out - 1) * s + (k - 1) * d + 1 - size))
        small = [t // 2 for t in total]
        large = [t - t // 2 for t in total]
        first, last = (small, large) if auto == "SAME_UPPER" else (large, small)
        return first[0], first[1], last[0], last[1]
    if auto == "VALID":
        return 0, 0, 0, 0
    pads = list(attributes.get("pads", [0, 0, 0, 0]))
    return pads[0], pads[1], pads[2], pads[3]


def unfold(layer: Layer, inputs: np.ndarray, weight_shape: tuple[int, ...], keep: np.ndarray | None = None) -> np.ndarray:
    """The rows each output of the layer sums over: (positions, groups, inputs per group), in the weight's
    column order (channel, then kernel row and column for a Conv); with `keep` (a mask over `row_count` rows),
    only those rows, gathered without unfolding the others."""
    if layer.op_type != "Conv":
        rows = inputs.reshape(-1, 1, inputs.shape[-1])
        return rows if keep is None else rows[keep]
    groups = int(layer.attributes.get("group", 1))
    if _pointwise(layer, inputs, weight_shape):  # each row one position's channels: no windows, no padded copy
        count, channels, height, width = inputs.shape
        if keep is None:
            return inputs.transpose(0, 2, 3, 1).reshape(count * height * width, groups, channels // groups)
        image, row, column = np.unravel_index(np.flatnonzero(keep), (count, height, width))
        return inputs[image, :, row, column].reshape(len(image), groups, channels // groups)
    windows = _windows(layer, inputs, weight_shape)
    count, channels, out_h, out_w = windows.shape[:4]
    columns = (channels // groups) * weight_shape[2] * weight_shape[3]
    if keep is not None:
        image, row, column = np.unravel_index(np.flatnonzero(keep), (count, out_h, out_w))
        return windows[image, :, row, column].reshape(len(image), groups, columns)
    return windows.transpose(0, 2, 3, 1, 4, 5).reshape(count * out_h * out_w, groups, columns)


def row_count(layer: Layer, inputs: np.ndarray, weight_shape: tuple[int, ...]) -> int:
    """How many rows `unfold` gives for `inputs`, without unfolding them."""
    if layer.op_type != "Conv":
        return int(np.prod(inputs.shape[:-1]))
    kernel, strides, dilations = _geometry(layer, weight_shape)
    top, left, bottom, right = _pads(layer.attributes, inputs.shape[2:], kernel, strides, dilations)  # type: ignore[arg-type]
    out_h, out_w = (max(0, -(-(size + before + after - (k - 1) * d) // s)) for size, before, after, k, d, s in
                    zip(inputs.shape[2:], (top, left), (bottom, right), kernel, dilations, strides, strict=True))
    return inputs.shape[0] * out_h * out_w


def _pointwise(layer: Layer, inputs: np.ndarray, weight_shape: tuple[int, ...]) -> bool:
    """A 1x1 Conv of stride 1 without padding: its windows are its input's positions."""
    if tuple(weight_shape[2:]) != (1, 1) or inputs.ndim != 4:
        return False
    kernel, strides, dilations = _geometry(layer, weight_shape)
    return tuple(strides) == (1, 1) and _pads(layer.attributes, inputs.shape[2:], kernel, strides, dilations) == (0, 0, 0, 0)  # type: ignore[arg-type]


def _geometry(layer: Layer, weight_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A Conv's (kernel, strides, dilations)."""
    return tuple(weight_shape[2:]), tuple(layer.attributes.get("strides", [1, 1])), tuple(layer.attributes.get("dilations", [1, 1]))


def _windows(layer: Layer, inputs: np.ndarray, weight_shape: tuple[int, ...]) -> np.ndarray:
    """A Conv's input windows, a view: (images, channels, output rows, output columns, kernel rows, kernel columns)."""
    kernel, strides, dilations = _geometry(layer, weight_shape)
    top, left, bottom, right = _pads(layer.attributes, inputs.shape[2:], kernel, strides, dilations)  # type: ignore[arg-type]
    padded = np.pad(inputs, ((0, 0), (0, 0), (top, bottom), (left, right)))
    span = ((kernel[0] - 1) * dilations[0] + 1, (kernel[1] - 1) * dilations[1] + 1)
    return np.lib.stride_tricks.sliding_window_view(padded, span, axis=(2, 3))[:, :, ::strides[0], ::strides[1], ::dilations[0], ::dilations[1]]


def weight_matrix(layer: Layer, weight: np.ndarray) -> np.ndarray:
    """The weight as (groups, output channels per group, inputs per group): `overflow.weight_rows`, split by group."""
    rows, _ = weight_rows(layer.op_type, weight, bool(layer.attributes.get("transB")))
    groups = int(layer.attributes.get("group", 1)) if layer.op_type == "Conv" else 1
    return rows.reshape(groups, rows.shape[0] // groups, rows.shape[1])


def from_matrix(layer: Layer, matrix: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layer.op_type == "Conv" or (layer.op_type == "Gemm" and layer.attributes.get("transB")):
        return matrix.reshape(shape)
    return matrix[0].T.reshape(shape)


@dataclass
class Moments:
    """Sums over sampled rows, per group: x_q x_q^T (H) and x_q of the quantized model, and x_fp32 of the float model
    over the same rows."""

    second: np.ndarray | None = None
    quantized_sum: np.ndarray | None = None
    float_sum: np.ndarray | None = None
    rows: int = 0

    def add(self, quantized: np.ndarray) -> None:
        if quantized.shape[2] > 1:  # batched BLAS over the groups, read where they lie: no groups-first copy (BLAS packs its operands alike)
            rows = quantized.astype(np.float64)
            parts = (np.matmul(rows.transpose(1, 2, 0), rows.transpose(1, 0, 2)), rows.sum(axis=0))
        else:  # one input per group: groups-first, as numpy then adds each group's rows pairwise
            grouped = np.ascontiguousarray(quantized.transpose(1, 0, 2), dtype=np.float64)
            parts = (np.matmul(grouped.transpose(0, 2, 1), grouped), grouped.sum(axis=1))
        if self.second is None or self.quantized_sum is None:
            self.second, self.quantized_sum = parts
        else:
            self.second, self.quantized_sum = self.second + parts[0], self.quantized_sum + parts[1]
        self.rows += len(quantized)


def _sampled_rows(layer: Layer, batches: Iterator[np.ndarray], weight_shape: tuple[int, ...], images: int,
                  rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The layer's unfolded rows over the batches of its input, a sample of at most about MAX_ROWS of them over
    `images` images (DEPTHWISE_ROWS where each group reads one channel; the rows drawn by `rng`: the same rows of the
    quantized and the float input for the same state), a few images at a time."""
    fraction = 1.0
    most = DEPTHWISE_ROWS if depthwise_multiplier(layer.node, weight_shape) else MAX_ROWS
    for index, batch in enumerate(batches):
        if index == 0:
            fraction = min(1.0, most / max(1, row_count(layer, batch[:1], weight_shape) * images))
        per_image = max(1, int(np.prod(batch.shape[1:])) * (int(np.prod(weight_shape[2:])) if layer.op_type == "Conv" else 1))
        step = max(1, ROW_BUDGET // per_image)
        for start in range(0, len(batch), step):
            part = batch[start : start + step]
            yield unfold(layer, part, weight_shape, rng.random(row_count(layer, part, weight_shape)) < fraction if fraction < 1.0 else None)


def gptq(weights: np.ndarray, second: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Integer codes for `weights` (groups x rows x inputs) minimising sum over rows of (w - s(q - z))^T H (w - s(q - z)),
    column by column with error feedback; `scale` and `zero` are per row (groups x rows)."""
    groups, rows, columns = weights.shape
    hessian = second.astype(np.float64).copy()
    diagonal = np.einsum("gii->gi", hessian)
    dead = diagonal <= 0
    diagonal[dead] = 1.0
    order = np.argsort(-diagonal, axis=1, kind="stable")  # largest inputs first (GPTQ's act-order)
    hessian = np.take_along_axis(np.take_along_axis(hessian, order[:, :, None], axis=1), order[:, None, :], axis=2)
    damping = DAMPING * np.mean(np.einsum("gii->gi", hessian), axis=1)
    hessian += damping[:, None, None] * np.eye(columns)[None]
    inverse = np.linalg.inv(hessian)
    upper = np.linalg.cholesky(inverse).transpose(0, 2, 1)  # H^-1 = U^T U
    work = np.take_along_axis(weights.astype(np.float64), order[:, None, :], axis=2)
    scale64, zero64 = scale.astype(np.float64)[:, :, None], zero.astype(np.float64)[:, :, None]
    codes = np.empty_like(work)
    for begin in range(0, columns, BLOCK):
        end = min(begin + BLOCK, columns)
        errors = np.empty((groups, rows, end - begin))
        for column in range(begin, end):
            values = work[:, :, column]
            code = np.clip(np.rint(values / scale64[:, :, 0] + zero64[:, :, 0]), qmin, qmax)
            codes[:, :, column] = code
            error = (values - (code - zero64[:, :, 0]) * scale64[:, :, 0]) / upper[:, column, column][:, None]
            errors[:, :, column - begin] = error
            if column + 1 < end:
                work[:, :, column + 1 : end] -= error[:, :, None] * upper[:, None, column, column + 1 : end]
        if end < columns:
            work[:, :, end:] -= np.einsum("grk,gkj->grj", errors, upper[:, begin:end, end:])
    restored = np.empty_like(codes)
    np.put_along_axis(restored, np.broadcast_to(order[:, None, :], codes.shape), codes, axis=2)
    return restored


def nearest(weights: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    return np.clip(np.rint(weights / scale[:, :, None] + zero[:, :, None]), qmin, qmax)


def keep_pair_rule(learned: np.ndarray, rounded: np.ndarray, depthwise: bool) -> tuple[np.ndarray, int]:
    """Learned codes that keep the pair rule in every output channel whose nearest codes followed it: where a
    channel's two largest same-sign codes would sum past the limit, the one of them learned rounding moved
    furthest past its nearest code steps back towards zero, until the rule holds. It always ends: the nearest
    codes follow the rule, so a violating pair holds a code past its nearest one. (codes, codes stepped back)."""
    if depthwise:
        return learned, 0
    flat_learned, flat_rounded = learned.reshape(-1, learned.shape[-1]), rounded.reshape(-1, rounded.shape[-1])
    positive, negative = pair_sums(flat_learned)
    stepped = 0
    for row in np.flatnonzero((positive > PAIR_LIMIT) | (negative > PAIR_LIMIT)):
        if not is_pair_safe(flat_rounded[row : row + 1]):
            continue  # never followed the rule (a layer the fix does not bound): nothing to keep
        codes, nearest_codes = flat_learned[row], flat_rounded[row]
        for sign in (1, -1):
            magnitudes = np.where(sign * codes > 0, sign * codes, 0)
            while np.sort(magnitudes)[-2:].sum() > PAIR_LIMIT:
                top = np.argsort(magnitudes, kind="stable")[-2:]
                past = sign * (codes[top] - nearest_codes[top])
                chosen = top[int(np.argmax(past))]
                codes[chosen] -= sign
                magnitudes[chosen] -= 1
                stepped += 1
    return flat_learned.reshape(learned.shape), stepped


ActivationSource = Callable[[object, str], Iterator[np.ndarray]]  # (model, tensor name) -> batches of that tensor


FloatMemo = Callable[[tuple, Callable[[], tuple[np.ndarray | None, int]]], tuple[np.ndarray | None, int]]


@dataclass(frozen=True)
class Refinement:
    """What learned rounding follows (`refine`): the float model, where each model's layer inputs come from on the same
    refinement images, and how many images those are.

    `quantized_batches(model, name)` yields the named tensor as the (current) QDQ model computes it on the images,
    `float_batches(float_model, name)` as the float graph does on the same images, in the same batches. `float_memo`
    (see `_moments`) shares the float model's sums between refinements of the same float model and images."""

    float_model: Any  # onnx.ModelProto
    quantized_batches: ActivationSource
    float_batches: ActivationSource
    images: int
    float_memo: FloatMemo | None = None


def refine(quantized, following: Refinement, seed: int = 0, progress: Callable[[int, int], None] | None = None, *,
           own_error: bool = False, go_on: Callable[[], bool] | None = None) -> tuple[Any, list[LayerResult]]:
    """The QDQ model with learned weight codes and corrected biases, in place, layer by layer in graph order.
    `own_error`: each bias takes up only the mean error of its own layer's codes, (W - Q) mu_int8 (see `_correct_bias`).
    `go_on()`, asked before each layer: where it says no, that layer and those after it keep their codes and biases
    (a time budget's end: quantize/budget.py)."""
    from onnx import numpy_helper

    initializers = {init.name: init for init in quantized.graph.initializer}
    float_nodes = {node.name: node for node in following.float_model.graph.node}
    float_initializers = {init.name: init for init in following.float_model.graph.initializer}
    results: list[LayerResult] = []
    layers = [layer for layer in find_layers(quantized) if _float_weight(float_nodes.get(layer.name), float_initializers) is not None]
    rng = np.random.default_rng(seed)
    for index, layer in enumerate(layers):
        if go_on is not None and not go_on():
            break
        float_node = float_nodes[layer.name]
        float_weight = _float_weight(float_node, float_initializers)
        assert float_weight is not None
        codes_init = initializers[layer.codes]
        codes_now = numpy_helper.to_array(codes_init)
        if codes_now.shape != float_weight.shape or codes_now.ndim != (4 if layer.op_type == "Conv" else 2):
            continue  # 1-D/3-D convolutions, batched MatMul weights: left as rounded
        info = np.iinfo(codes_now.dtype)
        scale = numpy_helper.to_array(initializers[layer.scale]).astype(np.float64)
        zero = numpy_helper.to_array(initializers[layer.zero_point]).astype(np.float64) if layer.zero_point else np.zeros_like(scale)
        matrix = weight_matrix(layer, float_weight.astype(np.float64))
        groups, rows = matrix.shape[:2]
        if scale.size not in (1, groups * rows) or zero.size != scale.size or matrix.shape[2] > MAX_INPUTS:
            continue  # not one scale per tensor or per output channel, or too wide to hold H
        per_row_scale = np.broadcast_to(scale.reshape(-1) if scale.size > 1 else scale.reshape(1), (groups * rows,)).reshape(groups, rows)
        per_row_zero = np.broadcast_to(zero.reshape(-1) if zero.size > 1 else zero.reshape(1), (groups * rows,)).reshape(groups, rows)
        moments = _moments(layer, quantized, following, codes_now.shape, rng)
        if moments.second is None or moments.rows == 0 or not np.all(np.isfinite(moments.second)):
            continue
        try:
            learned = gptq(matrix, moments.second / moments.rows, per_row_scale, per_row_zero, int(info.min), int(info.max))
        except np.linalg.LinAlgError:
            continue  # H not positive definite even damped: this layer keeps its nearest codes
        rounded = weight_matrix(layer, codes_now.astype(np.float64))
        learned, kept = keep_pair_rule(learned, rounded, depthwise=layer.op_type == "Conv" and is_depthwise(layer.node, codes_now.shape))
        codes_init.CopyFrom(numpy_helper.from_array(from_matrix(layer, learned, codes_now.shape).astype(codes_now.dtype), layer.codes))
        fitted = Fitted(matrix, learned, per_row_scale, per_row_zero)
        corrected = _correct_bias(layer, initializers, _float_bias(float_node, float_initializers), fitted, moments, own_error)
        results.append(LayerResult(layer.name, int(np.sum(learned != rounded)), int(learned.size), kept, corrected))
        if progress:
            progress(index + 1, len(layers))
    return quantized, results


def _float_weight(node, initializers: dict) -> np.ndarray | None:
    from onnx import numpy_helper

    if node is None or len(node.input) < 2 or node.input[1] not in initializers:
        return None
    weight = numpy_helper.to_array(initializers[node.input[1]])
    return weight if np.issubdtype(weight.dtype, np.floating) and weight.ndim >= 2 else None


def _moments(layer: Layer, quantized, following: Refinement, weight_shape: tuple[int, ...], rng: np.random.Generator) -> Moments:
    """The layer's input statistics over the refinement images, streamed a batch at a time: the quantized model's, then
    the float model's sum over the same rows. `following.float_memo(key, compute)` may hand back that sum from an earlier
    refinement of another quantized model of the same float model and images (the float model does not change)."""
    state = rng.bit_generator.state

    def float_sum() -> tuple[np.ndarray | None, int]:
        same_rows = np.random.default_rng()
        same_rows.bit_generator.state = state
        total, rows = None, 0
        for part in _sampled_rows(layer, following.float_batches(following.float_model, layer.float_input), weight_shape, following.images, same_rows):
            summed = _row_sum(part)
            total, rows = (summed if total is None else total + summed), rows + len(part)
        return total, rows

    moments = Moments()
    for part in _sampled_rows(layer, following.quantized_batches(quantized, layer.quantized_input), weight_shape, following.images, rng):
        moments.add(part)
    key = (layer.name, layer.float_input, tuple(weight_shape), repr(state))
    moments.float_sum, float_rows = float_sum() if following.float_memo is None else following.float_memo(key, float_sum)
    if float_rows != moments.rows:
        moments.float_sum = None  # not the same rows (a source that yields other batches): no bias correction
    return moments


def _row_sum(rows: np.ndarray) -> np.ndarray:
    """The float64 sum of `rows` over its first axis, as `rows.astype(np.float64).sum(axis=0)` adds it (one row after
    another, each output on its own) without the float64 copy: a twentieth of its time on a depthwise layer's rows. Where
    a row is one number, numpy would add them pairwise in its own blocks: that copy then, for the same sum."""
    return rows.sum(axis=0, dtype=np.float64) if int(np.prod(rows.shape[1:])) > 1 else rows.astype(np.float64).sum(axis=0)


@dataclass(frozen=True)
class Fitted:
    """A layer's weights as learned rounding fitted them, (groups, rows, inputs) as `weight_matrix` lays them out: the
    float weights, the learned codes, and each row's scale and zero point."""

    weights: np.ndarray
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    def dequantized(self) -> np.ndarray:
        return (self.codes - self.zero[:, :, None]) * self.scale[:, :, None]


def _float_bias(float_node, float_initializers: dict) -> np.ndarray | None:
    """The float layer's bias (float64, flat), None where it has none."""
    from onnx import numpy_helper

    name = float_node.input[2] if len(float_node.input) > 2 else ""
    return numpy_helper.to_array(float_initializers[name]).astype(np.float64).reshape(-1) if name in float_initializers else None


def _correct_bias(layer: Layer, initializers: dict, float_bias: np.ndarray | None, fitted: Fitted, moments: Moments, own_error: bool = False) -> bool:
    """b' = b + W mu_fp32 - Q mu_int8 per output channel, written back as int32 codes of the bias's own scale. With
    `own_error`, b' = b + (W - Q) mu_int8: the layer's own codes' mean error alone, not what the layers before it moved
    (where those moved its inputs far, as in squeeze-excitation gates of a fragile model, matching FP32's mean
    overshoots from layer to layer)."""
    from onnx import numpy_helper

    if layer.bias_codes is None or layer.bias_scale is None or moments.float_sum is None or not moments.rows or float_bias is None:
        return False
    mean_float, mean_quantized = moments.float_sum / moments.rows, moments.quantized_sum / moments.rows  # type: ignore[operator]
    dequantized = fitted.dequantized()
    if own_error:
        shift = np.einsum("gri,gi->gr", fitted.weights - dequantized, mean_quantized)
    else:
        shift = np.einsum("gri,gi->gr", fitted.weights, mean_float) - np.einsum("gri,gi->gr", dequantized, mean_quantized)
    bias_scale = numpy_helper.to_array(initializers[layer.bias_scale]).astype(np.float64).reshape(-1)
    corrected = float_bias + shift.reshape(-1)
    if float_bias.shape != corrected.shape:
        return False
    codes = np.clip(np.rint(corrected / bias_scale), np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
    shape = tuple(initializers[layer.bias_codes].dims)
    initializers[layer.bias_codes].CopyFrom(numpy_helper.from_array(codes.reshape(shape), layer.bias_codes))
    return True


def describe_rounding(rounding: str | None, nearest_db: float | None = None, learned_db: float | None = None) -> str:
    """e.g. "learned (image SQNR on held-out calibration images: 22.5 dB nearest, 23.2 dB learned)"."""
    if rounding is None:
        return AUTO
    if nearest_db is None or learned_db is None:
        return rounding
    return f"{rounding} (image SQNR on held-out calibration images: {nearest_db:.1f} dB nearest, {learned_db:.1f} dB learned)"
