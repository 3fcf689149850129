"""The whole study as one run of stages, each skipped when its inputs and outputs are unchanged.

A stage is up to date when the manifest's entry for it has the same options and the same sha256 for
every input, and every output still exists with the sha256 recorded when the stage wrote it. The
manifest (results/manifest.json) thus describes the files on disk: how each was made, from what, with
which versions, and how long its stage took. A run where every stage is up to date writes nothing.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import ptq_cli
from ptq_cli import backends, settings
from ptq_cli.datasets import Dataset, open_dataset
from ptq_cli.errors import Interrupted, PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import check_folder_writable, check_outside, check_writable, companions, write_text
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.model_file import read_onnx, resolve_threads
from ptq_cli.quantize import reuse
from ptq_cli.services import models as models_service
from ptq_cli.services import quant_settings
from ptq_cli.services.executor import HERE, Executor, Workers, executor
from ptq_cli.services.make import calibration as calibration_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.services.measure import report as report_service
from ptq_cli.services.study.stage_task import RunCommand, StageFiles, StageTask, run_stage_task, written_by
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import plan as int8_plan

MANIFEST_SCHEMA = 1
LIBRARIES = ("numpy", "onnx", "onnxruntime", "torch", "onnx2torch", "tensorflow-cpu", "tf2onnx", "typer", "rich", "pillow")
# ptq quantize options of the quantized models, in the order `make run` always made them; each is named
# by quantize's default_output (resnet8_int8.onnx, resnet8_uint8.onnx, resnet8_uint8_speed.onnx, resnet8_pytorch_int8.pt).
QUANTIZED: tuple[dict[str, Any], ...] = ({"dtype": "int8"}, {"dtype": "uint8"}, {"target": "speed"}, {"backend": "pytorch", "dtype": "int8"})
# With the openvino extra: the default OpenVINO int8 IR (ptq's QDQ quantization converted; closer to FP32
# than NNCF's on ResNet8 and EfficientNet-Lite0, docs), and the FP32 model run on OpenVINO at f32 to
# compare it with on its own runtime.
OPENVINO_QUANTIZED: dict[str, Any] = {"backend": "openvino"}
# The flash the study's 4-bit model may take: MLPerf Tiny's reference is 96 KB; the study aims at 60 KB.
MICROCONTROLLER_FLASH_KB = 60
# With the litert extra (the study only: LiteRT quantizes the Keras source): the converter's own calibration,
# the same with the activation ranges of the `--target speed` onnxruntime model (both models on one grid), and
# the converter's model with 4-bit filters (the microcontroller's smallest).
LITERT_QUANTIZED: tuple[dict[str, Any], ...] = ({"backend": "litert"}, {"backend": "litert", "ranges_from": "speed"},
                                                {"backend": "litert", "weight_dtype": "int4", "max_flash_kb": MICROCONTROLLER_FLASH_KB})
# The backends the study names (its recipe above is data; which of them run is the user's and the extras' say).
# Where one cannot take the model (onnx2torch lacks an op, NNCF fails on a graph), the study goes on without it.
PYTORCH, OPENVINO, LITERT = "pytorch", "openvino", "litert"


@dataclass(frozen=True)
class StudyOptions:
    keras_model: Path | None  # the study's source (None: the MLPerf Tiny ResNet8's); not with `model`
    data_dir: Path
    model: Path | None = None  # a user's FP32 ONNX model: no Keras step, outputs named after it
    calibration_data: Path | None = None
    flags: PreprocessingFlags = PreprocessingFlags()
    # Backends the user left out of the study (`--no-pytorch`...); one whose extra is not installed is left out too.
    without: frozenset[str] = frozenset()
    samples_per_class: int | None = None  # None: the default, or all of the smallest class when it has fewer
    calibration_size: int | None = None  # calibration images in all, instead of per class
    seed: int = settings.SEED
    benchmark: bool = True
    benchmark_runs: int = 100
    threads: int | None = None
    results_dir: Path = settings.RESULTS_DIR
    markdown: Path = settings.MARKDOWN_REPORT
    force: bool = False
    emulated_images: int | None = None  # on a VNNI CPU: images scored under emulation of the saturating path, per model (None: x86/plan.emulated_images)
    workers: Workers = HERE  # where the independent stages run: one after another here, or side by side as tasks on Ray

    def uses(self, backend: str) -> bool:
        return backend not in self.without and backends.backend(backend).available()


@dataclass(frozen=True)
class Stage:
    """One step of the study, written once: the ptq command it is, with its arguments as a user would type
    them; what runs is that command (`RunCommand`), in this process. Its records are named by the command,
    from what it measured: the stage learns them from what the command returns."""

    name: str
    command: str  # the ptq command, e.g. "quantize"
    arguments: tuple[str, ...]
    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]  # the files it is asked to write by name (a model, the calibration set, the report); not its records
    options: dict  # what decides its outputs besides its inputs (the manifest compares them)
    # Dataset splits read, hashed by content as one input each (a folder of 10,000 images is one entry).
    data_inputs: tuple[tuple[Dataset, str], ...] = ()
    reads_written_by: tuple[str, ...] = ()  # stages whose files are inputs of this one (the report reads the records)
    backend: str | None = None  # the study's optional backend it serves: where it fails, that backend is left out

    @property
    def command_line(self) -> str:
        """The equivalent single ptq command, for people reading the manifest."""
        return " ".join(["ptq", self.command, *(shlex.quote(argument) for argument in self.arguments)])


@dataclass(frozen=True)
class StageOutcome:
    name: str
    command: str
    ran: bool  # False: up to date, skipped
    seconds: float  # this run's time for the stage (hashing only, when skipped)
    inputs: dict[str, str]  # path -> sha256
    outputs: dict[str, str]
    left_out: str | None = None  # why its backend was left out of the study (the stage's error); it wrote nothing


@dataclass(frozen=True)
class RunResult:
    stages: list[StageOutcome]
    wall_seconds: float
    manifest: Path
    manifest_written: bool
    report: report_service.Report | None = None  # the comparison of the study's models, from their records
    left_out: dict[str, str] = field(default_factory=dict)  # backend -> the error that left it out of this run

    @property
    def ran(self) -> list[str]:
        return [stage.name for stage in self.stages if stage.ran]


# Called before (outcome None) and after each stage, with its index and the number of stages.
StageCallback = Callable[[int, int, Stage, "StageOutcome | None"], None]


@dataclass
class _Hashes:
    """sha256 of files, remembered by (size, mtime) so the 180 MB of CIFAR are read once per run, and dataset splits' content keys."""

    known: dict[tuple[str, int, int], str] = field(default_factory=dict)
    splits: dict[tuple[str, str], str] = field(default_factory=dict)  # (dataset root, split) -> content key

    def __call__(self, path: Path) -> str:
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self.known:
            self.known[key] = bounded.sha256(path, bounded.ARRAY_BYTES, "input file").hex()
        return self.known[key]

    def content_key(self, dataset: Dataset, split: str) -> str:
        """A dataset split's content key, computed once per run."""
        key = (str(dataset.root), split)
        if key not in self.splits:
            self.splits[key] = dataset.content_key(split)
        return self.splits[key]


