"""The `ptq` command line: parse options, call a service, render the result. Nothing else lives here."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from ptq_cli import backends, render, render_charts, render_report, settings
from ptq_cli.cli import console
from ptq_cli.cli.app import COMMAND_LINE, _guarding_inputs, _reflow, app, run_stage_command
from ptq_cli.cli.console import _byte_progress, _emit, _progress_bar, _working
from ptq_cli.cli.options import (
    COMMON_QUANTIZATION,
    MODELS_HELP,
    NO_CHOICE,
    NO_QUANTIZATION,
    Asset,
    Backend,
    CalibrationFile,
    DataChoice,
    DType,
    Int8Path,
    JsonFlag,
    KernelPath,
    Method,
    PrecisionOption,
    RayAddressOption,
    RunsOption,
    RuntimeOption,
    SamplesPerClassOption,
    Scope,
    SeedOption,
    Stem,
    StemOption,
    ThreadsOption,
    TrustOption,
    WorkersOption,
    _finite,
    _with_data,
    _with_quantization,
    _workers,
)
from ptq_cli.errors import PtqError
from ptq_cli.guards import trust
from ptq_cli.guards.atomic import check_outputs, write_text
from ptq_cli.model_file import read_onnx as check_model
from ptq_cli.services import fetch as fetch_service
from ptq_cli.services import models as models_service
from ptq_cli.services import quant_settings
from ptq_cli.services.make import calibration as calibration_service
from ptq_cli.services.make import convert as convert_service
from ptq_cli.services.make import export as export_service
from ptq_cli.services.make import prune as prune_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.services.make.portability import QUICK_SECONDS
from ptq_cli.services.measure import benchmark as benchmark_service
from ptq_cli.services.measure import evaluate as evaluate_service
from ptq_cli.services.measure import evaluation_records
from ptq_cli.services.measure import report as report_service
from ptq_cli.services.quant_settings import QuantizationSettings
from ptq_cli.services.study import choices as choices_service
from ptq_cli.services.study import pipeline as pipeline_service
from ptq_cli.services.study import sensitivity as sensitivity_service
from ptq_cli.services.study import sweep as sweep_service
from ptq_cli.services.study import tune as tune_service


@app.command()
def fetch(
    destination: Annotated[Path | None, typer.Option("--dest", help=f"Where the assets go. (default: ${settings.ASSETS_ENV}, {settings.ASSETS_ENV}={settings.DEFAULT_ASSETS})", show_default=False)] = None,
    mirror: Annotated[Path | None, typer.Option(help="Copy from this local copy (e.g. ../shared/assets) instead of downloading; checked by structure, not file hash.", show_default=False)] = None,
    asset: Annotated[list[Asset] | None, typer.Option(help="Only this asset; repeat for several. (default: both)", show_default=False)] = None,
    cifar_url: Annotated[str | None, typer.Option(help=f"CIFAR-10 python tarball URL (e.g. an internal mirror). (default: {fetch_service.CIFAR_URL})", show_default=False)] = None,
    cifar_md5: Annotated[str | None, typer.Option(help=f"Expected md5 of the tarball. (default: the published {fetch_service.CIFAR_MD5})", show_default=False)] = None,
    model_url: Annotated[str | None, typer.Option(help="MLPerf Tiny ResNet8 .h5 URL. (default: MLCommons Tiny on GitHub)", show_default=False)] = None,
    model_sha256: Annotated[str | None, typer.Option(help="Expected sha256 of the .h5. (default: the pinned one)", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Fetch again even if a valid copy is already in place.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Put CIFAR-10 and the MLPerf Tiny ResNet8 .h5 where ptq expects them: download (md5/sha256 checked) or copy a mirror.

    Downloads stream to a temporary file that is renamed into place only when complete and its checksum
    matches; CIFAR-10 is unpacked and validated (keys, shapes, label range, 1,000 test images per class)
    before it replaces anything. A valid copy already in place is kept unless --force.
    """
    with _byte_progress() as progress:
        result = fetch_service.fetch(
            destination or settings.assets_dir(),
            tuple(a.value for a in asset) if asset else fetch_service.ASSETS,
            mirror,
            fetch_service.cifar_source(cifar_url, cifar_md5),
            fetch_service.model_source(model_url, model_sha256),
            force,
            progress,
        )
    _emit(as_json, result, render.fetched(result))


