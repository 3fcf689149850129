"""What every backend shares, and the row each one fills in: the backend table's vocabulary.

A backend quantizes (its `quantize`) and a runtime executes (its `load`); most backends are both. Each
module in ptq_cli/backends exports one `BACKEND`, a `Backend`; services loop over the table and never
test a backend's name. This module imports no backend module and no service (model_file.py and lower only).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends.model_file import (  # noqa: F401  the metadata keys, named here for the backends
    KERAS_SOURCE_METADATA_KEY,
    PRUNING_METADATA_KEY,
    QUANTIZATION_METADATA_KEY,
    SOURCE_METADATA_KEY,
    metadata_object,
)
from ptq_cli.cpu import ALL
from ptq_cli.datasets.base import convert_channels, resize
from ptq_cli.errors import PtqError
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.inputs import ModelInput, Preprocessing
from ptq_cli.transforms.overflow import FIRST_LAYER, NO_FIX, OVERFLOW_FIXES

ProgressCallback = Callable[[int, int], None]  # (images done, images in all): a backend's calibration progress

EMULATE = "emulate"  # an int8 path reached by emulating a CPU of the other kind (Int8Paths.basis)
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
# Learned rounding reads at most this many image pixels per layer: 512 images at 32x32, 79 at 224x224.
ROUNDING_PIXELS = 4_000_000
ROUNDING_IMAGES = (32, 512)
# `--method auto` then searches each activation scale (transforms/ranges.py) on the images learned rounding reads,
# for at most this many image pixels run through the model in all, and only where one sweep fits in it: ResNet8's
# 13 or 14 scales take 79 or 85 runs of 512 images a sweep; EfficientNet-Lite2's 80 at 260x260 would take 481 runs of 59 images,
# against a budget of 100.
RANGE_SEARCH_PIXELS = 400_000_000


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    runtime: str  # the name of the backend that runs it
    dtype: str  # "fp32", "int8" or "uint8"
    quantization: dict | None  # the settings quantize used; None for a float model
    size_bytes: int
    sha256: str
    pruning: dict | None = None  # the settings prune used; None for an unpruned model
    source_sha256: str | None = None  # the float model this one was made from, if ptq made it
    precision: str | None = None  # the inference precision hint it ran with (OpenVINO: f32 or bf16)
    arena_bytes: int | None = None  # the working memory its runtime allocated for it, as that runtime measured it (TFLM's tensor arena)


@dataclass(frozen=True)
class LoadedModel:
    info: ModelInfo
    predict: Callable[[np.ndarray], np.ndarray]  # a batch in the model's input format -> (N, classes) scores
    input: ModelInput
    preprocessing: Preprocessing
    num_classes: int
    batch_note: str | None = None  # how a fixed batch dimension is handled, if the model has one

    def fit(self, images: np.ndarray) -> np.ndarray:
        """uint8 images of any size and channel count, at the model's."""
        if images.shape[1:3] != self.input.size:
            images = resize(images, self.input.size)
        return convert_channels(images, self.input.channels, self.info.path)

    def prepare(self, images: np.ndarray) -> np.ndarray:
        """uint8 N x H x W x C images -> the model's input (size, channels, scale, normalisation, layout)."""
        return inputs.prepare(self.fit(images), self.input, self.preprocessing)

    def describe_input(self) -> str:
        """e.g. "NCHW 3x32x32, batch 1 (fixed batch 1 made symbolic (same outputs))"."""
        shape = self.input.shape(1)[1:]
        batch = "batch N" if self.input.batch is None else f"batch {self.input.batch}"
        return f"{self.input.layout} {'x'.join(map(str, shape))}, {batch}" + (f" ({self.batch_note})" if self.batch_note else "")


@dataclass(frozen=True)
class RunOptions:
    """How a runtime runs a model: threads, the preprocessing the user told, and its own settings."""

    threads: int | None = None
    flags: inputs.PreprocessingFlags = field(default_factory=inputs.PreprocessingFlags)
    precision: str | None = None  # the inference precision hint, for a runtime that has them
    exact_int8: bool = False  # the exact u8 x s8 kernels on a CPU without VNNI, for a runtime that has a switch
    saturating_int8: bool = False  # on a CPU with VNNI, the kernels of CPUs without it, for a runtime that can pick them


@dataclass(frozen=True)
class QuantizedFile:
    """What every backend's quantize returns."""

    size_bytes: int
    space_to_depth: tuple = ()  # the convolutions regrouped before quantizing (onnxruntime only)
    notes: tuple[str, ...] = ()  # what the backend changed on the way (a fixed batch made symbolic, ...)
    settings: QuantizationSettings | None = None  # the settings as it applied them, where it decided some (the rounding)