def _flag_arguments(flags: PreprocessingFlags) -> tuple[str, ...]:
    """The preprocessing options that give these flags."""
    arguments: list[str] = []
    if flags.preset:
        arguments += ["--preprocess", flags.preset]
    if flags.scale is not None:
        arguments += ["--scale", f"{flags.scale:g}"]
    for name in ("mean", "std"):
        values = getattr(flags, name)
        if values is not None:
            arguments += [f"--{name}", ",".join(f"{value:g}" for value in values)]
    if flags.bgr is not None:
        arguments.append("--bgr" if flags.bgr else "--rgb")
    if flags.size is not None:
        arguments += ["--input-size", f"{flags.size[0]}x{flags.size[1]}"]
    return tuple(arguments)


def _arguments(**options: Any) -> tuple[str, ...]:
    """Options as a user types them: `--name value`, a repeated option once per value, None left out."""
    tokens: list[str] = []
    for name, value in options.items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if item is not None:
                tokens += [f"--{name.replace('_', '-')}", str(item)]
    return tuple(tokens)


@dataclass(frozen=True)
class _Study:
    """What the stages of one plan share."""

    options: StudyOptions
    dataset: Dataset
    calibration_dataset: Dataset
    fp32: Path
    calibration: Path
    quantized: list[tuple[Path, dict[str, Any]]]  # each quantized model and its quantize options
    # The FP32 model every model is measured against, where the test images' labels are not its classes (or there
    # are none); None where each is measured against its own source, as `evaluate` does. Known once the FP32 model exists.
    against: Path | None = None

    @property
    def results(self) -> Path:
        return self.options.results_dir

    @property
    def test(self) -> tuple[tuple[Dataset, str], ...]:
        return ((self.dataset, self.dataset.evaluation_split()),)

    def data_arguments(self, calibration: bool = False, preprocessing: bool = True) -> tuple[str, ...]:
        """--data, and --calibration-data and the preprocessing options for the commands that take them."""
        chosen = self.options.calibration_data if calibration else None
        flags = self.options.flags if preprocessing else PreprocessingFlags(size=self.options.flags.size)  # the size, for any command that reads the model
        return (*_arguments(data=self.options.data_dir, calibration_data=chosen), *_flag_arguments(flags))

    @property
    def results_arguments(self) -> tuple[str, ...]:
        return _arguments(results_dir=self.results if self.results != settings.RESULTS_DIR else None)

    @property
    def flag_options(self) -> dict:
        return {key: value for key, value in asdict(self.options.flags).items() if value is not None}

    @property
    def run_options(self) -> dict:
        """What decides an evaluation besides its inputs: the threads, and the int8 path this CPU takes (a
        machine of the other kind evaluates again)."""
        return {**({"threads": self.options.threads} if self.options.threads else {}), "cpu_int8_path": cpu_info.current().int8_path}

    @property
    def openvino_fp32(self) -> tuple[tuple[Path, str, str], ...]:
        """The FP32 model on OpenVINO at f32, to compare NNCF's model with on its own runtime."""
        return ((self.fp32, OPENVINO, "f32"),) if self.options.uses(OPENVINO) else ()

    @property
    def microcontroller_runs(self) -> tuple[tuple[Path, str, str | None], ...]:
        """(model, runtime, label): every file a microcontroller runtime takes (the TFLite models, the MLPerf
        reference), scored on that runtime's kernels too."""
        files = [(path, None) for path, _ in self.quantized] + [(path, settings.MLPERF_REFERENCE_LABEL) for path in _references(self)]
        return tuple((path, row.name, label) for row in backends.TABLE.values() if row.runtime.microcontroller and row.available()
                     for path, label in files if path.suffix in row.runtime.runs_suffixes)

    def evaluation(self, name: str, model: Path, options: dict, backend: str | None = None, **chosen: Any) -> Stage:
        """The stage evaluating `model` with these evaluate options (int8_path, runtime, precision, label, emulated_images),
        for the optional `backend` that made the model or runs it (else the model's own)."""
        arguments = _arguments(model=model, **chosen, threads=self.options.threads, against_fp32=self.against)
        return Stage(name, "evaluate", (*arguments, *self.data_arguments(), *self.results_arguments), (model,), (),
                     {**self.run_options, **options}, self.test, backend=backend or self.backend_of(model))

    def backend_of(self, model: Path) -> str | None:
        """The optional backend that made `model` (None: the FP32 model, or an onnxruntime one)."""
        made = {_torch_fp32(self): PYTORCH, **{path: choice.get("backend") for path, choice in self.quantized}}.get(Path(model))
        return made if made in (PYTORCH, OPENVINO, LITERT) else None


