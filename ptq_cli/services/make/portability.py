"""What running right on every x86 CPU costs a model, measured on this CPU: the portable model (`--cpus all`:
an overflow fix bounds its weights for CPUs without VNNI) against the model made for VNNI CPUs alone
(`--cpus vnni`: full-range weights), both against FP32 on the calibration images.

Only a CPU that takes the exact int8 path natively (VNNI) runs both as they would run for their users; on
a CPU without VNNI the portable model is the one for this CPU, and nothing is compared.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli import backends
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.metrics import sqnr_db
from ptq_cli.model_file import file_sha256
from ptq_cli.quantize.overflow import NO_FIX
from ptq_cli.quantize.settings import AUTO_METHOD, QuantizationSettings
from ptq_cli.services.models import load_model
from ptq_cli.services.records import from_dict, model_key, record_files, write_record
from ptq_cli.x86 import cpu as cpu_info

MAX_IMAGES = 256  # calibration images both models are measured on, at most


@dataclass(frozen=True)
class PortabilityCost:
    """Both models' fidelity to FP32 on this CPU, or why it was not measured."""

    cpu: str
    images: int = 0
    portable_sqnr_db: float | None = None
    portable_agreement: float | None = None  # top-1 agreement with FP32, percent
    vnni_sqnr_db: float | None = None
    vnni_agreement: float | None = None
    not_measured: str = ""  # why, when it was not
    model_path: str = ""  # the portable model measured, and its sha256 (its record's key)
    model_sha256: str = ""

    @property
    def sqnr_cost_db(self) -> float | None:
        return None if self.portable_sqnr_db is None or self.vnni_sqnr_db is None else round(self.vnni_sqnr_db - self.portable_sqnr_db, 2)


# By default (`--portability-cost` not given), measured only where the model took at most this long to make: the
# measurement makes a second model, in about as long again.
QUICK_SECONDS = 30.0


def left_out_as_slow(seconds: float, asked: bool | None) -> PortabilityCost | None:
    """Why the measurement is left out by default for a model that took `seconds` to make (on a CPU with VNNI, where
    it would take a second quantization); None where it is to be measured (asked, quick, or nothing to quantize)."""
    cpu = cpu_info.current()
    if asked is not None or seconds <= QUICK_SECONDS or not cpu.exact_int8:
        return None
    why = (f"not measured: making the model took {seconds:.0f} s and the model for VNNI CPUs alone would take about as long again "
           f"(by default measured up to {QUICK_SECONDS:.0f} s; --portability-cost measures it)")
    return PortabilityCost(cpu.model, not_measured=why)


def applies(settings: QuantizationSettings) -> bool:
    """Whether the model carries a portability fix at all (`--cpus all` with an overflow fix)."""
    return settings.cpus == cpu_info.ALL and settings.overflow_fix not in (None, NO_FIX)


def measure(source, portable: Path, settings: QuantizationSettings, calibration: object, prepared: np.ndarray,
            quantize_source: Callable[..., object]) -> PortabilityCost:
    """Quantize the model again for VNNI CPUs alone (the same settings, stem and rounding, no overflow fix) with
    `quantize_source` (services/make/quantize.py's, passed in: it calls this module) and measure both against FP32 on
    up to MAX_IMAGES calibration images. `calibration`: the CalibrationSet quantize calibrated on, handed back to it."""
    cpu = cpu_info.current()
    if not cpu.exact_int8:
        return PortabilityCost(cpu.model, not_measured=f"this {cpu.model} has no VNNI: the model for all CPUs is the one for it")
    images = prepared[:MAX_IMAGES]
    reference = _scores(source.loaded, images)
    vnni = replace(settings, cpus=cpu_info.VNNI, overflow_fix=NO_FIX, options=settings.options.without_overflow_fix()).with_evidence(overflow_fix_db=())
    if settings.evidence.method_sqnr_db:  # `--method auto` judged the ranges with the fix: judged again without it, as `--cpus vnni` does
        vnni = replace(vnni, method=AUTO_METHOD, percentile=None, ranges=None).with_evidence(method_sqnr_db=(), method_rounded_db=(), ranges_calibrated_db=None,
                                                                                        ranges_searched_db=None)
    suffix = backends.backend(settings.backend).suffix
    with tempfile.TemporaryDirectory(prefix="ptq-portability-") as workdir:
        quantize_source(source, Path(workdir) / f"vnni{suffix}", vnni, calibration, prepared=prepared)
        vnni_scores = _scores(load_model(Path(workdir) / f"vnni{suffix}", None), images)
    portable_scores = _scores(load_model(portable, None), images)

    def agreement(scores: np.ndarray) -> float:
        return round(100.0 * float(np.mean(scores.argmax(axis=1) == reference.argmax(axis=1))), 2)

    return PortabilityCost(cpu.model, len(images), round(sqnr_db(reference, portable_scores), 2), agreement(portable_scores),
                           round(sqnr_db(reference, vnni_scores), 2), agreement(vnni_scores), model_path=str(portable),
                           model_sha256=file_sha256(portable))


RECORD_DIR = "portability"  # results/portability/<model key>.json, read by `ptq report`


def save(cost: PortabilityCost, results_dir: Path) -> Path:
    """The measurement as a record keyed by the portable model's sha256 (the file it measured)."""
    return write_record(Path(results_dir) / RECORD_DIR / f"{model_key(cost.model_path)}.json", cost)


def load_all(results_dir: Path, skipped: list[str] | None = None) -> dict[str, PortabilityCost]:
    """Measured records by the portable model's sha256; an unreadable one is left out, and named in `skipped`
    ("path: problem") where the caller shows what it left out."""
    found: dict[str, PortabilityCost] = {}
    for path in record_files(Path(results_dir) / RECORD_DIR):
        try:
            cost = from_dict(PortabilityCost, bounded.json_loads(bounded.read_text(path, "record")))
        except (PtqError, OSError, ValueError, TypeError, AttributeError) as error:
            if skipped is not None:
                skipped.append(f"{path}: not a ptq int8-path record ({str(error).removeprefix(f'{path}: ')})")
            continue
        if cost.model_sha256 and not cost.not_measured and None not in (cost.portable_sqnr_db, cost.vnni_sqnr_db):
            found[cost.model_sha256] = cost
    return found


def _scores(model, images: np.ndarray) -> np.ndarray:
    """At most 16 images a call: a runtime's working memory grows with the images it is given at once."""
    step = bounded.images_per_call(int(np.prod(images.shape[1:])), 16)
    return np.concatenate([model.predict(images[start : start + step]) for start in range(0, len(images), step)])


def describe(cost: PortabilityCost) -> str:
    """One line: what portability costs here, e.g. "on this AMD EPYC, against FP32 on 109 calibration images: 23.4 dB SQNR,
    94.5% top-1 agreement (right on every x86 CPU); --cpus vnni 24.9 dB, 95.4% (right on VNNI CPUs only)"."""
    if cost.not_measured:
        return cost.not_measured
    return (f"on this {cost.cpu}, against FP32 on {cost.images} calibration images: {cost.portable_sqnr_db:.1f} dB SQNR, "
            f"{cost.portable_agreement:.1f}% top-1 agreement (right on every x86 CPU); --cpus vnni {cost.vnni_sqnr_db:.1f} dB, "
            f"{cost.vnni_agreement:.1f}% (right on VNNI CPUs only)")
