"""Quantization settings: the one vocabulary every backend shares, validated in one place, and the one
describer of a model's quantization (report, tune, sweep and render all use it)."""

from __future__ import annotations

from dataclasses import dataclass

from ptq_cli.cpu import ALL, CPU_TARGETS, VNNI
from ptq_cli.errors import PtqError
from ptq_cli.services.models import LITERT, ONNXRUNTIME, OPENVINO, PYTORCH
from ptq_cli.services.overflow import ALL_LAYERS, FIRST_LAYER, NO_FIX, OVERFLOW_FIXES

DTYPES = ("int8", "uint8")
BACKENDS = (ONNXRUNTIME, PYTORCH, OPENVINO, LITERT)
# Each library's own calibration methods; the first is the default. NNCF has one (min/max statistics of
# its preset, then bias correction), set by --preset and --bias-correction. LiteRT: the TFLite converter's
# min/max, or ptq's percentile rule (onnxruntime's histogram collector) applied to the same tensors.
METHODS = {ONNXRUNTIME: ("minmax", "entropy", "percentile"), PYTORCH: ("histogram", "minmax"), OPENVINO: ("nncf",),
           LITERT: ("minmax", "percentile")}
# ONNX Runtime keeps the seed study's per-tensor default; PyTorch's x86 default is per-channel, NNCF's and TFLite's too.
DEFAULT_PER_CHANNEL = {ONNXRUNTIME: False, PYTORCH: True, OPENVINO: True, LITERT: True}
FORMATS = {ONNXRUNTIME: "QDQ", PYTORCH: "FX", OPENVINO: "IR", LITERT: "TFLite"}
# A full-integer TFLite model's input and output tensors: int8 is what TFLite Micro wants; float keeps
# float I/O around the int8 body.
IO_TYPES = ("int8", "uint8", "float")
NNCF_PRESETS = ("performance", "mixed")  # NNCF's: symmetric activations, or asymmetric ones
BIAS_CORRECTIONS = ("fast", "full", "none")
DEFAULT_PERCENTILE = 99.999
DEFAULT_DTYPE = "int8"
# `--target speed`: the fast configuration on x86. onnxruntime's x86 int8 kernels (VNNI) multiply
# unsigned activations by signed weights; int8 x int8 and uint8 x uint8 fall back to slower paths.
# Per-channel weights with percentile calibration keep the accuracy (see README for the figures).
TARGETS = ("speed",)
PRESETS = {
    "speed": {
        ONNXRUNTIME: {"dtype": "uint8", "weight_dtype": "int8", "per_channel": True, "method": "percentile"},
        PYTORCH: {},  # PyTorch's x86 int8 is already uint8 activations x int8 per-channel weights
        OPENVINO: {},  # NNCF's performance preset is the fast one
        LITERT: {},  # a full-integer model has one configuration of kernels
    }
}


# How each backend keeps a model for `--cpus all` exact on x86 CPUs without VNNI (see README, "Right on
# every CPU"): onnxruntime and PyTorch give the first layer's weights pair-safe scales (the input's full
# range meets full-range weights there; measured) or, "all-layers", bound every layer (proven: the pair
# rule; PyTorch: 7-bit activations, torch.ao's own x86 default); NNCF its OverflowFix; LiteRT's XNNPACK
# widens to int16 before adding, and needs nothing.
DEFAULT_OVERFLOW_FIX = {ONNXRUNTIME: FIRST_LAYER, OPENVINO: FIRST_LAYER, PYTORCH: FIRST_LAYER, LITERT: NO_FIX}
OVERFLOW_FIX_CHOICES = {ONNXRUNTIME: OVERFLOW_FIXES, OPENVINO: OVERFLOW_FIXES, PYTORCH: OVERFLOW_FIXES, LITERT: (NO_FIX,)}