def _against(study: _Study) -> Path | None:
    """Where the test images' labels are not the FP32 model's classes (or there are none), every model is
    measured against the FP32 model (fidelity); else each against its own source."""
    if study.dataset.labelled and Path(study.fp32).is_file():
        classes = len(study.dataset.class_names())
        if models_service.load_model(study.fp32, 1, study.options.flags).num_classes == classes:
            return None
    return Path(study.fp32)


def _study(options: StudyOptions) -> tuple[_Study, StudyOptions]:
    dataset = open_dataset(options.data_dir)
    calibration_dataset = open_dataset(options.calibration_data) if options.calibration_data else dataset
    if options.samples_per_class is None and options.calibration_size is None and calibration_dataset.labelled:
        options = replace(options, samples_per_class=calibration_service.default_samples_per_class(calibration_dataset))
    fp32 = options.model if options.model is not None else settings.FP32_ONNX
    calibration = settings.CALIBRATION_FILE if options.model is None else settings.CALIBRATION_FILE.with_name(f"{Path(fp32).stem}_calib.npz")
    chosen: list[dict[str, Any]] = [choice for choice in QUANTIZED if options.uses(choice.get("backend", backends.DEFAULT))]
    if options.uses(OPENVINO):
        chosen.append(OPENVINO_QUANTIZED)
    if options.uses(LITERT) and options.model is None:  # LiteRT quantizes the study's Keras source
        speed = quantize_service.default_output(fp32, quant_settings.make_settings(target="speed"), settings.MODELS_DIR)
        chosen += [{**choice, "ranges_from": str(speed)} if "ranges_from" in choice else choice for choice in LITERT_QUANTIZED]
    quantized = [(quantize_service.default_output(fp32, quant_settings.make_settings(**choice), settings.MODELS_DIR), choice) for choice in chosen]
    return _Study(options, dataset, calibration_dataset, fp32, calibration, quantized), options


