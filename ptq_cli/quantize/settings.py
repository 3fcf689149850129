"""What a quantization asks for and what every quantizer returns: the common choices, a backend's own options (each
backend module subclasses BackendOptions), the settings stored in every model ptq makes, and the engine's constants
(the `--method auto` candidates, the held-out images, learned rounding's and the range search's budgets)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ptq_cli.errors import PtqError
from ptq_cli.quantize.budget import Deadline
from ptq_cli.quantize.overflow import NO_FIX
from ptq_cli.x86.cpu import ALL

if TYPE_CHECKING:
    import numpy as np

ProgressCallback = Callable[[int, int], None]  # (images done, images in all): a backend's calibration progress
# What only the service quantizing can give a backend (backends import no service), handed in QuantizeCall:
# the outputs of a model file on the saturating x86 int8 path at native speed, as (model file, inputs in its format, threads)
# -> its outputs, None where this machine cannot run those kernels at native speed (a PtqError where it can but the run failed);
SaturatingScores = Callable[[Path, "np.ndarray", int], "np.ndarray | None"]
# and ptq's onnxruntime model made from the same source and images, as (where to write it, whether its weights must
# follow the pair rule on every layer): the PT2E backends' `--weights-from onnxruntime`.
WeightsMaker = Callable[[Path, bool], None]

INT4 = "int4"  # 4-bit weights (`--weight-dtype int4`), for a backend whose format holds them (Quantizer.int4_weights)
# `--method auto`: the activation ranges each of these gives (method, percentile) are judged by the output on held-out
# calibration images and the best kept (the percentiles clip the rare activations MinMax spends codes on).
AUTO_METHOD = "auto"
PER_IMAGE = "per-image"  # each activation's range from a percentile over the images of each image's own extremes
PER_IMAGE_PERCENTILE = 99.0
# A tighter per-image range, judged too: a Keras EfficientNet-B0 (SE blocks, swish) kept 62% top-1 agreement with
# FP32 with per-image 99 and 90% with 90 (held out: 9.2 and 21.8 dB); NNCF's mean of the same extremes gave 79%.
PER_IMAGE_TIGHT_PERCENTILE = 90.0
METHOD_CANDIDATES: tuple[tuple[str, float | None], ...] = (("minmax", None), ("percentile", 99.999), ("percentile", 99.99),
                                                           (PER_IMAGE, PER_IMAGE_PERCENTILE), (PER_IMAGE, PER_IMAGE_TIGHT_PERCENTILE))
# A percentile replaces MinMax only when it measures at least this much better: on a few dozen held-out images smaller
# differences are noise (EfficientNet-Lite0 on 27 photos: +0.3 dB held out, -0.7 dB on the test photos).
METHOD_MARGIN_DB = 0.5
HELD_OUT_EVERY = 4  # every 4th calibration image judges choices made on the others (ranges, learned rounding)
HELD_OUT_MAX = 256
# `--method auto`'s candidates (and the overflow fix's) are calibrated on at most this many activation values (every
# float tensor of one image, as quantize/calibration.activation_bytes counts them, times the images), drawn evenly from
# the images not held out; the model kept is then calibrated on every image. ResNet8 (0.34 M values an image): all its
# 750; EfficientNet-Lite0 at 224x224 (18 M): 66 of its 225. An image in the draw costs its histograms and five
# calibrations; an image left out, its share of the kept model's one MinMax pass (docs/speed.md: the same model, sooner).
CANDIDATE_VALUES = 1_200_000_000
# Learned rounding reads at most this many image pixels per layer: 512 images at 32x32, 79 at 224x224.
ROUNDING_PIXELS = 4_000_000
ROUNDING_IMAGES = (32, 512)
# `--method auto` then searches each activation scale (quantize/ranges.py) on the images learned rounding reads,
# for at most this many image pixels run through the model in all, and only where one sweep fits in it: ResNet8's
# 13 or 14 scales take 79 or 85 runs of 512 images a sweep; EfficientNet-Lite2's 80 at 260x260 would take 481 runs of 59 images,
# against a budget of 100.
RANGE_SEARCH_PIXELS = 400_000_000


def option(default: Any, *flags: str, help: str, choices: tuple[str, ...] = (), minimum: float | None = None, cli: Any = str) -> Any:
    """A field of a backend's Options: its default (None: the backend decides), its command-line flags (default
    --<name>), its help, its accepted values or lower bound, and the type the command line parses (str, bool,
    int, float, Path, or list[str] for a repeated option)."""
    return field(default=default, metadata={"flags": flags, "help": help, "choices": choices, "minimum": minimum, "cli": cli})


@dataclass(frozen=True)
class CommonChoices:
    """The choices every backend shares, as given (before the defaults): what a backend's Options may settle."""

    dtype: str
    weight_dtype: str
    per_channel: bool | None
    method: str | None  # None: the backend's first method, unless its options say which
    rounding: str | None
    overflow_fix: str | None = None  # a backend's own say (else the --cpus rules)
    float_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendOptions:
    """The settings only one backend takes. Each backend module subclasses it with its own fields (`option`),
    its rules on the common choices (`settle`) and its words (`describe`): the command line, the checks and the
    stored settings all come from here, so nothing outside the module names them."""

    panel: ClassVar[str] = ""  # the --help panel of its options, e.g. "NNCF (--backend openvino)"
    word: ClassVar[str] = ""  # what its options are called in a message, e.g. "an NNCF option"

    def __init_subclass__(cls, owner: str = "", backends: str = "", article: str = "a", **kwargs: Any) -> None:
        """`class Options(BackendOptions, owner="NNCF", backends="openvino", article="an")` names its panel and its word."""
        super().__init_subclass__(**kwargs)
        if owner:
            cls.panel, cls.word = f"{owner} (--backend {backends})", f"{article} {owner} option"

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line option that sets field `name`."""
        flags = next(item for item in fields(cls) if item.name == name).metadata["flags"]
        return flags[0].split("/")[0] if flags else "--" + name.replace("_", "-")

    @classmethod
    def from_given(cls, given: dict[str, Any]) -> BackendOptions:
        """The options from the values given (None: not given), each checked against its choices and bound."""
        values = {item.name: given[item.name] for item in fields(cls) if given.get(item.name) is not None}
        for item in fields(cls):
            value, meta = values.get(item.name), item.metadata
            if value is None:
                continue
            if meta["choices"] and value not in meta["choices"]:
                raise PtqError(f"{cls.flag(item.name)}: '{value}' is not one of {', '.join(meta['choices'])}")
            if meta["minimum"] is not None and not value >= meta["minimum"]:
                raise PtqError(f"{cls.flag(item.name)}: must be at least {meta['minimum']:g}, got {value}")
            if isinstance(value, list):
                values[item.name] = tuple(value)
        return cls(**values)

    def given(self) -> list[str]:
        """The options set away from their defaults, as their flags."""
        return [self.flag(item.name) for item in fields(self) if getattr(self, item.name) not in (item.default, None, ())]

    def settle(self, common: CommonChoices) -> tuple[BackendOptions, CommonChoices]:
        """Its rules: (its options with their defaults filled in, the common choices as it changes them);
        a PtqError for a combination it does not take."""
        return self, common

    def describe(self) -> str:
        """Its options in a few words for the quantize table ("" when there is nothing to say)."""
        return ""

    def without_overflow_fix(self) -> BackendOptions:
        """Its options for the same model made for VNNI CPUs alone (`--cpus vnni`): those that only say how a fix is kept go."""
        return self

    def input_files(self) -> tuple[Path, ...]:
        """ONNX models its options make quantize read: checked before any calibration work, never overwritten by the output."""
        return ()

    def stored(self) -> dict[str, Any]:
        """Its fields as the model's stored settings hold them: beside the common ones, as ptq 0.4 wrote them."""
        return asdict(self)