@app.command()
@_with_data(calibration=False)
def convert(
    keras: Annotated[Path | None, typer.Option(help=f"Keras model to convert: a .keras or .h5 file, or a TensorFlow SavedModel folder (its ops vetted before TensorFlow loads it). (default: ${settings.ASSETS_ENV}/mlperf-tiny-resnet8/pretrainedResnet.h5)", show_default=False)] = None,
    output: Annotated[Path, typer.Option(help="Where to write the ONNX model converted from Keras.")] = settings.FP32_ONNX,
    onnx_source: Annotated[Path | None, typer.Option("--onnx", help="Start from this ONNX model instead of Keras (use with --torch).", show_default=False)] = None,
    torch_output: Annotated[Path | None, typer.Option("--torch", help="Also convert the ONNX model to PyTorch (onnx2torch), saved here: a torch.export program for a .pt2 path, TorchScript for .pt (e.g. models/resnet8.pt).", show_default=False)] = None,
    opset: Annotated[int, typer.Option(min=10, max=21, help="ONNX opset for tf2onnx.")] = 13,
    check_images: Annotated[int, typer.Option(min=1, help=f"Test images (at least 1: every conversion is checked) on which source and converted outputs must agree within {convert_service.LIMIT}.")] = 1000,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> list[convert_service.ConversionResult]:
    """Convert Keras -> ONNX (tf2onnx) and/or ONNX -> PyTorch TorchScript (onnx2torch), checking each on real test images.

    Each conversion runs the source and the converted model on the same test images and prints the
    max absolute output difference and the top-1 agreement; beyond 0.1% of the largest output it exits 1 and writes nothing.
    """
    if onnx_source is not None and keras is not None:
        raise PtqError("--keras and --onnx: give one source model, not both")
    if onnx_source is not None and torch_output is None:
        raise PtqError("--onnx: converts an existing ONNX model to PyTorch and needs --torch PATH")
    check_outputs([("--output", None if onnx_source is not None else output, (".onnx",)), ("--torch", torch_output, (".pt", ".pt2"))],
                  [keras or (settings.keras_model_path() if onnx_source is None else None), onnx_source])
    dataset = choice.dataset()
    results = []
    if onnx_source is None:
        with _working("Converting Keras -> ONNX with tf2onnx and checking against Keras…"):
            results.append(convert_service.keras_to_onnx(keras or settings.keras_model_path(), output, dataset, opset, check_images, choice.flags))
    if torch_output is not None:
        with _working("Converting ONNX -> PyTorch with onnx2torch and checking against onnxruntime…"):
            results.append(convert_service.onnx_to_torchscript(onnx_source or output, torch_output, dataset, check_images, choice.flags))
    _emit(as_json, results if len(results) > 1 else results[0], Group(*map(render.conversion, results)))
    return results


@app.command()
@_with_data(preprocessing=False)
def calibrate(
    samples_per_class: SamplesPerClassOption = None,
    seed: SeedOption = settings.SEED,
    model: Annotated[Path | None, typer.Option(help="Resize the images to this model's input size (needed when a folder's images differ in size). (default: the images' own size)", show_default=False)] = None,
    output: Annotated[Path, typer.Option(help="Where to write the calibration set (.npz).")] = settings.CALIBRATION_FILE,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> calibration_service.SavedCalibration:
    """Draw a seeded, class-stratified calibration set from the dataset's train split (never its test split).

    The set holds the images as uint8 pixels; each model's own preprocessing is applied when quantizing.
    """
    with _working("Sampling the training images…"):
        saved = calibration_service.draw_and_save(model, choice.data, choice.calibration_data, output, samples_per_class, seed, choice.calibration_size,
                                                  choice.flags)
    calibration_set = saved.calibration
    summary = {"output": output, "samples": len(calibration_set.labels), "seed": seed, "per_class": calibration_set.per_class_counts,
               "dataset": calibration_set.dataset, "split": calibration_set.split, "pixel_range": calibration_set.pixel_range}
    _emit(as_json, summary, render.calibration(calibration_set, output))
    return saved


@app.command()
@_with_quantization()
@_with_data()
def quantize(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model to quantize (the PyTorch backend converts it with onnx2torch first; LiteRT starts from the Keras model `ptq convert --keras` made it from).")] = settings.FP32_ONNX,
    quantization: QuantizationSettings = NO_QUANTIZATION,
    calibration: CalibrationFile = None,
    output: Annotated[Path | None, typer.Option(help="Where to write the quantized model. (default: beside the model, <model>_<dtype>.onnx, <model>_pytorch_<dtype>.pt, <model>_pt2e_<dtype>.pt2, <model>_executorch_<dtype>.pte, <model>_openvino_<dtype>.xml or <model>_<dtype>.tflite)", show_default=False)] = None,
    results_dir: Annotated[Path, typer.Option(help="Records of earlier evaluations and benchmarks: the models made from the same FP32 model that they measured are named after quantizing, as the other choices.")] = settings.RESULTS_DIR,
    portability_cost: Annotated[bool | None, typer.Option("--portability-cost/--no-portability-cost", help=f"On a CPU with VNNI, for a model made for all CPUs with an overflow fix: quantize it again for VNNI CPUs alone (--cpus vnni) and say what running right on every x86 CPU costs, both measured against FP32 on the calibration images. Takes one more quantization. (default: measured where the model took at most {QUICK_SECONDS:.0f} s to make; env: PTQ_PORTABILITY_COST=0 turns it off)", envvar="PTQ_PORTABILITY_COST", show_envvar=False, show_default=False, rich_help_panel="Quantization")] = None,
    time_budget: Annotated[float | None, typer.Option(help="Seconds the whole quantization may take, loading included (onnxruntime and openvino): --method auto's candidates after MinMax take at most half of what is left as they begin, learned rounding refines layers while each is expected to end before a tenth of the budget is left (the others keep nearest codes); what did not fit is said. The same model as without it where everything fits; a model that depends on this machine's speed where not. (default: none, every step runs)", show_default=False, rich_help_panel="Quantization")] = None,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> quantize_service.QuantizeResult:
    """Static post-training quantization, calibrated on the calibration set: ONNX Runtime (QDQ), PyTorch (FX), OpenVINO (NNCF) or LiteRT (full-integer TFLite).

    The model's input (layout, channels, size, batch) is read from the model; its preprocessing comes
    from --preprocess/--scale/--mean/--std/--bgr and is stored in the quantized model, so evaluating it
    needs no flags. Models below opset 10 (13 for per-channel) are upgraded first.
    """
    request = quantize_service.QuantizeRequest(model, quantization, choice.data, choice.calibration_data, calibration, choice.calibration_size, choice.flags,
                                               output, results_dir, portability_cost, time_budget)
    result = choices_service.quantize(request, _progress_bar)
    _emit(as_json, result, render_report.quantization(result))
    return result


ExcludeFirst = Annotated[bool, typer.Option("--exclude-first/--prune-first", help="Leave the first convolution (3 input channels, 432 weights) dense.")]
ExcludeClassifier = Annotated[bool, typer.Option("--exclude-classifier/--prune-classifier", help="Leave the classifier (last Gemm/MatMul) dense.")]
Reconstruct = Annotated[bool, typer.Option("--reconstruct/--no-reconstruct", help="Re-fit the kept weights, layer by layer, by least squares on the calibration images (no labels, no training); --no-reconstruct is magnitude pruning alone.")]
ScopeOption = Annotated[Scope, typer.Option(help="global: one magnitude threshold across all pruned layers; layer: every layer to the same sparsity.")]


@app.command()
@_with_data()
def prune(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    sparsity: Annotated[float, typer.Option(callback=_finite, help="Fraction of the weights to set to zero, in [0, 1).")] = 0.5,
    scope: ScopeOption = Scope("global"),
    exclude_first: ExcludeFirst = False,
    exclude_classifier: ExcludeClassifier = False,
    reconstruct: Reconstruct = True,
    calibration: CalibrationFile = None,
    output: Annotated[Path | None, typer.Option(help="Where to write the pruned model. (default: beside the model, <model>_pruned<NN>.onnx)", show_default=False)] = None,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
) -> None:
    """Magnitude pruning: zero the smallest Conv and Gemm/MatMul weights; biases and batch-norm stay untouched.

    Then, unless --no-reconstruct, the kept weights are re-fitted layer by layer by least squares on the
    calibration images, so each layer reproduces the original's output (no training, no labels). Writes
    an ordinary ONNX model (`ptq quantize --model` takes it) and prints the sparsity reached per layer.
    `ptq sweep` shows what pruning costs in accuracy, with and without the re-fit.
    """
    request = prune_service.PruneRequest(model, prune_service.make_settings(sparsity, scope.value, exclude_first, exclude_classifier, reconstruct),
                                         choice, calibration, output)
    result = prune_service.run(request, _progress_bar)
    _emit(as_json, result, render.pruning(result))


@app.command()
@_with_quantization(COMMON_QUANTIZATION, dtype=DType("int8"), per_channel=True, method=Method("percentile"))
@_with_data()
def sweep(
    sparsity: Annotated[str, typer.Option(help="Comma-separated sparsities to try, each in [0, 1).")] = "0,0.3,0.5,0.7",
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    quantization: QuantizationSettings = NO_QUANTIZATION,
    scope: ScopeOption = Scope("global"),
    exclude_first: ExcludeFirst = False,
    exclude_classifier: ExcludeClassifier = False,
    reconstruct: Reconstruct = True,
    calibration: CalibrationFile = None,
    models_dir: Annotated[Path, typer.Option(help="Where the pruned and quantized models go.")] = settings.MODELS_DIR / "sweep",
    results_dir: Annotated[Path, typer.Option(help="The sweep record goes to RESULTS_DIR/sweep/<model>_<dtype>_<scope>.json, which `ptq report` shows.")] = settings.RESULTS_DIR,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
) -> None:
    """For each sparsity: prune, quantize (onnxruntime), evaluate both on the test set; accuracy, size and gzipped size.

    Sparsity 0 is the unpruned model. Every point uses the same calibration set and settings (default:
    per-channel weights, percentile calibration). With --workers or --ray-address, each point is pruned
    and quantized as a task and each model evaluated in shards; the models and the record are the same.
    """
    where = _workers(workers, ray_address)
    sparsities = sweep_service.parse_sparsities(sparsity)
    pruning_check = prune_service.make_settings(0.0, scope.value, exclude_first, exclude_classifier, reconstruct)  # checked before any work
    check_model(model)
    calibration_set = _calibration_set(calibration, choice, model)
    with _progress_bar(f"Prune, quantize, evaluate ({where.describe()})", lines=True) as progress:
        result = sweep_service.sweep(
            model, sparsities, quantization, calibration_set, choice.dataset(), models_dir, results_dir,
            pruning_check, progress, choice.flags, where,
        )
    _emit(as_json, result, render.sweep(result))


ValidationPerClass = Annotated[
    int, typer.Option(min=1, help="Validation split size: training images per class, disjoint from the calibration set.")
]


def _calibration_set(calibration: Path | None, choice: DataChoice, model: Path):
    with _working("Loading the calibration set…"):
        return calibration_service.for_model(model, choice.data, choice.calibration_data, saved=calibration, reuse_default=True, flags=choice.flags,
                                             count=choice.calibration_size)


@app.command()
@_with_quantization(COMMON_QUANTIZATION, dtype=DType("int8"), per_channel=False, method=Method("minmax"))
@_with_data()
def sensitivity(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    quantization: QuantizationSettings = NO_QUANTIZATION,
    calibration: CalibrationFile = None,
    validation_per_class: ValidationPerClass = settings.VALIDATION_PER_CLASS,
    results_dir: Annotated[Path, typer.Option(help="The record goes to RESULTS_DIR/sensitivity/<model>_<dtype>.json; each layer's scores to "
                                                   "RESULTS_DIR/tuning/candidates, shared with `ptq tune` (a layer scored before is not scored again).")] = settings.RESULTS_DIR,
    choice: DataChoice = NO_CHOICE,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Per layer: quantize that layer alone and measure the model's output SQNR and validation accuracy against FP32.

    Measured on the validation split (training images not in the calibration set), never the test set;
    sorted worst first. The layer names are what `ptq tune` leaves in float.
    """
    request = sensitivity_service.SensitivityRequest(model, quantization, choice, calibration, validation_per_class, results_dir, _workers(workers, ray_address))
    ran = sensitivity_service.run(request, functools.partial(_progress_bar, lines=True))
    result, record_file = ran.result, ran.record_file
    _emit(as_json, result, render.sensitivity(result, record_file))


@app.command()
@_with_data()
def tune(
    model: Annotated[Path, typer.Option(help="FP32 ONNX model.")] = settings.FP32_ONNX,
    dtype: Annotated[DType, typer.Option(help="Activation type to tune for (uint8 also tries int8 weights).")] = DType("int8"),
    backend: Annotated[Backend, typer.Option(help="onnxruntime (QDQ), pytorch (FX, int8 only: granularity x observer x calibration size, no float layers) or openvino (NNCF, int8: preset x bias correction x calibration size x ignored scope); not litert.")] = Backend(backends.DEFAULT),
    max_drop: Annotated[float, typer.Option(callback=_finite, min=0, help="Accuracy budget: points below FP32 allowed on the validation split.")] = 0.05,
    method: Annotated[list[Method] | None, typer.Option(help="Calibration methods to search; repeat for several. (default: onnxruntime minmax and percentile at 99.9, 99.95, 99.99, 99.999; pytorch histogram and minmax)", show_default=False)] = None,
    per_channel: Annotated[bool | None, typer.Option("--per-channel/--per-tensor", help="Search only this weight granularity. (default: both)", show_default=False)] = None,
    max_float_layers: Annotated[int, typer.Option(min=0, help="Most sensitive layers to try leaving in float, one more at a time (0: none).")] = tune_service.MAX_FLOAT_LAYERS,
    calibration: CalibrationFile = None,
    validation_per_class: ValidationPerClass = settings.VALIDATION_PER_CLASS,
    output: Annotated[Path | None, typer.Option(help="Where to write the chosen model. (default: beside the model, <model>_<dtype>_tuned.onnx, <model>_pytorch_int8_tuned.pt or <model>_openvino_int8_tuned.xml)", show_default=False)] = None,
    results_dir: Annotated[Path, typer.Option(help="The record of the search goes to RESULTS_DIR/tuning/<output>.json.")] = settings.RESULTS_DIR,
    stem: StemOption = Stem(quant_settings.AUTO),
    choice: DataChoice = NO_CHOICE,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Search quantization settings for the smallest, fastest model within --max-drop of FP32.

    Every decision is made on the validation split (training images not in the calibration set); the
    test set is never read. Stages: calibration method x granularity x weight type (NNCF: preset x bias
    correction), calibration size, then the most sensitive layers left in float (NNCF: its ignored scope). Without any candidate in budget, the most accurate
    is kept and the command says so (exit 0).
    """
    request = tune_service.TuneRequest(
        model, choice, dtype.value, backend.value, max_drop, calibration, validation_per_class, output, results_dir,
        methods=tuple(m.value for m in method) if method else None,
        granularities=(per_channel,) if per_channel is not None else (True, False),
        max_float_layers=max_float_layers, stem=stem.value, workers=_workers(workers, ray_address),
    )
    result = tune_service.run(request, functools.partial(_progress_bar, lines=True))
    _emit(as_json, result, render.tuning(result))


def _default_models() -> list[Path]:
    found, skipped = models_service.models_in(settings.MODELS_DIR, backends.suffixes())
    for path in skipped:
        console.err.print(f"skipped {path}: TorchScript ptq did not write (loading it runs its code; pass --model {path} {trust.OPTION} to load it)",
                  soft_wrap=True, highlight=False)
    if not found:
        raise PtqError(f"{settings.MODELS_DIR}: no {', '.join(backends.suffixes())} models to evaluate (run `ptq convert` or pass --model)")
    return found


@app.command()
@_with_data(calibration=False)
def evaluate(
    model: Annotated[list[Path] | None, typer.Option(help=MODELS_HELP, show_default=False)] = None,
    per_class: Annotated[bool, typer.Option("--per-class", help="Also show per-class accuracy, with the delta against the FP32 source model's record.")] = False,
    results_dir: Annotated[Path, typer.Option(help="Where to write one JSON record per model and dataset.")] = settings.RESULTS_DIR,
    batch_size: Annotated[int, typer.Option(min=1, help="Images per inference call (split over the threads).")] = settings.EVALUATION_BATCH,
    threads: ThreadsOption = None,
    choice: DataChoice = NO_CHOICE,
    runtime: RuntimeOption = None,
    precision: PrecisionOption = None,
    label: Annotated[str | None, typer.Option(help="What the report calls the model, beside its file name (one --model only).", show_default=False)] = None,
    int8_path: Annotated[Int8Path, typer.Option(help="Which x86 int8 path to score 8-bit onnxruntime and PyTorch models on: native (this CPU's), exact (VNNI/AMX, ARM), saturating (AVX2 without VNNI) or both. The path this CPU does not take comes from onnxruntime's exact kernels, a proof that the model cannot saturate, or emulation of an AVX2 CPU on --emulated-images images: its AVX2 kernels run natively with CPUID masked where Linux can fault CPUID (and a C compiler builds ptq's shim), else under qemu-x86_64 -cpu Haswell.", rich_help_panel="Runtime")] = Int8Path("native"),
    emulated_images: Annotated[int | None, typer.Option(min=10, help="Images (the first of each class) scored under emulation. Default: the whole split where the AVX2 kernels run natively while the model input it takes stays under 512 MB, else 1,000 (qemu: about 100 images/s on ResNet8).", show_default=False, rich_help_panel="Runtime")] = None,
    against_fp32: Annotated[Path | None, typer.Option("--against-fp32", help="The FP32 model to measure fidelity against (top-1 agreement, top-5 containment, SQNR and KL of the scores, on the same images; no labels needed). (default: the FP32 source a ptq-made model names, while that file is unchanged)", show_default=False)] = None,
    trust_remote_code: TrustOption = False,  # noqa: ARG001  taken by its callback while parsing
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
    as_json: JsonFlag = False,
) -> list[evaluate_service.Evaluated]:
    """Top-1 accuracy on the dataset's test split (val if it has no test), and fidelity to the FP32 model.

    A quantized model's delta is against its FP32 source model measured on the same images: the source
    (named in the model) is evaluated too if its record is missing. Its fidelity (top-1 agreement, top-5
    containment, SQNR, KL) is measured against that source, or --against-fp32, and needs no labels: on
    images whose labels are not the model's classes (or an unlabelled folder, ROOT/*.jpg), it is the
    measure. Records go to RESULTS_DIR/<model file>-<folder>@<dataset>.json, one per model file,
    runtime and dataset.
    """
    request = evaluate_service.EvaluationRequest(
        tuple(model or _default_models()), choice.dataset(), results_dir, int8_path.value, batch_size, threads, choice.flags, runtime and runtime.value,
        precision and precision.value, label, emulated_images, against_fp32, _workers(workers, ray_address))
    done = []
    for evaluated in evaluate_service.evaluate(request, _progress_bar):
        done.append(evaluated)
        warning = evaluate_service.outside_target(evaluated.record.model_path, (evaluated.record.quantization or {}).get("cpus"))
        if warning:
            console.err.print(f"warning: {warning}", soft_wrap=True)
        if not as_json:
            if evaluated.source_evaluated is not None:
                console.out.print(Text(f"Evaluated its FP32 source {evaluated.source_evaluated} too (no record of it on this dataset).", style="dim"))
            labelled = evaluated.record.accuracy is not None
            shown = (evaluation_records.classes_to_show(evaluated.record, evaluated.reference) if labelled else []) if per_class else None
            console.out.print(render.evaluation(evaluated.record, evaluated.reference, shown, evaluated.path, evaluated.reference_status))
    if as_json:
        _emit(True, [evaluated.record for evaluated in done] if len(done) > 1 else done[0].record, None)
    return done


@app.command()
@_with_data(calibration=False)
def benchmark(
    model: Annotated[list[Path] | None, typer.Option(help=MODELS_HELP, show_default=False)] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help=f"Batch size for the throughput measurement (latency is always at batch 1). (default: {benchmark_service.DEFAULT_BATCH} at 32x32; a larger input as many pixels a batch, at least {benchmark_service.MIN_BATCH} images: 16 at 224x224)", show_default=False)] = None,
    threads: ThreadsOption = None,
    runs: RunsOption = 100,
    results_dir: Annotated[Path, typer.Option(help="Records go to RESULTS_DIR/benchmarks/<model file>.json, read by `ptq report`.")] = settings.RESULTS_DIR,
    choice: DataChoice = NO_CHOICE,
    runtime: RuntimeOption = None,
    precision: PrecisionOption = None,
    also: Annotated[list[str] | None, typer.Option(help="Also time this model on another runtime in the same turns, as MODEL@RUNTIME[:PRECISION] (e.g. models/resnet8.onnx@openvino:f32: the ONNX file on OpenVINO at f32 beside its onnxruntime run); repeat for several.", show_default=False, rich_help_panel="Runtime")] = None,
    int8_path: Annotated[KernelPath, typer.Option(help="The kernels to time: native (this CPU's) or saturating (those of x86 CPUs without VNNI, AVX2: the speed an 8-bit model gives there). On a CPU with VNNI, every model, FP32 ones too, is timed in a child process that takes the AVX2 kernels at native speed: CPUID masked where Linux can fault CPUID (and a C compiler builds ptq's shim); never under qemu, whose pace says nothing of a CPU's. Records are kept apart from native ones (…~saturating.json).", rich_help_panel="Runtime")] = KernelPath("native"),
    profile: Annotated[bool, typer.Option("--profile", help="Also where the time goes at --batch-size, from each runtime's profiler: per op type its share of the time and whether it ran on an integer kernel, in float, converting to and from 8 bits, or moving data; kept in the record, summed up by `ptq report`.")] = False,
    trust_remote_code: TrustOption = False,  # noqa: ARG001  taken by its callback while parsing
    as_json: JsonFlag = False,
) -> benchmark_service.Benchmarked:
    """Latency at batch 1 (p50/p95/p99) and throughput at --batch-size, after warm-up, for every model kind ptq runs (ONNX, TorchScript, torch.export, ExecuTorch, OpenVINO IR, TFLite).

    The models are measured in turns, one run of each at a time, so that the machine's ups and downs reach
    them all alike: compare models in one call. At a batch, onnxruntime (spinning off), OpenVINO and TFLite
    models take their turns together; at batch 1, each runtime's models among themselves (so its threads are
    as warm as when serving alone); PyTorch models come last (their spinning threads would slow the next
    model). Throughput is the batch size over the median batch time. A model with a fixed batch runs chunks of it.
    Without --data (and without the study's CIFAR-10), the models are fed seeded random pixels of their input's
    size: speed needs no real images, and the output says what was fed.
    """
    dataset = choice.dataset() if choice.data_given or choice.data.exists() else None
    request = benchmark_service.BenchmarkRequest(tuple(model or _default_models()), dataset, results_dir, batch_size, threads, runs, choice.flags,
                                                 runtime and runtime.value, precision and precision.value,
                                                 tuple(map(benchmark_service.parse_also, also or ())), int8_path.value, profile)
    result = benchmark_service.run(request, _progress_bar)
    for warning in result.warnings:
        console.err.print(f"warning: {warning}", soft_wrap=True)
    _emit(as_json, [{**render.plain(record), "speedup_vs_fp32": result.speedups[benchmark_service.run_key(record)]} for record in result.records],
          render.benchmarks(result.records, result.speedups, with_profiles=profile))
    return result


@app.command()
def export(
    model: Annotated[Path, typer.Option(help="The .tflite model to export.")],
    c_array: Annotated[bool, typer.Option("--c-array", help="Write it as C source and header: a 16-byte-aligned const unsigned char array and its length, as TensorFlow Lite Micro projects compile in.")] = False,
    output_dir: Annotated[Path | None, typer.Option(help="Where to write <model>.c and <model>.h. (default: beside the model)", show_default=False)] = None,
    symbol: Annotated[str | None, typer.Option(help="The array's C name; its length is <symbol>_len. (default: from the file name, e.g. resnet8_int8_tflite)", show_default=False)] = None,
    arena: Annotated[bool, typer.Option("--arena/--no-arena", help="Run the model once on TensorFlow Lite Micro (with the litert extra) and write the tensor arena it allocated as <SYMBOL>_ARENA_BYTES; a model it cannot run is refused.")] = True,
    as_json: JsonFlag = False,
) -> None:
    """Export a model in the form a deployment compiles in (today: --c-array, for TFLite Micro)."""
    if not c_array:
        raise PtqError("--c-array: the one export format so far; pass it")
    result = export_service.export_c_array(model, output_dir, symbol, arena)
    _emit(as_json, result, render.exported(result))


@app.command()
def report(
    results_dir: Annotated[Path, typer.Option(help="Directory of JSON records written by `ptq evaluate`.")] = settings.RESULTS_DIR,
    markdown: Annotated[
        Path | None,
        typer.Option(help=f"Also write the report as Markdown, to PATH if given. (PATH defaults to {settings.MARKDOWN_REPORT})", metavar="[PATH]"),
    ] = None,
    plot: Annotated[bool, typer.Option("--plot", help="Also draw PNG charts (per-class accuracy; accuracy vs compressed size of `ptq sweep`) beside the Markdown report, linked from it; implies --markdown.")] = False,
    refresh: Annotated[bool, typer.Option("--refresh", help="First evaluate again every model whose file changed since its record (rows otherwise marked stale).")] = False,
    threads: ThreadsOption = None,
    trust_remote_code: TrustOption = False,  # noqa: ARG001  taken by its callback while parsing
    as_json: JsonFlag = False,
) -> report_service.Reported:
    """Compare every evaluated model: accuracy, delta, size, size reduction, speed.

    Reads the records, never re-evaluates (unless --refresh); each row is checked against the model file now on disk, and marked stale when the file changed since it was measured, or missing."""
    reported = report_service.run(results_dir, refresh, threads, _progress_bar)
    result = reported.report
    if plot and markdown is None:
        markdown = settings.MARKDOWN_REPORT
    charts: list[Path] = []
    if markdown is not None:
        chart_paths = report_service.chart_paths(markdown) if plot else {}
        check_outputs([("--markdown", markdown, (".md",)), *(("--plot", path, (".png",)) for path in chart_paths.values())],
                      [*report_service.input_files(results_dir)])
        charts = render_charts.write_charts(result, chart_paths)
        write_text(markdown, render_report.report_markdown(result, charts))
    _emit(as_json, result, render_report.report(result))
    if markdown is not None and not as_json:
        console.out.print(f"Markdown report written to {markdown}" + (f"; charts: {', '.join(str(path) for path in charts)}" if charts else ""))
    return report_service.Reported(result, (*reported.written, *((markdown,) if markdown is not None else ()), *charts))


@app.command(name="run")
@_with_data()
def run_pipeline(
    model: Annotated[Path | None, typer.Option(help="Your FP32 ONNX classifier: the study runs on it (no Keras step), outputs named after it, e.g. models/<model>_int8.onnx. (default: the MLPerf Tiny ResNet8, converted from --keras)", show_default=False)] = None,
    keras: Annotated[Path | None, typer.Option(help=f"Keras .h5 model. (default: ${settings.ASSETS_ENV}/mlperf-tiny-resnet8/pretrainedResnet.h5)", show_default=False)] = None,
    samples_per_class: SamplesPerClassOption = None,
    seed: SeedOption = settings.SEED,
    pytorch: Annotated[bool, typer.Option("--pytorch/--no-pytorch", help="Also convert to TorchScript and quantize with PyTorch.")] = True,
    openvino: Annotated[bool, typer.Option("--openvino/--no-openvino", help="Also quantize with NNCF (full bias correction) to OpenVINO IR, and run the FP32 model on OpenVINO at f32; skipped when the openvino extra is not installed.")] = True,
    litert: Annotated[bool, typer.Option("--litert/--no-litert", help="Also quantize to int8 TFLite with the TFLite converter (the converter's calibration, and the ranges of the --target speed model), and evaluate and benchmark them with MLCommons' int8 TFLite ResNet8 (the MLPerf Tiny reference) on LiteRT; skipped when the litert extra is not installed or for --model.")] = True,
    benchmark: Annotated[bool, typer.Option("--benchmark/--no-benchmark", help="Benchmark every model (latency and throughput) for the report.")] = True,
    runs: RunsOption = 100,
    threads: ThreadsOption = None,
    force: Annotated[bool, typer.Option("--force", help="Run every stage, even those whose outputs are up to date.")] = False,
    emulated_images: Annotated[int | None, typer.Option(min=10, help="On a CPU with VNNI: images (the first of each class) of the test split scored under emulation of an AVX2 CPU, for each 8-bit model whose saturating path is not proven equal. Default: the whole split where the AVX2 kernels run natively, 500 under qemu (about 100 images/s on ResNet8).", show_default=False)] = None,
    choice: DataChoice = NO_CHOICE,
    as_json: JsonFlag = False,
    workers: WorkersOption = None,
    ray_address: RayAddressOption = None,
) -> None:
    """The whole study: convert, calibrate, quantize (int8, uint8, speed, PyTorch), evaluate, benchmark, report.

    Each stage is skipped when its inputs (by sha256), its options and its outputs are those recorded in results/manifest.json
    by the run that made them. The manifest also keeps the tool and library versions, the seed and each stage's command and
    wall time. Outputs go to models/, calibration/, results/ and reports/ here. `ptq run --model yours.onnx --data DIR`
    runs it on your model and images; a backend that cannot take it is left out, and the run says why and goes on.
    With --workers or --ray-address, the stages that do not read each other's files run side by side as tasks, one CPU
    each (the benchmark and the report alone); a cluster must share the run's folder.
    """
    options = pipeline_service.StudyOptions(
        keras_model=keras, data_dir=choice.data, model=model,
        calibration_data=choice.calibration_data, flags=choice.flags, samples_per_class=samples_per_class, calibration_size=choice.calibration_size,
        without=frozenset(name for name, wanted in ((pipeline_service.PYTORCH, pytorch), (pipeline_service.OPENVINO, openvino),
                                                    (pipeline_service.LITERT, litert)) if not wanted),
        seed=seed, benchmark=benchmark, benchmark_runs=runs, threads=threads, force=force, emulated_images=emulated_images,
        workers=_workers(workers, ray_address))
    columns = (SpinnerColumn(finished_text="[green]✓[/green]"), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console.err, disable=not console.err.is_terminal) as display:
        tasks: dict[int, Any] = {}

        def on_stage(index: int, total: int, stage: pipeline_service.Stage, outcome: pipeline_service.StageOutcome | None) -> None:
            if not console.err.is_terminal:  # piped or logged: one plain line as each stage starts and as it ends
                console.err.print(render.stage_line(index, total, stage.name, outcome), highlight=False, soft_wrap=True)
                return
            label = escape(f"[{index + 1}/{total}] {stage.name}")
            if outcome is None:
                tasks[index] = display.add_task(label, total=1)
            else:
                display.update(tasks[index], completed=1, description=render.stage_label(label, outcome))

        result = pipeline_service.run(options, run_stage_command, list(COMMAND_LINE.get()), on_stage)
    _emit(as_json, result, render_report.pipeline_run(result))


for _command in app.registered_commands:
    _command.help = _reflow(_command.help or inspect.getdoc(_command.callback) or "")
    if _command.callback is not None:
        _command.callback = _guarding_inputs(_command.callback)