def _torch_fp32(study: _Study) -> Path:
    return settings.MODELS_DIR / f"{Path(study.fp32).stem}.pt"


def _source_stages(study: _Study) -> list[Stage]:
    options, fp32 = study.options, study.fp32
    stages = []
    if options.model is None and options.keras_model is not None:
        keras = options.keras_model
        stages.append(Stage("convert keras -> onnx", "convert", (*_arguments(keras=keras, output=fp32), *study.data_arguments()), (keras,), (fp32,),
                            {"opset": 13, **study.flag_options}, study.test))
    if options.uses(PYTORCH):
        torch_fp32 = _torch_fp32(study)
        stages.append(Stage("convert onnx -> pytorch", "convert", (*_arguments(onnx=fp32, torch=torch_fp32), *study.data_arguments()),
                            (fp32,), (torch_fp32,), study.flag_options, study.test, backend=PYTORCH))
    train = ((study.calibration_dataset, study.calibration_dataset.calibration_split()),)
    sizing = {"samples_per_class": options.samples_per_class} if options.samples_per_class else {"calibration_size": options.calibration_size}
    stages.append(Stage("calibrate", "calibrate", (*_arguments(model=fp32, **sizing, seed=options.seed, output=study.calibration),
                                                   *study.data_arguments(calibration=True, preprocessing=False)),
                        (fp32,), (study.calibration,), {**sizing, "seed": options.seed}, train))
    return stages


def _quantize_stages(study: _Study) -> list[Stage]:
    stages = []
    for output, choice in study.quantized:
        made = quant_settings.make_settings(**choice)
        # LiteRT also reads the Keras source and, for its ranges, the onnxruntime model they come from.
        reads_keras = made.format == backends.backend(LITERT).format
        extra_inputs = tuple(Path(path) for path in (study.options.keras_model if reads_keras else None, choice.get("ranges_from")) if path)
        arguments = (*_arguments(model=study.fp32, **choice, calibration=study.calibration, output=output), "--no-portability-cost",
                     *study.data_arguments(calibration=True), *study.results_arguments)
        stages.append(Stage(f"quantize {output.name}", "quantize", arguments, (study.fp32, study.calibration, *extra_inputs), tuple(companions(output)),
                            {**choice, **study.flag_options, "cpus": made.cpus, "overflow_fix": made.overflow_fix, "stem": made.stem or "auto"},
                            backend=study.backend_of(output)))
    return stages


