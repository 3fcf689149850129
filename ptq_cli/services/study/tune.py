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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ptq_cli import backends
from ptq_cli.atomic import check_outputs
from ptq_cli.errors import PtqError
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.services.calibration import CalibrationSet, stratified_subset
from ptq_cli.services.measure.records import model_key, write_record
from ptq_cli.services.measure.sensitivity import layer_sensitivity, preprocessed, quantizable_layers
from ptq_cli.services.measure.validation import ValidationSet, score, sqnr_db
from ptq_cli.services.models import load_model
from ptq_cli.services.progress import ProgressCallback, Steps
from ptq_cli.services.quant_settings import QuantizationSettings, describe_quantization, make_settings
from ptq_cli.services.quantize import SourceModel, calibration_inputs, load_source, quantize_source, with_calibration

PERCENTILES = (99.9, 99.95, 99.99, 99.999)
CALIBRATION_SUBSETS = (25, 50)  # per class, besides the full set
MAX_FLOAT_LAYERS = 2
# A model with float layers must stay an 8-bit model: at most this much larger than the same settings
# with every layer quantized (with onnxruntime's int8 ResNet8, about 40% of the FP32 file).
FLOAT_GROWTH_LIMIT = 0.15
TUNING_DIR = "tuning"  # under the results directory; not read as evaluation records



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
    return describe_quantization(asdict(settings))


def weight_dtypes(dtype: str) -> tuple[str, ...]:
    # onnxruntime has no int8-activation x uint8-weight kernels; uint8 activations take either.
    return ("int8",) if dtype == "int8" else ("int8", "uint8")


def fast_on_x86(settings: QuantizationSettings) -> bool:
    """The backend's x86 fast configuration (onnxruntime's VNNI kernels: uint8 activations x int8 weights)."""
    return backends.backend(settings.backend).fast_on_x86(settings)


def calibration_grid(backend: str, dtype: str, methods: tuple[str, ...], granularities: tuple[bool, ...]) -> list[QuantizationSettings]:
    """The first stage's candidates: each library's own calibration choices."""
    row = backends.backend(backend)
    if row.tune_grid is not None:
        return [make_settings(dtype, backend, **options) for options in row.tune_grid(dtype, methods)]
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
    row = backends.backend(backend)
    if row.tune_refused or row.quantize is None:
        raise PtqError(row.tune_refused or f"--backend {backend}: runs models but does not quantize them")


