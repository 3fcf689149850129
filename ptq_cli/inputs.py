"""A model's input contract: what the model declares (layout, channels, size, batch) and what the user
says about its preprocessing (scale, mean, std, channel order), and the one function that turns dataset
images (uint8 N x H x W x C) into the model's input."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded

NHWC, NCHW = "NHWC", "NCHW"
# Written into every model ptq makes (ONNX metadata; TorchScript extra file), so the model's
# evaluation, benchmark and tuning need no flags again.
INPUT_METADATA_KEY = "ptq.input"

# name -> (scale, mean, std). Mean and std apply after scaling, per channel (R, G, B).
PRESETS = {
    "raw255": (1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),  # the MLPerf Tiny ResNet8: raw pixels 0-255
    "unit": (1 / 255, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),  # 0-1
    "imagenet": (1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10-normalized": (1 / 255, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
DEFAULT_PRESET = "raw255"


def _values(values: tuple[float, ...]) -> str:
    """Per-channel values as --mean/--std take them: one value where every channel (or the one of a grey model) has it."""
    return f"{values[0]:g}" if len(set(values)) == 1 else ",".join(f"{value:g}" for value in values)


def describe_presets() -> str:
    """Each preset with its values, for help texts: "raw255 (x1), unit (x1/255), imagenet (x1/255, mean ..., std ...)"."""
    def one(name: str) -> str:
        scale, mean, std = PRESETS[name]
        parts = ["x1" if scale == 1 else "x1/255" if abs(scale - 1 / 255) < 1e-12 else f"x{scale:g}"]
        if any(mean) or any(value != 1 for value in std):
            parts += [f"mean {','.join(f'{value:g}' for value in mean)}", f"std {','.join(f'{value:g}' for value in std)}"]
        return f"{name} ({', '.join(parts)})"
    return ", ".join(one(name) for name in PRESETS)
MAX_SIDE = 16384  # pixels a side of --input-size (the input's element bound applies as well)


@dataclass(frozen=True)
class ModelInput:
    """Read from the model: never asked of the user."""

    name: str
    layout: str  # NHWC or NCHW
    channels: int
    height: int
    width: int
    batch: int | None  # a fixed batch size, or None for a symbolic one

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width

    def shape(self, batch: int) -> tuple[int, ...]:
        if self.layout == NCHW:
            return batch, self.channels, self.height, self.width
        return batch, self.height, self.width, self.channels


@dataclass(frozen=True)
class Preprocessing:
    """Given by the user (or read from a model ptq made): pixels x scale, then (x - mean) / std."""

    scale: float = 1.0
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    bgr: bool = False
    preset: str | None = DEFAULT_PRESET  # the preset it equals, if any
    size: tuple[int, int] | None = None  # height, width given for a model whose input does not fix them (--input-size)

    def describe(self) -> str:
        name = self.preset or "custom"
        details = "" if self.preset else f" (x{self.scale:g}, mean {_values(self.mean)}, std {_values(self.std)})"
        return name + details + (", BGR" if self.bgr else "")

    def to_json(self) -> str:
        stored = asdict(self)
        if self.size is None:  # what models made before --input-size store
            del stored["size"]
        return json.dumps(stored)


@dataclass(frozen=True)
class PreprocessingFlags:
    """The command-line options; None where not given."""

    preset: str | None = None
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    bgr: bool | None = None
    size: tuple[int, int] | None = None

    @property
    def given(self) -> bool:
        return any(value is not None for value in asdict(self).values())


def parse_triple(option: str, text: str | None) -> tuple[float, ...] | None:
    """'0.5,0.5,0.5' -> (0.5, 0.5, 0.5); one value is used for every channel."""
    if text is None:
        return None
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError as error:
        raise PtqError(f"{option}: '{text}' is not a comma-separated list of numbers") from error
    if len(values) not in (1, 3):
        raise PtqError(f"{option}: give 1 value or 3 (R,G,B), got {len(values)}")
    if not all(np.isfinite(values)):
        raise PtqError(f"{option}: '{text}' has a value that is not a finite number")
    return values * 3 if len(values) == 1 else values


def parse_size(option: str, text: str | None) -> tuple[int, int] | None:
    """'224' -> (224, 224); '240x320' -> (240, 320): height x width."""
    if text is None:
        return None
    parts = text.lower().replace(",", "x").split("x")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError as error:
        raise PtqError(f"{option}: '{text}' is not a size (one number, or HEIGHTxWIDTH such as 240x320)") from error
    if len(values) not in (1, 2) or min(values) < 1 or max(values) > MAX_SIDE:
        raise PtqError(f"{option}: give one side or HEIGHTxWIDTH, each 1 to {MAX_SIDE:,} pixels; got '{text}'")
    return (values[0], values[-1])


def make_flags(preset: str | None, scale: float | None, mean: str | None, std: str | None, bgr: bool | None,
               size: str | None = None) -> PreprocessingFlags:
    """Validated flags, before any work."""
    if preset is not None and preset not in PRESETS:
        raise PtqError(f"--preprocess: '{preset}' is not one of {', '.join(PRESETS)}")
    if scale is not None and not (np.isfinite(scale) and scale > 0):
        raise PtqError(f"--scale: must be a positive number, got {scale}")
    stds = parse_triple("--std", std)
    if stds is not None and any(value <= 0 for value in stds):
        raise PtqError(f"--std: every value must be above 0, got {std}")
    return PreprocessingFlags(preset, scale, parse_triple("--mean", mean), stds, bgr, parse_size("--input-size", size))


def from_flags(flags: PreprocessingFlags, base: Preprocessing | None = None) -> Preprocessing:
    """The preset (or `base`, or raw255), with the explicit options on top."""
    if flags.preset is not None:
        scale, mean, std = PRESETS[flags.preset]
        base = Preprocessing(scale, mean, std, False, flags.preset)
    base = base or Preprocessing()
    result = replace(
        base,
        scale=base.scale if flags.scale is None else flags.scale,
        mean=base.mean if flags.mean is None else flags.mean,
        std=base.std if flags.std is None else flags.std,
        bgr=base.bgr if flags.bgr is None else flags.bgr,
        size=base.size if flags.size is None else flags.size,
    )
    return replace(result, preset=preset_of(result))


def preset_of(preprocessing: Preprocessing) -> str | None:
    for name, (scale, mean, std) in PRESETS.items():
        if np.isclose(scale, preprocessing.scale) and np.allclose(mean, preprocessing.mean) and np.allclose(std, preprocessing.std):
            return name
    return None


def from_metadata(text: str | None, where: Path | str = "model") -> Preprocessing | None:
    """The preprocessing a model ptq wrote says it takes (metadata INPUT_METADATA_KEY), checked like flags."""
    if not text:
        return None
    try:
        data = bounded.json_loads(text)
        stored = Preprocessing(float(data["scale"]), tuple(map(float, data["mean"])), tuple(map(float, data["std"])), bool(data["bgr"]),
                               None if data.get("preset") is None else str(data["preset"]), _stored_size(data.get("size")))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise PtqError(f"{where}: model metadata '{INPUT_METADATA_KEY}' is not readable ({error})") from error
    values = (stored.scale, *stored.mean, *stored.std)
    if len(stored.mean) not in (1, 3) or len(stored.std) not in (1, 3) or not all(math.isfinite(v) for v in values) \
            or stored.scale <= 0 or min(stored.std) <= 0:
        raise PtqError(f"{where}: model metadata '{INPUT_METADATA_KEY}' holds an unusable preprocessing ({text[:80]})")
    return stored


def _stored_size(value) -> tuple[int, int] | None:
    if value is None:
        return None
    height, width = (int(side) for side in value)
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise ValueError(f"size {value} out of range")
    return height, width


def resolve(flags: PreprocessingFlags, stored: Preprocessing | None) -> Preprocessing:
    """Flags given on the command line win; else what the model says it was made with; else raw255."""
    if flags.given:
        return from_flags(flags, None if flags.preset else stored)
    return stored or Preprocessing()


def prepare(images: np.ndarray, model_input: ModelInput, preprocessing: Preprocessing) -> np.ndarray:
    """uint8 N x H x W x C images (already at the model's size and channel count) -> the model's float32 input."""
    if images.shape[1:] != (model_input.height, model_input.width, model_input.channels):
        raise PtqError(f"images of shape {images.shape[1:]} do not fit the model input {model_input.height}x{model_input.width}x{model_input.channels}")
    batch = images[..., ::-1] if preprocessing.bgr and model_input.channels == 3 else images
    channels = model_input.channels
    scale = np.float32(preprocessing.scale)
    mean = np.asarray(preprocessing.mean[:channels], dtype=np.float32)
    std = np.asarray(preprocessing.std[:channels], dtype=np.float32)
    exact_pixels = preprocessing.preset == DEFAULT_PRESET and not preprocessing.bgr  # the common case
    batch = batch.astype(np.float32) if exact_pixels else (batch.astype(np.float32) * scale - mean) / std
    if model_input.layout == NCHW:
        return np.ascontiguousarray(batch.transpose(0, 3, 1, 2))
    return np.ascontiguousarray(batch)
