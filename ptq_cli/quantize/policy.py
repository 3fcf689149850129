"""The judged-choice policy every quantizer follows: which calibration images are held out to judge a choice, how
many learned rounding reads, how a figure is kept, and when a candidate replaces the default."""

from __future__ import annotations

import numpy as np

from ptq_cli.quantize.settings import HELD_OUT_EVERY, HELD_OUT_MAX, METHOD_MARGIN_DB, ROUNDING_IMAGES, ROUNDING_PIXELS


def per_image_range(lows: np.ndarray, highs: np.ndarray, percentile: float) -> tuple[float, float]:
    """`--method per-image`: an activation's range from each calibration image's own smallest (`lows`) and largest
    (`highs`) value, the `percentile`-th percentile over the images of the largest and likewise of the smallest."""
    return float(np.percentile(lows, 100.0 - percentile)), float(np.percentile(highs, percentile))


def held_out_mask(count: int) -> np.ndarray:
    """Which of `count` calibration images are held out: every HELD_OUT_EVERY-th, at most HELD_OUT_MAX."""
    mask = np.zeros(count, bool)
    mask[np.arange(HELD_OUT_EVERY - 1, count, HELD_OUT_EVERY)[:HELD_OUT_MAX]] = True
    return mask


def _rest(count: int) -> np.ndarray:
    """The indices of the images choices are made on: all but every HELD_OUT_EVERY-th, held out or not."""
    return np.delete(np.arange(count), np.arange(HELD_OUT_EVERY - 1, count, HELD_OUT_EVERY))


def held_out_split(calibration: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(held-out images, the rest): the held_out_mask images judge choices made on the rest (which leaves out
    every HELD_OUT_EVERY-th image, held out or not)."""
    return calibration[held_out_mask(len(calibration))], calibration[_rest(len(calibration))]


def even_draw(count: int, most: int) -> np.ndarray:
    """The indices of at most `most` of `count` items, evenly spread from the first to the last (all where they fit)."""
    return np.linspace(0, count - 1, min(most, count)).astype(int)


def judged_indices(count: int, most: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(the images choices are calibrated on, the others, how many were not held out): of `count` calibration images,
    held_out_split's rest, or an even draw of at most `most` of them; the others every image besides, once (the
    held-out ones among them)."""
    rest = _rest(count)
    chosen = rest[even_draw(len(rest), most)]
    return chosen, np.setdiff1d(np.arange(count), chosen), len(rest)


def image_pixels(images: np.ndarray) -> int:
    """The pixels of one image of a batch, NCHW or NHWC."""
    return int(np.prod(images.shape[2:] if images.shape[1] in (1, 3, 4) else images.shape[1:3]))


def rounding_image_count(pixels: int) -> int:
    """How many calibration images learned rounding reads for a model whose images have `pixels` pixels."""
    return int(np.clip(ROUNDING_PIXELS // max(1, pixels), *ROUNDING_IMAGES))


def pools_in_float_note(pools: list[str] | tuple[str, ...], runtime: str) -> list[str]:
    """One note for the whole-map average pools left in float (a squeeze-and-excitation network has one a block)."""
    if not pools:
        return []
    named = ", ".join(pools[:3]) + (f" and {len(pools) - 3} more" if len(pools) > 3 else "")
    which = f"average pool {named}: left in float, so the layer reading it" if len(pools) == 1 else \
        f"{len(pools)} average pools ({named}): left in float, so the layers reading them"
    return [f"{which} quantize{'s' if len(pools) == 1 else ''} the pooled features on their own range ({runtime} would give them the scale of the whole maps)"]


def sqnr_figure(value: float) -> float | None:
    """An SQNR (dB) as the settings record it: two decimals, None where it is not finite."""
    return round(float(value), 2) if np.isfinite(value) else None


def closer_by_margin(candidate_db: float | None, preferred_db: float | None) -> bool:
    """Whether a candidate measured on held-out images replaces the one preferred: METHOD_MARGIN_DB closer to FP32 (a
    figure of None, a candidate that could not be measured, never wins)."""
    return candidate_db is not None and candidate_db >= (-np.inf if preferred_db is None else preferred_db) + METHOD_MARGIN_DB


def chosen_method(measured: tuple[tuple[str, float | None, float | None], ...]) -> tuple[str, float | None]:
    """(method, percentile) `--method auto` keeps from what each METHOD_CANDIDATES range measured: the best, unless
    it beats the first (MinMax) by less than METHOD_MARGIN_DB."""
    best, first = max(measured, key=lambda score: -np.inf if score[2] is None else score[2]), measured[0]
    kept = best if closer_by_margin(best[2], first[2]) else first
    return kept[0], kept[1]