def _models(study: _Study) -> list[Path]:
    return [study.fp32, *([_torch_fp32(study)] if study.options.uses(PYTORCH) else []), *(path for path, _ in study.quantized)]


def _references(study: _Study) -> list[Path]:
    reference = settings.mlperf_reference_path()
    return [reference] if study.options.uses(LITERT) and study.options.model is None and reference.is_file() else []


def _evaluate_stages(study: _Study) -> list[Stage]:
    flag_options = study.flag_options
    stages = [study.evaluation(f"evaluate {model.name}", model, flag_options) for model in _models(study)]
    # Both x86 int8 paths of the 8-bit models whose runtime's kernels differ by CPU: the one this CPU does
    # not take, from the exact kernels' switch, a proof, or emulation (records "~exact" / "~saturating").
    other_path = int8_plan.other_path(cpu_info.current())
    for output, choice in study.quantized:
        made = quant_settings.make_settings(**choice)
        emulated = int8_plan.emulated_images(study.options.emulated_images) if other_path == cpu_info.SATURATING else study.options.emulated_images
        if int8_plan.other_path_measurable(backends.backend(made.backend).int8_paths, made.overflow_fix, other_path):
            stages.append(study.evaluation(f"evaluate {output.name} on the {other_path} int8 path", output,
                                           {**flag_options, "int8_path": other_path, "emulated_images": emulated},
                                           int8_path=other_path, emulated_images=emulated))
    for model, runtime, precision in study.openvino_fp32:
        stages.append(study.evaluation(f"evaluate {model.name} on {runtime}", model, {**flag_options, "runtime": runtime, "precision": precision},
                                       OPENVINO, runtime=runtime, precision=precision))
    for model, runtime, named in study.microcontroller_runs:
        stages.append(study.evaluation(f"evaluate {named or model.name} on {runtime}", model,
                                       {**flag_options, "runtime": runtime, **({"label": named} if named else {})}, LITERT, runtime=runtime, label=named))
    label = settings.MLPERF_REFERENCE_LABEL
    stages += [study.evaluation(f"evaluate {label}", model, {"label": label}, LITERT, label=label) for model in _references(study)]
    return stages


def _report_stages(study: _Study, evaluations: list[Stage]) -> list[Stage]:
    options, stages = study.options, []
    measured = tuple(stage.name for stage in evaluations)
    if options.benchmark:
        # One stage for all models: they are measured in turns, so their speed-ups come from one measurement.
        # With OpenVINO, the FP32 model also runs on it, in the same process.
        models = [*_models(study), *_references(study)]
        also = [f"{model}@{runtime}:{precision}" for model, runtime, precision in study.openvino_fp32]
        arguments = _arguments(model=models, also=also, runs=options.benchmark_runs, threads=options.threads)
        stages.append(Stage("benchmark", "benchmark", (*arguments, *study.data_arguments(), *study.results_arguments), tuple(models), (),
                            {"runs": options.benchmark_runs, "openvino_fp32": bool(also), **study.run_options}, study.test))
        measured += ("benchmark",)
    stages.append(Stage("report", "report", (*_arguments(markdown=options.markdown), *study.results_arguments), (), (options.markdown,), {},
                        reads_written_by=measured))
    return stages


def _stages(study: _Study) -> list[Stage]:
    """The stages of `make run`, in order; each reads only files earlier stages (or the user) provide."""
    evaluations = _evaluate_stages(study)
    return _source_stages(study) + _quantize_stages(study) + evaluations + _report_stages(study, evaluations)


def manifest_path(results_dir: Path) -> Path:
    return Path(results_dir) / settings.MANIFEST_NAME