@dataclass
class _MadeOnce:
    """While `reusing_made_files()` is open: what backends made (files, intermediate models, choices), by the digest
    of what each was made from, with its size in bytes."""

    open: bool = False
    made: dict[str, tuple[Any, int]] = field(default_factory=dict)  # oldest first
    directory: Path | None = None  # files kept for the scope's later calls (onnxruntime's calibration caches)


REUSE_BYTES = 512 * 2**20  # the bytes kept at most: the oldest go first
_MADE = _MadeOnce()
REUSED_NOTE = "the same file an earlier stage of this run made from the same model, images and settings: written again, not made again"


@contextmanager
def reusing_made_files() -> Iterator[None]:
    """Within it, a backend hands back what it made from the same inputs earlier (`made_once`, `computed_once`):
    `ptq run` makes several models from one FP32 model, and OpenVINO's default IR is onnxruntime's int8 QDQ model
    converted."""
    was_open, _MADE.open = _MADE.open, True
    if not was_open:
        _MADE.directory = Path(tempfile.mkdtemp(prefix="ptq-reused-"))
    try:
        yield
    finally:
        _MADE.open = was_open
        if not was_open:
            _MADE.made.clear()
            shutil.rmtree(_MADE.directory or "", ignore_errors=True)
            _MADE.directory = None


def reused_file(key: Callable[[], str], suffix: str) -> Path | None:
    """Within `reusing_made_files()`, where a backend keeps (or finds) the file it made from the inputs `key()` digests,
    for later calls of the same run; None outside it."""
    if not _MADE.open or _MADE.directory is None:
        return None
    return _MADE.directory / f"{key()}{suffix}"


# How a backend's judges reach the saturating x86 int8 path where this CPU's own kernels are exact: given by the service
# that quantizes (services/measure/emulate.py), as (model file, inputs in its format, threads) -> its outputs, or None
# where this machine cannot run those kernels at native speed. Backends import no service: it is handed down.
SaturatingScores = Callable[[Path, np.ndarray, int], "np.ndarray | None"]
_SATURATING: ContextVar[SaturatingScores | None] = ContextVar("saturating_scores", default=None)


@contextmanager
def reaching_saturating_path(scores: SaturatingScores) -> Iterator[None]:
    """Within it, `saturating_outputs` runs models on the saturating path with `scores`."""
    token = _SATURATING.set(scores)
    try:
        yield
    finally:
        _SATURATING.reset(token)


def saturating_outputs(path: Path, batch: np.ndarray, threads: int) -> np.ndarray | None:
    """The model file's outputs on the saturating x86 path at native speed, where the service quantizing gave a way to
    it (`reaching_saturating_path`) and this machine has one; else None."""
    scores = _SATURATING.get()
    return None if scores is None else scores(path, batch, threads)


