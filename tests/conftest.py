"""Shared fixtures. Real-asset tests read PTQ_ASSETS (default ../shared/assets) and never skip silently."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The decoded-CIFAR cache of this test session, apart from the user's (~/.cache/ptq), removed when the session ends.
if "PTQ_CACHE_DIR" not in os.environ:
    os.environ["PTQ_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptq-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PTQ_CACHE_DIR"], ignore_errors=True)
# quantize's second quantization (what portability costs, on VNNI CPUs only) would make the suite slower on those
# CPUs than on others: off unless a test asks for it (--portability-cost).
os.environ.setdefault("PTQ_PORTABILITY_COST", "0")
# pytest-xdist's workers start with COLUMNS=80 and LINES=24; rich fixes a console's size from them when the console is
# made (ptq's, on import): the tests give the width of each call (`ptq(..., columns=)`) instead.
for size in ("COLUMNS", "LINES"):
    os.environ.pop(size, None)
ASSETS = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets")).resolve()
CIFAR = ASSETS / "cifar-10-batches-py"
KERAS_MODEL = ASSETS / "mlperf-tiny-resnet8" / "pretrainedResnet.h5"


PIPELINE_MODELS = ("resnet8.onnx", "resnet8.pt", "resnet8_int8.onnx", "resnet8_uint8.onnx", "resnet8_uint8_speed.onnx", "resnet8_pytorch_int8.pt",
                   "resnet8_openvino_int8.xml", "resnet8_int8.tflite", "resnet8_int8_ranges.tflite", "resnet8_int8_w4.tflite")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def ptq_process(*args: str, cwd: Path) -> Run:
    """Run the CLI as a user would: a fresh interpreter, real stdout/stderr and exit code (for tests where
    the process itself is the point: its entry point, its streams)."""
    env = {**os.environ, "PTQ_ASSETS": str(ASSETS), "COLUMNS": "160"}
    done = subprocess.run([sys.executable, "-m", "ptq_cli", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True)
    return Run(done.returncode, done.stdout, done.stderr)


def ptq(*args: str, cwd: Path, columns: int = 160) -> Run:
    """Run the CLI in this process (typer's CliRunner) in `cwd`, on a `columns`-wide terminal: its stdout,
    stderr and exit code; an exception that escapes it is reported as the traceback a user would see."""
    import traceback

    from synthetic import invoke

    result = invoke(*args, cwd=cwd, columns=columns, env={"PTQ_ASSETS": str(ASSETS)})
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(result.exception))
    return Run(result.exit_code, result.stdout, stderr)


def ptq_ok(*args: str, cwd: Path, fresh_process: bool = False) -> Run:
    run = (ptq_process if fresh_process else ptq)(*args, cwd=cwd)
    assert run.returncode == 0, f"ptq {' '.join(map(str, args))} failed:\n{run.stdout}\n{run.stderr}"
    return run


# Every `ptq run` on the study passes it: a run with other options would not find its stages up to date. The fewest
# allowed, one image a class: where CPUID cannot be masked, qemu emulates the saturating path (the int8 model keeps its stem
# convolution in float, and qemu computes floats slowly).
STUDY_EMULATION = ("--emulated-images", "10")
REAL_ASSET_FIXTURES = {"assets", "resnet8_onnx", "pipeline", "pipeline_snapshot"}


STUDY_FIXTURES = {"pipeline", "pipeline_snapshot"}
# What bounds a process's threads, for each library the tests run: ptq's own share (as a Ray task's), OpenMP
# (torch, onnxruntime's emulated runs), the BLAS under numpy, TensorFlow's converter.
THREAD_LIMITS = ("PTQ_TASK_CPUS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker is given its share of the cores before it starts (the workers inherit this
    process's environment): every library otherwise takes every core in each worker, and onnxruntime's threads spin
    between runs, so that the workers slow each other down."""
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 2:
        return
    share = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for name in THREAD_LIMITS:
        os.environ.setdefault(name, share)


def pytest_itemcollected(item) -> None:
    """A test on the real assets is marked `real_assets` whether it says so or uses a fixture that reads
    them: `make test-fast` (-m "not real_assets") must not start the study.

    Under pytest-xdist (`make test`: `-n 2 --dist loadgroup`) each test is grouped with those that must share its
    worker (marked as it is collected, before xdist reads the groups): every test of the study (its session fixture
    is made once, by one worker); any other test with its module's (a module's fixtures are made once). Two local Ray
    instances may run at once (the study's tune on Ray, test_workers.py's): each keeps to its own session folder."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if REAL_ASSET_FIXTURES & fixtures:
        item.add_marker(pytest.mark.real_assets)
    module = item.path.name
    item.add_marker(pytest.mark.xdist_group("study" if STUDY_FIXTURES & fixtures else module))


# The groups that take longest, longest first (`make test`, measured): pytest-xdist hands groups out in the order they
# are collected (`--no-loadscope-reorder`; by default it orders them by their number of tests), so that the workers
# end together when the long ones start first. The others follow in file order.
LONGEST_GROUPS = ("study", "test_fuzz.py", "test_workers.py", "test_tuning_real.py", "test_contracts_real.py", "test_imagenet_real.py",
                  "test_executorch.py", "test_bad_input.py")


def pytest_collection_modifyitems(items) -> None:
    """The tests in the order their groups should start in (LONGEST_GROUPS first), each group's in file order."""
    def rank(item) -> int:
        marker = item.get_closest_marker("xdist_group")
        group = marker.args[0] if marker and marker.args else ""
        return LONGEST_GROUPS.index(group) if group in LONGEST_GROUPS else len(LONGEST_GROUPS)

    items.sort(key=rank)  # stable: file order within a rank


@pytest.fixture(scope="session")
def assets() -> Path:
    if not CIFAR.is_dir() or not KERAS_MODEL.is_file():
        pytest.fail(f"real assets not found under {ASSETS} (set PTQ_ASSETS)")
    return ASSETS


@pytest.fixture(scope="session")
def resnet8_onnx(tmp_path_factory, assets) -> Path:
    """The MLPerf Tiny ResNet8 converted to ONNX (`ptq convert`), for the tests that need only the FP32
    model and not the whole study."""
    work = tmp_path_factory.mktemp("converted")
    ptq_ok("convert", "--output", "resnet8.onnx", cwd=work)
    return work / "resnet8.onnx"


@pytest.fixture
def fp32_study(resnet8_onnx, tmp_path) -> Path:
    """A study directory holding only the FP32 ResNet8 where `ptq run` puts it (models/resnet8.onnx, `ptq convert`):
    for the commands that read the study's FP32 model and nothing `ptq run` made from it. Not the study: such a
    test runs on either worker."""
    work = tmp_path / "fp32-study"
    (work / "models").mkdir(parents=True)
    shutil.copy(resnet8_onnx, work / "models" / "resnet8.onnx")
    return work


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, assets) -> Path:
    """The study as `make run` does it (`ptq run`, without the benchmarks), once per session, in a fresh
    directory; a copy of the directory as the run left it is kept beside it for `pipeline_snapshot`."""
    base = tmp_path_factory.mktemp("study")
    work = base / "work"
    work.mkdir()
    # As `make run` does it, in a fresh interpreter: what a study writes is defined run by run (TorchScript
    # names its classes with a counter that lasts as long as the process).
    # On a VNNI CPU the saturating path of unproven models is emulated (about 100x slower under qemu, where CPUID
    # cannot be masked): a few images keep the suite's cost the same on every CPU.
    ptq_ok("run", "--no-benchmark", *STUDY_EMULATION, cwd=work, fresh_process=True)
    shutil.copytree(work, base / "snapshot", symlinks=True)
    return work


