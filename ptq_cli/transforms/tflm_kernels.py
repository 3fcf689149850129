"""TensorFlow Lite Micro's int8 reference kernels, integer for integer, over whole batches in numpy.

The tflite-micro interpreter runs one image per invoke (about 7 ms for ResNet8 on one core, 38 s for the CIFAR-10
test set on two). These are the same computations as its reference kernels (tensorflow/lite/kernels/internal/
reference/integer_ops and gemmlowp's fixed point, which CMSIS-NN reproduces): the same int32 accumulators, the
same multipliers and shifts derived from the same float scales, the same rounding. Only the ops written here are
covered (`covers`); `tflm.py` runs a model through them only where they give TFLM's own output bytes on the
images it checks, and TFLM itself otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ptq_cli.transforms.tflite_graph import op_kind, schema_module, unpack_int4

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
WINDOW_VALUES = 1 << 20  # unfolded input values per convolution product (4 MB in float32): the images per product follow


# --- gemmlowp / TFLite fixed point on int64 arrays holding int32 values -------------------------------------------

def _truncating_divide(numerator: np.ndarray, denominator: int) -> np.ndarray:
    """C's integer division (toward zero)."""
    quotient = np.abs(numerator) // denominator
    return np.where(numerator < 0, -quotient, quotient)