@dataclass(frozen=True)
class QuantizationSettings:
    """Everything that decides the quantized model; stored inside it and in its evaluation record."""

    framework: str  # ONNXRUNTIME or PYTORCH
    format: str  # "QDQ" (onnxruntime) or "FX" (torch.ao FX graph mode)
    dtype: str  # activations: "int8" or "uint8"; names the model's data type
    weight_dtype: str
    per_channel: bool
    method: str
    percentile: float | None  # only for method "percentile"
    preprocess: bool  # onnxruntime's quant_pre_process (shape inference, BN folding) before quantizing
    # Filled in by quantize() from the calibration set it was given.
    calibration_samples: int = 0
    calibration_seed: int | None = None
    calibration_source: str | None = None
    target: str | None = None  # the preset the settings came from, if any
    float_nodes: tuple[str, ...] = ()  # nodes left in float (names in the preprocessed graph)
    # Regroup the convolutions onnxruntime's fast x86 int8 kernel handles poorly (the RGB stem, 16-channel
    # layers) over blocks of pixels (services/space_to_depth.py); same products.
    space_to_depth: bool = False
    # NNCF (OpenVINO) only: its preset, its bias correction, and how many calibration samples it uses.
    nncf_preset: str | None = None
    bias_correction: str | None = None
    subset_size: int | None = None
    # LiteRT only: the input/output tensors' type, and the onnxruntime model whose activation ranges it copies.
    io: str | None = None
    ranges_from: str | None = None
    # Which CPUs the model is for (cpu.CPU_TARGETS) and how it is kept exact on those without VNNI.
    cpus: str = ALL
    overflow_fix: str = NO_FIX


