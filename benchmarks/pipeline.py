"""Time the whole ptq pipeline end to end, then benchmark every model it made.

    .venv/bin/python benchmarks/pipeline.py [--workdir DIR] [--runs N] [--threads T]

Runs each stage as a user would (`python -m ptq_cli ...`, a fresh process per command) in a scratch
directory, with the decoded-CIFAR cache warm (a first `calibrate` fills it), and prints:
- the wall time of every stage, the total, and the total of the warm pipeline (calibrate, all
  quantizations, all evaluations, report: the part that runs again when models change);
- `ptq benchmark` of every model at batch 1 and batch 256: p50/p99 latency, throughput, speed-up
  against the FP32 model of the same runtime;
- `ptq run` twice in a row in a new directory: both wall times, and whether the second changed any file;
  then, with every output after the conversion deleted, `ptq run --no-benchmark` again: the warm pipeline
  (calibrate, all quantizations, all evaluations, report) in one process; and inside the first run, the
  seconds TFLite Micro's scoring of every .tflite took (`... on tflm` stages).
Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

MODELS = ("resnet8.onnx", "resnet8_int8.onnx", "resnet8_uint8.onnx", "resnet8_uint8_speed.onnx", "resnet8.pt", "resnet8_pytorch_int8.pt")
STAGES = (
    ("convert", ["convert", "--torch", "models/resnet8.pt"]),
    ("calibrate", ["calibrate"]),
    ("quantize int8", ["quantize", "--dtype", "int8"]),
    ("quantize uint8", ["quantize", "--dtype", "uint8"]),
    ("quantize --target speed", ["quantize", "--target", "speed"]),
    ("quantize pytorch int8", ["quantize", "--backend", "pytorch", "--dtype", "int8"]),
    *((f"evaluate {model}", ["evaluate", "--model", f"models/{model}"]) for model in MODELS),
    ("report", ["report", "--markdown"]),
)


def ptq(args: list[str], workdir: Path, env: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ptq_cli", *args], cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"ptq {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return seconds, done.stdout


def setup(description: str, prefix: str) -> tuple[argparse.Namespace, Path, dict[str, str], Console]:
    """A benchmark script's options (--workdir, --runs, --threads), its work directory, the environment
    its ptq commands run in (PTQ_ASSETS, ../shared/assets unless set) and a console wide enough for tables."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, help="where to run (default: a new temporary directory)")
    parser.add_argument("--runs", type=int, default=200, help="timed runs per benchmark measurement")
    parser.add_argument("--threads", type=int, help="inference threads (default: all cores)")
    options = parser.parse_args()
    repo = Path(__file__).resolve().parent.parent
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PTQ_ASSETS": str(Path(os.environ.get("PTQ_ASSETS", repo.parent / "shared" / "assets")).resolve())}
    return options, workdir, env, Console(width=max(Console().width, 110))


