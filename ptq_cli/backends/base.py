"""What every backend's quantize returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizedFile:
    size_bytes: int
    space_to_depth: tuple = ()  # the convolutions regrouped before quantizing (onnxruntime only)
    notes: tuple[str, ...] = ()  # what the backend changed on the way (a fixed batch made symbolic, ...)
