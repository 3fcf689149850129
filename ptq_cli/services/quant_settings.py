"""Quantization settings: the one vocabulary every backend shares, validated in one place, and the one
describer of a model's quantization (report, tune, sweep and render all use it)."""

from __future__ import annotations

from typing import Any

from ptq_cli import backends
from ptq_cli.backends.base import Quantizer, describe_settings, short_node
from ptq_cli.errors import PtqError
from ptq_cli.quantize.overflow import ALL_LAYERS, FIRST_LAYER, NO_FIX
from ptq_cli.quantize.rounding import AUTO as AUTO_ROUNDING
from ptq_cli.quantize.rounding import LEARNED, NEAREST, ROUNDING_CHOICES
from ptq_cli.quantize.settings import INT4, PER_IMAGE, PER_IMAGE_PERCENTILE, CommonChoices, QuantizationSettings
from ptq_cli.x86.cpu import ALL, CPU_TARGETS, VNNI

__all__ = ["QuantizationSettings", "describe_cpus", "describe_method", "describe_model", "describe_quantization", "make_settings", "short_node"]

DTYPES = ("int8", "uint8")
WEIGHT_DTYPES = (*DTYPES, INT4)
DEFAULT_PERCENTILE = 99.999
DEFAULT_DTYPE = "int8"
# `--target speed`: the fast configuration on x86, each backend's own (Quantizer.speed_target). See docs/speed.md.
TARGETS = ("speed",)
COMMON_OVERFLOW_WORDS = {FIRST_LAYER: "first-layer pair rule", ALL_LAYERS: "all-layer pair rule"}
# `--stem`: the layers the image enters first in float or int8, or auto (measured when quantizing: services/make/stem.py).
FLOAT, INT8, AUTO = "float", "int8", "auto"
STEM_CHOICES = (AUTO, FLOAT, INT8)


def check_stem(stem: str | None, backend: str) -> str | None:
    """`--stem` as the settings hold it: None for auto (measured when quantizing)."""
    if stem in (None, AUTO):
        return None
    if stem not in STEM_CHOICES:
        raise PtqError(f"--stem: '{stem}' is not one of {', '.join(STEM_CHOICES)}")
    if stem == FLOAT and not backends.backend(backend).quantizes.float_stem:
        raise PtqError(f"--stem float: --backend {backend} quantizes every layer to int8")
    return stem


def _refuse_foreign_options(row: backends.Backend, given: dict[str, Any]) -> None:
    """An option only another backend takes is refused, naming the backends it applies to."""
    owners = backends.private_options()
    for name, value in given.items():
        if name not in owners:
            raise TypeError(f"make_settings: no backend takes an option '{name}'")
        if value in (None, False, ()) or row in owners[name]:
            continue
        first = owners[name][0].quantizes.options
        raise PtqError(f"{first.flag(name)}: {first.word or 'an option of ' + owners[name][0].name}; "
                       f"applies to --backend {' or '.join(owner.name for owner in owners[name])}")


