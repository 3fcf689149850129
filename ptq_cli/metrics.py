"""How far an approximation is from its reference: one definition for every service and backend."""

from __future__ import annotations

import base64
import binascii
import math

import numpy as np

Z_95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal


def sqnr_db(reference: np.ndarray, approximation: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB; higher is better, inf when identical."""
    noise = float(np.sum((reference.astype(np.float64) - approximation) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(signal / noise)


IMAGE_DB_BOUND = 150.0  # an image's own SQNR is kept within +-this: exact scores (float32's own noise lies below) and all-zero ones


def image_sqnr_db(reference: np.ndarray, approximation: np.ndarray) -> float:
    """The mean over images (the first axis) of each image's own SQNR in dB; inf when identical. The judge of every
    choice ptq makes on held-out images: `sqnr_db` pools the images' noise and signal, so the few images whose scores
    are largest decide it, and a range that serves them can fail most others."""
    exact = reference.astype(np.float64).reshape(len(reference), -1)
    noise = np.sum((exact - approximation.reshape(len(exact), -1)) ** 2, axis=1)
    if not noise.any():
        return float("inf")
    signal = np.sum(exact**2, axis=1)
    tiny = np.finfo(np.float64).tiny
    per_image = 10.0 * (np.log10(np.maximum(signal, tiny)) - np.log10(np.maximum(noise, tiny)))
    return float(np.mean(np.clip(per_image, -IMAGE_DB_BOUND, IMAGE_DB_BOUND)))


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (`successes` of `trials`), as fractions: where the share would
    lie, at 95% by default, over other images drawn the same way. Unlike the normal approximation it stays
    within 0..1 and keeps its width near 0% and 100%. (0, 1) for no trials."""
    if trials <= 0:
        return 0.0, 1.0
    share, spread = successes / trials, z * z / trials
    centre = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_p_value(only_first: int, only_second: int) -> float:
    """The exact two-sided McNemar test of two classifiers on the same images, from the images only the first got
    right and those only the second did: the chance of a split at least this uneven were both equally often
    right (a binomial test at 1/2 on the discordant images). 1.0 when none differ."""
    discordant = only_first + only_second
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, count) for count in range(min(only_first, only_second) + 1))
    return min(1.0, 2 * tail / 2**discordant)


def packed_hits(hits: np.ndarray) -> str:
    """Which images a model got right (a boolean per image, in the images' order) as base64 text, one bit each:
    what lets two models measured on the same images be compared image by image later (`paired_p_value`)."""
    return base64.b64encode(np.packbits(np.asarray(hits, dtype=bool)).tobytes()).decode("ascii")


def unpacked_hits(text: str, images: int) -> np.ndarray:
    """`packed_hits`'s text back as `images` booleans; ValueError for text that is not exactly that many bits."""
    try:
        packed = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as error:
        raise ValueError(f"its images right are not base64 ({error})") from error
    if len(packed) != (images + 7) // 8:
        raise ValueError(f"its images right hold {len(packed) * 8} bits for {images:,} images")
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8))
    if bits[images:].any():
        raise ValueError("its images right set bits past its last image")
    return bits[:images].astype(bool)


def paired_p_value(first_hits: np.ndarray, second_hits: np.ndarray) -> float:
    """McNemar's p of two models on the same images, from which each got right."""
    return mcnemar_p_value(int(np.sum(first_hits & ~second_hits)), int(np.sum(second_hits & ~first_hits)))