NO_OPTIONS = BackendOptions()


@dataclass(frozen=True)
class Evidence:
    """What the judges measured for the decisions they made, as image SQNR on held-out calibration images
    (metrics.image_sqnr_db, dB): stored in the model and its records beside the settings, never given by a user."""

    # The output SQNR the stem's int8 weights alone gave (services/make/stem.py).
    stem_sqnr_db: float | None = None
    # Learned rounding against nearest rounding, each measured.
    rounding_nearest_db: float | None = None
    rounding_learned_db: float | None = None
    # `--method auto`: each activation range tried (method, percentile) and the image SQNR it gave.
    method_sqnr_db: tuple[tuple[str, float | None, float | None], ...] = ()
    # Where those nearest-rounded models preferred a percentile to MinMax, both again after learned rounding (the same
    # triples, for the rounding each kept): the percentile stays only where it still wins by METHOD_MARGIN_DB.
    method_rounded_db: tuple[tuple[str, float | None, float | None], ...] = ()
    # The activation scales as calibrated and as searched.
    ranges_calibrated_db: float | None = None
    ranges_searched_db: float | None = None
    # Where the overflow fix was judged (overflow.JUDGED): each fix tried and the image SQNR it gave (nearest rounding,
    # the method kept); all-layers kept unless first-layer is METHOD_MARGIN_DB closer.
    overflow_fix_db: tuple[tuple[str, float | None], ...] = ()