def digest(*parts: bytes | memoryview) -> str:
    """sha256 over `parts`, each with its length, so no two lists of parts give the same bytes. A part may be a byte
    view of an array (`array.reshape(-1).view(np.uint8).data`): hashed where it lies, not copied."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(len(part).to_bytes(8, "little"))
        hashed.update(part)
    return hashed.hexdigest()


T = TypeVar("T")


def computed_once(key: Callable[[], str], compute: Callable[[], T], size: Callable[[T], int] = lambda _: 0) -> T:
    """`compute()`; within `reusing_made_files()`, what an earlier `compute()` of the same `key()` returned (`size`:
    the bytes it holds)."""
    if not _MADE.open:
        return compute()
    digest = key()
    if digest in _MADE.made:
        return _MADE.made[digest][0]
    value = compute()
    _MADE.made[digest] = (value, size(value))
    while sum(held for _, held in _MADE.made.values()) > REUSE_BYTES and len(_MADE.made) > 1:
        del _MADE.made[next(iter(_MADE.made))]
    return value


def made_once(key: Callable[[], str], output: Path, make: Callable[[], QuantizedFile]) -> QuantizedFile:
    """`make()`, which writes `output`; within `reusing_made_files()`, the bytes and result of an earlier `make()` of
    the same `key()` instead, written to `output`."""
    made_now = False

    def make_and_keep() -> tuple[bytes, QuantizedFile]:
        nonlocal made_now
        made_now, result = True, make()
        return Path(output).read_bytes() if _MADE.open else b"", result

    data, result = computed_once(key, make_and_keep, size=lambda kept: len(kept[0]))
    if made_now:
        return result
    with atomic_output(output) as tmp:
        tmp.write_bytes(data)
    return replace(result, notes=(*result.notes, REUSED_NOTE))


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
class QuantizationSettings:
    """Everything that decides the quantized model; stored inside it and in its evaluation record."""

    backend: str  # the backend that quantizes (and runs) it
    format: str  # the backend's format: "QDQ", "FX", "IR", "TFLite"...
    dtype: str  # activations: "int8" or "uint8"; names the model's data type
    weight_dtype: str
    per_channel: bool | None  # None until the model decides: per-channel where it has depthwise convolutions (quantize.resolve_model_defaults)
    method: str
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
    # The stem (the layers the image enters): "float" or "int8"; None until measured (services/make/stem.py),
    # with the output SQNR its int8 weights alone gave.
    stem: str | None = None
    stem_sqnr_db: float | None = None
    # Weight rounding: "learned" (codes and biases refined layer by layer, transforms/rounding.py) or "nearest";
    # None until measured on held-out calibration images, with the image SQNR (metrics.image_sqnr_db) of each there.
    rounding: str | None = None
    rounding_nearest_db: float | None = None
    rounding_learned_db: float | None = None
    # `--method auto`: each activation range tried (method, percentile) and the image SQNR it gave on held-out
    # calibration images; `method` and `percentile` then hold the one kept.
    method_sqnr_db: tuple[tuple[str, float | None, float | None], ...] = ()
    # Where those nearest-rounded models preferred a percentile to MinMax, both again after learned rounding (the same
    # triples, for the rounding each kept): the percentile stays only where it still wins by METHOD_MARGIN_DB.
    method_rounded_db: tuple[tuple[str, float | None, float | None], ...] = ()
    # `--method auto` then searches each activation scale: "searched" where that brought the output closer to FP32 on
    # held-out calibration images by METHOD_MARGIN_DB, else "calibrated"; None where no search ran. With both figures.
    ranges: str | None = None
    ranges_calibrated_db: float | None = None
    ranges_searched_db: float | None = None
    # Where the overflow fix was judged (overflow.JUDGED): each fix tried and the image SQNR it gave on held-out
    # calibration images (nearest rounding, the method kept); all-layers kept unless first-layer is METHOD_MARGIN_DB closer.
    overflow_fix_db: tuple[tuple[str, float | None], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The settings as a model and its records store them: the backend's options beside the common fields."""
        stored = asdict(self)
        stored.pop("options")
        return {**stored, **self.options.stored()}


def per_image_range(lows: np.ndarray, highs: np.ndarray, percentile: float) -> tuple[float, float]:
    """`--method per-image`: an activation's range from each calibration image's own smallest (`lows`) and largest
    (`highs`) value, the `percentile`-th percentile over the images of the largest and likewise of the smallest."""
    return float(np.percentile(lows, 100.0 - percentile)), float(np.percentile(highs, percentile))


def held_out_mask(count: int) -> np.ndarray:
    """Which of `count` calibration images are held out: every HELD_OUT_EVERY-th, at most HELD_OUT_MAX."""
    mask = np.zeros(count, bool)
    mask[np.arange(HELD_OUT_EVERY - 1, count, HELD_OUT_EVERY)[:HELD_OUT_MAX]] = True
    return mask