def main() -> None:
    options, workdir, env, console = setup(__doc__.splitlines()[0], "ptq-bench-")

    ptq(["calibrate", "--output", "warm-up.npz"], workdir, env)  # fills the decoded-CIFAR cache
    timings = {name: ptq(args, workdir, env)[0] for name, args in STAGES}
    stages = Table(title=f"Pipeline wall time ({os.cpu_count()} cores, one process per command, warm CIFAR cache)", title_justify="left")
    stages.add_column("stage")
    stages.add_column("seconds", justify="right")
    for name, seconds in timings.items():
        stages.add_row(name, f"{seconds:.2f}")
    warm = sum(seconds for name, seconds in timings.items() if name != "convert")
    stages.add_row("[bold]total[/bold]", f"[bold]{sum(timings.values()):.2f}[/bold]")
    stages.add_row("[bold]without convert (calibrate, quantize, evaluate, report)[/bold]", f"[bold]{warm:.2f}[/bold]")
    console.print(stages)

    threads = ["--threads", str(options.threads)] if options.threads else []
    _, output = ptq(["benchmark", *[arg for model in MODELS for arg in ("--model", f"models/{model}")], "--runs", str(options.runs), *threads, "--json"], workdir, env)
    records = json.loads(output)
    # Its record on its own runtime: <model>-<folder digest>@<dataset>.json (others carry ~runtime or ~path).
    accuracy = {model: json.loads(next(path for path in (workdir / "results").glob(f"{model}-*@*.json") if "~" not in path.name).read_text())["accuracy"]
                for model in MODELS}
    table = Table(title=f"Benchmark: latency at batch 1, throughput at batch {records[0]['batch_size']}, {records[0]['threads']} threads, {options.runs} runs after warm-up", title_justify="left")
    for column in ("model", "runtime", "type", "top-1", "p50 ms", "p99 ms", "images/s", "speed-up vs FP32"):
        table.add_column(column, justify="left" if column in ("model", "runtime", "type") else "right")
    for record in records:
        name = Path(record["model_path"]).name
        ratio = record["speedup_vs_fp32"]
        table.add_row(
            name, record["runtime"], record["dtype"], f"{accuracy[name]:.2f}%", f"{record['latency_ms_p50']:.3f}", f"{record['latency_ms_p99']:.3f}",
            f"{record['images_per_second']:,.0f}", "-" if ratio is None else f"{ratio:.2f}x",
        )
    console.print(table)

    # `ptq run` twice in a new directory: the second run should only hash, and change no file.
    run_dir = workdir / "ptq-run"
    run_dir.mkdir(exist_ok=True)
    run_options = ["--runs", str(options.runs), *threads]  # the same options twice: options are part of a stage's identity
    first, output = ptq(["run", "--force", *run_options, "--json"], run_dir, env)
    stage_seconds = {stage["name"]: stage["seconds"] for stage in json.loads(output)["stages"]}
    warm_stages = sum(seconds for name, seconds in stage_seconds.items() if not name.startswith(("convert", "benchmark")))
    # TFLite Micro's scoring of every .tflite (issue 34's budget: at most 120 s added to `ptq run` on 2 cores).
    microcontroller = {name: seconds for name, seconds in stage_seconds.items() if name.endswith(" on tflm")}
    before = _hashes(run_dir)
    second, _ = ptq(["run", *run_options], run_dir, env)
    unchanged = _hashes(run_dir) == before
    # The warm pipeline as a user meets it: the converted models are there, everything after them is not.
    for path in [*(run_dir / "models").glob("*"), *(run_dir / "calibration").glob("*"), *(run_dir / "results").glob("resnet8*.json"),
                 *(run_dir / "reports").glob("*")]:
        if path.is_file() and path.name not in ("resnet8.onnx", "resnet8.pt"):
            path.unlink()
    warm, _ = ptq(["run", "--no-benchmark", *threads], run_dir, env)
    runs = Table(title="ptq run in a new directory (one process each)", title_justify="left")
    for column in ("run", "seconds", "share of first"):
        runs.add_column(column, justify="left" if column == "run" else "right")
    runs.add_row("first (every stage)", f"{first:.2f}", "100%")
    runs.add_row("second (all up to date)", f"{second:.2f}", f"{second / first:.1%}")
    runs.add_row("warm pipeline: outputs after convert deleted, --no-benchmark", f"{warm:.2f}", f"{warm / first:.1%}")
    console.print(runs)
    console.print(f"second run changed no file: {unchanged}")
    console.print(f"inside the first run: calibrate + quantize + evaluate + report = {warm_stages:.2f} s (one process; convert and benchmark excluded)")
    if microcontroller:
        each = ", ".join(f"{name.removeprefix('evaluate ').removesuffix(' on tflm')} {seconds:.1f} s" for name, seconds in microcontroller.items())
        console.print(f"inside the first run: TFLite Micro scoring of {len(microcontroller)} models on the test set = "
                      f"{sum(microcontroller.values()):.1f} s ({each})")
    console.print(f"work directory: {workdir}")


def _hashes(directory: Path) -> dict[str, str]:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.rglob("*")) if path.is_file()}


if __name__ == "__main__":
    main()