def doubling_high_mul(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    """gemmlowp's SaturatingRoundingDoublingHighMul. Its nudge (2^30, or 1 - 2^30 below zero) and its division by
    2^31 truncating toward zero (2^31 - 1 added below zero, then a floor) come to one floor of (a x b + 2^30) / 2^31."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    product = a * b
    product += 1 << 30
    product >>= 31
    if np.any(b == INT32_MIN):
        product = np.where((a == INT32_MIN) & (b == INT32_MIN), INT32_MAX, product)
    return product


def divide_by_pot(x: np.ndarray, exponent: np.ndarray | int) -> np.ndarray:
    """gemmlowp's RoundingDivideByPOT: to nearest, ties away from zero, as one floor of (x + 2^(e-1) - [x < 0]) / 2^e."""
    x, exponent = np.asarray(x, np.int64), np.asarray(exponent, np.int64)
    rounded = x + ((np.int64(1) << exponent) >> 1)
    below_zero = x < 0
    rounded -= below_zero if np.all(exponent > 0) else below_zero & (exponent > 0)  # nothing to round at 2^0
    rounded >>= exponent
    return rounded


def multiply_by_quantized_multiplier(x: np.ndarray, multiplier: np.ndarray | int, shift: np.ndarray | int) -> np.ndarray:
    """TFLite's MultiplyByQuantizedMultiplier: divide_by_pot(doubling_high_mul(x x 2^left, multiplier), right).

    Without a left shift, the two roundings come to one floor, since floor((floor(A / m) + c) / n) = floor((A + c m) / (m n)):
    with p = x x multiplier and e = right > 0, floor((p + 2^30 + 2^(30+e) - [p < -2^30] 2^31) / 2^(31+e))."""
    shift, multiplier = np.asarray(shift, np.int64), np.asarray(multiplier, np.int64)
    left, right = np.maximum(shift, 0), np.maximum(-shift, 0)
    x = np.asarray(x, np.int64)
    if np.any(left) or np.any(multiplier == INT32_MIN) or not np.all(right > 0):
        return divide_by_pot(doubling_high_mul(x * (np.int64(1) << left), multiplier), right)
    total = x * multiplier
    total += np.int64(1) << 30
    # p < -2^30 where p + 2^30 is negative: its sign bit, spread (-1 or 0) and shifted, subtracts 2^31 without a mask.
    below = total >> 63
    below <<= 31
    total += below
    total += np.int64(1) << (30 + right)
    total >>= 31 + right
    return total


def quantize_multiplier(value: float) -> tuple[int, int]:
    """TFLite's QuantizeMultiplier: (int32 multiplier, shift) with value = multiplier x 2^(shift - 31)."""
    if value == 0.0:
        return 0, 0
    fraction, shift = math.frexp(value)
    fixed = int(math.floor(abs(fraction) * (1 << 31) + 0.5)) * (1 if fraction >= 0 else -1)  # TfLiteRound: half away from zero
    if fixed == 1 << 31:
        fixed //= 2
        shift += 1
    if shift < -31:
        return 0, 0
    return fixed, shift


def _saturating_pot(x: np.ndarray, exponent: int) -> np.ndarray:
    """gemmlowp's SaturatingRoundingMultiplyByPOT."""
    if exponent > 0:
        threshold = (1 << (31 - exponent)) - 1
        return np.where(x > threshold, INT32_MAX, np.where(x < -threshold, INT32_MIN, x << exponent))
    return divide_by_pot(x, -exponent) if exponent < 0 else x


def _exp_near_zero(a: np.ndarray) -> np.ndarray:
    """gemmlowp's exp_on_interval_between_negative_one_quarter_and_0_excl (raw values, 0 integer bits)."""
    x = a + (1 << 28)
    x2 = doubling_high_mul(x, x)
    x3 = doubling_high_mul(x2, x)
    x4 = doubling_high_mul(x2, x2)
    x4_over_4 = _saturating_pot(x4, -2)
    polynomial = _saturating_pot(doubling_high_mul(x4_over_4 + x3, 715827883) + x2, -1)
    return 1895147668 + doubling_high_mul(1895147668, x + polynomial)


def _exp_on_negative(a: np.ndarray) -> np.ndarray:
    """gemmlowp's exp_on_negative_values for 5 integer bits in, 0 out (raw int32 values)."""
    quarter = 1 << 24
    mod_quarter = (a & (quarter - 1)) - quarter
    result = _exp_near_zero(_saturating_pot(mod_quarter, 5))
    remainder = mod_quarter - a
    for exponent, multiplier in ((-2, 1672461947), (-1, 1302514674), (0, 790015084), (1, 290630308), (2, 39332535), (3, 720401), (4, 242)):
        result = np.where(remainder & (1 << (26 + exponent)), doubling_high_mul(result, multiplier), result)
    return np.where(a == 0, INT32_MAX, result)


def _reciprocal(x: np.ndarray, integer_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """TFLite's GetReciprocal: (1 / (1 + fraction) raw, the bits over unit)."""
    headroom = np.array([32 - int(value).bit_length() for value in x.reshape(-1)], np.int64).reshape(x.shape)  # leading zeros of uint32
    bits_over_unit = integer_bits - headroom
    shifted = ((x.astype(np.uint64) << headroom.astype(np.uint64)) & 0xFFFFFFFF).astype(np.int64) - (1 << 31)
    # gemmlowp's one_over_one_plus_x_for_x_in_0_1 (Newton-Raphson, 2 integer bits)
    total = shifted + INT32_MAX
    half_denominator = _truncating_divide(total + np.where(total >= 0, 1, -1), 2)
    estimate = 1515870810 + doubling_high_mul(half_denominator, -1010580540)
    for _ in range(3):
        product = doubling_high_mul(half_denominator, estimate)
        one_minus = (1 << 29) - product
        estimate = estimate + _saturating_pot(doubling_high_mul(estimate, one_minus), 2)
    return _saturating_pot(estimate, 1), bits_over_unit


# --- the ops ------------------------------------------------------------------------------------------------------

def _activation_range(activation: int, scale: float, zero_point: int) -> tuple[int, int]:
    schema = schema_module()

    def quantized(value: float) -> int:
        scaled = value / scale
        return zero_point + int(math.floor(abs(scaled) + 0.5)) * (1 if scaled >= 0 else -1)

    low, high = -128, 127
    if activation == schema.ActivationFunctionType.RELU:
        low = max(low, quantized(0.0))
    elif activation == schema.ActivationFunctionType.RELU6:
        low, high = max(low, quantized(0.0)), min(high, quantized(6.0))
    elif activation == schema.ActivationFunctionType.RELU_N1_TO_1:
        low, high = max(low, quantized(-1.0)), min(high, quantized(1.0))
    elif activation != schema.ActivationFunctionType.NONE:
        raise _Uncovered(f"fused activation {activation}")
    return low, high


TARGET_OPS = ("SHAPE", "STRIDED_SLICE", "PACK")  # how the converter computes a Flatten's RESHAPE target at run time


def _nothing(_values: dict[int, np.ndarray]) -> None:
    """The step of an op whose result nothing here reads."""


class _Uncovered(Exception):
    """An op or option these kernels do not reproduce (TFLM itself then runs the model)."""


def _padding(size: int, kernel: int, stride: int, dilation: int, same: bool) -> tuple[int, int]:
    """(output size, padding before), TFLite's ComputePaddingHeightWidth."""
    effective = (kernel - 1) * dilation + 1
    out = (size + stride - 1) // stride if same else (size - effective + stride) // stride
    total = max((out - 1) * stride + effective - size, 0)
    return out, total // 2


def _padded(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int], same: bool,
            fill: int) -> tuple[np.ndarray, tuple[int, int]]:
    """(an NHWC batch padded as the op pads it, outside positions holding `fill`; the output's (OH, OW))."""
    _, height, width, _ = x.shape
    (out_h, pad_h), (out_w, pad_w) = (_padding(size, k, s, d, same) for size, k, s, d in zip((height, width), kernel, strides, dilations, strict=True))
    need_h = (out_h - 1) * strides[0] + (kernel[0] - 1) * dilations[0] + 1
    need_w = (out_w - 1) * strides[1] + (kernel[1] - 1) * dilations[1] + 1
    padded = np.pad(x, ((0, 0), (pad_h, max(need_h - height - pad_h, 0)), (pad_w, max(need_w - width - pad_w, 0)), (0, 0)), constant_values=fill)
    return padded, (out_h, out_w)


def _windows(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int], same: bool, fill: int) -> np.ndarray:
    """(N, OH, OW, KH, KW, C) windows of an NHWC batch, outside positions holding `fill`."""
    padded, (out_h, out_w) = _padded(x, kernel, strides, dilations, same, fill)
    span = ((kernel[0] - 1) * dilations[0] + 1, (kernel[1] - 1) * dilations[1] + 1)
    windows = np.lib.stride_tricks.sliding_window_view(padded, span, axis=(1, 2))[:, ::strides[0], ::strides[1], :, ::dilations[0], ::dilations[1]]
    return windows[:, :out_h, :out_w].transpose(0, 1, 2, 4, 5, 3)