def held_out_split(calibration: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(held-out images, the rest): the held_out_mask images judge choices made on the rest (which leaves out
    every HELD_OUT_EVERY-th image, held out or not)."""
    rest = np.delete(calibration, np.arange(HELD_OUT_EVERY - 1, len(calibration), HELD_OUT_EVERY), axis=0)
    return calibration[held_out_mask(len(calibration))], rest


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


def _fast_when_u8s8(settings: QuantizationSettings) -> bool:
    return settings.dtype == "uint8" and settings.weight_dtype == "int8"


@dataclass(frozen=True)
class Quantizer:
    """A backend's quantizing side: how it quantizes, what it takes and decides, and how it is tuned."""

    quantize: Callable[..., QuantizedFile]  # (onnx model, output, settings, calibration inputs, stored metadata, progress=)
    methods: tuple[str, ...] = ("minmax",)  # its calibration methods; the first is the default
    per_channel: bool = True  # its default weight granularity
    overflow_fixes: tuple[str, ...] = (FIRST_LAYER, *[fix for fix in OVERFLOW_FIXES if fix != FIRST_LAYER])  # the first is the default
    clamped_overflow_fix: str | None = None  # its default instead for a model with clamped activations (ReLU6)
    # For other models: all-layers or first-layer judged on held-out calibration images (overflow.JUDGED), not the first.
    judges_overflow_fix: bool = False
    speed_target: dict[str, Any] = field(default_factory=dict)  # what `--target speed` sets for it
    speed_by_default: bool = False  # a plain `quantize` (no type or target given) gets the speed target: measured as faithful (docs)
    options: type[BackendOptions] = BackendOptions  # the settings only it takes, with its rules on the common ones
    describe: Callable[[dict[str, Any]], str] | None = None  # its settings in a few words (else the common description)
    overflow_words: Callable[[dict[str, Any]], dict[str, str]] = lambda _settings: {}  # how a model's settings keep each fix, if not the common words
    output_name: Callable[[str, QuantizationSettings], str] | None = None  # default output file name for a model's stem
    float_stem: bool = True  # whether it can leave the stem in float (`QuantizationSettings.stem`)
    learned_rounding: bool = False  # whether its quantize refines the weights' rounding (`QuantizationSettings.rounding`)
    int4_weights: bool = False  # whether it writes 4-bit weights (`--weight-dtype int4`)
    fast_on_x86: Callable[[QuantizationSettings], bool] = _fast_when_u8s8  # its x86 fast configuration
    # Tuning: `tune_refused` says why tune does not search it (and what to use instead); `tune_grid` gives
    # its own first-stage candidates (make_settings' options), else the common grid of `tune_methods` x
    # `granularities` x weight types; float layers come from `float_layers` (each tried alone) if it has
    # its own way, else from the ONNX sensitivity ranking, or not at all without `leaves_layers_float`.
    tune_refused: str = ""
    tune_grid: Callable[[str, tuple[str, ...]], list[dict[str, Any]]] | None = None
    tune_methods: tuple[str, ...] | None = None  # searched by default (else all its methods)
    granularities: tuple[bool, ...] = (True, False)  # per-channel, per-tensor: what it can do
    leaves_layers_float: bool = True
    float_layers: Callable[[Any], list[str]] | None = None


@dataclass(frozen=True)
class Runtime:
    """A backend's running side: how it loads a model and how it runs."""

    load: Callable[[Path, RunOptions], LoadedModel]
    settings: str = ""  # how ptq runs it, for benchmark records
    runs_suffixes: tuple[str, ...] = ()  # other backends' files it also runs when asked (`--runtime`)
    precisions: tuple[str, ...] = ()  # its inference precision hints; the first is the default
    spins_when_idle: bool = False  # its idle threads spin after a run: benchmarked apart from the others
    microcontroller: bool = False  # runs the kernels a microcontroller runs: `ptq run` scores every file it takes on it too


@dataclass(frozen=True)
class Int8Paths:
    """A runtime whose x86 int8 kernels differ between CPUs with and without VNNI: whether the path this CPU does
    not take can be scored here for a model made with an overflow fix (`reaches(overflow_fix, path)`), and how
    (`basis(model file, its settings, path)`: words for the record, or EMULATE; a PtqError where it cannot)."""

    reaches: Callable[[str | None, str], bool]
    basis: Callable[[Path, dict | None, str], str]
    # Where a proof gives the saturating path on a VNNI CPU: scored with the runtime's kernels for CPUs without VNNI
    # (RunOptions.saturating_int8), which compute there what they compute here; else this CPU's own compute the same.
    proof_loads_saturating_kernels: bool = False


@dataclass(frozen=True)
class Backend:
    """One row of the backend table: a file kind, its runtime, and, for most, its quantizer and int8 paths. A
    runtime-only row has no quantizer; a quantizer whose models run elsewhere does not exist (each backend runs
    what it writes)."""

    name: str
    suffixes: tuple[str, ...]  # model files it writes (the first) and reads
    sniff: Callable[[bytes], bool]  # whether a file's first bytes are this backend's
    runtime: Runtime
    quantizer: Quantizer | None = None
    int8_paths: Int8Paths | None = None  # where its x86 int8 kernels differ by CPU
    format: str = ""  # what its models are, in a word (QDQ, FX, IR, TFLite)
    summary: str = ""  # what it does, for --backend's help
    # The declared input (with the size --input-size gives a model that leaves it open) without running the model, where that is cheap.
    read_input: Callable[[Path, tuple[int, int] | None], ModelInput] | None = None
    available: Callable[[], bool] = lambda: True
    companion_suffixes: tuple[str, ...] = ()  # files kept beside its model file, part of the model (an IR's .bin)
    catch_all: bool = False  # takes any file no other backend claims (and then says if it is not its kind)
    suffix_decides: bool = False  # a file with its suffix is its kind whatever its bytes

    @property
    def suffix(self) -> str:
        return self.suffixes[0]

    @property
    def quantizes(self) -> Quantizer:
        """Its quantizer; a PtqError for a runtime-only row."""
        if self.quantizer is None:
            raise PtqError(f"--backend {self.name}: runs models but does not quantize them")
        return self.quantizer

    def default_output(self, model: Path, settings: QuantizationSettings, directory: Path) -> Path:
        stem, output_name = Path(model).stem, self.quantizes.output_name
        name = output_name(stem, settings) if output_name else f"{stem}_{self.name}_{settings.dtype}{self.suffix}"
        return Path(directory) / name

    def tuned_output(self, model: Path, dtype: str) -> Path:
        name = self.default_output(model, _bare(self, dtype), Path(model).parent).name
        return Path(model).with_name(f"{Path(name).stem}_tuned{self.suffix}")


def _bare(backend: Backend, dtype: str) -> QuantizationSettings:
    quantizer = backend.quantizes
    return QuantizationSettings(backend.name, backend.format, dtype, dtype, quantizer.per_channel, quantizer.methods[0], None, True,
                                options=quantizer.options())


READ_FROM_METADATA: Any = object()  # finish_load's quantization: the settings stored in the model


def finish_load(path: Path, backend: Backend, options: RunOptions, *, described: ModelInput, predict: Callable[[np.ndarray], np.ndarray],  # noqa: PLR0913  keyword-only: what each backend's load read, by name
                dtype: str, size_bytes: int, sha256: str, stored: dict[str, str], declared_classes: int | None,
                quantization: dict | None = READ_FROM_METADATA, note: str | None = None, arena_bytes: int | None = None) -> LoadedModel:
    """Every backend's load ends here: the model run once on a probe image (its output checked against the
    class count it declares), the preprocessing resolved, and its ModelInfo."""
    probe = predict(np.zeros(described.shape(described.batch or 1), np.float32))[:1]
    if probe.ndim != 2 or probe.shape[0] != 1 or (declared_classes is not None and probe.shape[1] != declared_classes):
        raise PtqError(f"{path}: outputs {list(probe.shape)} for one image, not 1 x {declared_classes or 'classes'} class scores (as its output declares)")
    preprocessing = inputs.resolve(options.flags, inputs.from_metadata(stored.get(inputs.INPUT_METADATA_KEY), path))
    if quantization is READ_FROM_METADATA:
        quantization = metadata_object(path, stored, QUANTIZATION_METADATA_KEY)
    info = ModelInfo(path, backend.name, dtype, quantization, size_bytes, sha256, metadata_object(path, stored, PRUNING_METADATA_KEY),
                     stored.get(SOURCE_METADATA_KEY), options.precision, arena_bytes)
    return LoadedModel(info, predict, described, preprocessing, int(probe.shape[1]), note)


def short_node(name: str) -> str:
    """tf2onnx names a layer's nodes model_1/conv2d_1/BiasAdd: the layer is the middle part. OpenVINO
    names a convolution split from its bias <node>/WithoutBiases."""
    name = name.removesuffix("/WithoutBiases")
    return name.split("/")[-2] if "/" in name else name


def float_parts(settings: dict) -> list[str]:
    """The layers a model keeps in float, in words: its float stem, then the named layers."""
    parts = ["float stem"] if settings.get("stem") == "float" else []
    if settings.get("float_nodes"):
        parts.append("float: " + ", ".join(short_node(name) for name in settings["float_nodes"]))
    return parts


def describe_settings(settings: dict, types: str | None = None) -> str:
    """The common description of stored settings (a dict: records hold JSON), e.g. "QDQ a:uint8 w:int8,
    per-channel, percentile 99.999, 1000 samples, float: conv2d_1"; `types` for a backend that names them
    otherwise."""
    types = types or f"a:{settings['dtype']} w:{settings.get('weight_dtype', settings['dtype'])}"
    if settings.get("made_by"):  # read from the graph of a model ptq did not make: no calibration to name
        return f"{settings.get('format', 'QDQ')} {types}, {'per-channel' if settings.get('per_channel') else 'per-tensor'} (made by {settings['made_by']})"
    parts = [
        f"{settings.get('format', 'QDQ')} {types}",
        "per-channel" if settings.get("per_channel") else "per-tensor",
        settings.get("method", "?") + (f" {settings['percentile']:g}" if settings.get("percentile") else ""),
        f"{settings.get('calibration_samples', '?')} samples",
    ]
    parts += float_parts(settings)
    if settings.get("ranges") == "searched":
        parts.append("searched ranges")
    if settings.get("rounding") == "learned":
        parts.append("learned rounding")
    if settings.get("space_to_depth_convs"):
        parts.append("space-to-depth: " + ", ".join(short_node(rewrite["node"]) for rewrite in settings["space_to_depth_convs"]))
    return ", ".join(parts)
