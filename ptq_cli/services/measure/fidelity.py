"""Fidelity to the FP32 model: how closely a model's class scores follow its float source's on the same
images. It needs no labels, so it measures a quantized model on any photos, of its classes or not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ptq_cli.metrics import mcnemar_p_value, wilson_interval

TOP_K = 5


@dataclass(frozen=True)
class Fidelity:
    reference_path: str  # the FP32 model compared with
    reference_sha256: str
    images: int
    top1_agreement: float  # percent of images whose top-1 class is the FP32 model's
    top5_containment: float  # percent of images whose FP32 top-1 class is among the model's top 5 (all classes, if fewer)
    sqnr_db: float | None  # of the class scores, FP32's as the signal; None when they are identical
    kl_divergence: float  # mean KL(FP32 || model) of the softmax of the scores (of the scores, if they are probabilities), nats
    # Where top-1 agreement would lie over other images drawn the same way (Wilson, 95%), percent; None in older records.
    top1_agreement_low: float | None = None
    top1_agreement_high: float | None = None
    # With labels of the model's classes: the images FP32 alone classifies right, those the model alone does, and the
    # exact McNemar p-value of that split (the chance of one as uneven, were both equally accurate). None without labels.
    fp32_only_right: int | None = None
    model_only_right: int | None = None
    accuracy_delta_p_value: float | None = None


def _probabilities(scores: np.ndarray) -> np.ndarray:
    """Rows that are already probabilities stay as they are; logits go through a softmax."""
    scores = scores.astype(np.float64)
    if scores.min() >= 0 and np.allclose(scores.sum(axis=1), 1.0, atol=1e-3):
        return np.clip(scores, 1e-12, None)
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return np.clip(shifted / shifted.sum(axis=1, keepdims=True), 1e-12, None)


def compare(reference: np.ndarray, scores: np.ndarray, reference_path: str, reference_sha256: str, labels: np.ndarray | None = None) -> Fidelity:
    """The model's `scores` against the FP32 model's `reference` scores on the same images (N x classes each);
    `labels`: the images' classes, where they are the model's."""
    if reference.shape != scores.shape or reference.ndim != 2 or not len(reference):
        raise ValueError(f"scores {scores.shape} and FP32 scores {reference.shape} differ")
    expected, predicted = reference.argmax(axis=1), scores.argmax(axis=1)
    agreeing = int(np.sum(predicted == expected))
    low, high = wilson_interval(agreeing, len(reference))
    paired: dict[str, Any] = {}
    if labels is not None:
        fp32_right, model_right = expected == labels, predicted == labels
        only_fp32, only_model = int(np.sum(fp32_right & ~model_right)), int(np.sum(model_right & ~fp32_right))
        paired = {"fp32_only_right": only_fp32, "model_only_right": only_model, "accuracy_delta_p_value": round(mcnemar_p_value(only_fp32, only_model), 4)}
    k = min(TOP_K, scores.shape[1])
    top_k = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    noise = float(np.sum((reference.astype(np.float64) - scores) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    p, q = _probabilities(reference), _probabilities(scores)
    return Fidelity(
        reference_path=reference_path,
        reference_sha256=reference_sha256,
        images=len(reference),
        top1_agreement=round(100.0 * agreeing / len(reference), 4),
        top5_containment=round(100.0 * float(np.mean((top_k == expected[:, None]).any(axis=1))), 4),
        sqnr_db=None if noise == 0 else round(10.0 * float(np.log10(max(signal, 1e-300) / noise)), 3),
        kl_divergence=round(max(0.0, float(np.mean(np.sum(p * np.log(p / q), axis=1)))), 6),
        top1_agreement_low=round(100.0 * low, 2),
        top1_agreement_high=round(100.0 * high, 2),
        **paired,
    )


def check(data: dict) -> Fidelity:
    """A record's stored fidelity, its figures in range; ValueError otherwise."""
    from ptq_cli.services.records import from_dict

    fidelity = from_dict(Fidelity, data)
    if not (0 <= fidelity.top1_agreement <= 100 and 0 <= fidelity.top5_containment <= 100 and fidelity.images > 0 and fidelity.kl_divergence >= 0):
        raise ValueError("fidelity figures out of range")
    if fidelity.top5_containment < fidelity.top1_agreement:
        raise ValueError("top-5 containment below top-1 agreement")
    low, high = fidelity.top1_agreement_low, fidelity.top1_agreement_high
    agreement = fidelity.top1_agreement  # to 4 decimals, the interval's ends to 2: a hundredth of slack
    if (low, high) != (None, None) and (low is None or high is None or not (0 <= low <= agreement + 0.01 and agreement - 0.01 <= high <= 100)):
        raise ValueError("top-1 agreement interval out of range")
    only_fp32, only_model, p_value = fidelity.fp32_only_right, fidelity.model_only_right, fidelity.accuracy_delta_p_value
    if (only_fp32, only_model, p_value) != (None, None, None) and (
            only_fp32 is None or only_model is None or p_value is None or min(only_fp32, only_model) < 0
            or only_fp32 + only_model > fidelity.images or not 0 <= p_value <= 1):
        raise ValueError("images right in only one model: missing or out of range")
    return fidelity