def make_settings(
    dtype: str | None = None,
    backend: str = ONNXRUNTIME,
    weight_dtype: str | None = None,
    per_channel: bool | None = None,
    method: str | None = None,
    percentile: float | None = None,
    preprocess: bool = True,
    target: str | None = None,
    space_to_depth: bool | None = None,
    nncf_preset: str | None = None,
    bias_correction: str | None = None,
    subset_size: int | None = None,
    float_nodes: tuple[str, ...] = (),
    io: str | None = None,
    ranges_from: str | None = None,
    cpus: str | None = None,
    overflow_fix: str | None = None,
) -> QuantizationSettings:
    """Validated settings. Without a target the defaults are the seed study's, the weights following the
    activations' type; a target's preset fills in what the options leave open. Space-to-depth is on by
    default where it speeds the model up: onnxruntime, uint8 activations x int8 weights."""
    if backend not in BACKENDS:
        raise PtqError(f"--backend: '{backend}' is not one of {', '.join(BACKENDS)}")
    if target is not None and target not in TARGETS:
        raise PtqError(f"--target: '{target}' is not one of {', '.join(TARGETS)}")
    preset = PRESETS[target][backend] if target else {}
    dtype = dtype or preset.get("dtype") or DEFAULT_DTYPE
    weight_dtype = weight_dtype or preset.get("weight_dtype")
    per_channel = preset.get("per_channel") if per_channel is None else per_channel
    method = method or preset.get("method")
    if dtype not in DTYPES:
        raise PtqError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    weight_dtype = weight_dtype or dtype
    if weight_dtype not in DTYPES:
        raise PtqError(f"--weight-dtype: '{weight_dtype}' is not one of {', '.join(DTYPES)}")
    nncf_given = [option for option, value in (("--preset", nncf_preset), ("--bias-correction", bias_correction), ("--subset-size", subset_size),
                                                   ("--ignored-scope", float_nodes or None)) if value is not None]
    if backend != OPENVINO and nncf_given:
        raise PtqError(f"{nncf_given[0]}: an NNCF option; applies to --backend openvino")
    if backend == OPENVINO:
        if "uint8" in (dtype, weight_dtype):
            raise PtqError("--dtype uint8: NNCF quantizes to int8 (its presets choose symmetric or asymmetric activations: --preset)")
        if per_channel is False:
            raise PtqError("--per-tensor: NNCF quantizes weights per channel on the CPU")
        nncf_preset, bias_correction = nncf_preset or NNCF_PRESETS[0], bias_correction or BIAS_CORRECTIONS[0]
        if nncf_preset not in NNCF_PRESETS:
            raise PtqError(f"--preset: '{nncf_preset}' is not one of {', '.join(NNCF_PRESETS)}")
        if bias_correction not in BIAS_CORRECTIONS:
            raise PtqError(f"--bias-correction: '{bias_correction}' is not one of {', '.join(BIAS_CORRECTIONS)}")
        if subset_size is not None and subset_size < 1:
            raise PtqError(f"--subset-size: must be at least 1, got {subset_size}")
    litert_given = [option for option, value in (("--io", io), ("--ranges-from", ranges_from)) if value is not None]
    if backend != LITERT and litert_given:
        raise PtqError(f"{litert_given[0]}: a LiteRT option; applies to --backend litert")
    if backend == LITERT:
        if "uint8" in (dtype, weight_dtype):
            raise PtqError("--dtype uint8: a full-integer TFLite model computes in int8; --io uint8 gives it uint8 input and output")
        io = io or IO_TYPES[0]
        if io not in IO_TYPES:
            raise PtqError(f"--io: '{io}' is not one of {', '.join(IO_TYPES)}")
        if ranges_from is not None and method not in (None, METHODS[LITERT][0]):
            raise PtqError(f"--method {method}: --ranges-from takes the activation ranges from {ranges_from} instead")
    if backend == PYTORCH and "uint8" in (dtype, weight_dtype):
        option = "--dtype" if dtype == "uint8" else "--weight-dtype"
        raise PtqError(
            f"{option} uint8: PyTorch's x86/fbgemm quantized convolutions need signed int8 weights "
            "(their activations are uint8 already); use --dtype int8, or --backend onnxruntime for uint8"
        )
    method = method or METHODS[backend][0]
    if space_to_depth and backend != ONNXRUNTIME:
        raise PtqError("--space-to-depth: applies to --backend onnxruntime only")
    if space_to_depth is None:
        space_to_depth = preset.get("space_to_depth", backend == ONNXRUNTIME and (dtype, weight_dtype) == ("uint8", "int8"))
    if method not in METHODS[backend]:
        raise PtqError(f"--method: '{method}' is not a {backend} calibration method ({', '.join(METHODS[backend])})")
    if method == "percentile":
        percentile = DEFAULT_PERCENTILE if percentile is None else percentile
        if not 50.0 < percentile <= 100.0:
            raise PtqError(f"--percentile: {percentile} is not in (50, 100]")
    elif percentile is not None:
        raise PtqError("--percentile: only applies to --method percentile")
    cpus = cpus or ALL
    if cpus not in CPU_TARGETS:
        raise PtqError(f"--cpus: '{cpus}' is not one of {', '.join(CPU_TARGETS)}")
    if cpus == VNNI:
        if overflow_fix not in (None, NO_FIX):
            raise PtqError(f"--overflow-fix {overflow_fix}: --cpus vnni keeps the full 8-bit range; the fix is for --cpus all")
        overflow_fix = NO_FIX
    else:
        overflow_fix = overflow_fix or DEFAULT_OVERFLOW_FIX[backend]
        if overflow_fix not in OVERFLOW_FIX_CHOICES[backend]:
            raise PtqError(f"--overflow-fix: {backend} takes {', '.join(OVERFLOW_FIX_CHOICES[backend])}")
    if weight_dtype == "uint8" and backend == ONNXRUNTIME:
        overflow_fix = NO_FIX  # u8 x u8 runs on a kernel that widens to 16 bits first: nothing to fix
    return QuantizationSettings(
        framework=backend,
        format=FORMATS[backend],
        dtype=dtype,
        weight_dtype=weight_dtype,
        per_channel=DEFAULT_PER_CHANNEL[backend] if per_channel is None else per_channel,
        method=method,
        percentile=percentile,
        preprocess=preprocess,
        target=target,
        space_to_depth=space_to_depth,
        nncf_preset=nncf_preset,
        bias_correction=bias_correction,
        subset_size=subset_size,
        float_nodes=tuple(float_nodes),
        io=io,
        ranges_from=None if ranges_from is None else str(ranges_from),
        cpus=cpus,
        overflow_fix=overflow_fix,
    )


def short_node(name: str) -> str:
    """tf2onnx names a layer's nodes model_1/conv2d_1/BiasAdd: the layer is the middle part. OpenVINO
    names a convolution split from its bias <node>/WithoutBiases."""
    name = name.removesuffix("/WithoutBiases")
    return name.split("/")[-2] if "/" in name else name


