"""Latency at batch 1 and throughput at a larger batch, measured after warm-up in one process."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import ptq_cli
from ptq_cli import backends
from ptq_cli.backends.base import LoadedModel, RunOptions, RuntimeProfile
from ptq_cli.datasets import Dataset
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import check_folder_writable
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.model_file import resolve_threads
from ptq_cli.services.measure.evaluate import outside_target
from ptq_cli.services.measure.evaluation_records import record_file
from ptq_cli.services.models import load_model
from ptq_cli.services.progress import ProgressBar, ProgressCallback, Steps, no_progress_bar
from ptq_cli.services.records import MeasurementKey, from_dict, record_files, write_record
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import emulate
from ptq_cli.x86 import plan as int8_plan
from ptq_cli.x86.plan import NATIVE_PATH

BENCHMARK_DIR = "benchmarks"  # under the results directory, beside the evaluation records


@dataclass(frozen=True)
class BenchmarkRecord:
    NESTED_FIELDS: ClassVar[dict[str, type]] = {"cpu": cpu_info.CpuRecord}  # checked when a record is read (records.from_dict)

    model_path: str
    model_sha256: str  # ties the figures to one exact file; the report ignores figures of an older file
    model_size_bytes: int
    runtime: str
    dtype: str
    threads: int
    warmup: int
    runs: int
    latency_ms_p50: float  # batch 1
    latency_ms_p95: float
    latency_ms_p99: float
    batch_size: int
    images_per_second: float  # at batch_size: batch_size / the median time of a batch
    timestamp: str
    tool_version: str
    # How the runtime ran: onnxruntime with intra-op spinning off, one session per model, a batch in
    # one shard per thread; TorchScript in chunks of 64 images.
    runtime_settings: str = ""
    precision: str | None = None  # OpenVINO's inference precision hint; None for the other runtimes
    cpu: dict | None = None  # the CPU it ran on (cpu.Cpu.as_record): speed is a property of the machine too
    target_cpus: str | None = None  # the CPUs the model was quantized for (`--cpus`), if ptq says
    source_sha256: str | None = None  # the FP32 model it was made from, if ptq made it: its speed-up is against that model
    runs_asked: int | None = None  # the runs asked for, where the time budget (PTQ_BENCHMARK_SECONDS) allowed fewer: `runs`
    inputs: str = ""  # what it was fed: a dataset's images, or seeded synthetic pixels (speed needs no labels, nor real images)
    # "saturating": timed on the kernels of x86 CPUs without VNNI, on a CPU with VNNI (`int8_basis` says how); None: this CPU's own
    int8_path: str | None = None
    int8_basis: str = ""
    # `--profile`: where the time goes at batch_size (backends.base.RuntimeProfile as a dict); None where not asked or
    # its runtime has no profiler.
    profile: dict | None = None

    @property
    def name(self) -> str:
        return Path(self.model_path).name

    def runtime_profile(self) -> RuntimeProfile | None:
        return None if self.profile is None else RuntimeProfile.from_stored(self.profile)


# The study's batch at CIFAR-10's 32x32; a larger input gets as many pixels a batch (its activations and its
# time grow with them: 256 images at 224x224 held 10.5 GB in onnxruntime), but never fewer than MIN_BATCH images.
DEFAULT_BATCH, MIN_BATCH = 256, 16
SYNTHETIC_INPUTS = "synthetic pixels (seeded uniform 0-255, the model's input size; no --data given)"


def default_batch(height: int, width: int) -> int:
    return max(MIN_BATCH, min(DEFAULT_BATCH, DEFAULT_BATCH * 32 * 32 // max(1, height * width)))


def benchmark_models(  # noqa: PLR0913,PLR0917  BenchmarkRequest's fields, for ptq run's stage
    model_paths: list[Path],
    dataset: Dataset | None,
    batch_size: int | None = None,
    threads: int | None = None,
    runs: int = 100,
    warmup: int = 10,
    progress: ProgressCallback | None = None,
    flags: PreprocessingFlags | None = None,
    runtime: str | None = None,
    precision: str | None = None,
    also: Sequence[tuple[Path, str, str | None]] = (),
    fed: tuple[np.ndarray, str] | None = None,
) -> list[BenchmarkRecord]:
    """Latency at batch 1 and throughput at `batch_size` (default: `default_batch` of the first model's input)
    of every model, the models in turns.
    `also`: more runs, each (model, runtime, precision): an ONNX file on OpenVINO beside its onnxruntime run.
    Without a `dataset`, the models are fed seeded random pixels of their input's size (SYNTHETIC_INPUTS); `fed`: the
    pixels a parent process chose, and what they are.

    Each timed run goes round a group of models before the next begins, so a change in the machine's
    speed during the measurement (another tenant, a frequency change) reaches them alike and the ratios
    between them hold (which models share a group: below). Throughput is the batch size over the median time of a batch, so one stalled
    batch does not move it."""
    for option, value in (("--batch-size", batch_size), ("--runs", runs)):
        if value is not None and value < 1:
            raise PtqError(f"{option}: must be at least 1, got {value}")
    threads = resolve_threads(threads)
    models = [load_model(path, threads, flags, runtime, precision) for path in model_paths]
    models += [load_model(path, threads, flags, other_runtime, other_precision) for path, other_runtime, other_precision in also]
    if not models:
        return []
    batch_size = batch_size or default_batch(*models[0].input.size)
    per_image = int(np.prod(models[0].input.shape(1)))
    if batch_size * per_image > bounded.CALL_ELEMENTS.value():
        raise PtqError(f"--batch-size {batch_size:,}: {batch_size * per_image:,} input values in one call, over the limit of "
                       f"{bounded.CALL_ELEMENTS.value():,} (raise {bounded.CALL_ELEMENTS.env} to allow more)")
    pixels, inputs = fed or _pixels(dataset, models[0], batch_size)
    # Each model's own input (size, layout, preprocessing), prepared before any timing.
    batches = [model.prepare(pixels) for model in models]
    latencies, batch_seconds = _timed_in_turns(models, batches, warmup, runs, Steps(2 * (warmup + runs) * len(models), progress))
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    timed = [min(len(latency), len(seconds)) for latency, seconds in zip(latencies, batch_seconds, strict=True)]
    return [replace(_record(model, latency, seconds, threads, warmup, done, batch_size, timestamp), inputs=inputs, runs_asked=runs if done < runs else None)
            for model, latency, seconds, done in zip(models, latencies, batch_seconds, timed, strict=True)]


def _pixels(dataset: Dataset | None, model: LoadedModel, batch_size: int) -> tuple[np.ndarray, str]:
    """(one batch of pixels at the model's input size, what they are): the dataset's first images, else seeded random pixels."""
    if dataset is None:
        height, width = model.input.size
        return np.random.default_rng(0).integers(0, 256, (batch_size, height, width, max(model.input.channels, 1)), dtype=np.uint8), SYNTHETIC_INPUTS
    split = dataset.evaluation_split()
    loaded = dataset.load(split, model.input.size, indices=np.arange(min(batch_size, len(dataset.labels(split)))))
    pixels = loaded.images
    if len(pixels) < batch_size:  # a small dataset: its images again, to fill the batch
        pixels = np.resize(pixels, (batch_size, *pixels.shape[1:]))
    return pixels, f"{dataset.root} ({loaded.split})"


# Timed runs a model makes whatever its time budget, so that a median exists.
MIN_TIMED_RUNS = 3


def _timed_in_turns(models: list[LoadedModel], batches: list[np.ndarray], warmup: int, runs: int,
                    step: Callable[[], None]) -> tuple[list[list[float]], list[list[float]]]:
    """(batch-1 latencies, batch times) of each model, timed in turns (see benchmark_models)."""
    latencies: list[list[float]] = [[] for _ in models]
    batch_seconds: list[list[float]] = [[] for _ in models]

    def in_turns(group: list[int], single: bool, timings: list[list[float]]) -> None:
        # A slow model (a fixed batch run a call at a time, an emulated path) stops at its time budget, not at its
        # runs: its figure then comes from the runs that fit (the record says how many).
        deadline = time.monotonic() + bounded.BENCHMARK_SECONDS.value()
        for run in range(warmup + runs):
            if run >= warmup + MIN_TIMED_RUNS and time.monotonic() > deadline:
                break
            for index in group:
                inputs = batches[index][:1] if single else batches[index]
                began = time.perf_counter()
                models[index].predict(inputs)
                if run >= warmup:
                    timings[index].append(time.perf_counter() - began)
                step()

    runtimes = [model.info.runtime for model in models]
    spinning = {runtime for runtime in runtimes if backends.backend(runtime).runtime.spins_when_idle}
    quiet = [index for index, runtime in enumerate(runtimes) if runtime not in spinning]
    # Batch 1: each runtime's models in turns among themselves. Between another runtime's runs a
    # runtime's worker threads fall asleep, and each call would pay their wake-up, which a model serving
    # alone does not.
    for runtime in dict.fromkeys(runtimes[index] for index in quiet):
        in_turns([index for index in quiet if runtimes[index] == runtime], True, latencies)
    # Throughput: the runtimes whose idle threads do not spin (onnxruntime with spinning off, OpenVINO,
    # LiteRT) in turns together, so their ratios are measured in turns too; waking threads costs little
    # against a batch.
    in_turns(quiet, False, batch_seconds)
    # Those whose threads keep spinning after a run (PyTorch's OpenMP) would slow whatever ran next: last.
    for runtime in dict.fromkeys(runtime for runtime in runtimes if runtime in spinning):
        group = [index for index, other in enumerate(runtimes) if other == runtime]
        in_turns(group, True, latencies)
        in_turns(group, False, batch_seconds)
    return latencies, batch_seconds


def _record(model: LoadedModel, latency: list[float], seconds: list[float], threads: int, warmup: int, runs: int, batch_size: int,
            timestamp: str) -> BenchmarkRecord:
    p50, p95, p99 = (float(value) * 1000 for value in np.percentile(latency, [50, 95, 99]))
    return BenchmarkRecord(
        model_path=str(model.info.path),
        model_sha256=model.info.sha256,
        model_size_bytes=model.info.size_bytes,
        runtime=model.info.runtime,
        dtype=model.info.dtype,
        threads=threads,
        warmup=warmup,
        runs=runs,
        latency_ms_p50=round(p50, 4),
        latency_ms_p95=round(p95, 4),
        latency_ms_p99=round(p99, 4),
        batch_size=batch_size,
        images_per_second=round(batch_size / float(np.median(seconds)), 1),
        timestamp=timestamp,
        tool_version=ptq_cli.__version__,
        runtime_settings=backends.backend(model.info.runtime).runtime.settings
        + (f", precision hint {model.info.precision}" if model.info.precision else ""),
        precision=model.info.precision,
        cpu=cpu_info.current().as_record(),
        target_cpus=(model.info.quantization or {}).get("cpus"),
        source_sha256=model.info.source_sha256,
    )


def save_benchmark(record: BenchmarkRecord, results_dir: Path) -> Path:
    """RESULTS/benchmarks/<model key><runtime tag>.json: speed is not tied to a dataset."""
    return write_record(record_file(Path(results_dir) / BENCHMARK_DIR, record), record)


def load_benchmarks(results_dir: Path, skipped: list[str] | None = None) -> dict[MeasurementKey, BenchmarkRecord]:
    """Benchmark records by what they measured (MeasurementKey without a dataset: model sha256, runtime,
    precision, and the int8 path where it is not the CPU's own); an unreadable one is left out, and named in
    `skipped` ("path: problem") where the caller shows what it left out."""
    found: dict[MeasurementKey, BenchmarkRecord] = {}
    for path in record_files(Path(results_dir) / BENCHMARK_DIR):
        try:
            data = bounded.json_loads(bounded.read_text(path, "record"))
            record = from_dict(BenchmarkRecord, data)
        except (PtqError, OSError, ValueError, TypeError, AttributeError) as error:
            if skipped is not None:
                skipped.append(f"{path}: not a ptq benchmark record ({str(error).removeprefix(f'{path}: ')})")
            continue
        found[replace(MeasurementKey.of(record, with_dataset=False), int8_path=record.int8_path or "")] = record
    return found


def run_key(record: BenchmarkRecord) -> tuple[str, str, str | None]:
    """One file can be measured on two runtimes (an ONNX file on onnxruntime and on OpenVINO)."""
    return record.model_path, record.runtime, record.precision


def speedups(records: list[BenchmarkRecord], saved: dict[MeasurementKey, BenchmarkRecord] | None = None) -> dict[tuple, float | None]:
    """Throughput against the model's own FP32 source on the same runtime and precision hint (or converted
    to that runtime from it), measured at the same batch size and threads; for a model ptq did not make,
    the one FP32 model so measured, if there is one. By run_key."""
    candidates = list(records) + [record for record in (saved or {}).values() if record not in records]
    result: dict[tuple, float | None] = {}
    for record in records:
        floats = [other for other in candidates if other.dtype == "fp32" and (other.runtime, other.precision) == (record.runtime, record.precision)
                  and other.int8_path == record.int8_path
                  and (other.batch_size, other.threads) == (record.batch_size, record.threads)]
        sources = [other for other in floats if record.source_sha256 and record.source_sha256 in (other.model_sha256, other.source_sha256)]
        if not record.source_sha256 and len({other.model_sha256 for other in floats}) == 1:
            sources = floats
        reference = min(sources, key=lambda other: other.model_path, default=None)
        ratio = record.images_per_second / reference.images_per_second if reference and record.dtype != "fp32" else None
        result[run_key(record)] = None if ratio is None else round(ratio, 3)
    return result


@dataclass(frozen=True)
class BenchmarkRequest:
    """What `ptq benchmark` asks: these models timed in turns (fed `dataset`'s images, else random pixels)."""

    models: tuple[Path, ...]
    dataset: Dataset | None
    results_dir: Path
    batch_size: int | None = None
    threads: int | None = None
    runs: int = 100
    flags: PreprocessingFlags | None = None
    runtime: str | None = None
    precision: str | None = None
    also: tuple[tuple[Path, str, str | None], ...] = ()  # more runs in the same turns, each (model, runtime, precision): see parse_also
    int8_path: str = NATIVE_PATH  # or SATURATING: the kernels of x86 CPUs without VNNI (`on_avx2_kernels`)
    profile: bool = False  # also where the time goes, from each runtime's profiler (`profiled`)


PROFILE_RUNS = 10  # runs of the throughput batch the profiler averages, after one warm-up run


@dataclass(frozen=True)
class Benchmarked:
    records: list[BenchmarkRecord]
    speedups: dict[tuple, float | None]  # by run_key: throughput against the FP32 source, from these and the saved records
    warnings: tuple[str, ...] = ()  # a model timed on a CPU outside those it was quantized for
    written: tuple[Path, ...] = ()  # the records


def parse_also(text: str) -> tuple[Path, str, str | None]:
    """`models/resnet8.onnx@openvino:f32` -> (the model, the runtime, the precision hint or None)."""
    model, at, run = text.rpartition("@")
    runtime, _, precision = run.partition(":")
    if not at or not model or runtime not in backends.TABLE:
        raise PtqError(f"--also: '{text}' is not MODEL@RUNTIME[:PRECISION] with a runtime among {', '.join(backends.TABLE)}")
    return Path(model), runtime, precision or None


def run(request: BenchmarkRequest, progress_bar: ProgressBar = no_progress_bar) -> Benchmarked:
    """The records' folder checked before the timing, the models timed in turns, their records written."""
    check_folder_writable(Path(request.results_dir) / BENCHMARK_DIR)
    on_avx2 = int8_plan.times_in_avx2_child(request.int8_path, cpu_info.current())
    count = len(request.models) + len(request.also)
    if request.profile and on_avx2:
        raise PtqError("--profile: profiles this CPU's own kernels; not with --int8-path saturating on a CPU with VNNI")
    with progress_bar(f"Benchmarking {count} model{'s' if count > 1 else ''} in turns") as progress:
        if on_avx2:
            records = on_avx2_kernels(request)
        else:
            records = benchmark_models(list(request.models), request.dataset, request.batch_size, request.threads, request.runs, progress=progress,
                                       flags=request.flags, runtime=request.runtime, precision=request.precision, also=request.also)
    if request.profile:
        with progress_bar(f"Profiling {count} model{'s' if count > 1 else ''}") as progress:
            records = [profiled(record, request, progress) for record in records]
    written = tuple(save_benchmark(record, request.results_dir) for record in records)
    warnings = tuple(warning for record in records if (warning := outside_target(record.model_path, record.target_cpus)))
    return Benchmarked(records, speedups(records, load_benchmarks(request.results_dir)), warnings, written)


def profiled(record: BenchmarkRecord, request: BenchmarkRequest, progress: ProgressCallback | None = None) -> BenchmarkRecord:
    """The record with where its model's time goes at its batch, from its runtime's profiler (PROFILE_RUNS runs of the
    same pixels); as it was where the runtime has none."""
    backend = backends.for_file(Path(record.model_path), record.runtime)
    if backend.runtime.profile is None:
        return record
    model = load_model(Path(record.model_path), request.threads, request.flags, record.runtime, record.precision)
    pixels, _ = _pixels(request.dataset, model, record.batch_size)
    options = RunOptions(request.threads, request.flags or PreprocessingFlags(), record.precision)
    found = backend.runtime.profile(Path(record.model_path), options, model.prepare(pixels), PROFILE_RUNS)
    if progress:
        progress(1, 1)
    return replace(record, profile=asdict(found))


def on_avx2_kernels(request: BenchmarkRequest) -> list[BenchmarkRecord]:
    """The request timed in a child process whose runtime takes the kernels of x86 CPUs without VNNI at native speed
    (emulate.run_on_avx2_kernels; never under qemu, whose pace says nothing of a CPU's): every model, FP32 ones
    too, so that the ratios are those of such a CPU. The pixels are chosen here, the records written here."""
    runs = [*((path, request.runtime) for path in request.models), *((path, runtime) for path, runtime, _ in request.also)]
    if runs:
        int8_plan.check_avx2_timing(runs[0][0])
    models = [path for path, _ in runs]
    if not models:
        return []
    first = load_model(models[0], 1, request.flags, request.runtime, request.precision)
    batch_size = request.batch_size or default_batch(*first.input.size)
    pixels, inputs = _pixels(request.dataset, first, batch_size)
    with tempfile.TemporaryDirectory(prefix="ptq-benchmark-") as workdir:
        asked, fed, measured = Path(workdir) / "request.json", Path(workdir) / "pixels.npy", Path(workdir) / "records.json"
        asked.write_text(json.dumps({"models": [str(path) for path in request.models], "batch_size": batch_size, "threads": request.threads,
                                     "runs": request.runs, "flags": asdict(request.flags or PreprocessingFlags()), "runtime": request.runtime,
                                     "precision": request.precision, "also": [[str(path), runtime, precision] for path, runtime, precision in request.also],
                                     "inputs": inputs}))
        np.save(fed, pixels)
        emulate.run_on_avx2_kernels(__name__, [str(asked), str(fed), str(measured)], models[0], resolve_threads(request.threads))
        records = [from_dict(BenchmarkRecord, record) for record in json.loads(bounded.read_text(measured, "benchmark records"))]
    path, basis = int8_plan.timed_in_avx2_child()
    return [replace(record, int8_path=path, int8_basis=basis) for record in records]


def _child(asked: str, fed: str, measured: str) -> None:
    """The child `on_avx2_kernels` starts: the request timed here, the records written as JSON."""
    emulate.enter_avx2_child()
    request = json.loads(Path(asked).read_text())
    given: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value for key, value in request["flags"].items()}
    flags = PreprocessingFlags(**given)
    records = benchmark_models([Path(path) for path in request["models"]], None, request["batch_size"], request["threads"], request["runs"],
                               flags=flags, runtime=request["runtime"], precision=request["precision"],
                               also=[(Path(path), runtime, precision) for path, runtime, precision in request["also"]],
                               fed=(np.load(fed, allow_pickle=False), request["inputs"]))
    Path(measured).write_text(json.dumps([asdict(record) for record in records]))


if __name__ == "__main__":
    _child(*sys.argv[1:4])