# The order a model's stored settings have always had: each figure beside the decision it is evidence for.
STORED_ORDER = ("backend", "format", "dtype", "weight_dtype", "per_channel", "method", "percentile", "preprocess", "calibration_samples",
                "calibration_seed", "calibration_source", "target", "float_nodes", "cpus", "overflow_fix", "stem", "stem_sqnr_db", "rounding",
                "rounding_nearest_db", "rounding_learned_db", "method_sqnr_db", "method_rounded_db", "ranges", "ranges_calibrated_db",
                "ranges_searched_db", "overflow_fix_db")


@dataclass(frozen=True)
class QuantizationSettings:
    """What decides the quantized model: the request (what the user asked, the backend's options), the decisions the
    quantizer made where the request left them open (None until then), and the evidence for those decisions
    (`evidence`). Stored inside the model and in its evaluation record (`as_dict`)."""

    backend: str  # the backend that quantizes (and runs) it
    format: str  # the backend's format: "QDQ", "FX", "IR", "TFLite"...
    dtype: str  # activations: "int8" or "uint8"; names the model's data type
    weight_dtype: str
    per_channel: bool | None  # None until the model decides: per-channel where it has depthwise convolutions (quantize.resolve_model_defaults)
    method: str  # `--method auto`: the range kept, once judged
    percentile: float | None  # only for methods "percentile" and PER_IMAGE
    preprocess: bool  # onnxruntime's quant_pre_process (shape inference, BN folding) before quantizing
    # Filled in by quantize() from the calibration set it was given.
    calibration_samples: int = 0
    calibration_seed: int | None = None
    calibration_source: str | None = None
    target: str | None = None  # the preset the settings came from, if any
    float_nodes: tuple[str, ...] = ()  # nodes left in float (names in the preprocessed graph)
    options: BackendOptions = NO_OPTIONS  # the backend's own (its module's Options)
    # Which CPUs the model is for (cpu.CPU_TARGETS) and how it is kept exact on those without VNNI.
    cpus: str = ALL
    overflow_fix: str | None = NO_FIX  # None until the model decides (quantize.resolve_model_defaults)
    # The stem (the layers the image enters): "float" or "int8"; None until measured (services/make/stem.py).
    stem: str | None = None
    # Weight rounding: "learned" (codes and biases refined layer by layer, quantize/rounding.py) or "nearest";
    # None until measured on held-out calibration images.
    rounding: str | None = None
    # `--method auto` then searches each activation scale: "searched" where that brought the output closer to FP32 on
    # held-out calibration images by METHOD_MARGIN_DB, else "calibrated"; None where no search ran.
    ranges: str | None = None
    evidence: Evidence = Evidence()

    def with_evidence(self, **measured: Any) -> QuantizationSettings:
        """The same settings, with these figures of the judges' evidence."""
        return replace(self, evidence=replace(self.evidence, **measured))

    def as_dict(self) -> dict[str, Any]:
        """The settings as a model and its records store them: each figure beside its decision, the backend's options
        after the common fields."""
        stored = {**asdict(self), **asdict(self.evidence)}
        return {**{key: stored[key] for key in STORED_ORDER}, **self.options.stored()}


@dataclass(frozen=True)
class QuantizedFile:
    """What every backend's quantize returns."""

    size_bytes: int
    space_to_depth: tuple = ()  # the convolutions regrouped before quantizing (onnxruntime only)
    notes: tuple[str, ...] = ()  # what the backend changed on the way (a fixed batch made symbolic, ...)
    settings: QuantizationSettings | None = None  # the settings as it applied them, where it decided some (the rounding)


@dataclass(frozen=True)
class QuantizeCall:
    """What a backend's quantize is handed (Quantizer.quantize): the float model and the calibration images in its input
    format, the settings, where to write, the metadata to keep in the model (input contract, source sha256, tune's
    validation scores), and what only the service quantizing can give (None where no service gives it: a judge of the
    overflow fix then measures the exact path alone; `--weights-from onnxruntime` keeps the flow's own rounding)."""

    model: Any  # onnx.ModelProto
    output: Path
    settings: QuantizationSettings
    calibration: np.ndarray
    stored: dict[str, str]
    progress: ProgressCallback | None = None
    saturating_scores: SaturatingScores | None = None
    make_weights: WeightsMaker | None = None
    deadline: Deadline | None = None  # the time budget the engine's optional steps keep to (`--time-budget`), if any


def progress_after(progress: ProgressCallback | None, done: int) -> ProgressCallback | None:
    """The progress of a phase, shown after the `done` steps of the phases before it on the same bar."""
    return (lambda steps, total: progress(done + steps, done + total)) if progress else None
