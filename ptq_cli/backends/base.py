"""What every backend shares, and the row each one fills in: the backend table's vocabulary.

A backend quantizes (its `quantize`) and a runtime executes (its `load`); most backends are both. Each
module in ptq_cli/backends exports one `BACKEND`, a `Backend`; services loop over the table and never
test a backend's name. This module imports no backend module and no service (model_file.py and lower only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import inputs
from ptq_cli.datasets.base import convert_channels, resize
from ptq_cli.errors import PtqError
from ptq_cli.inputs import ModelInput, Preprocessing
from ptq_cli.model_file import (  # noqa: F401  the metadata keys, named here for the backends
    KERAS_SOURCE_METADATA_KEY,
    PRUNING_METADATA_KEY,
    QUANTIZATION_METADATA_KEY,
    SOURCE_METADATA_KEY,
    metadata_object,
)
from ptq_cli.quantize.overflow import FIRST_LAYER, OVERFLOW_FIXES
from ptq_cli.quantize.settings import BackendOptions, QuantizationSettings, QuantizeCall, QuantizedFile
from ptq_cli.x86.paths import Int8Paths


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


def _fast_when_u8s8(settings: QuantizationSettings) -> bool:
    return settings.dtype == "uint8" and settings.weight_dtype == "int8"


@dataclass(frozen=True)
class Quantizer:
    """A backend's quantizing side: how it quantizes, what it takes and decides, and how it is tuned."""

    quantize: Callable[[QuantizeCall], QuantizedFile]  # the model, its calibration inputs, settings, output, metadata and the service's aids
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
    keeps_time_budget: bool = False  # whether its quantize keeps to `--time-budget` (QuantizeCall.deadline; quantize/budget.py)
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


# What an op's time is spent on, as a runtime's profiler says (OpTime.kind): an integer kernel, a float one, converting
# between float and 8-bit (QuantizeLinear/DequantizeLinear, a standalone FakeQuantize), or moving data (layouts, reorders).
INT8_KERNEL, FLOAT_KERNEL, CONVERT, LAYOUT = "int8", "float", "convert", "layout"
OP_KINDS = (INT8_KERNEL, FLOAT_KERNEL, CONVERT, LAYOUT)


@dataclass(frozen=True)
class OpTime:
    """One kind of op as the runtime ran it (after its own fusions): its name there, what it computes in, how many
    nodes, and their time in one run, summed."""

    op: str  # e.g. onnxruntime's QLinearConv, OpenVINO's Convolution
    kind: str  # one of OP_KINDS
    nodes: int
    milliseconds: float


@dataclass(frozen=True)
class RuntimeProfile:
    """Where a model's time goes on its runtime (Runtime.profile): the ops by time, and how many of its convolutions
    (and matrix products) run on integer kernels."""

    ops: tuple[OpTime, ...]  # the most time first
    convolutions: int  # convolutions and matrix products, as the runtime runs them
    int8_convolutions: int
    batch_size: int
    runs: int  # the runs averaged (after a warm-up run)
    source: str  # how it was measured, e.g. "onnxruntime's profiler (SessionOptions.enable_profiling), 1 intra-op thread"

    @classmethod
    def from_stored(cls, stored: dict) -> RuntimeProfile:
        """The profile as a record holds it (dataclasses.asdict)."""
        return cls(**{**stored, "ops": tuple(OpTime(**op) for op in stored.get("ops", ()))})

    def share(self, kind: str) -> float:
        """The fraction of the run's time in ops of `kind`."""
        total = sum(op.milliseconds for op in self.ops)
        return sum(op.milliseconds for op in self.ops if op.kind == kind) / total if total > 0 else 0.0


@dataclass(frozen=True)
class Runtime:
    """A backend's running side: how it loads a model and how it runs."""

    load: Callable[[Path, RunOptions], LoadedModel]
    # Where the time goes: (model, options, a batch in its input format, runs) -> the profile, where its runtime has a profiler.
    profile: Callable[[Path, RunOptions, np.ndarray, int], RuntimeProfile] | None = None
    settings: str = ""  # how ptq runs it, for benchmark records
    runs_suffixes: tuple[str, ...] = ()  # other backends' files it also runs when asked (`--runtime`)
    precisions: tuple[str, ...] = ()  # its inference precision hints; the first is the default
    spins_when_idle: bool = False  # its idle threads spin after a run: benchmarked apart from the others
    microcontroller: bool = False  # runs the kernels a microcontroller runs: `ptq run` scores every file it takes on it too


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
