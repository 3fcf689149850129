"""The int16 pair overflow of x86 u8 x s8 kernels without VNNI, and the weight scales that rule it out.

`vpmaddubsw` multiplies u8 activations (0-255) by s8 weights and adds each *pair* of adjacent products
of one dot product (so of one output channel) into a saturating int16. A pair a1*w1 + a2*w2 lies within
[-255*(n1+n2), 255*(p1+p2)], where p1, p2 are the two largest positive weight codes of that output
channel and n1, n2 the two largest negative ones in magnitude. If both sums are at most 128, every pair
stays within 255*128 = 32,640 <= 32,767 whatever the activations and whatever pairing the kernel uses.
That is the *pair rule*: weaker than onnxruntime's own rule (every weight in [-64, 63], i.e. 7-bit
weights) and so cheaper in accuracy, since only a channel's two largest same-sign codes are bounded.
s8 x s8 models are covered too: on x86 onnxruntime shifts s8 activations to u8 and runs the u8 x s8 kernel.
Depthwise convolutions (one input and one output channel per group) are exempt: onnxruntime runs them on
a kernel that widens to 16 bits before multiplying, so they give the same sums on both paths; so are uint8
weights under uint8 activations, whose u8 x u8 kernel widens too (tests/test_int8_paths.py measures both).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ptq_cli.transforms.graph import WEIGHTED_OPS, depthwise_multiplier

PAIR_LIMIT = 128  # 255 * 128 = 32,640 <= 32,767
SHAPE_OPS = ("Shape", "Size")
# Overflow fixes (`--overflow-fix`): the layers whose weights follow the pair rule.
FIRST_LAYER, ALL_LAYERS, NO_FIX = "first-layer", "all-layers", "none"
OVERFLOW_FIXES = (FIRST_LAYER, ALL_LAYERS)
# Not a fix: the default of a backend that judges both on held-out calibration images (Quantizer.judges_overflow_fix)
# for a model without clamped activations; its quantize resolves it to one of them. Either bounds the stem.
JUDGED = "judged"


def bounds_stem(fix: str | None) -> bool:
    """Whether a model with this overflow fix keeps its stem's weights under the pair rule."""
    return fix in (*OVERFLOW_FIXES, JUDGED)


def _top_two(values: np.ndarray) -> np.ndarray:
    """Per row, the sum of the two largest values (of a non-negative matrix)."""
    if values.shape[1] == 1:
        return values[:, 0]
    return -np.partition(-values, 1, axis=1)[:, :2].sum(axis=1)