def _window_rows(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int], same: bool) -> np.ndarray:
    """The windows of an NHWC batch as rows, (N x OH x OW, KH x KW x C), zero outside: one matrix product then computes
    a convolution. Without dilation a window's KW x C values of one row lie together in the padded batch, and copy as
    one run; a 1 x 1 window of stride 1 is the batch itself."""
    if kernel == (1, 1) and strides == (1, 1):
        return x.reshape(-1, x.shape[3])
    if dilations != (1, 1):
        windows = _windows(x, kernel, strides, dilations, same, 0)
        return windows.reshape(-1, int(np.prod(windows.shape[3:])))
    padded, (out_h, out_w) = _padded(x, kernel, strides, dilations, same, 0)
    count, _, _, channels = padded.shape
    batch, row, column, channel = padded.strides
    windows = np.lib.stride_tricks.as_strided(padded, (count, out_h, out_w, kernel[0], kernel[1] * channels),
                                              (batch, strides[0] * row, strides[1] * column, row, channel), writeable=False)
    return windows.reshape(count * out_h * out_w, -1)


def _depthwise(x: np.ndarray, taps: np.ndarray, strides: tuple[int, int], dilations: tuple[int, int], same: bool, multiplier: int) -> np.ndarray:
    """A depthwise convolution's sums (N, OH, OW, O) of an NHWC batch (input - zero point, in the exact float type) and
    its KH x KW x O taps, one strided slice of the padded batch per tap, each output channel o reading input channel
    o // multiplier."""
    kernel = taps.shape[:2]
    padded, (out_h, out_w) = _padded(x, kernel, strides, dilations, same, 0)
    if multiplier > 1:
        padded = np.repeat(padded, multiplier, axis=-1)
    sums = np.zeros((len(x), out_h, out_w, taps.shape[2]), taps.dtype)
    for row in range(kernel[0]):
        for column in range(kernel[1]):
            top, left = row * dilations[0], column * dilations[1]
            rows = slice(top, top + (out_h - 1) * strides[0] + 1, strides[0])
            columns = slice(left, left + (out_w - 1) * strides[1] + 1, strides[1])
            sums += padded[:, rows, columns] * taps[row, column]
    return sums


def kernel_terms(weights: np.ndarray) -> int:
    """The terms of one DEPTHWISE_CONV_2D sum (1 x KH x KW x O filter): KH x KW."""
    return int(weights.shape[1] * weights.shape[2])