def tune(
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
    backend: str = "onnxruntime",
    flags: PreprocessingFlags | None = None,
) -> TuneResult:
    """Search, choose, write the chosen model and the record. The PyTorch backend searches granularity x
    observer (histogram, minmax) and calibration size; it has no float-layer stage (FX quantizes all).
    NNCF (openvino) searches preset x bias correction, calibration size and its ignored scope."""
    model_path, output = Path(model_path), Path(output)
    check_backend(backend)
    row = backends.backend(backend)
    methods = methods or row.tune_methods or row.methods
    if not row.leaves_layers_float:
        max_float_layers = 0
    granularities = tuple(granularity for granularity in granularities if granularity in row.granularities) or row.granularities
    if max_drop < 0:
        raise PtqError(f"--max-drop: must be at least 0 points, got {max_drop}")
    if max_float_layers < 0:
        raise PtqError(f"--max-float-layers: must be at least 0, got {max_float_layers}")
    record = Path(results_dir) / TUNING_DIR / f"{model_key(output)}.json"
    check_outputs([("--output", output, (row.suffix,)), ("--results-dir", record, (".json",))], [model_path])
    source = load_source(model_path, flags or PreprocessingFlags())
    model = source.model
    prepared = {len(calibration.labels): calibration_inputs(source, calibration)}
    fp32_size = model_path.stat().st_size
    fp32 = score(load_model(model_path, None, flags), validation)
    grid = calibration_grid(backend, dtype, methods, granularities)
    subsets = [size for size in CALIBRATION_SUBSETS if size < calibration.samples_per_class]
    total = len(grid) + len(subsets) + max_float_layers
    candidates: list[Candidate] = []

    with tempfile.TemporaryDirectory(prefix="ptq-tune-") as workdir:
        if row.float_layers is not None:
            layers = row.float_layers(model) if max_float_layers else []
            total += len(layers) - 1 if max_float_layers else 0
        else:
            layers = quantizable_layers(preprocessed(model, Path(workdir)))
            total += len(layers) if max_float_layers else 0

        step = Steps(total, progress)

        def try_candidate(stage: str, settings: QuantizationSettings, calibration_set: CalibrationSet,
                          quantized_size: int | None = None) -> Candidate:
            """`quantized_size`: for a candidate with float layers, the size of its settings with none."""
            settings = with_calibration(settings, calibration_set)
            if len(calibration_set.labels) not in prepared:
                prepared[len(calibration_set.labels)] = calibration_inputs(source, calibration_set)
            size, quantized = _quantize_and_score(source, Path(workdir), settings, calibration_set, validation, prepared[len(calibration_set.labels)])
            drop = round(fp32.accuracy - quantized.accuracy, 4)
            limit = None if quantized_size is None else quantized_size * (1 + FLOAT_GROWTH_LIMIT)
            too_large = limit is not None and size > limit
            candidate = Candidate(
                stage=stage,
                settings=settings,
                validation_accuracy=quantized.accuracy,
                accuracy_drop=drop,
                output_sqnr_db=round(sqnr_db(fp32.outputs, quantized.outputs), 2),
                size_bytes=size,
                size_ratio=round(size / fp32_size, 4),
                within_budget=drop <= max_drop,
                rejected=f"{size / quantized_size - 1:+.0%} over the fully quantized model, limit +{FLOAT_GROWTH_LIMIT:.0%}" if too_large else None,
            )
            candidates.append(candidate)
            step()
            return candidate

        def best() -> tuple[Candidate, CalibrationSet]:
            """The candidate closest to FP32 so far (output SQNR): the next stage starts from it."""
            keep = [candidate for candidate in candidates if candidate.rejected is None]
            top = max(keep, key=lambda candidate: (candidate.output_sqnr_db, candidate.validation_accuracy))
            return top, calibration_sets[top.settings.calibration_samples]

        calibration_sets = {len(calibration.labels): calibration}
        for settings in grid:
            try_candidate("method", settings, calibration)
        leader, _ = best()
        for per_class in subsets:
            subset = stratified_subset(calibration, per_class)
            calibration_sets[len(subset.labels)] = subset
            try_candidate("size", leader.settings, subset)
        leader, leader_calibration = best()
        if max_float_layers and row.float_layers is not None:
            # A backend with no per-layer sensitivity of its own (NNCF, outside its accuracy-control loop):
            # each layer is left in float in turn, and the best of those are then left in float together.
            alone = [try_candidate("float", replace(leader.settings, float_nodes=(layer,)), leader_calibration, leader.size_bytes)
                     for layer in layers]
            worst = [candidate.settings.float_nodes[0] for candidate in sorted(alone, key=lambda c: -c.output_sqnr_db)]
            for count in range(2, min(max_float_layers, len(worst)) + 1):
                try_candidate("float", replace(leader.settings, float_nodes=tuple(worst[:count])), leader_calibration, leader.size_bytes)
        elif max_float_layers:
            ranking = layer_sensitivity(source, leader.settings, leader_calibration, validation, progress=lambda *_: step(), flags=flags)
            worst = [layer.node for layer in ranking.layers]
            for count in range(1, min(max_float_layers, len(worst)) + 1):
                try_candidate("float", replace(leader.settings, float_nodes=tuple(worst[:count])), leader_calibration, leader.size_bytes)

        chosen, met_budget, reason = choose(candidates, max_drop)
        validation_summary = {**validation.describe(), "accuracy": chosen.validation_accuracy, "fp32_accuracy": fp32.accuracy}
        quantize_source(source, output, chosen.settings, calibration_sets[chosen.settings.calibration_samples],
                        metadata={"validation": validation_summary, "tuned_max_drop": max_drop})

    result = TuneResult(model_path, dtype, max_drop, fp32.accuracy, validation.describe(), candidates, chosen, met_budget,
                        reason, output, record)
    write_record(record, result)
    return result


def _quantize_and_score(source: SourceModel, workdir: Path, settings: QuantizationSettings, calibration: CalibrationSet,
                        validation: ValidationSet, prepared):
    """(file size, validation score) of one candidate, quantized with its own backend."""
    path = workdir / f"candidate{backends.backend(settings.backend).suffix}"
    written = quantize_source(source, path, settings, calibration, prepared=prepared)
    return written.size_bytes, score(load_model(path), validation)


def default_output(model: Path, dtype: str, backend: str = "onnxruntime") -> Path:
    """models/resnet8.onnx -> models/resnet8_int8_tuned.onnx, resnet8_pytorch_int8_tuned.pt, ..."""
    return backends.backend(backend).tuned_output(Path(model), dtype)
