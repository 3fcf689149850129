"""Activation ranges searched, not only calibrated: each activation scale of a QDQ model moved by a few factors in
turn, in graph order, and kept where the model's output comes closer to FP32 on the calibration images.

A calibrated range (MinMax or a percentile) is the best one for that tensor alone, by its own rule; what the
model computes is better served by some ranges wider (rare large activations that decide a class) and others
narrower (finer codes where the tails matter little). Only scales move: zero points stay, so zero stays exact and
a ReLU folded into a zero point stays folded; codes, types and the pair rule are untouched. Where an activation
scale is part of an int32 bias's scale (input scale x weight scale), that bias is re-expressed on its new scale.
A scale shared by several QuantizeLinear nodes (onnxruntime gives a pooling or reshape the scale of its input)
moves as one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

FACTORS = (0.8, 0.87, 0.93, 1.07, 1.15, 1.25)  # each scale times these; the best kept
MIN_GAIN_DB = 0.01  # a move is kept only above this (the score's float noise)


@dataclass(frozen=True)
class BiasLink:
    """An int32 bias whose scale is `input_scale` x `weight_scale` (names of initializers)."""

    codes: str
    scale: str
    input_scale: str
    weight_scale: str


@dataclass(frozen=True)
class SearchResult:
    scales: int  # activation scales in the model
    searched: int  # those the budget reached
    moved: int  # those left at another value than calibrated
    evaluations: int
    start_db: float
    end_db: float


def activation_scales(model) -> list[str]:
    """The scale initializers of the model's activation QuantizeLinear nodes (whose input is not an initializer),
    per-tensor float ones only, in graph order, each once."""
    from onnx import TensorProto

    initializers = {init.name: init for init in model.graph.initializer}
    names: list[str] = []
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in initializers or len(node.input) < 2:
            continue
        scale = initializers.get(node.input[1])
        if scale is not None and scale.data_type == TensorProto.FLOAT and not list(scale.dims) and scale.name not in names:
            names.append(scale.name)
    return names


def bias_links(model) -> list[BiasLink]:
    """Each Conv/Gemm whose bias is an int32 DequantizeLinear over its input's and weights' scales."""
    initializers = {init.name: init for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    links = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3:
            continue
        bias, activation, weight = (producers.get(name) for name in (node.input[2], node.input[0], node.input[1]))
        if any(found is None or found.op_type != "DequantizeLinear" or len(found.input) < 2 for found in (bias, activation, weight)):
            continue
        assert bias is not None and activation is not None and weight is not None
        if bias.input[0] in initializers and bias.input[1] in initializers and activation.input[1] in initializers:
            links.append(BiasLink(bias.input[0], bias.input[1], activation.input[1], weight.input[1]))
    return links


class Rescaler:
    """Sets activation scales of a model in place, re-expressing the biases that depend on them."""

    def __init__(self, model) -> None:
        from onnx import numpy_helper

        self._numpy_helper = numpy_helper
        self._initializers = {init.name: init for init in model.graph.initializer}
        self._links = [link for link in bias_links(model) if link.weight_scale in self._initializers]
        self._float_biases = {link.codes: self._array(link.codes).astype(np.float64) * self._array(link.scale).astype(np.float64)
                              for link in self._links}

    def _array(self, name: str) -> np.ndarray:
        return self._numpy_helper.to_array(self._initializers[name])

    def _write(self, name: str, value: np.ndarray) -> None:
        self._initializers[name].CopyFrom(self._numpy_helper.from_array(value, name))

    def get(self, name: str) -> float:
        return float(self._array(name))

    def set(self, name: str, value: float) -> None:
        self._write(name, np.array(value, np.float32))
        for link in self._links:
            if link.input_scale != name:
                continue
            scale = (np.float32(value) * self._array(link.weight_scale).astype(np.float32)).astype(np.float32)
            scale = scale.reshape(self._array(link.scale).shape)
            codes = np.clip(np.round(self._float_biases[link.codes] / scale), -(2**31), 2**31 - 1).astype(np.int32)
            self._write(link.scale, scale)
            self._write(link.codes, codes)


def search(model, score: Callable[[Any, str | None], float], evaluations: int,
           progress: Callable[[int, int], None] | None = None) -> tuple[Any, SearchResult]:
    """The model with its activation scales searched in place: one sweep of coordinate ascent of `score(model, moved)`
    (higher is closer to FP32; `moved`, the scale this call's candidate moved, None for the calibrated model: the
    scorer may run only what depends on it) over FACTORS of each scale, in graph order, within `evaluations` calls of
    `score`.
    One sweep: on every ResNet8 model measured, a second one fit the searched images more tightly and took held-out
    images further from FP32 than the first left them (docs: Activation ranges)."""
    names = activation_scales(model)
    rescaler = Rescaler(model)
    calibrated = {name: rescaler.get(name) for name in names}
    best = start = score(model, None)
    spent, reached = 1, set()
    planned = min(evaluations, len(names) * len(FACTORS) + 1)  # the bar's total: what the search can spend
    for name in names:
        if spent + len(FACTORS) > evaluations:
            break
        reached.add(name)
        start_value = kept_value = rescaler.get(name)
        for factor in FACTORS:
            rescaler.set(name, start_value * factor)
            value, spent = score(model, name), spent + 1
            if value > best + MIN_GAIN_DB:
                best, kept_value = value, start_value * factor
        rescaler.set(name, kept_value)
        if progress:
            progress(spent, planned)
    moved = sum(rescaler.get(name) != calibrated[name] for name in names)
    return model, SearchResult(len(names), len(reached), moved, spent, float(start), float(best))


def describe_ranges(ranges: str | None, calibrated_db: float | None = None, searched_db: float | None = None) -> str | None:
    """e.g. "searched (image SQNR on held-out calibration images: 30.6 dB calibrated, 31.6 dB searched)"; None where
    no search ran."""
    if ranges is None:
        return None
    if calibrated_db is None or searched_db is None:
        return ranges
    return f"{ranges} (image SQNR on held-out calibration images: {calibrated_db:.1f} dB calibrated, {searched_db:.1f} dB searched)"
