"""The whole study as one run of stages, each skipped when its inputs and outputs are unchanged.

A stage is up to date when the manifest's entry for it has the same options and the same sha256 for
every input, and every output still exists with the sha256 recorded when the stage wrote it. The
manifest (results/manifest.json) thus describes the files on disk: how each was made, from what, with
which versions, and how long its stage took. A run where every stage is up to date writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata as package_metadata
from pathlib import Path

import ptq_cli
from ptq_cli import bounded, settings
from ptq_cli import cpu as cpu_info
from ptq_cli.atomic import check_writable, write_text
from ptq_cli.backends import litert as litert_backend
from ptq_cli.backends import openvino as openvino_backend
from ptq_cli.datasets import Dataset, open_dataset
from ptq_cli.errors import PtqError
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.services import calibration as calibration_service
from ptq_cli.services import convert as convert_service
from ptq_cli.services import quant_settings
from ptq_cli.services import quantize as quantize_service
from ptq_cli.services.measure import benchmark as benchmark_service
from ptq_cli.services.measure import evaluate as evaluate_service
from ptq_cli.services.measure import report as report_service
from ptq_cli.services.models import load_model

MANIFEST_SCHEMA = 1
LIBRARIES = ("numpy", "onnx", "onnxruntime", "torch", "onnx2torch", "tensorflow-cpu", "tf2onnx", "typer", "rich", "pillow")
# ptq quantize options of the quantized models, in the order `make run` always made them; each is named
# by quantize's default_output (resnet8_int8.onnx, resnet8_uint8.onnx, resnet8_uint8_speed.onnx, resnet8_pytorch_int8.pt).
QUANTIZED = ({"dtype": "int8"}, {"dtype": "uint8"}, {"target": "speed"}, {"backend": "pytorch", "dtype": "int8"})
# With the openvino extra: NNCF int8 with full bias correction (the more accurate of NNCF's two on ResNet8,
# README), and the FP32 model run on OpenVINO at f32 to compare it with on its own runtime.
OPENVINO_QUANTIZED = {"backend": "openvino", "bias_correction": "full"}
# With the litert extra (the study only: LiteRT quantizes the Keras source): the converter's own calibration,
# and the same with the activation ranges of the `--target speed` onnxruntime model (both models on one grid).
LITERT_QUANTIZED = ({"backend": "litert"}, {"backend": "litert", "ranges_from": "speed"})
# On a VNNI CPU the saturating path of a model that cannot be proven exact is emulated (about 35 to 70 s
# for 1,000 images on 2 cores): the study emulates this many, so that `ptq run` stays within minutes.
RUN_EMULATED_IMAGES = 500


@dataclass(frozen=True)
class RunOptions:
    keras_model: Path | None  # the study's source; None when `model` is given
    data_dir: Path
    model: Path | None = None  # a user's FP32 ONNX model: no Keras step, outputs named after it
    calibration_data: Path | None = None
    flags: PreprocessingFlags = PreprocessingFlags()
    pytorch: bool = True  # also convert to TorchScript and quantize with PyTorch
    openvino: bool = True  # also quantize with NNCF and run on OpenVINO, when the extra is installed
    litert: bool = True  # also quantize to TFLite and evaluate the MLPerf Tiny int8 reference (the study only), when the extra is installed
    samples_per_class: int | None = None  # None: the default, or all of the smallest class when it has fewer
    seed: int = settings.SEED
    benchmark: bool = True
    benchmark_runs: int = 100
    threads: int | None = None
    results_dir: Path = settings.RESULTS_DIR
    markdown: Path = settings.MARKDOWN_REPORT
    force: bool = False


@dataclass(frozen=True)
class Stage:
    name: str
    command: str  # the equivalent single ptq command, for people reading the manifest
    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]
    options: dict
    action: Callable[[], object]
    # Dataset splits read, hashed by content as one input each (a folder of 10,000 images is one entry).
    data_inputs: tuple[tuple[Dataset, str], ...] = ()


@dataclass(frozen=True)
class StageOutcome:
    name: str
    command: str
    ran: bool  # False: up to date, skipped
    seconds: float  # this run's time for the stage (hashing only, when skipped)
    inputs: dict[str, str]  # path -> sha256
    outputs: dict[str, str]


@dataclass(frozen=True)
class RunResult:
    stages: list[StageOutcome]
    wall_seconds: float
    manifest: Path
    manifest_written: bool
    report: report_service.Report | None = None  # the comparison of the study's models, from their records

    @property
    def ran(self) -> list[str]:
        return [stage.name for stage in self.stages if stage.ran]


# Called before (outcome None) and after each stage.
StageCallback = Callable[[int, Stage, "StageOutcome | None"], None]


@dataclass
class _Hashes:
    """sha256 of files, remembered by (size, mtime) so the 180 MB of CIFAR are read once per run."""

    known: dict[tuple[str, int, int], str] = field(default_factory=dict)

    def __call__(self, path: Path) -> str:
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self.known:
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            self.known[key] = digest.hexdigest()
        return self.known[key]


def _flag_text(flags: PreprocessingFlags) -> str:
    parts = []
    if flags.preset:
        parts.append(f"--preprocess {flags.preset}")
    if flags.scale is not None:
        parts.append(f"--scale {flags.scale:g}")
    for name in ("mean", "std"):
        if getattr(flags, name) is not None:
            parts.append(f"--{name} {','.join(f'{value:g}' for value in getattr(flags, name))}")
    if flags.bgr is not None:
        parts.append("--bgr" if flags.bgr else "--rgb")
    return (" " + " ".join(parts)) if parts else ""


def plan(options: RunOptions, render_markdown: Callable[[report_service.Report], str]) -> list[Stage]:
    """The stages of `make run`, in order; each reads only files earlier stages (or the user) provide."""
    data, results, flags = options.data_dir, options.results_dir, options.flags
    dataset = open_dataset(data)
    calibration_dataset = open_dataset(options.calibration_data) if options.calibration_data else dataset
    if options.calibration_data is None and dataset.single_set:
        raise PtqError(f"{data}: one set of images with no train split: give --calibration-data to calibrate on other images")
    test = ((dataset, dataset.evaluation_split()),)
    train = ((calibration_dataset, calibration_dataset.calibration_split()),)
    data_flags = f" --data {data}" + (f" --calibration-data {options.calibration_data}" if options.calibration_data else "") + _flag_text(flags)
    flag_options = {key: value for key, value in asdict(flags).items() if value is not None}
    if options.samples_per_class is None:
        options = replace(options, samples_per_class=calibration_service.default_samples_per_class(calibration_dataset))
    fp32 = options.model if options.model is not None else settings.FP32_ONNX
    stem = Path(fp32).stem
    fp32_torch = settings.MODELS_DIR / f"{stem}.pt"
    calibration = settings.CALIBRATION_FILE if options.model is None else settings.CALIBRATION_FILE.with_name(f"{stem}_calib.npz")
    quantized = [(quantize_service.default_output(fp32, quant_settings.make_settings(**quantize_options), settings.MODELS_DIR), quantize_options)
                 for quantize_options in QUANTIZED if options.pytorch or quantize_options.get("backend") != "pytorch"]
    with_openvino = options.openvino and openvino_backend.available()
    if with_openvino:
        quantized.append((quantize_service.default_output(fp32, quant_settings.make_settings(**OPENVINO_QUANTIZED), settings.MODELS_DIR),
                          OPENVINO_QUANTIZED))
    with_litert = options.litert and options.model is None and litert_backend.available()
    if with_litert:
        speed = quantize_service.default_output(fp32, quant_settings.make_settings(target="speed"), settings.MODELS_DIR)
        for litert_options in LITERT_QUANTIZED:
            litert_options = {**litert_options, "ranges_from": str(speed)} if "ranges_from" in litert_options else litert_options
            quantized.append((quantize_service.default_output(fp32, quant_settings.make_settings(**litert_options), settings.MODELS_DIR),
                              litert_options))
    models = [fp32, *([fp32_torch] if options.pytorch else []), *(path for path, _ in quantized)]
    stages = []
    if options.model is None:
        stages.append(Stage("convert keras -> onnx", f"ptq convert --keras {options.keras_model}{data_flags}", (options.keras_model,), (fp32,),
                            {"opset": 13, **flag_options},
                            lambda: convert_service.keras_to_onnx(options.keras_model, fp32, dataset, flags=flags), test))
    if options.pytorch:
        stages.append(Stage("convert onnx -> pytorch", f"ptq convert --onnx {fp32} --torch {fp32_torch}{data_flags}", (fp32,), (fp32_torch,), flag_options,
                            lambda: convert_service.onnx_to_torchscript(fp32, fp32_torch, dataset, flags=flags), test))
    stages.append(Stage("calibrate", f"ptq calibrate --model {fp32} --samples-per-class {options.samples_per_class} --seed {options.seed}{data_flags}",
                        (fp32,), (calibration,), {"samples_per_class": options.samples_per_class, "seed": options.seed},
                        lambda: _calibrate(options, calibration_dataset, fp32, calibration), train))
    for output, quantize_options in quantized:
        command_flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in quantize_options.items())
        files = (output, output.with_suffix(".bin")) if output.suffix == ".xml" else (output,)  # an IR is two files
        # LiteRT also reads the Keras source and, for its ranges, the onnxruntime model they come from.
        extra_inputs = ((options.keras_model,) if quantize_options.get("backend") == "litert" else ()) \
            + ((Path(quantize_options["ranges_from"]),) if "ranges_from" in quantize_options else ())
        stages.append(Stage(f"quantize {output.name}", f"ptq quantize --model {fp32} {command_flags}{_flag_text(flags)}",
                            (fp32, calibration, *extra_inputs), files,
                            {**quantize_options, **flag_options, **_portability(quantize_options)},
                            lambda output=output, quantize_options=quantize_options: _quantize(fp32, output, calibration, quantize_options, flags)))
    threads = {"threads": options.threads} if options.threads else {}
    # A figure belongs to the int8 path it was measured on: a machine of the other kind evaluates again.
    threads["cpu_int8_path"] = cpu_info.current().int8_path
    for model in models:
        record = evaluate_service.record_path(results, model, dataset)
        stages.append(Stage(f"evaluate {model.name}", f"ptq evaluate --model {model}{data_flags}", (model,), (record,), {**threads, **flag_options},
                            lambda model=model: evaluate_service.save_record(
                                evaluate_service.evaluate_model(model, dataset, threads=options.threads, flags=flags), results, dataset), test))
    # Both x86 int8 paths of the 8-bit onnxruntime and PyTorch models: the one this CPU does not take, from
    # onnxruntime's exact kernels, a proof, or emulation (records "~exact" / "~saturating").
    other_path = next(path for path in cpu_info.INT8_PATHS if path != cpu_info.current().int8_path)
    other_records = []
    for output, quantize_options in quantized:
        made = quant_settings.make_settings(**quantize_options)
        if not evaluate_service.other_path_measurable(made.backend, made.overflow_fix, other_path):
            continue
        record = evaluate_service.record_path(results, output, dataset, evaluate_service.requested_tag(other_path))
        other_records.append(record)
        stages.append(Stage(f"evaluate {output.name} on the {other_path} int8 path",
                            f"ptq evaluate --model {output} --int8-path {other_path} --emulated-images {RUN_EMULATED_IMAGES}{data_flags}",
                            (output,), (record,), {**threads, **flag_options, "int8_path": other_path, "emulated_images": RUN_EMULATED_IMAGES},
                            lambda model=output: evaluate_service.save_record(evaluate_service.evaluate_model(
                                model, dataset, threads=options.threads, flags=flags, int8_path=other_path, subset=RUN_EMULATED_IMAGES),
                                results, dataset), test))
    openvino_fp32 = ()
    openvino_tag = evaluate_service.runtime_tag(fp32, "openvino", "f32")
    also = ((fp32, "openvino", "f32"),) if with_openvino else ()
    if with_openvino:
        openvino_fp32 = (evaluate_service.record_path(results, fp32, dataset, openvino_tag),)
        stages.append(Stage(f"evaluate {fp32.name} on openvino", f"ptq evaluate --model {fp32} --runtime openvino --precision f32{data_flags}", (fp32,),
                            openvino_fp32, {**threads, **flag_options, "runtime": "openvino", "precision": "f32"},
                            lambda: evaluate_service.save_record(evaluate_service.evaluate_model(
                                fp32, dataset, threads=options.threads, flags=flags, runtime="openvino", precision="f32"), results, dataset), test))
    reference = settings.mlperf_reference_path()
    references = [reference] if with_litert and reference.is_file() else []
    for model in references:
        record = evaluate_service.record_path(results, model, dataset)
        stages.append(Stage(f"evaluate {settings.MLPERF_REFERENCE_LABEL}",
                            f"ptq evaluate --model {model} --label '{settings.MLPERF_REFERENCE_LABEL}'{data_flags}", (model,), (record,),
                            {**threads, "label": settings.MLPERF_REFERENCE_LABEL},
                            lambda model=model: evaluate_service.save_record(evaluate_service.evaluate_model(
                                model, dataset, threads=options.threads, label=settings.MLPERF_REFERENCE_LABEL), results, dataset), test))
    models_and_references = [*models, *references]
    if options.benchmark:
        # One stage for all models: they are measured in turns, so their speed-ups come from one measurement.
        # With OpenVINO, the FP32 model also runs on it, in the same process (`ptq benchmark --runtime openvino` alone).
        benchmarks = tuple(benchmark_service.benchmark_path(results, model) for model in models_and_references) \
            + tuple(benchmark_service.benchmark_path(results, model, openvino_tag) for model, _, _ in also)
        command = f"ptq benchmark {' '.join(f'--model {model}' for model in models_and_references)} --runs {options.benchmark_runs}{data_flags}"
        if also:
            command += f" (and --model {fp32} --runtime openvino --precision f32 in the same process)"
        stages.append(Stage("benchmark", command, tuple(models_and_references), benchmarks,
                            {"runs": options.benchmark_runs, "openvino_fp32": bool(also), **threads},
                            lambda: _benchmark(models_and_references, also, dataset, options), test))
    records = tuple(evaluate_service.record_path(results, model, dataset) for model in models_and_references) + openvino_fp32 + tuple(other_records)
    if options.benchmark:
        records += benchmarks
    stages.append(Stage("report", f"ptq report --markdown {options.markdown}", records, (options.markdown,), {},
                        lambda: write_text(options.markdown, render_markdown(report_service.report_from_results(results)))))
    return stages


def _benchmark(models: list[Path], also, dataset: Dataset, options: RunOptions) -> None:
    for record in benchmark_service.benchmark_models(models, dataset, threads=options.threads, runs=options.benchmark_runs, flags=options.flags,
                                                     also=also):
        benchmark_service.save_benchmark(record, options.results_dir)


def _portability(quantize_options: dict) -> dict:
    made = quant_settings.make_settings(**quantize_options)
    return {"cpus": made.cpus, "overflow_fix": made.overflow_fix}


def _calibrate(options: RunOptions, dataset: Dataset, model: Path, output: Path) -> None:
    size = load_model(model, 1, options.flags).input.size
    calibration = calibration_service.build_calibration_set(dataset, options.samples_per_class, options.seed, size)
    calibration_service.save_calibration_set(calibration, output)


def _quantize(model: Path, output: Path, calibration: Path, options: dict, flags: PreprocessingFlags) -> None:
    quantization_settings = quant_settings.make_settings(**options)
    quantize_service.quantize(model, output, quantization_settings, calibration_service.load_calibration_set(calibration), flags)


def manifest_path(results_dir: Path) -> Path:
    return Path(results_dir) / settings.MANIFEST_NAME


def read_manifest(path: Path) -> dict:
    """The previous manifest, or an empty one; a damaged manifest only means every stage runs again."""
    try:
        data = json.loads(bounded.read_text(Path(path), "record"))
    except (PtqError, OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
        return {}
    stages = data.get("stages")
    # Only well-formed stage entries count; a stage without one runs again.
    data["stages"] = [entry for entry in stages if _well_formed(entry)] if isinstance(stages, list) else []
    return data


def _well_formed(entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("options"), dict)
            and all(isinstance(entry.get(key), dict) and all(isinstance(value, str) for value in entry[key].values())
                    for key in ("inputs", "outputs")))


def _up_to_date(entry: dict | None, stage: Stage, inputs: dict[str, str], hashes: _Hashes) -> bool:
    # Another ptq version may make other outputs from the same inputs (e.g. a new graph rewrite).
    if not entry or entry.get("tool_version") != ptq_cli.__version__ or entry.get("options") != stage.options or entry.get("inputs") != inputs:
        return False
    recorded = entry.get("outputs") or {}
    return set(recorded) == {str(path) for path in stage.outputs} and all(
        path.is_file() and hashes(path) == recorded[str(path)] for path in stage.outputs
    )


def _check_inputs(stage: Stage) -> None:
    for path in stage.inputs:
        if not path.is_file():
            raise PtqError(f"{path}: input of stage '{stage.name}' not found")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = package_metadata.version(name)
        except package_metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def run(
    options: RunOptions,
    render_markdown: Callable[[report_service.Report], str],
    command_line: list[str],
    on_stage: StageCallback | None = None,
) -> RunResult:
    """Run every stage that is not up to date (all of them with `force`); write the manifest if any ran."""
    began, started_at = time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest_file = manifest_path(options.results_dir)
    previous = read_manifest(manifest_file)
    entries: dict[str, dict] = {entry["name"]: entry for entry in previous.get("stages", [])}
    hashes = _Hashes()
    outcomes: list[StageOutcome] = []
    calibration_service.check_seed(options.seed)
    for option, value in (("--samples-per-class", options.samples_per_class or 1), ("--runs", options.benchmark_runs)):
        if value < 1:
            raise PtqError(f"{option}: must be at least 1, got {value}")
    from ptq_cli.backends.model_file import resolve_threads

    resolve_threads(options.threads)
    stages = plan(options, render_markdown)
    content_keys: dict[tuple[str, str], str] = {}

    def content_key(dataset: Dataset, split: str) -> str:
        key = (str(dataset.root), split)
        if key not in content_keys:
            content_keys[key] = dataset.content_key(split)
        return content_keys[key]

    for path in (manifest_file, *(output for stage in stages for output in stage.outputs)):
        check_writable(path)  # a read-only directory fails now, not after minutes of work
    for index, stage in enumerate(stages):
        if on_stage:
            on_stage(index, stage, None)
        started = time.perf_counter()
        _check_inputs(stage)
        inputs = {str(path): hashes(path) for path in stage.inputs}
        inputs.update({f"{dataset.root} ({split})": content_key(dataset, split) for dataset, split in stage.data_inputs})
        ran = options.force or not _up_to_date(entries.get(stage.name), stage, inputs, hashes)
        if ran:
            stage.action()
        outputs = {str(path): hashes(path) for path in stage.outputs}
        outcome = StageOutcome(stage.name, stage.command, ran, round(time.perf_counter() - started, 3), inputs, outputs)
        if ran:
            entries[stage.name] = {
                "name": stage.name, "command": stage.command, "options": stage.options, "inputs": inputs, "outputs": outputs,
                "tool_version": ptq_cli.__version__,
                "seconds": outcome.seconds, "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        outcomes.append(outcome)
        if on_stage:
            on_stage(index, stage, outcome)
    wall = round(time.perf_counter() - began, 3)
    written = any(outcome.ran for outcome in outcomes)
    if written:
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "tool": "ptq",
            "tool_version": ptq_cli.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "libraries": library_versions(),
            "seed": options.seed,
            "last_run": {
                "command": command_line,
                "started_at": started_at,
                "wall_seconds": wall,
                "ran": [outcome.name for outcome in outcomes if outcome.ran],
                "up_to_date": [outcome.name for outcome in outcomes if not outcome.ran],
            },
            # Stages in plan order; a stage that was up to date keeps the entry of the run that made its outputs.
            "stages": [entries[stage.name] for stage in stages],
        }
        write_text(manifest_file, json.dumps(manifest, indent=2) + "\n")
    return RunResult(outcomes, wall, manifest_file, written, report_service.report_from_results(options.results_dir))
