"""Accuracy-budget tuning of static quantization (onnxruntime, PyTorch, NNCF), decided on the validation split only.

The search, in three stages, each starting from the best candidate so far:
1. calibration: weight type x per-channel/per-tensor x method (minmax, percentile at several points);
   for NNCF, its preset x bias correction;
2. calibration size: the same settings on stratified subsets of the calibration set;
3. float layers: the layers `sensitivity` ranks worst left in float, one more at a time; for NNCF, each
   layer left in float in turn (its ignored scope), then the best of those together.
Then the smallest and fastest candidate within the budget is kept: fewest float layers first, then the
x86 fast path (uint8 activations x int8 weights; NNCF's performance preset), then the one closest to FP32
by output SQNR on the validation split. Accuracy decides the budget only: within it, differences are a handful of the 5,000
validation images (on training images, which the model has fit), while the SQNR of all ten scores of
every image is a steady measure of what "near-lossless" asks, behaving like FP32. Each stage also starts
from the candidate with the best SQNR. The test set is never read here (see services/validation.py);
`ptq evaluate` judges the chosen model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ptq_cli import backends
from ptq_cli.backends.base import Quantizer
from ptq_cli.errors import PtqError
from ptq_cli.guards.atomic import check_outputs
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.metrics import sqnr_db
from ptq_cli.model_file import read_onnx
from ptq_cli.services.executor import HERE, Executor, Workers, executor
from ptq_cli.services.make.calibration import CalibrationSet, DataSource, stratified_subset
from ptq_cli.services.make.quantize import SourceModel, calibration_inputs, load_source, quantize_source, resolve_settings, with_calibration
from ptq_cli.services.models import load_model
from ptq_cli.services.progress import ProgressBar, ProgressCallback, Steps, no_progress_bar
from ptq_cli.services.quant_settings import QuantizationSettings, check_stem, describe_quantization, make_settings
from ptq_cli.services.records import model_key, write_record
from ptq_cli.services.study.candidates import TUNING_DIR, CandidateInputs, ScoreStore, inputs_for, score_candidates, scores_folder
from ptq_cli.services.study.sensitivity import layer_sensitivity, quantizable_layers
from ptq_cli.services.study.validation import ValidationSet, calibration_and_validation, labels_from_fp32, score
from ptq_cli.settings import RESULTS_DIR, VALIDATION_PER_CLASS
from ptq_cli.transforms.graph import preprocessed

PERCENTILES = (99.9, 99.95, 99.99, 99.999)
CALIBRATION_SUBSETS = (25, 50)  # per class, besides the full set
MAX_FLOAT_LAYERS = 2
# A model with float layers must stay an 8-bit model: at most this much larger than the same settings
# with every layer quantized (with onnxruntime's int8 ResNet8, about 40% of the FP32 file).
FLOAT_GROWTH_LIMIT = 0.15



@dataclass(frozen=True)
class Candidate:
    stage: str  # "method", "size" (calibration subset) or "float" (layers left in float)
    settings: QuantizationSettings
    validation_accuracy: float
    accuracy_drop: float  # points below FP32 on the validation split
    output_sqnr_db: float  # the model's scores against FP32's on the validation split
    size_bytes: int
    size_ratio: float  # of the FP32 file
    within_budget: bool
    rejected: str | None = None  # why it cannot be kept even if within budget

    @property
    def label(self) -> str:
        return describe(self.settings)


@dataclass(frozen=True)
class TuneResult:
    model: Path
    dtype: str
    max_drop: float
    fp32_validation_accuracy: float
    validation: dict
    candidates: list[Candidate]
    chosen: Candidate
    met_budget: bool
    reason: str
    output: Path
    record: Path


def describe(settings: QuantizationSettings) -> str:
    return describe_quantization(settings.as_dict())


def weight_dtypes(dtype: str) -> tuple[str, ...]:
    # onnxruntime has no int8-activation x uint8-weight kernels; uint8 activations take either.
    return ("int8",) if dtype == "int8" else ("int8", "uint8")


def fast_on_x86(settings: QuantizationSettings) -> bool:
    """The backend's x86 fast configuration (onnxruntime's VNNI kernels: uint8 activations x int8 weights)."""
    return backends.backend(settings.backend).quantizes.fast_on_x86(settings)


def calibration_grid(backend: str, dtype: str, methods: tuple[str, ...], granularities: tuple[bool, ...]) -> list[QuantizationSettings]:
    """The first stage's candidates: each library's own calibration choices."""
    quantizer = backends.backend(backend).quantizes
    if quantizer.tune_grid is not None:
        return [make_settings(dtype, backend, **options) for options in quantizer.tune_grid(dtype, methods)]
    return [
        make_settings(dtype, backend, weight_dtype=weights, per_channel=per_channel, method=method, percentile=percentile)
        for weights in weight_dtypes(dtype)
        for per_channel in granularities
        for method in methods
        for percentile in (PERCENTILES if method == "percentile" else (None,))
    ]


def choose(candidates: list[Candidate], max_drop: float) -> tuple[Candidate, bool, str]:
    """(chosen, budget met, why). Within the budget: fewest float layers, then the x86 fast path, then the
    closest to FP32 by output SQNR; with none within it, the most accurate."""
    keep = [candidate for candidate in candidates if candidate.rejected is None]
    eligible = [candidate for candidate in keep if candidate.within_budget]
    if eligible:
        chosen = min(eligible, key=lambda c: (len(c.settings.float_nodes), not fast_on_x86(c.settings), -c.output_sqnr_db, -c.validation_accuracy))
        return chosen, True, (
            f"{len(eligible)} of {len(candidates)} candidates are within {max_drop:g} points of FP32 on the validation split; "
            "kept the one with the fewest float layers, on the x86 fast path if any, then the closest to FP32 (output SQNR)"
        )
    chosen = max(keep, key=lambda c: (c.validation_accuracy, c.output_sqnr_db))
    return chosen, False, (
        f"no candidate is within {max_drop:g} points of FP32 on the validation split; "
        f"kept the most accurate, {chosen.accuracy_drop:.2f} points below FP32"
    )


def check_backend(backend: str) -> None:
    quantizer = backends.backend(backend).quantizes
    if quantizer.tune_refused:
        raise PtqError(quantizer.tune_refused)


@dataclass
class _Search:
    """One tuning search's state: the source, FP32's validation score, the candidates tried so far, and the
    calibration sets and prepared inputs each was calibrated on; the candidates of a stage are scored by the executor."""

    source: SourceModel
    validation: ValidationSet
    fp32: Any  # FP32's validation score (validation.Score)
    fp32_size: int
    max_drop: float
    step: Callable[[], None]
    executor: Executor
    inputs: CandidateInputs
    store: ScoreStore | None  # the candidates scored before, by what they measured
    calibration_sets: dict[int, CalibrationSet] = field(default_factory=dict)
    subsets: dict[int, int | None] = field(default_factory=dict)  # calibration samples -> per class (None: the whole set)
    prepared: dict[int, Any] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)

    def stages(self, grid: list[QuantizationSettings], subsets: list[int], quantizer: Quantizer, layers,  # noqa: PLR0913,PLR0917  the search space, one part each
               max_float_layers: int, flags: PreprocessingFlags | None) -> None:
        """The search in its stages: each setting of the grid, the leader's on smaller calibration subsets, then
        the most sensitive layers left in float, one more at a time."""
        self.try_candidates("method", grid)
        leader, _ = self.best()
        for per_class in subsets:
            self.try_candidates("size", [leader.settings], per_class)
        if max_float_layers:
            self.float_stage(quantizer, layers, max_float_layers, flags)

    def try_candidates(self, stage: str, grid: list[QuantizationSettings], per_class: int | None = None,
                       quantized_size: int | None = None) -> list[Candidate]:
        """The settings of `grid` on the calibration set (or its subset of `per_class` images a class), scored by
        the executor. `quantized_size`: for candidates with float layers, the size of their settings with none."""
        calibration_set = self.inputs.calibration if per_class is None else stratified_subset(self.inputs.calibration, per_class)
        samples = len(calibration_set.labels)
        self.calibration_sets.setdefault(samples, calibration_set)
        self.subsets.setdefault(samples, per_class)
        if samples not in self.prepared:
            self.prepared[samples] = calibration_inputs(self.source, calibration_set)
        resolved = [resolve_settings(self.source, with_calibration(settings, calibration_set), self.prepared[samples]) for settings in grid]
        scored = score_candidates(self.executor, [(settings, per_class) for settings in resolved], self.inputs, self.store, done=lambda *_: self.step())
        made = [self._candidate(stage, settings, size, quantized, quantized_size) for settings, (size, quantized) in zip(resolved, scored, strict=True)]
        self.candidates += made
        return made

    def _candidate(self, stage: str, settings: QuantizationSettings, size: int, quantized: Any,  # noqa: PLR0913,PLR0917  one scored candidate, part by part
                   quantized_size: int | None) -> Candidate:
        drop = round(self.fp32.accuracy - quantized.accuracy, 4)
        too_large = quantized_size is not None and size > quantized_size * (1 + FLOAT_GROWTH_LIMIT)
        candidate = Candidate(
            stage=stage,
            settings=settings,
            validation_accuracy=quantized.accuracy,
            accuracy_drop=drop,
            output_sqnr_db=round(sqnr_db(self.fp32.outputs, quantized.outputs), 2),
            size_bytes=size,
            size_ratio=round(size / self.fp32_size, 4),
            within_budget=drop <= self.max_drop,
            rejected=f"{size / quantized_size - 1:+.0%} over the fully quantized model, limit +{FLOAT_GROWTH_LIMIT:.0%}"
            if too_large and quantized_size else None,
        )
        return candidate

    def best(self) -> tuple[Candidate, CalibrationSet]:
        """The candidate closest to FP32 so far (output SQNR): the next stage starts from it."""
        keep = [candidate for candidate in self.candidates if candidate.rejected is None]
        top = max(keep, key=lambda candidate: (candidate.output_sqnr_db, candidate.validation_accuracy))
        return top, self.calibration_sets[top.settings.calibration_samples]

    def float_stage(self, quantizer: Quantizer, layers: list[Any], max_float_layers: int, flags: PreprocessingFlags | None) -> None:
        """Layers left in float, one more at a time, from the best candidate so far."""
        leader, calibration = self.best()
        per_class = self.subsets[len(calibration.labels)]
        worst: list[str]
        first = 1
        if quantizer.float_layers is not None:
            # A backend with no per-layer sensitivity of its own (NNCF, outside its accuracy-control loop):
            # each layer is left in float in turn, and the best of those are then left in float together.
            alone = self.try_candidates("float", [replace(leader.settings, float_nodes=(str(layer),)) for layer in layers], per_class, leader.size_bytes)
            worst, first = [candidate.settings.float_nodes[0] for candidate in sorted(alone, key=lambda c: -c.output_sqnr_db)], 2
        else:
            ranking = layer_sensitivity(self.source, leader.settings, calibration, self.validation, progress=lambda *_: self.step(), flags=flags,
                                        runs=self.executor, scores=self.store.folder if self.store else None)
            worst = [str(layer.node) for layer in ranking.layers]
        counts = range(first, min(max_float_layers, len(worst)) + 1)
        self.try_candidates("float", [replace(leader.settings, float_nodes=tuple(worst[:count])) for count in counts], per_class, leader.size_bytes)


def _float_layers(quantizer: Quantizer, model: Any, workdir: Path, max_float_layers: int) -> tuple[list[Any], int]:
    """(the layers the float stage may leave in float, the steps it takes)."""
    if not max_float_layers:
        return [], 0
    if quantizer.float_layers is not None:
        named: list[Any] = quantizer.float_layers(model)
        return named, len(named) - 1
    ranked: list[Any] = quantizable_layers(preprocessed(model, workdir))
    return ranked, len(ranked)


def _checked_search_space(quantizer: Quantizer, methods: tuple[str, ...] | None, granularities: tuple[bool, ...], max_drop: float,
                          max_float_layers: int) -> tuple[tuple[str, ...], tuple[bool, ...], int]:
    if max_drop < 0:
        raise PtqError(f"--max-drop: must be at least 0 points, got {max_drop}")
    if max_float_layers < 0:
        raise PtqError(f"--max-float-layers: must be at least 0, got {max_float_layers}")
    granularities = tuple(granularity for granularity in granularities if granularity in quantizer.granularities) or quantizer.granularities
    return methods or quantizer.tune_methods or quantizer.methods, granularities, max_float_layers if quantizer.leaves_layers_float else 0


def tune(  # noqa: PLR0913,PLR0917  the options of `ptq tune`, one each
    model_path: Path,
    dtype: str,
    max_drop: float,
    calibration: CalibrationSet,
    validation: ValidationSet,
    output: Path,
    results_dir: Path,
    methods: tuple[str, ...] | None = None,
    granularities: tuple[bool, ...] = (True, False),
    max_float_layers: int = MAX_FLOAT_LAYERS,
    progress: ProgressCallback | None = None,
    backend: str = backends.DEFAULT,
    flags: PreprocessingFlags | None = None,
    stem: str | None = None,
    workers: Workers = HERE,
) -> TuneResult:
    """Search, choose, write the chosen model and the record. The PyTorch backend searches granularity x
    observer (histogram, minmax) and calibration size; it has no float-layer stage (FX quantizes all).
    NNCF (openvino) searches preset x bias correction, calibration size and its ignored scope. Each stage's
    candidates are scored by `workers` (here, or as tasks on Ray); the chosen model is written here."""
    model_path, output = Path(model_path), Path(output)
    check_backend(backend)
    row = backends.backend(backend)
    methods, granularities, max_float_layers = _checked_search_space(row.quantizes, methods, granularities, max_drop, max_float_layers)
    record = Path(results_dir) / TUNING_DIR / f"{model_key(output)}.json"
    check_outputs([("--output", output, (row.suffix,)), ("--results-dir", record, (".json",))], [model_path])
    source = load_source(model_path, flags or PreprocessingFlags())
    # Without labels, validation scores are the top-1 agreement with FP32 (its own top-1 classes as labels).
    validation, fp32 = labels_from_fp32(validation, score(load_model(model_path, None, flags), validation))
    stem = check_stem(stem, backend)
    grid = [replace(settings, stem=stem) for settings in calibration_grid(backend, dtype, methods, granularities)]
    subsets = [size for size in CALIBRATION_SUBSETS if size < calibration.samples_per_class]

    with tempfile.TemporaryDirectory(prefix="ptq-tune-") as workdir, executor(workers) as runs:
        inputs = inputs_for(source, flags, calibration, validation, runs.task_threads)
        layers, float_steps = _float_layers(row.quantizes, source.model, Path(workdir), max_float_layers)
        search = _Search(source, validation, fp32, model_path.stat().st_size, max_drop,
                         Steps(len(grid) + len(subsets) + max_float_layers + float_steps, progress), runs, inputs,
                         ScoreStore.for_search(scores_folder(results_dir), inputs))
        search.stages(grid, subsets, row.quantizes, layers, max_float_layers, flags)
        chosen, met_budget, reason = choose(search.candidates, max_drop)
        validation_summary = {**validation.describe(), "accuracy": chosen.validation_accuracy, "fp32_accuracy": fp32.accuracy}
        quantize_source(source, output, chosen.settings, search.calibration_sets[chosen.settings.calibration_samples],
                        metadata={"validation": validation_summary, "tuned_max_drop": max_drop})

    result = TuneResult(model_path, dtype, max_drop, fp32.accuracy, validation.describe(), search.candidates, chosen, met_budget,
                        reason, output, record)
    write_record(record, result)
    return result


def default_output(model: Path, dtype: str, backend: str = backends.DEFAULT) -> Path:
    """models/resnet8.onnx -> models/resnet8_int8_tuned.onnx, resnet8_pytorch_int8_tuned.pt, ..."""
    return backends.backend(backend).tuned_output(Path(model), dtype)


@dataclass(frozen=True)
class TuneRequest:
    """What `ptq tune` asks: search the settings of `backend` for `dtype` within `max_drop` points of FP32 on the
    validation split drawn beside the calibration set, and write the chosen model."""

    model: Path
    source: DataSource  # the images and how they are fed
    dtype: str = "int8"
    backend: str = backends.DEFAULT
    max_drop: float = 0.05
    calibration_file: Path | None = None  # a `ptq calibrate` file, else drawn from the data
    validation_per_class: int = VALIDATION_PER_CLASS
    output: Path | None = None  # None: default_output
    results_dir: Path = RESULTS_DIR
    methods: tuple[str, ...] | None = None
    granularities: tuple[bool, ...] = (True, False)
    max_float_layers: int = MAX_FLOAT_LAYERS
    stem: str | None = None
    workers: Workers = HERE


def run(request: TuneRequest, progress_bar: ProgressBar = no_progress_bar) -> TuneResult:
    """The request checked (the model, the backend) before any image is read, the calibration and validation sets
    drawn, then `tune`; `progress_bar(description)` gives each phase's progress callback."""
    read_onnx(request.model)
    check_backend(request.backend)
    calibration, validation = calibration_and_validation(request.model, request.source, request.calibration_file, request.validation_per_class,
                                                         progress_bar)
    output = request.output or default_output(request.model, request.dtype, request.backend)
    with progress_bar(f"Tuning {request.dtype} ({request.backend}, {request.workers.describe()})") as progress:
        return tune(request.model, request.dtype, request.max_drop, calibration, validation, output, request.results_dir,
                    methods=request.methods, granularities=request.granularities, max_float_layers=request.max_float_layers,
                    progress=progress, backend=request.backend, flags=request.source.flags, stem=request.stem, workers=request.workers)
