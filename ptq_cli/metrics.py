"""How far an approximation is from its reference: one definition for every service and backend."""

from __future__ import annotations

import numpy as np


def sqnr_db(reference: np.ndarray, approximation: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB; higher is better, inf when identical."""
    noise = float(np.sum((reference.astype(np.float64) - approximation) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(signal / noise)