def read_manifest(path: Path) -> dict:
    """The previous manifest, or an empty one; a damaged manifest only means every stage runs again."""
    try:
        data = bounded.json_loads(bounded.read_text(Path(path), "record"))
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
    return bool(recorded) and {str(path) for path in stage.outputs} <= set(recorded) and all(
        Path(path).is_file() and hashes(Path(path)) == digest for path, digest in recorded.items()
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


def _manifest(options: StudyOptions, last_run: dict, stages: list[dict], libraries: dict[str, str | None]) -> dict:
    return {
        "schema": MANIFEST_SCHEMA,
        "tool": "ptq",
        "tool_version": ptq_cli.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "libraries": libraries,
        "seed": options.seed,
        "last_run": last_run,
        "stages": stages,
    }


def _checked(options: StudyOptions) -> StudyOptions:
    """The options checked before any stage runs, the study's Keras model filled in where no model is given."""
    if options.model is not None and options.keras_model is not None:
        raise PtqError("--model and --keras: give one source model, not both")
    if options.model is not None:
        read_onnx(options.model)
    if options.keras_model is not None and Path(options.keras_model).is_dir():
        raise PtqError(f"--keras: {options.keras_model} is a folder; convert a SavedModel with ptq convert --keras "
                       f"{options.keras_model} --output model.onnx, then ptq run --model model.onnx")
    calibration_service.check_seed(options.seed)
    for option, value in (("--samples-per-class", options.samples_per_class or 1), ("--runs", options.benchmark_runs)):
        if value < 1:
            raise PtqError(f"{option}: must be at least 1, got {value}")
    resolve_threads(options.threads)
    return options if options.model is not None else replace(options, keras_model=options.keras_model or settings.keras_model_path())


def _run_stage(stage: Stage, entry: dict | None, hashes: _Hashes, run: _Run) -> tuple[StageOutcome, dict | None]:
    """(what the stage did, its new manifest entry if it ran): its command run unless up to date (always with --force).
    A stage of an optional backend that fails leaves that backend out (an outcome saying why, no entry)."""
    started = time.perf_counter()
    inputs, ran = _to_run(stage, entry, hashes, run)
    try:
        made = written_by(run.command(stage.command, stage.arguments)) if ran else ()
    except PtqError as error:
        if stage.backend is None or isinstance(error, Interrupted):
            raise
        return _left_out(stage, inputs, started, str(error)), None
    return _finished(stage, entry, hashes, run, (inputs, ran, made, started))


def _left_out(stage: Stage, inputs: dict[str, str], started: float, why: str) -> StageOutcome:
    return StageOutcome(stage.name, stage.command_line, True, round(time.perf_counter() - started, 3), inputs, {}, why)


def _to_run(stage: Stage, entry: dict | None, hashes: _Hashes, run: _Run) -> tuple[dict[str, str], bool]:
    """(the stage's inputs by sha256, whether it must run)."""
    _check_inputs(stage)
    read = [Path(path) for name in stage.reads_written_by for path in run.written.get(name, {})]
    inputs = {str(path): hashes(path) for path in (*stage.inputs, *read)}
    inputs.update({f"{dataset.root} ({split})": hashes.content_key(dataset, split) for dataset, split in stage.data_inputs})
    return inputs, run.force or not _up_to_date(entry, stage, inputs, hashes)


def _finished(stage: Stage, entry: dict | None, hashes: _Hashes, run: _Run,
              done: tuple[dict[str, str], bool, tuple[Path, ...], float]) -> tuple[StageOutcome, dict | None]:
    """The outcome and manifest entry of a stage `done`: (its inputs, whether it ran, the files it wrote, when it started)."""
    inputs, ran, made, started = done
    written = dict.fromkeys(map(str, stage.outputs))
    written.update(dict.fromkeys(map(str, made)) if ran else dict.fromkeys((entry or {}).get("outputs", {})))
    outputs = {path: hashes(Path(path)) for path in written}
    run.written[stage.name] = outputs
    outcome = StageOutcome(stage.name, stage.command_line, ran, round(time.perf_counter() - started, 3), inputs, outputs)
    if not ran:
        return outcome, None
    return outcome, {"name": stage.name, "command": stage.command_line, "options": stage.options, "inputs": inputs, "outputs": outputs,
                     "tool_version": ptq_cli.__version__, "seconds": outcome.seconds, "finished_at": datetime.now(UTC).isoformat(timespec="seconds")}


@dataclass
class _Run:
    """What the stages of one run share: the command runner, --force, and the files each stage wrote (or had written)."""

    command: RunCommand
    force: bool
    records: Path  # the results folder, as given
    written: dict[str, dict[str, str]] = field(default_factory=dict)  # stage name -> path -> sha256


# Stages that run in the driver alone, never beside another: timings (the benchmark), and the report, which reads every record.
DRIVER_STAGES = ("benchmark", "report")


def _wave(stages: list[Stage], first: int, sources: int) -> list[int]:
    """The stages from `first` on that can run side by side: none reads what another writes, none is the
    benchmark or the report, and none crosses from the source stages to those that need the FP32 model."""
    wave = [first]
    end = sources if first < sources else len(stages)
    while stages[first].command not in DRIVER_STAGES and first + len(wave) < end:
        candidate = stages[first + len(wave)]
        made = {path for position in wave for path in stages[position].outputs}
        if candidate.command in DRIVER_STAGES or made & set(candidate.inputs) or {stages[position].name for position in wave} & set(candidate.reads_written_by):
            break
        wave.append(first + len(wave))
    return wave


def _run_wave(wave: list[Stage], entries: dict[str, dict], hashes: _Hashes, run: _Run, runs: Executor) -> list[tuple[StageOutcome, dict | None]]:
    """The stages of a wave: those not up to date run side by side as tasks, then each is finished in order."""
    started = time.perf_counter()
    planned = [_to_run(stage, entries.get(stage.name), hashes, run) for stage in wave]
    running = [stage for stage, (_, ran) in zip(wave, planned, strict=True) if ran]
    tasks = [StageTask(stage.command, stage.arguments, str(Path.cwd()), tuple(sorted({str(Path(output).parent) for output in stage.outputs})),
                       str(run.records), may_fail=stage.backend is not None) for stage in running]
    # The driver alone writes what the tasks made, each task's files as it finishes.
    results = dict(zip((stage.name for stage in running), runs.map(run_stage_task, tasks, run.command, each=lambda _, made: made.write()), strict=True))
    done: list[tuple[StageOutcome, dict | None]] = []
    for stage, (inputs, ran) in zip(wave, planned, strict=True):
        made = results.get(stage.name, StageFiles((), (), 0.0))
        if made.failed is not None:
            done.append((replace(_left_out(stage, inputs, started, made.failed), seconds=round(made.seconds, 3)), None))
            continue
        outcome, entry = _finished(stage, entries.get(stage.name), hashes, run, (inputs, ran, tuple(map(Path, made.named)), started))
        if ran:  # its own time, not the wave's
            outcome = replace(outcome, seconds=round(made.seconds, 3))
            entry = {**(entry or {}), "seconds": outcome.seconds}
        done.append((outcome, entry))
    return done


@dataclass(frozen=True)
class _Plan:
    """The stages of a study, in order, and how many of them make its sources (the FP32 model, the calibration set)."""

    study: _Study
    stages: list[Stage]
    sources: int

    @classmethod
    def of(cls, study: _Study) -> _Plan:
        return cls(study, _stages(study), len(_source_stages(study)))

    def without(self, left_out: set[str], done: set[str]) -> tuple[_Plan, int]:
        """The plan without the backends left out, and where to go on in it (what ran is its beginning)."""
        options = replace(self.study.options, without=self.study.options.without | left_out)
        plan = _Plan.of(replace(_study(options)[0], against=self.study.against))
        return plan, sum(stage.name in done for stage in plan.stages)


def _run_plan(plan: _Plan, entries: dict[str, dict], shared: _Run, on_stage: StageCallback | None) -> tuple[list[StageOutcome], dict[str, str], _Plan]:
    """(each stage's outcome, backend -> why it was left out, the plan as it ended): the stages run in order, side by
    side in waves on Ray; a stage of an optional backend that fails takes that backend's stages out of the plan."""
    hashes, outcomes, workers = _Hashes(), [], plan.study.options.workers
    left_out: dict[str, str] = {}
    with executor(workers) as runs, reuse.reusing_made_files():
        index = 0
        while index < len(plan.stages):
            if index == plan.sources:  # the FP32 model exists now: what each model is measured against is known
                plan = _Plan.of(replace(plan.study, against=_against(plan.study)))
            stages = plan.stages
            wave = _wave(stages, index, plan.sources) if workers.on_ray else [index]
            for position in wave:
                if on_stage:
                    on_stage(position, len(stages), stages[position], None)
            done = _run_wave([stages[position] for position in wave], entries, hashes, shared, runs) if len(wave) > 1 else \
                [_run_stage(stages[index], entries.get(stages[index].name), hashes, shared)]
            for position, (outcome, entry) in zip(wave, done, strict=True):
                if entry is not None:
                    entries[outcome.name] = entry
                outcomes.append(outcome)
                if outcome.left_out is not None:
                    left_out.setdefault(str(stages[position].backend), outcome.left_out)
                if on_stage:
                    on_stage(position, len(stages), stages[position], outcome)
            index += len(wave)
            if set(left_out) - plan.study.options.without:
                plan, index = plan.without(set(left_out), {outcome.name for outcome in outcomes})
    return outcomes, left_out, plan


def run(
    options: StudyOptions,
    run_command: RunCommand,
    command_line: list[str],
    on_stage: StageCallback | None = None,
) -> RunResult:
    """Run every stage that is not up to date (all of them with `force`), each as the ptq command it is
    (`run_command`); write the manifest if any ran."""
    began, started_at = time.perf_counter(), datetime.now(UTC).isoformat(timespec="seconds")
    manifest_file = manifest_path(options.results_dir)
    previous = read_manifest(manifest_file)
    entries: dict[str, dict] = {entry["name"]: entry for entry in previous.get("stages", [])}
    options = _checked(options)
    plan = _Plan.of(_study(options)[0])  # the datasets opened once for the whole run
    to_write = [manifest_file, *(output for stage in plan.stages for output in stage.outputs)]
    check_outside([*to_write, options.results_dir], [options.data_dir, options.calibration_data])
    for path in to_write:
        check_writable(path)  # a read-only directory fails now, not after minutes of work
    check_folder_writable(options.results_dir)
    libraries = library_versions()  # read once: the manifest is written after every stage

    def stage_done(position: int, total: int, stage: Stage, outcome: StageOutcome | None) -> None:
        # After each stage that ran, the manifest holds it: a run stopped later goes on from there, not from the start.
        if outcome is not None and outcome.ran:
            so_far = {"command": command_line, "started_at": started_at, "unfinished": True}
            write_text(manifest_file, json.dumps(_manifest(options, so_far, list(entries.values()), libraries), indent=2) + "\n")
        if on_stage:
            on_stage(position, total, stage, outcome)

    outcomes, left_out, plan = _run_plan(plan, entries, _Run(run_command, options.force, options.results_dir), stage_done)
    wall = round(time.perf_counter() - began, 3)
    written = any(outcome.ran for outcome in outcomes)
    if written:
        last_run = {"command": command_line, "started_at": started_at, "wall_seconds": wall,
                    "ran": [outcome.name for outcome in outcomes if outcome.ran], "up_to_date": [outcome.name for outcome in outcomes if not outcome.ran],
                    "left_out": left_out}
        # Stages in plan order; a stage that was up to date keeps the entry of the run that made its outputs.
        write_text(manifest_file, json.dumps(_manifest(options, last_run, [entries[stage.name] for stage in plan.stages], libraries), indent=2) + "\n")
    return RunResult(outcomes, wall, manifest_file, written, report_service.report_from_results(options.results_dir), left_out)