class _Model:
    def __init__(self, data: bytes) -> None:
        schema = schema_module()
        self.schema = schema
        self.model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
        if len(self.model.subgraphs) != 1:
            raise _Uncovered("more than one subgraph")
        self.graph = self.model.subgraphs[0]
        targets = self._target_ops()
        self.steps: list[Callable[[dict[int, np.ndarray]], None]] = [_nothing if position in targets else self._step(operator)
                                                                     for position, operator in enumerate(self.graph.operators)]

    def _target_ops(self) -> set[int]:
        """The ops (positions) that only compute RESHAPE targets at run time (a Flatten with the batch left free, as the
        converter writes it): RESHAPE here takes its output's own shape, the batch free, so they need not run."""
        readers: dict[int, list[tuple[int, int]]] = {}
        for position, operator in enumerate(self.graph.operators):
            for slot, index in enumerate(operator.inputs):
                readers.setdefault(int(index), []).append((position, slot))
        kinds = [op_kind(self.model, operator) for operator in self.graph.operators]
        outputs, targets = {int(index) for index in self.graph.outputs}, set()
        for position in reversed(range(len(kinds))):
            made = [int(index) for index in self.graph.operators[position].outputs]
            if kinds[position] in TARGET_OPS and not outputs & set(made) and all(
                    (kinds[reader] == "RESHAPE" and slot == 1) or reader in targets for index in made for reader, slot in readers.get(index, [])):
                targets.add(position)
        return targets

    def tensor(self, index: int):
        return self.graph.tensors[int(index)]

    def quantization(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        parameters = self.tensor(index).quantization
        if parameters is None or parameters.scale is None or not len(parameters.scale):
            raise _Uncovered("a tensor without quantization")
        return np.asarray(parameters.scale, np.float32), np.asarray(parameters.zeroPoint, np.int64)

    def constant(self, index: int) -> np.ndarray:
        tensor = self.tensor(index)
        raw = np.asarray(self.model.buffers[tensor.buffer].data, np.uint8).tobytes()
        shape = [int(dim) for dim in tensor.shape]
        if tensor.type == self.schema.TensorType.INT4:
            return unpack_int4(np.frombuffer(raw, np.uint8), shape)
        types = {self.schema.TensorType.INT8: np.int8, self.schema.TensorType.INT32: np.int32, self.schema.TensorType.INT64: np.int64}
        if tensor.type not in types:
            raise _Uncovered(f"a constant of type {tensor.type}")
        return np.frombuffer(raw, types[tensor.type]).astype(np.int64).reshape(shape)

    def _int8(self, index: int) -> None:
        if self.tensor(index).type != self.schema.TensorType.INT8:
            raise _Uncovered("a tensor other than int8")

    def _step(self, operator) -> Callable[[dict[int, np.ndarray]], None]:
        kind = op_kind(self.model, operator)
        builder = {"CONV_2D": self._convolution, "DEPTHWISE_CONV_2D": self._convolution, "FULLY_CONNECTED": self._fully_connected,
                   "ADD": self._add, "AVERAGE_POOL_2D": self._pool, "MAX_POOL_2D": self._pool, "RESHAPE": self._reshape,
                   "SOFTMAX": self._softmax}.get(kind)
        if builder is None:
            raise _Uncovered(kind)
        for index in operator.outputs:
            self._int8(int(index))
        return builder(operator, kind)

    def _requantizer(self, input_index: int, weight_scales: np.ndarray, output_index: int, activation: int):
        (input_scale,), _ = self.quantization(input_index)
        (output_scale,), (output_zero,) = self.quantization(output_index)
        pairs = [quantize_multiplier(float(input_scale) * float(scale) / float(output_scale)) for scale in weight_scales]
        multipliers, shifts = (np.array(values, np.int64) for values in zip(*pairs, strict=True))
        low, high = _activation_range(activation, float(output_scale), int(output_zero))

        def requantized(accumulators: np.ndarray) -> np.ndarray:
            codes = multiply_by_quantized_multiplier(accumulators, multipliers, shifts)
            codes += output_zero
            return np.clip(codes, low, high, out=codes).astype(np.int16)

        return requantized

    def _convolution(self, operator, kind: str):
        inputs = [int(index) for index in operator.inputs]
        self._int8(inputs[0])
        options = operator.builtinOptions
        weights = self.constant(inputs[1])  # CONV_2D: O x KH x KW x I; DEPTHWISE_CONV_2D: 1 x KH x KW x O
        bias = self.constant(inputs[2]) if len(inputs) > 2 and inputs[2] >= 0 else np.zeros(weights.shape[-1 if kind != "CONV_2D" else 0], np.int64)
        weight_scales, weight_zeros = self.quantization(inputs[1])
        if np.any(weight_zeros != 0):
            raise _Uncovered("filter zero points")
        outputs = weights.shape[0] if kind == "CONV_2D" else weights.shape[3]
        _, (input_zero,) = self.quantization(inputs[0])
        requantized = self._requantizer(inputs[0], np.broadcast_to(weight_scales, (outputs,)), int(operator.outputs[0]), options.fusedActivationFunction)
        strides, dilations = (options.strideH, options.strideW), (options.dilationHFactor, options.dilationWFactor)
        same = options.padding == self.schema.Padding.SAME
        kernel = (weights.shape[1], weights.shape[2])
        multiplier = getattr(options, "depthMultiplier", 1) or 1
        # Integer sums are exact in floating point while the sum of the terms' magnitudes stays below 2^24 (float32)
        # or 2^53 (float64): |input - zero point| <= 255, and each sum has KH x KW x C terms.
        terms = int(np.prod(weights.shape[1:])) if kind == "CONV_2D" else kernel_terms(weights)
        exact = np.float32 if terms * 255 * int(np.abs(weights).max(initial=0)) < (1 << 24) else np.float64
        matrix = weights.reshape(outputs, -1).T.astype(exact) if kind == "CONV_2D" else None
        taps = weights[0].astype(exact) if kind != "CONV_2D" else np.empty(0, exact)  # DEPTHWISE_CONV_2D: KH x KW x O

        def run(values: dict[int, np.ndarray]) -> None:
            x = values[inputs[0]]
            results = []
            out_h, out_w = (_padding(size, k, stride, dilation, same)[0]
                            for size, k, stride, dilation in zip(x.shape[1:3], kernel, strides, dilations, strict=True))
            chunk = max(1, WINDOW_VALUES // (out_h * out_w * kernel[0] * kernel[1] * x.shape[3] * multiplier))
            for start in range(0, len(x), chunk):
                # Positions outside the image add nothing: the kernel skips them, here they hold input - zero point = 0.
                part = (x[start : start + chunk] - input_zero).astype(exact)
                if kind == "CONV_2D":
                    sums = _window_rows(part, kernel, strides, dilations, same) @ matrix  # whole numbers, exactly
                    accumulators = sums.astype(np.int64).reshape(len(part), out_h, out_w, outputs)
                else:
                    accumulators = _depthwise(part, taps, strides, dilations, same, multiplier).astype(np.int64)
                accumulators += bias
                results.append(requantized(accumulators))
            values[int(operator.outputs[0])] = np.concatenate(results)

        return run

    def _fully_connected(self, operator, _kind: str):
        inputs = [int(index) for index in operator.inputs]
        self._int8(inputs[0])
        weights = self.constant(inputs[1])
        bias = self.constant(inputs[2]) if len(inputs) > 2 and inputs[2] >= 0 else np.zeros(weights.shape[0], np.int64)
        weight_scales, weight_zeros = self.quantization(inputs[1])
        _, (input_zero,) = self.quantization(inputs[0])
        requantized = self._requantizer(inputs[0], np.broadcast_to(weight_scales, (weights.shape[0],)), int(operator.outputs[0]),
                                        operator.builtinOptions.fusedActivationFunction)
        matrix = (weights - weight_zeros.reshape(-1, 1) if len(weight_zeros) > 1 else weights - int(weight_zeros[0])).T.astype(np.float64)
        output_shape = [int(dim) for dim in self.tensor(int(operator.outputs[0])).shape]

        def run(values: dict[int, np.ndarray]) -> None:
            x = values[inputs[0]].reshape(-1, weights.shape[1]).astype(np.float64) - float(input_zero)
            result = requantized((x @ matrix).astype(np.int64) + bias)
            values[int(operator.outputs[0])] = result.reshape(len(values[inputs[0]]), *output_shape[1:])

        return run

    def _add(self, operator, _kind: str):
        first, second = (int(index) for index in operator.inputs)
        output = int(operator.outputs[0])
        (scale_1,), (zero_1,) = self.quantization(first)
        (scale_2,), (zero_2,) = self.quantization(second)
        (scale_out,), (zero_out,) = self.quantization(output)
        if list(self.tensor(first).shape) != list(self.tensor(second).shape):
            raise _Uncovered("ADD with broadcasting")
        left_shift = 20
        twice_max = 2 * max(float(scale_1), float(scale_2))
        multiplier_1, shift_1 = quantize_multiplier(float(scale_1) / twice_max)
        multiplier_2, shift_2 = quantize_multiplier(float(scale_2) / twice_max)
        multiplier_out, shift_out = quantize_multiplier(twice_max / ((1 << left_shift) * float(scale_out)))
        low, high = _activation_range(operator.builtinOptions.fusedActivationFunction, float(scale_out), int(zero_out))

        # The output depends on the two int8 codes alone: every pair computed once, as the kernel computes it.
        codes = np.arange(-128, 128, dtype=np.int64)
        scaled_1 = divide_by_pot(doubling_high_mul((codes - zero_1) << left_shift, multiplier_1), -shift_1)
        scaled_2 = divide_by_pot(doubling_high_mul((codes - zero_2) << left_shift, multiplier_2), -shift_2)
        total = divide_by_pot(doubling_high_mul(scaled_1[:, None] + scaled_2[None, :], multiplier_out), -shift_out) + zero_out
        table = np.clip(total, low, high).astype(np.int16).reshape(-1)

        def run(values: dict[int, np.ndarray]) -> None:
            values[output] = table[(values[first].astype(np.int32) + 128) * 256 + (values[second] + 128)]

        return run

    def _pool(self, operator, kind: str):
        source, output = int(operator.inputs[0]), int(operator.outputs[0])
        options = operator.builtinOptions
        (scale_out,), (zero_out,) = self.quantization(output)
        low, high = _activation_range(options.fusedActivationFunction, float(scale_out), int(zero_out))
        kernel, strides = (options.filterHeight, options.filterWidth), (options.strideH, options.strideW)
        same = options.padding == self.schema.Padding.SAME

        def run(values: dict[int, np.ndarray]) -> None:
            x = values[source]
            if kind == "MAX_POOL_2D":
                pooled = _windows(x, kernel, strides, (1, 1), same, -129).max(axis=(3, 4))  # below every int8 code
            else:
                windows = _windows(x, kernel, strides, (1, 1), same, 0)
                counts = _windows(np.ones((1, *x.shape[1:3], 1), np.int64), kernel, strides, (1, 1), same, 0).sum(axis=(3, 4))
                sums = windows.sum(axis=(3, 4))
                half = counts // 2  # C's (sum +- count / 2) / count, truncating
                pooled = np.where(sums > 0, (sums + half) // counts, -((half - sums) // counts))
            values[output] = np.clip(pooled, low, high).astype(np.int16)

        return run

    def _reshape(self, operator, _kind: str):
        source, output = int(operator.inputs[0]), int(operator.outputs[0])
        shape = [int(dim) for dim in self.tensor(output).shape]
        signature = self.tensor(output).shapeSignature
        if signature is not None and any(int(dim) < 0 for dim in list(signature)[1:]):
            raise _Uncovered("a RESHAPE to a shape known only at run time")

        def run(values: dict[int, np.ndarray]) -> None:
            values[output] = values[source].reshape(len(values[source]), *shape[1:])

        return run

    def _softmax(self, operator, _kind: str):
        source, output = int(operator.inputs[0]), int(operator.outputs[0])
        (scale_in,), _ = self.quantization(source)
        (scale_out,), (zero_out,) = self.quantization(output)
        if abs(float(scale_out) - 1 / 256) > 1e-9 or int(zero_out) != -128:
            raise _Uncovered("SOFTMAX output other than scale 1/256, zero point -128")
        beta = float(operator.builtinOptions.beta)
        real = min(beta * float(scale_in) * (1 << (31 - 5)), (1 << 31) - 1.0)
        multiplier, left_shift = quantize_multiplier(real)
        radius = math.floor(1.0 * ((1 << 5) - 1) * (1 << (31 - 5)) / (1 << left_shift))
        diff_min = -radius

        def run(values: dict[int, np.ndarray]) -> None:
            x = values[source]
            difference = x - x.max(axis=-1, keepdims=True)
            inside = difference >= diff_min
            rescaled = doubling_high_mul(difference * (np.int64(1) << left_shift), multiplier)
            exps = _exp_on_negative(rescaled)
            summed = np.where(inside, _saturating_pot(exps, -12), 0).sum(axis=-1, keepdims=True)
            scale, bits_over_unit = _reciprocal(summed, 12)
            unsaturated = divide_by_pot(doubling_high_mul(scale, exps), bits_over_unit + 31 - 8)
            values[output] = np.where(inside, np.clip(unsaturated - 128, -128, 127), -128).astype(np.int16)

        return run

    def run(self, batch: np.ndarray) -> np.ndarray:
        output = int(self.graph.outputs[0])
        return self.tensors({int(self.graph.inputs[0]): batch}, [output])[output]

    def tensors(self, feeds: dict[int, np.ndarray], wanted: list[int]) -> dict[int, np.ndarray]:
        """The int8 codes of the `wanted` tensors, the model's inputs fed their int8 codes (`feeds`, tensor ->
        batch); a tensor is let go once no later op reads it, unless wanted."""
        values = {int(index): codes.astype(np.int16) for index, codes in feeds.items()}  # int8 codes, with room for arithmetic
        last_read = {int(index): position for position, operator in enumerate(self.graph.operators) for index in operator.inputs}
        for position, step in enumerate(self.steps):
            step(values)
            for index in [index for index in values if last_read.get(index, -1) <= position and index not in wanted]:
                del values[index]
        return {index: values[index].astype(np.int8) for index in wanted}


def runner(data: bytes) -> _Model | str:
    """The model as these kernels run it (`.tensors`), when its ops are all written here and its inputs are int8,
    else the name of the first op or option that is not."""
    try:
        model = _Model(data)
        for index in model.graph.inputs:
            model._int8(int(index))
    except _Uncovered as missing:
        return str(missing)
    except Exception as error:  # noqa: BLE001  a file the interpreter runs but this reading does not follow: the interpreter runs it
        return f"unread ({type(error).__name__})"
    return model


REFERENCE_BATCH = 100  # images a call in reference_codes


def reference_codes(data: bytes, feeds: dict[int, np.ndarray], wanted: list[int]) -> dict[int, np.ndarray]:
    """The codes of the `wanted` tensors of a model (`data`) whose inputs are fed `feeds` (tensor -> batch),
    REFERENCE_BATCH images a call: by these kernels where they cover the model (TFLM's own arithmetic, about twice
    LiteRT's speed), else by LiteRT's reference kernels, which round some ops apart from TFLM's (FULLY_CONNECTED
    by one code on a few outputs)."""
    model = runner(data)
    run = _interpreter_run(data) if isinstance(model, str) else model.tensors
    count = len(next(iter(feeds.values())))
    found: dict[int, list[np.ndarray]] = {tensor: [] for tensor in wanted}
    for start in range(0, count, REFERENCE_BATCH):
        part = run({tensor: values[start : start + REFERENCE_BATCH] for tensor, values in feeds.items()}, wanted)
        for tensor in wanted:
            found[tensor].append(part[tensor])
    return {tensor: np.concatenate(found[tensor]) for tensor in wanted}


def _interpreter_run(data: bytes) -> Callable[[dict[int, np.ndarray], list[int]], dict[int, np.ndarray]]:
    """LiteRT's reference kernels (no XNNPACK) as `_Model.tensors` runs: feeds in, the wanted tensors out."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interpreter = Interpreter(model_content=data, experimental_preserve_all_tensors=True, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    shapes: dict[int, tuple[int, ...]] = {}

    def run(feeds: dict[int, np.ndarray], wanted: list[int]) -> dict[int, np.ndarray]:
        if {tensor: values.shape for tensor, values in feeds.items()} != shapes:
            for tensor, values in feeds.items():
                interpreter.resize_tensor_input(tensor, list(values.shape))
            interpreter.allocate_tensors()
            shapes.update({tensor: values.shape for tensor, values in feeds.items()})
        for tensor, values in feeds.items():
            interpreter.set_tensor(tensor, values)
        interpreter.invoke()
        return {tensor: interpreter.get_tensor(tensor) for tensor in wanted}

    return run


def covers(data: bytes) -> Callable[[np.ndarray], np.ndarray] | str:
    """A batch runner (int8 NHWC batch -> int8 outputs) for a model whose ops are all written here, else the
    name of the first op or option that is not."""
    model = runner(data)
    if isinstance(model, str):
        return model
    if len(model.graph.inputs) != 1 or len(model.graph.outputs) != 1:
        return "more than one input or output"
    return model.run