def make_settings(  # noqa: PLR0913,PLR0917  the common settings vocabulary, one keyword each
    dtype: str | None = None,
    backend: str = backends.DEFAULT,
    weight_dtype: str | None = None,
    per_channel: bool | None = None,
    method: str | None = None,
    percentile: float | None = None,
    preprocess: bool = True,
    target: str | None = None,
    float_nodes: tuple[str, ...] = (),
    cpus: str | None = None,
    overflow_fix: str | None = None,
    stem: str | None = None,
    rounding: str | None = None,
    **options: Any,
) -> QuantizationSettings:
    """Validated settings. Without a type or target, the backend's speed target where it runs as faithfully
    (onnxruntime); with a type and no target, the weights follow the activations' type; a target's preset fills
    in what the options leave open; `options` are the backend's own (its Options' fields), which settle the rest."""
    row = backends.backend(backend)
    if row.quantizer is None:
        raise PtqError(f"--backend {backend}: runs models but does not quantize them (quantizers: {', '.join(backends.quantizers())})")
    quantizer = row.quantizer
    _refuse_foreign_options(row, options)
    target, targeted = _target(quantizer, target, dtype is None and weight_dtype is None)
    dtype, weight_dtype = _types(dtype or targeted.get("dtype") or DEFAULT_DTYPE, weight_dtype or targeted.get("weight_dtype"), quantizer)
    given = CommonChoices(dtype, weight_dtype, targeted.get("per_channel") if per_channel is None else per_channel, method or targeted.get("method"),
                          rounding, float_nodes=tuple(float_nodes))
    own, common = quantizer.options.from_given(options).settle(given)
    # The backend may infer the method from its own options; a percentile alone asks for percentile calibration.
    method = common.method or ("percentile" if percentile is not None and "percentile" in quantizer.methods else quantizer.methods[0])
    if method not in quantizer.methods:
        raise PtqError(f"--method: '{method}' is not a {backend} calibration method ({', '.join(quantizer.methods)})")
    cpus, overflow_fix = _cpus(row, cpus, overflow_fix)
    return QuantizationSettings(
        # A backend whose default is per-tensor leaves it to the model (quantize.resolve_model_defaults).
        backend=backend, format=row.format, dtype=dtype, weight_dtype=weight_dtype,
        per_channel=(quantizer.per_channel or None) if common.per_channel is None else common.per_channel,
        method=method, percentile=_percentile(method, percentile), preprocess=preprocess, target=target, float_nodes=common.float_nodes, cpus=cpus,
        overflow_fix=common.overflow_fix or overflow_fix,  # the backend's own say first (onnxruntime's u8 x u8 kernel needs no fix)
        stem=check_stem(stem, backend),  # None: measured when quantizing (services/make/stem.py)
        rounding=check_rounding(common.rounding, row),  # None: measured when quantizing (quantize/rounding.py)
        options=own,
    )


def describe_method(method: str, percentile: float | None, measured=(), rounded=()) -> str:
    """e.g. "percentile 99.99 (auto: image SQNR on held-out calibration images, minmax 23.1, percentile 99.999
    24.0, percentile 99.99 25.2 dB; after weight rounding, percentile 99.99 30.1, minmax 29.0 dB)"; `measured` is
    QuantizationSettings.evidence.method_sqnr_db, `rounded` its evidence.method_rounded_db."""
    def label(name: str, value: float | None) -> str:
        return f"{name} {value:g}" if value is not None else name

    def scores(triples) -> str:
        return ", ".join(f"{label(name, value)} {'-' if db is None else f'{db:.1f}'}" for name, value, db in triples)

    chosen = label(method, percentile)
    if not measured:
        return chosen
    after = f"; after weight rounding, {scores(rounded)} dB" if rounded else ""
    return f"{chosen} (auto: image SQNR on held-out calibration images, {scores(measured)} dB{after})"


def check_rounding(rounding: str | None, row: backends.Backend) -> str | None:
    """`--rounding` as the settings hold it: None for auto (decided on held-out calibration images), nearest
    for a backend that does not refine its weights."""
    if rounding not in (None, *ROUNDING_CHOICES):
        raise PtqError(f"--rounding: '{rounding}' is not one of {', '.join(ROUNDING_CHOICES)}")
    if not row.quantizes.learned_rounding:
        if rounding == LEARNED:
            learns = [other.name for other in backends.TABLE.values() if other.quantizer and other.quantizer.learned_rounding]
            raise PtqError(f"--rounding learned: --backend {row.name} rounds its weights to nearest (learned rounding: --backend {' or '.join(learns)})")
        return NEAREST
    return None if rounding in (None, AUTO_ROUNDING) else rounding


def _target(quantizer: Quantizer, target: str | None, no_types: bool) -> tuple[str | None, dict[str, Any]]:
    """(the target, what it presets): the quantizer's speed target where it is its default and no type is given."""
    if target is not None and target not in TARGETS:
        raise PtqError(f"--target: '{target}' is not one of {', '.join(TARGETS)}")
    if target is None and no_types and quantizer.speed_by_default:
        target = "speed"
    return target, (quantizer.speed_target if target else {})


def _types(dtype: str, weight_dtype: str | None, quantizer: Quantizer) -> tuple[str, str]:
    """(activation type, weight type): the weights follow the activations unless told."""
    if dtype not in DTYPES:
        raise PtqError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    weight_dtype = weight_dtype or dtype
    if weight_dtype not in WEIGHT_DTYPES:
        raise PtqError(f"--weight-dtype: '{weight_dtype}' is not one of {', '.join(WEIGHT_DTYPES)}")
    if weight_dtype == INT4 and not quantizer.int4_weights:
        writers = [row.name for row in backends.TABLE.values() if row.quantizer and row.quantizer.int4_weights]
        raise PtqError(f"--weight-dtype int4: 4-bit weights are written by --backend {' or '.join(writers)}")
    return dtype, weight_dtype