def describe_pruning(pruning: dict | None) -> str:
    if not pruning:
        return ""
    kept = [name for name, flag in (("first conv", pruning.get("exclude_first")), ("classifier", pruning.get("exclude_classifier"))) if flag]
    refit = " re-fitted" if pruning.get("reconstruct") else ""
    return f"pruned {pruning['sparsity']:.0%} {pruning['scope']}{refit}" + (f" (dense: {', '.join(kept)})" if kept else "")


def describe_cpus(settings: dict | None) -> str:
    """The CPUs a model is for and its overflow fix, e.g. "all CPUs (first-layer pair rule)"; "" if not stated."""
    if not settings or "cpus" not in settings:
        return ""
    fix = settings.get("overflow_fix") or NO_FIX
    how = {FIRST_LAYER: "first-layer pair rule", ALL_LAYERS: "7-bit activations" if settings.get("format") == "FX" else "all-layer pair rule"}
    if settings.get("format") == "IR":
        how = {FIRST_LAYER: "NNCF overflow fix, first layer", ALL_LAYERS: "NNCF overflow fix, all layers"}
    target = "all CPUs" if settings["cpus"] == ALL else f"{settings['cpus']} CPUs"
    return f"{target} ({how[fix]})" if fix in how else target


def describe_quantization(settings: dict | None) -> str:
    """How a model was quantized, in a few words, from its stored settings (a dict: records hold JSON)."""
    if not settings:
        return "float"
    return ", ".join(part for part in (_describe_quantization(settings), describe_cpus(settings)) if part)


def _describe_quantization(settings: dict) -> str:
    # PyTorch's x86 kernels pair unsigned activations with signed weights whatever the model is called.
    types = "a:quint8 w:qint8" if settings.get("format") == "FX" else f"a:{settings['dtype']} w:{settings.get('weight_dtype', settings['dtype'])}"
    if settings.get("format") == "TFLite":  # a full-integer .tflite: its tensors' types and its I/O quantization
        parts = [f"TFLite {types}"]
        if "per_channel" in settings:  # ptq made it: how it was calibrated
            parts.append("per-channel" if settings["per_channel"] else "per-tensor")
            ranges = settings.get("ranges_from")
            parts.append(f"ranges of {ranges.replace(chr(92), '/').rsplit('/', 1)[-1]}" if ranges else
                         settings.get("method", "?") + (f" {settings['percentile']:g}" if settings.get("percentile") else ""))
            parts.append(f"{settings.get('calibration_samples', '?')} samples")
        return ", ".join([*parts, f"input {settings.get('input', '?')}", f"output {settings.get('output', '?')}"])
    if settings.get("format") == "IR":
        parts = [f"NNCF IR {types}", f"{settings.get('nncf_preset')} preset", f"{settings.get('bias_correction')} bias correction",
                 f"{settings.get('subset_size') or settings.get('calibration_samples', '?')} samples"]
        if settings.get("float_nodes"):
            parts.append("float: " + ", ".join(short_node(name) for name in settings["float_nodes"]))
        return ", ".join(parts)
    parts = [
        f"{settings.get('format', 'QDQ')} {types}",
        "per-channel" if settings.get("per_channel") else "per-tensor",
        settings.get("method", "?") + (f" {settings['percentile']:g}" if settings.get("percentile") else ""),
        f"{settings.get('calibration_samples', '?')} samples",
    ]
    if settings.get("float_nodes"):
        parts.append("float: " + ", ".join(short_node(name) for name in settings["float_nodes"]))
    if settings.get("space_to_depth_convs"):
        parts.append("space-to-depth: " + ", ".join(short_node(rewrite["node"]) for rewrite in settings["space_to_depth_convs"]))
    return ", ".join(parts)


def describe_model(settings: dict | None, pruning: dict | None = None) -> str:
    """How a model was made, in a few words: its pruning, then its quantization."""
    return ", ".join(part for part in (describe_pruning(pruning), describe_quantization(settings)) if part)
