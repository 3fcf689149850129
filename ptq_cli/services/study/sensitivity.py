"""Per-layer sensitivity: the error that quantizing one layer alone (everything else in float) introduces.

Measured on the validation split (training images the calibration set does not use), never the test set.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.metrics import sqnr_db
from ptq_cli.model_file import read_onnx
from ptq_cli.quantize.rounding import NEAREST
from ptq_cli.services.executor import HERE, Executor, InProcess, Workers, executor
from ptq_cli.services.make.calibration import CalibrationSet, DataSource
from ptq_cli.services.make.quantize import SourceModel, load_source, with_calibration
from ptq_cli.services.models import load_model
from ptq_cli.services.progress import ProgressBar, ProgressCallback, no_progress_bar
from ptq_cli.services.quant_settings import INT8, QuantizationSettings
from ptq_cli.services.records import write_record
from ptq_cli.services.study.candidates import ScoreStore, inputs_for, score_candidates, scores_folder
from ptq_cli.services.study.validation import ValidationSet, calibration_and_validation, labels_from_fp32, score
from ptq_cli.settings import RESULTS_DIR, VALIDATION_PER_CLASS
from ptq_cli.transforms.graph import preprocessed

# The layers that compute: onnxruntime quantizes these (Relu folds into the preceding layer's output
# range; Transpose and Reshape only move quantized data).
LAYER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "AveragePool", "MaxPool", "Softmax")

SENSITIVITY_DIR = "sensitivity"  # under the results directory; not read as evaluation records


@dataclass(frozen=True)
class LayerSensitivity:
    node: str  # node name in the preprocessed graph: what `--float-node` / tune's float layers name
    op_type: str
    output_sqnr_db: float  # the model's output with only this layer quantized, against FP32
    validation_accuracy: float
    accuracy_drop: float  # points below the FP32 model on the validation split


@dataclass(frozen=True)
class SensitivityResult:
    model: Path
    settings: QuantizationSettings
    fp32_validation_accuracy: float
    validation: dict
    layers: list[LayerSensitivity]  # worst first


def quantizable_layers(model) -> list[tuple[str, str]]:
    """(node name, op type) of each layer in the graph quantization sees, in graph order."""
    return [(node.name, node.op_type) for node in model.graph.node if node.op_type in LAYER_OPS]


def layer_sensitivity(
    model_path: Path | SourceModel,
    settings: QuantizationSettings,
    calibration: CalibrationSet,
    validation: ValidationSet,
    progress: ProgressCallback | None = None,
    flags: PreprocessingFlags | None = None,
    runs: Executor | None = None,
    scores: Path | None = None,
) -> SensitivityResult:
    """Each layer quantized alone, scored on the validation split; `runs` scores the layers (default: here, one
    after another). `scores`: the folder of scores kept by what they measured (candidates.ScoreStore): a layer
    scored there before, by this command, tune or any worker, is not scored again."""
    source = model_path if isinstance(model_path, SourceModel) else load_source(model_path, flags or PreprocessingFlags(), settings.per_channel is not False)
    settings = with_calibration(settings, calibration)
    validation, fp32 = labels_from_fp32(validation, score(load_model(source.path, None, flags), validation))  # no labels: agreement with FP32
    with tempfile.TemporaryDirectory(prefix="ptq-sensitivity-") as workdir:
        graph = preprocessed(source.model, Path(workdir)) if settings.preprocess else source.model
        layers = quantizable_layers(graph)
    others = {name for name, _ in layers}
    # Every other layer stays in float: only this one's error reaches the output.
    # The stem is measured like any layer, each layer's weights rounded to nearest (the cost of 8 bits, not of the refinement).
    jobs: list[tuple[QuantizationSettings, int | None]] = [
        (replace(settings, stem=INT8, float_nodes=tuple(sorted(others - {name})), rounding=NEAREST), None) for name, _ in layers]
    runs = runs or InProcess()
    inputs = inputs_for(source, flags, calibration, validation, runs.task_threads)
    scored = score_candidates(runs, jobs, inputs, ScoreStore.for_search(scores, inputs) if scores else None, done=progress)
    results = [LayerSensitivity(node=name, op_type=op_type, output_sqnr_db=round(sqnr_db(fp32.outputs, quantized.outputs), 2),
                                validation_accuracy=quantized.accuracy, accuracy_drop=round(fp32.accuracy - quantized.accuracy, 4))
               for (name, op_type), (_, quantized) in zip(layers, scored, strict=True)]
    results.sort(key=lambda layer: (layer.output_sqnr_db, -layer.accuracy_drop))
    return SensitivityResult(source.path, settings, fp32.accuracy, validation.describe(), results)


def sensitivity(model_path: Path, settings: QuantizationSettings, calibration: CalibrationSet, validation: ValidationSet,  # noqa: PLR0913,PLR0917  `ptq sensitivity`'s options, one each
                progress: ProgressCallback | None = None, flags: PreprocessingFlags | None = None, workers: Workers = HERE,
                results_dir: Path | None = None) -> SensitivityResult:
    """`ptq sensitivity`: layer_sensitivity with its layers scored by `workers` (here, or as tasks on Ray), and
    kept with tune's candidates in `results_dir` (a layer measured before is read, not measured again)."""
    with executor(workers) as runs:
        return layer_sensitivity(model_path, settings, calibration, validation, progress, flags, runs, scores_folder(results_dir) if results_dir else None)


def save_result(result: SensitivityResult, results_dir: Path) -> Path:
    return write_record(Path(results_dir) / SENSITIVITY_DIR / f"{result.model.stem}_{result.settings.dtype}.json", result)


@dataclass(frozen=True)
class SensitivityRequest:
    """What `ptq sensitivity` asks: each layer of `model` quantized alone with `settings`, judged on the validation
    split drawn beside the calibration set."""

    model: Path
    settings: QuantizationSettings
    source: DataSource  # the images and how they are fed
    calibration_file: Path | None = None  # a `ptq calibrate` file, else drawn from the data
    validation_per_class: int = VALIDATION_PER_CLASS
    results_dir: Path = RESULTS_DIR
    workers: Workers = HERE


@dataclass(frozen=True)
class SensitivityRun:
    result: SensitivityResult
    record_file: Path  # where the result was written (results/sensitivity/<model>_<dtype>.json)


def run(request: SensitivityRequest, progress_bar: ProgressBar = no_progress_bar) -> SensitivityRun:
    """The model checked, the calibration and validation sets drawn, each layer scored, and the result written."""
    read_onnx(request.model)
    calibration, validation = calibration_and_validation(request.model, request.source, request.calibration_file, request.validation_per_class,
                                                         progress_bar)
    with progress_bar(f"Quantizing one layer at a time ({request.workers.describe()})") as progress:
        result = sensitivity(request.model, request.settings, calibration, validation, progress, request.source.flags, request.workers,
                             request.results_dir)
    return SensitivityRun(result, save_result(result, request.results_dir))