def _percentile(method: str, percentile: float | None) -> float | None:
    if method in ("percentile", PER_IMAGE):
        percentile = (DEFAULT_PERCENTILE if method == "percentile" else PER_IMAGE_PERCENTILE) if percentile is None else percentile
        if not 50.0 < percentile <= 100.0:
            raise PtqError(f"--percentile: {percentile} is not in (50, 100]")
        return percentile
    if percentile is not None:
        raise PtqError(f"--percentile: only applies to --method percentile or {PER_IMAGE}")
    return None


def _cpus(row: backends.Backend, cpus: str | None, overflow_fix: str | None) -> tuple[str, str | None]:
    """(the CPUs the model is for, how it is kept exact on those without VNNI: docs, "Right on every CPU").
    The fix is None where the backend's default depends on the model (quantize.resolve_model_defaults)."""
    cpus = cpus or ALL
    if cpus not in CPU_TARGETS:
        raise PtqError(f"--cpus: '{cpus}' is not one of {', '.join(CPU_TARGETS)}")
    if cpus == VNNI:
        if overflow_fix not in (None, NO_FIX):
            raise PtqError(f"--overflow-fix {overflow_fix}: --cpus vnni keeps the full 8-bit range; the fix is for --cpus all")
        return cpus, NO_FIX
    quantizer = row.quantizes
    if overflow_fix is None and quantizer.clamped_overflow_fix is not None:
        return cpus, None
    overflow_fix = overflow_fix or quantizer.overflow_fixes[0]
    if overflow_fix not in quantizer.overflow_fixes:
        raise PtqError(f"--overflow-fix: {row.name} takes {', '.join(quantizer.overflow_fixes)}")
    return cpus, overflow_fix



def describe_pruning(pruning: dict | None) -> str:
    if not pruning:
        return ""
    kept = [name for name, flag in (("first conv", pruning.get("exclude_first")), ("classifier", pruning.get("exclude_classifier"))) if flag]
    refit = " re-fitted" if pruning.get("reconstruct") else ""
    return f"pruned {pruning['sparsity']:.0%} {pruning['scope']}{refit}" + (f" (dense: {', '.join(kept)})" if kept else "")


def _quantizer_of(settings: dict) -> Quantizer | None:
    """The quantizer whose models have this format (settings are stored with the format, not always the backend)."""
    return next((row.quantizer for row in backends.TABLE.values() if row.quantizer and row.format == settings.get("format")), None)


def describe_overflow_judgement(measured) -> str:
    """A judged overflow fix's figures, e.g. "image SQNR on held-out calibration images: all-layers 21.4, first-layer 21.8 dB"."""
    figures = ", ".join(f"{fix} {'n/a' if db is None else f'{db:.1f}'}" for fix, db in measured)
    return f"image SQNR on held-out calibration images: {figures} dB"


def describe_cpus(settings: dict | None) -> str:
    """The CPUs a model is for and its overflow fix, e.g. "all CPUs (first-layer pair rule)"; "" if not stated."""
    if not settings or "cpus" not in settings:
        return ""
    fix = settings.get("overflow_fix") or NO_FIX
    quantizer = _quantizer_of(settings)
    how = {**COMMON_OVERFLOW_WORDS, **(quantizer.overflow_words(settings) if quantizer else {})}
    target = "all CPUs" if settings["cpus"] == ALL else f"{settings['cpus']} CPUs"
    judged = f"; judged: {describe_overflow_judgement(settings['overflow_fix_db'])}" if settings.get("overflow_fix_db") else ""
    return f"{target} ({how[fix]}{judged})" if fix in how else target


def describe_quantization(settings: dict | None) -> str:
    """How a model was quantized, in a few words, from its stored settings (a dict: records hold JSON)."""
    if not settings:
        return "float"
    quantizer = _quantizer_of(settings)
    described = quantizer.describe(settings) if quantizer is not None and quantizer.describe is not None else describe_settings(settings)
    return ", ".join(part for part in (described, describe_cpus(settings)) if part)


def describe_model(settings: dict | None, pruning: dict | None = None) -> str:
    """How a model was made, in a few words: its pruning, then its quantization."""
    return ", ".join(part for part in (describe_pruning(pruning), describe_quantization(settings)) if part)