def pair_sums(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per output channel (row), the sum of its two largest positive codes and of its two largest negative
    codes in magnitude."""
    codes = codes.astype(np.int64)
    return _top_two(np.where(codes > 0, codes, 0)), _top_two(np.where(codes < 0, -codes, 0))


def is_pair_safe(codes: np.ndarray) -> bool:
    positive, negative = pair_sums(codes)
    return bool(np.all(positive <= PAIR_LIMIT) and np.all(negative <= PAIR_LIMIT))


def quantize_rows(rows: np.ndarray, scales: np.ndarray, qmax: int = 127) -> np.ndarray:
    """Symmetric int8 codes as onnxruntime computes them (round half to even, clipped)."""
    return np.clip(np.rint(rows / scales[:, None]), -qmax, qmax)


def pair_safe_scales(rows: np.ndarray, qmax: int = 127) -> np.ndarray:
    """Per row (output channel x its inputs, float weights), the smallest symmetric scale at least
    max|w|/qmax whose codes follow the pair rule."""
    rows = np.asarray(rows, dtype=np.float32)
    magnitude_positive, magnitude_negative = pair_sums_float(rows)
    scales = np.maximum(np.abs(rows).max(axis=1) / qmax, np.maximum(magnitude_positive, magnitude_negative) / PAIR_LIMIT).astype(np.float32)
    scales[scales == 0] = np.float32(1.0)  # an all-zero channel: any scale
    for _ in range(200):  # rounding can push a pair one code over: widen those rows by a hair
        positive, negative = pair_sums(quantize_rows(rows, scales, qmax))
        unsafe = (positive > PAIR_LIMIT) | (negative > PAIR_LIMIT)
        if not unsafe.any():
            return scales
        scales[unsafe] = scales[unsafe] * np.float32(1.001)
    raise AssertionError("pair_safe_scales did not converge")  # unreachable: 128/129 of the scale always suffices


def pair_sums_float(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _top_two(np.where(rows > 0, rows, 0)), _top_two(np.where(rows < 0, -rows, 0))


def weight_rows(op_type: str, weight: np.ndarray, trans_b: bool = False) -> tuple[np.ndarray, int]:
    """(rows, channel axis): a weight as output channels x the inputs each one sums over."""
    if op_type == "Conv":
        return weight.reshape(weight.shape[0], -1), 0
    if op_type == "Gemm" and trans_b:
        return weight, 0
    return weight.reshape(-1, weight.shape[-1]).T, weight.ndim - 1  # Gemm / MatMul: K x N


def first_layers(model) -> list:
    """The weighted nodes the model's input reaches without passing another weighted node (the stem)."""
    return walk_to_stem(model)[0]


def walk_to_stem(model) -> tuple[list, list]:
    """(the stem's weighted nodes as `first_layers` finds them, the other nodes passed on the way there)."""
    initializers = {init.name for init in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    frontier = [value.name for value in model.graph.input if value.name not in initializers]
    seen, found, passed = set(frontier), [], []
    while frontier:
        for node in consumers.get(frontier.pop(), []):
            if node.op_type in SHAPE_OPS:
                continue  # the input's shape, not its values: a Reshape far down is not on the image's way
            if node.op_type in WEIGHTED_OPS:
                if node not in found:
                    found.append(node)
                continue
            if node not in passed:
                passed.append(node)
            for output in node.output:
                if output not in seen:
                    seen.add(output)
                    frontier.append(output)
    return found, passed


def _attribute(node, name: str, default: int = 0) -> int:
    return next((attribute.i for attribute in node.attribute if attribute.name == name), default)


def is_depthwise(node, weight_dims) -> bool:
    """A Conv with one input and one output channel per group: onnxruntime's depthwise kernel, which cannot
    saturate (with two output channels per group it already can)."""
    return depthwise_multiplier(node, weight_dims) == 1


def saturable_layers(model, fix: str, float_nodes: Collection[str] = ()) -> list:
    """The int8 weighted nodes the fix bounds: the stem or every layer, less depthwise convolutions and the
    `float_nodes` (a float stem leaves `first-layer` nothing to bound: the image meets no int8 weights)."""
    weights = {init.name: init.dims for init in model.graph.initializer}
    nodes = first_layers(model) if fix == FIRST_LAYER else [node for node in model.graph.node if node.op_type in WEIGHTED_OPS]
    nodes = [node for node in nodes if node.name not in float_nodes]
    return [node for node in nodes if not (len(node.input) > 1 and is_depthwise(node, weights.get(node.input[1], ())))]


def weight_overrides(model, fix: str, per_channel: bool, float_nodes: Collection[str] = ()) -> dict[str, list[dict]]:
    """onnxruntime `TensorQuantOverrides` giving the weights of the fix's layers pair-safe scales."""
    from onnx import numpy_helper

    initializers = {init.name: init for init in model.graph.initializer}
    nodes = saturable_layers(model, fix, float_nodes)
    overrides: dict[str, list[dict]] = {}
    for node in nodes:
        if len(node.input) < 2 or node.input[1] not in initializers or node.input[1] in overrides:
            continue
        weight = numpy_helper.to_array(initializers[node.input[1]])
        if weight.ndim < 2 or not np.issubdtype(weight.dtype, np.floating):
            continue
        rows, axis = weight_rows(node.op_type, weight, bool(_attribute(node, "transB")))
        scales = pair_safe_scales(rows)
        if per_channel:
            overrides[node.input[1]] = [{"axis": axis, "scale": float(scales[0]), "zero_point": 0},
                                        *({"scale": float(scale), "zero_point": 0} for scale in scales[1:])]
        else:
            overrides[node.input[1]] = [{"scale": float(scales.max()), "zero_point": 0}]
    return overrides


def _activation_type(node, producers: dict, initializers: dict) -> int | None:
    """The integer type of the activation a weighted node reads through a DequantizeLinear (its zero point's), or None."""
    dequantize = producers.get(node.input[0])
    if dequantize is None or dequantize.op_type != "DequantizeLinear" or len(dequantize.input) < 3 or dequantize.input[2] not in initializers:
        return None
    return int(initializers[dequantize.input[2]].data_type)


def saturation_proof(model) -> tuple[bool, str]:
    """Whether a QDQ model provably computes the same on both x86 int8 paths: every int8 weight of a
    Conv/Gemm/MatMul follows the pair rule or belongs to a depthwise convolution, and every uint8 weight
    meets uint8 activations. (proven, why) in a few words."""
    import onnx
    from onnx import numpy_helper

    initializers = {init.name: init for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    checked = 0
    for node in model.graph.node:
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2:
            continue
        dequantize = producers.get(node.input[1])
        if dequantize is None or dequantize.op_type != "DequantizeLinear" or dequantize.input[0] not in initializers:
            continue  # a float weight: nothing to saturate
        codes_init = initializers[dequantize.input[0]]
        if codes_init.data_type == onnx.TensorProto.UINT8:
            if _activation_type(node, producers, initializers) != onnx.TensorProto.UINT8:
                return False, f"{node.name or node.op_type}: uint8 weights under int8 activations (not covered by the pair rule)"
            checked += 1  # u8 x u8: onnxruntime's kernel widens to 16 bits first
            continue
        if codes_init.data_type != onnx.TensorProto.INT8:
            continue
        codes = numpy_helper.to_array(codes_init)
        if codes.ndim < 2:
            continue
        if is_depthwise(node, codes.shape):
            checked += 1  # onnxruntime's depthwise kernel widens to 16 bits first
            continue
        rows, _ = weight_rows(node.op_type, codes, bool(_attribute(node, "transB")))
        if not is_pair_safe(rows):
            return False, f"{node.name or node.op_type}: a pair of int8 weights can overflow int16"
        checked += 1
    if not checked:
        return False, "no int8 weights of a Conv/Gemm/MatMul found"
    return True, f"all {checked} 8-bit weight tensors follow the pair rule, are depthwise or are u8 x u8"