@pytest.fixture
def pipeline_snapshot(pipeline, tmp_path) -> Path:
    """A private copy of the directory exactly as `ptq run` left it (other tests write into `pipeline`)."""
    copy = tmp_path / "study"
    shutil.copytree(pipeline.parent / "snapshot", copy, symlinks=True)
    return copy


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def assert_clean_failure(run: Run, exit_code: int, mentions: str) -> None:
    """One line on stderr naming the culprit, the expected exit code, no traceback."""
    assert run.returncode == exit_code, (run.returncode, run.stdout, run.stderr)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("Error:"), run.stderr
    assert mentions in lines[0], run.stderr
    assert "Traceback" not in run.stderr + run.stdout


def record_of(results: Path, model_name: str) -> dict:
    """The evaluation record of one model file (on whichever dataset: tests evaluate on one)."""
    found = sorted(Path(results).glob(f"{model_name}-??????@*.json"))
    assert len(found) == 1, f"{model_name}: {len(found)} records in {results}: {sorted(p.name for p in Path(results).iterdir())}"
    return read_json(found[0])


def benchmark_of(results: Path, model_name: str, runtime_tag: str = "") -> dict:
    """The benchmark record of one model file (speed is not tied to a dataset); `runtime_tag` "~openvino-f32"
    for an ONNX file's run on OpenVINO."""
    found = sorted((Path(results) / "benchmarks").glob(f"{model_name}-??????{runtime_tag}.json"))
    assert len(found) == 1, f"{model_name}: {len(found)} benchmark records in {results}"
    return read_json(found[0])


def cifar_split(split: str):
    """The real CIFAR-10 split as LabelledImages (uint8 NHWC)."""
    from ptq_cli.datasets.cifar10 import Cifar10

    return Cifar10(CIFAR).load(split)
