"""Static post-training quantization of an FP32 ONNX model, through the backend the settings name."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import backends, inputs
from ptq_cli.backends.base import QUANTIZATION_METADATA_KEY, SOURCE_METADATA_KEY, LoadedModel, RunOptions, RuntimeProfile
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import check_outputs, check_writable, companions
from ptq_cli.model_file import read_onnx
from ptq_cli.quantize import budget, overflow, reuse
from ptq_cli.quantize.budget import Deadline
from ptq_cli.quantize.settings import QuantizationSettings, QuantizeCall, QuantizedFile, WeightsMaker
from ptq_cli.services import models as model_service
from ptq_cli.services.make import portability
from ptq_cli.services.make.calibration import CalibrationSet, for_model
from ptq_cli.services.make.stem import resolve_stem
from ptq_cli.services.models import load_model
from ptq_cli.services.progress import ProgressBar, ProgressCallback, no_progress_bar
from ptq_cli.services.quant_settings import make_settings
from ptq_cli.transforms.graph import clamped_activations, dense_initializers, depthwise_convs, fixed_input_size, upgrade_opset

# QDQ needs opset 10; per-channel QDQ needs 13. Older models are converted to this opset first.
MIN_OPSET, MIN_OPSET_PER_CHANNEL, UPGRADE_OPSET = 10, 13, 13


@dataclass(frozen=True)
class QuantizeResult:
    source: Path
    output: Path
    source_size_bytes: int
    output_size_bytes: int
    settings: QuantizationSettings
    space_to_depth: tuple = ()  # the convolutions regrouped before quantizing
    notes: tuple[str, ...] = ()  # what was changed on the way (opset upgrade, fixed batch made symbolic)
    model_input: str = ""
    preprocessing: str = ""
    portability: portability.PortabilityCost | None = None  # what running right on every x86 CPU costs it here, where measured
    # The other models made from the same FP32 model, as their records measured them on this CPU (the report's group,
    # measure/report.DatasetGroup): filled in by services/study/choices.py, which `ptq quantize` runs.
    measured_choices: Any = None
    # Where the model's time goes on this CPU at batch 1, from its runtime's profiler (None where the runtime has none).
    profile: RuntimeProfile | None = None

    @property
    def size_ratio(self) -> float:
        return self.output_size_bytes / self.source_size_bytes

    @property
    def written(self) -> tuple[Path, ...]:
        """The files it wrote: the model and those that stand with it (an IR's .bin)."""
        return tuple(companions(self.output))


@dataclass(frozen=True)
class SourceModel:
    """An FP32 ONNX model ready to quantize, any number of times (tune, sensitivity, sweep)."""

    path: Path
    model: object  # onnx.ModelProto, at an opset quantization takes
    loaded: LoadedModel  # its input contract, preprocessing and class count
    notes: tuple[str, ...]
    stem_costs: dict = field(default_factory=dict, compare=False)  # stem.resolve_stem's measurements, per settings


def load_source(model_path: Path, flags: inputs.PreprocessingFlags, per_channel: bool = True) -> SourceModel:
    model_path = Path(model_path)
    model = read_onnx(model_path)
    loaded = load_model(model_path, 1, flags)
    if loaded.info.dtype != "fp32":
        raise PtqError(f"{model_path}: already quantized ({loaded.info.dtype}); give the FP32 model")
    model, note = upgrade_opset(model, MIN_OPSET_PER_CHANNEL if per_channel else MIN_OPSET, UPGRADE_OPSET)
    model = fixed_input_size(model, loaded.input.name, loaded.input.shape(1)[1:])  # a size the model leaves open, as --input-size gave it
    model.graph.name = str(model_path)  # names the file in the backends' messages
    model = dense_initializers(model, bounded.ARRAY_BYTES.value())
    _check_finite_weights(model_path, model)
    return SourceModel(model_path, model, loaded, (note,) if note else ())


WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def _check_finite_weights(model_path: Path, model) -> None:
    """NaN anywhere among the weights, or an infinity in a layer's weights, has no 8-bit code: one line, before any
    backend's calibration meets it (an infinite constant elsewhere, an attention mask's, is left to the model)."""
    from onnx import numpy_helper

    weights = {name for node in model.graph.node if node.op_type in WEIGHTED for name in node.input[1:]}
    for init in model.graph.initializer:
        if init.data_type not in (1, 10, 11, 16):  # float, float16, double, bfloat16
            continue
        try:
            values = numpy_helper.to_array(init)
        except ValueError as error:  # its bytes do not fit its dims (a damaged file)
            raise PtqError(f"{model_path}: weights '{init.name[:80]}' do not fit their shape {list(init.dims)} ({error})") from error
        if np.isnan(values).any() or (init.name in weights and not np.isfinite(values).all()):
            raise PtqError(f"{model_path}: weights '{init.name[:80]}' hold NaN or infinity, which no 8-bit code represents; "
                           "fix the model (its FP32 scores are not finite either)")


def resolve_model_defaults(settings: QuantizationSettings, model) -> QuantizationSettings:
    """Settings left open for the model to decide.

    Granularity: per-channel weights for a model with depthwise convolutions (one scale over all their
    channels leaves most channels a few codes), the backend's per-tensor otherwise. Overflow fix: the
    backend's `clamped_overflow_fix` for a model with clamped activations (ReLU6 outputs sit at the top
    code, where x86 kernels without VNNI saturate in every layer, not only the first); otherwise judged on held-out
    images by a backend that can (overflow.JUDGED), else its first."""
    if settings.per_channel is None:
        settings = replace(settings, per_channel=bool(depthwise_convs(model)))
    if settings.overflow_fix is None:
        quantizer = backends.backend(settings.backend).quantizes
        clamped = quantizer.clamped_overflow_fix is not None and bool(clamped_activations(model))
        unclamped = overflow.JUDGED if quantizer.judges_overflow_fix else quantizer.overflow_fixes[0]
        settings = replace(settings, overflow_fix=quantizer.clamped_overflow_fix if clamped else unclamped)
    return settings


def resolve_settings(source: SourceModel, settings: QuantizationSettings, prepared: np.ndarray) -> QuantizationSettings:
    """Everything the model and its calibration images decide: granularity, overflow fix, then the stem."""
    return resolve_stem(resolve_model_defaults(settings, source.model), source.model, prepared, source.stem_costs)


def calibration_inputs(source: SourceModel, calibration: CalibrationSet) -> np.ndarray:
    """The calibration images in the model's input format. Calibration reads no labels: its images need
    not be of the model's classes (a folder of photos calibrates an ImageNet classifier)."""
    prepared = source.loaded.prepare(calibration.images)
    if not np.all(np.isfinite(prepared)):
        raise PtqError(f"{calibration.source}: calibration images are not finite after preprocessing")
    return prepared


def quantize_source(source: SourceModel, output: Path, settings: QuantizationSettings, calibration: CalibrationSet,  # noqa: PLR0913  the time budget
                    metadata: dict | None = None, prepared: np.ndarray | None = None, progress: ProgressCallback | None = None,
                    deadline: Deadline | None = None) -> QuantizedFile:
    """Quantize with the settings' backend; the model keeps its settings, input contract and source sha256.
    `metadata` (e.g. the validation scores `tune` measured) is stored next to the settings. `deadline`: the time budget
    the engine's optional steps keep to (quantize/budget.py)."""
    if prepared is None:
        prepared = calibration_inputs(source, calibration)
    settings = resolve_settings(source, settings, prepared)
    stored = {
        # A model made within a time budget says so: what it left out depends on the machine that made it.
        QUANTIZATION_METADATA_KEY: json.dumps({"source_model": str(source.path), **(metadata or {}),
                                               **({"time_budget_s": deadline.seconds} if deadline is not None else {})}),
        inputs.INPUT_METADATA_KEY: source.loaded.preprocessing.to_json(),
        SOURCE_METADATA_KEY: source.loaded.info.sha256,
    }
    # The judges of an overflow fix measure both x86 paths; the PT2E backends take ptq's onnxruntime weights.
    return backends.backend(settings.backend).quantizes.quantize(QuantizeCall(
        source.model, Path(output), settings, prepared, stored, progress,
        saturating_scores=model_service.native_scores, make_weights=_weights_maker(source, calibration, prepared, settings), deadline=deadline))


def _weights_maker(source: SourceModel, calibration: CalibrationSet, prepared: np.ndarray, settings: QuantizationSettings) -> WeightsMaker:
    """How a PT2E backend has ptq's onnxruntime model made from the same source and images (`--weights-from onnxruntime`):
    the default onnxruntime model in the settings' granularity, without space-to-depth (whose regrouped weights match no
    layer of the torch module), for every CPU under the pair rule on every layer, else for VNNI CPUs."""
    def make(path: Path, pair_safe: bool) -> None:
        asked = make_settings(backend=backends.DEFAULT, per_channel=settings.per_channel, cpus="all" if pair_safe else "vnni",
                              overflow_fix=overflow.ALL_LAYERS if pair_safe else None, space_to_depth=False)
        quantize_source(source, path, with_calibration(resolve_settings(source, asked, prepared), calibration), calibration, prepared=prepared)

    return make


def with_calibration(settings: QuantizationSettings, calibration: CalibrationSet) -> QuantizationSettings:
    source = f"{calibration.source}, from the images it is judged on" if calibration.judged_on else calibration.source
    return replace(settings, calibration_samples=int(len(calibration.labels)), calibration_seed=calibration.seed, calibration_source=source)


def judged_on_note(calibration: CalibrationSet) -> tuple[str, ...]:
    """What calibrating on the set a model is judged on means, said where it happens."""
    if not calibration.judged_on:
        return ()
    return (f"calibrated on {len(calibration.labels):,} images of {calibration.dataset}, the set it is judged on (it has no train split): "
            "fidelity measured there may flatter the model; --calibration-data DIR calibrates on other images",)


def default_output(model: Path, settings: QuantizationSettings, models_dir: Path | None = None) -> Path:
    """models/resnet8.onnx -> models/resnet8_int8.onnx, resnet8_uint8_speed.onnx, resnet8_pytorch_int8.pt,
    resnet8_openvino_int8.xml or resnet8_int8.tflite (beside the model, or in `models_dir`): the backend's name."""
    model = Path(model)
    return backends.backend(settings.backend).default_output(model, settings, Path(models_dir) if models_dir is not None else model.parent)


@dataclass(frozen=True)
class QuantizeRequest:
    """What `ptq quantize` asks: the FP32 model, how to quantize it, the images that calibrate it (a set `ptq
    calibrate` drew, else drawn from `data` or `calibration_data`) and where the model goes."""

    model: Path
    settings: QuantizationSettings
    data: Path
    calibration_data: Path | None = None
    calibration_file: Path | None = None
    calibration_size: int | None = None
    flags: inputs.PreprocessingFlags = field(default_factory=inputs.PreprocessingFlags)
    output: Path | None = None  # default_output's name, beside the model
    results_dir: Path | None = None  # names what its records measured of the other models made from the same FP32 model
    portability_cost: bool | None = False  # None: measured where the model was quick to make (portability.QUICK_SECONDS)
    time_budget: float | None = None  # seconds the whole quantization keeps to, leaving out optional steps (quantize/budget.py)


def run(request: QuantizeRequest, progress_bar: ProgressBar = no_progress_bar) -> QuantizeResult:
    """The request checked (the model loaded once, the files it reads, the output writable) before any
    calibration work, then quantize; `progress_bar(description)` gives each long phase's progress callback."""
    settings, deadline = request.settings, budget.deadline(request.time_budget)
    _check_keeps(deadline, settings)  # before any loading
    source = load_source(request.model, request.flags, settings.per_channel is not False)
    for path in settings.options.input_files():
        read_onnx(path)
    output = request.output or default_output(request.model, settings)
    check_writable(output)
    with progress_bar("Loading the calibration set"):
        calibration = for_model(request.model, request.data, request.calibration_data, saved=request.calibration_file, reuse_default=True,
                                flags=request.flags, count=request.calibration_size, size=source.loaded.input.size)
    with progress_bar(f"Calibrating ({settings.method}) and quantizing with {settings.backend}") as progress:
        return quantize(request.model, output, settings, calibration, request.flags, progress, request.portability_cost, request.results_dir, source,
                        deadline=deadline)


def _check_keeps(deadline: Deadline | None, settings: QuantizationSettings) -> None:
    """A time budget is refused by a backend that does not keep to it, naming those that do."""
    if deadline is not None and not backends.backend(settings.backend).quantizes.keeps_time_budget:
        keeping = [row.name for row in backends.TABLE.values() if row.quantizer is not None and row.quantizer.keeps_time_budget]
        raise PtqError(f"--time-budget: --backend {settings.backend} does not keep to a time budget ({' and '.join(keeping)} do)")


def quantize(model_path: Path, output: Path, settings: QuantizationSettings, calibration: CalibrationSet,  # noqa: PLR0913,PLR0917  QuantizeRequest's fields once the model and calibration set are loaded
             flags: inputs.PreprocessingFlags | None = None, progress: ProgressCallback | None = None,
             portability_cost: bool | None = False, results_dir: Path | None = None, source: SourceModel | None = None, *,
             deadline: Deadline | None = None) -> QuantizeResult:
    """Quantize the FP32 ONNX model with the settings' backend; the output is written atomically. With
    `portability_cost`, a model with an overflow fix is measured against one made for VNNI CPUs alone (portability.py);
    with None, where it was quick to make (portability.QUICK_SECONDS), else the result says why not.
    With `results_dir`, the portability cost measured is recorded there.
    `source`: the model already loaded by load_source (a command that checked it before drawing calibration images),
    so it is loaded once. `deadline`: the time budget the engine's optional steps keep to (quantize/budget.py); the
    portability cost's second model is made without it."""
    model_path, output = Path(model_path), Path(output)
    _check_keeps(deadline, settings)
    calibration_file = Path(calibration.source.split(" (")[0]) if calibration.source else None
    check_outputs([("--output", output, (backends.backend(settings.backend).suffix,))], [model_path, *settings.options.input_files(), calibration_file])
    if source is None or Path(source.path) != model_path:
        source = load_source(model_path, flags or inputs.PreprocessingFlags(), settings.per_channel is not False)
    prepared = calibration_inputs(source, calibration)
    settings = with_calibration(resolve_settings(source, settings, prepared), calibration)
    with reuse.reusing_made_files():  # the model for VNNI CPUs shares what it can with this one (its float model's sums)
        began = time.perf_counter()
        written = quantize_source(source, output, settings, calibration, prepared=prepared, progress=progress, deadline=deadline)
        settings = written.settings or settings
        cost = None
        if portability_cost is not False and portability.applies(settings):
            cost = portability.left_out_as_slow(time.perf_counter() - began, portability_cost)
            cost = cost or portability.measure(source, output, settings, calibration, prepared, quantize_source)
    if cost is not None and cost.model_sha256 and results_dir is not None:
        portability.save(cost, results_dir)
    return QuantizeResult(model_path, output, model_path.stat().st_size, written.size_bytes, settings, written.space_to_depth,
                          source.notes + written.notes + judged_on_note(calibration), source.loaded.describe_input(), source.loaded.preprocessing.describe(),
                          cost, profile=where_time_goes(output, settings.backend, prepared, flags))


PROFILE_RUNS = 10  # runs of one image the profiler averages for `quantize`'s "where the time goes"


def where_time_goes(path: Path, backend_name: str, prepared: np.ndarray, flags: inputs.PreprocessingFlags | None = None) -> RuntimeProfile | None:
    """Where a model's time goes on this CPU, one image at a time (PROFILE_RUNS runs of the first of `prepared`, the
    model's inputs), from its runtime's profiler; None where the runtime has none or its inputs are not the float
    model's (a LiteRT model with 8-bit input)."""
    runtime = backends.backend(backend_name).runtime
    if runtime.profile is None or len(prepared) == 0:
        return None
    try:
        return runtime.profile(path, RunOptions(None, flags or inputs.PreprocessingFlags()), prepared[:1], PROFILE_RUNS)
    except PtqError:  # the model is written and sound; only this summary of it is missing (`ptq benchmark --profile` says why)
        return None
