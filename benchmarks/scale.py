"""`ptq tune` past one process: candidates per minute in this process and on Ray with 1 and 2 workers, and what a
64-candidate ImageNet-size tune would take on 8 and 32 workers, projected from a measured candidate.

    .venv/bin/python benchmarks/scale.py [--workdir DIR] [--skip-imagenet] [--ceiling-only]

In a scratch directory (or DIR), one process per command, as a user would:
1. `ptq convert` (the MLPerf Tiny ResNet8), then the same `ptq tune` three times: in this process, `--workers 1`,
   `--workers 2` (minmax and percentile at four points x both granularities, then two calibration sizes: 12
   candidates, no float layers); each command's wall time, the candidates it scored, and whether the three
   chose the same settings and wrote the same bytes; then the candidate phase alone (the first stage's 10
   candidates through the executor, in this process and on 1 and 2 workers), where candidates dominate;
1b. the machine's own ceiling for two tasks: the same 4 candidates scored in one plain process (one thread for
   everything: PTQ_TASK_CPUS, OMP, OpenBLAS), then in two such processes at once; the ratio of the work done is
   what two independent tasks can get from this machine's two cores, Ray or not (`--ceiling-only` runs this alone);
2. Ray's start-up and shut-down alone (an empty executor on 2 workers), three times;
3. the pretrained EfficientNet-Lite0 (224x224) on CIFAR-10 photos upsampled (benchmarks/imagenet_table.py's):
   one `ptq tune` (minmax, per-channel; 100 calibration and 200 validation photos), its wall time over its
   candidates as the cost of one (an upper bound: loading the model and scoring FP32 count in); the projection
   is ceil(64 / workers) x that cost + Ray's start-up and shut-down.
Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline import ptq, setup

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

from ptq_cli.services.executor import Workers, executor  # noqa: E402
from ptq_cli.x86 import cpu as cpu_info  # noqa: E402

TUNE = ["tune", "--max-float-layers", "0", "--method", "minmax", "--method", "percentile", "--validation-per-class", "100", "--json"]
PROJECTED_CANDIDATES = 64


def _first_stage(workdir: Path) -> tuple[Any, Any, Any, list]:
    """(the source, calibration set, validation set, tune's first-stage grid resolved) of ResNet8 in `workdir`."""
    from ptq_cli.datasets import open_dataset
    from ptq_cli.inputs import PreprocessingFlags
    from ptq_cli.services.make.calibration import for_model
    from ptq_cli.services.make.quantize import calibration_inputs, load_source, resolve_settings, with_calibration
    from ptq_cli.services.study.tune import calibration_grid
    from ptq_cli.services.study.validation import build_validation_set

    model, data = workdir / "models" / "resnet8.onnx", Path(os.environ["PTQ_ASSETS"]) / "cifar-10-batches-py"
    source = load_source(model, PreprocessingFlags())
    calibration = for_model(model, data, samples_per_class=100)
    validation = build_validation_set(calibration, open_dataset(data), 100)
    prepared = calibration_inputs(source, calibration)
    grid = [resolve_settings(source, with_calibration(settings, calibration), prepared)
            for settings in calibration_grid("onnxruntime", "int8", ("minmax", "percentile"), (True, False))]
    return source, calibration, validation, grid


def _candidate_phase(workdir: Path, workers: Workers) -> tuple[float, int]:
    """(seconds, candidates) of the candidate phase alone: tune's first-stage grid (resolved here, once), scored by
    the executor; model loading, FP32 scoring and Ray's start-up are outside the timing."""
    from ptq_cli.services.study.candidates import inputs_for, score_candidate

    source, calibration, validation, grid = _first_stage(workdir)
    with executor(workers) as runs:
        inputs = inputs_for(source, None, calibration, validation, runs.task_threads)
        runs.map(score_candidate, [(grid[0], None)], inputs)  # each worker's first task loads the model: not a candidate's cost
        began = time.perf_counter()
        runs.map(score_candidate, [(settings, None) for settings in grid], inputs)
        return time.perf_counter() - began, len(grid)


ONE_THREAD = {"PTQ_TASK_CPUS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _score_four(workdir: Path, start_file: Path | None) -> float:
    """Seconds to score tune's 4 per-channel percentile candidates on one thread, after a first (unmeasured) one;
    with `start_file`, the clock starts when that file appears (two processes start together)."""
    from ptq_cli.services.study.candidates import inputs_for, score_candidate

    source, calibration, validation, grid = _first_stage(workdir)
    inputs = inputs_for(source, None, calibration, validation, 1)
    score_candidate((grid[0], None), inputs)
    while start_file is not None and not start_file.exists():
        time.sleep(0.05)
    began = time.perf_counter()
    for settings in grid[1:5]:
        score_candidate((settings, None), inputs)
    return time.perf_counter() - began


def _machine_ceiling(workdir: Path, env: dict) -> tuple[float, list[float]]:
    """(seconds alone, [seconds of each of two processes at once]) for the same 4 candidates on one thread each."""
    import subprocess
    import tempfile

    env = {**env, **ONE_THREAD}
    command = [sys.executable, __file__, "--score-four", str(workdir)]
    alone = float(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.split()[-1])
    with tempfile.TemporaryDirectory(prefix="ptq-ceiling-") as folder:
        start = Path(folder) / "go"
        pair = [subprocess.Popen([*command, str(start)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
        time.sleep(90)  # both loaded (CIFAR decoded, the first candidate scored) before the clock starts
        start.touch()
        together = [float(process.communicate()[0].split()[-1]) for process in pair]
    return alone, together


def _print_ceiling(console, workdir: Path, env: dict) -> None:
    alone, together = _machine_ceiling(workdir, env)
    ceiling = 2 * alone / max(together)
    console.print(f"\n[bold]The machine's ceiling for two tasks[/bold] (4 candidates, one thread each): alone {alone:.1f} s; "
                  f"two processes at once {together[0]:.1f} s and {together[1]:.1f} s: x{ceiling:.2f} the work of one")


def _ray_start_stop(workers: int) -> float:
    began = time.perf_counter()
    with executor(Workers(workers)):
        pass
    return time.perf_counter() - began


def main() -> None:
    if sys.argv[1:2] == ["--score-four"]:  # one process of the ceiling measurement
        print(f"{_score_four(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None):.3f}")
        return
    flags = {flag for flag in ("--skip-imagenet", "--ceiling-only") if flag in sys.argv}
    sys.argv = [argument for argument in sys.argv if argument not in flags]
    options, workdir, env, console = setup(__doc__.splitlines()[0], "ptq-scale-")
    console.print(f"{cpu_info.current().describe()}, {os.cpu_count()} cores; work directory {workdir}")
    if not (workdir / "models" / "resnet8.onnx").is_file():
        ptq(["convert"], workdir, env)
    if "--ceiling-only" in flags:
        _print_ceiling(console, workdir, env)
        return
    runs = {}
    for label, extra in (("in this process", []), ("Ray, 1 worker", ["--workers", "1"]), ("Ray, 2 workers", ["--workers", "2"])):
        output = f"models/scale_{len(runs)}.onnx"
        seconds, stdout = ptq([*TUNE, *extra, "--output", output, "--results-dir", f"results_{len(runs)}"], workdir, env)
        result = json.loads(stdout)
        runs[label] = (seconds, len(result["candidates"]), result["chosen"]["settings"],
                       hashlib.sha256((workdir / output).read_bytes()).hexdigest())
    console.print("\n[bold]ResNet8 tune, 12 candidates[/bold] (wall time of the whole command, model loading and FP32 scoring included)")
    base = runs["in this process"][0]
    for label, (seconds, count, _, _) in runs.items():
        console.print(f"  {label:16} {seconds:6.1f} s  {60 * count / seconds:5.1f} candidates/min  x{base / seconds:.2f} against this process")
    same = len({(json.dumps(chosen, sort_keys=True), digest) for _, _, chosen, digest in runs.values()}) == 1
    console.print(f"  same choice and byte-identical model in all three: {'yes' if same else 'NO'}")
    one, two = runs["Ray, 1 worker"][0], runs["Ray, 2 workers"][0]
    console.print(f"  2 workers against 1: x{one / two:.2f}")
    console.print("\n[bold]The candidate phase alone[/bold] (tune's first stage, 10 candidates, 1,000 validation images each)")
    phases = {label: _candidate_phase(workdir, workers) for label, workers in
              (("in this process", Workers()), ("Ray, 1 worker", Workers(1)), ("Ray, 2 workers", Workers(2)))}
    for label, (seconds, count) in phases.items():
        console.print(f"  {label:16} {seconds:6.1f} s  {60 * count / seconds:5.1f} candidates/min")
    console.print(f"  2 workers against 1: x{phases['Ray, 1 worker'][0] / phases['Ray, 2 workers'][0]:.2f}")
    _print_ceiling(console, workdir, env)

    start_stop = [_ray_start_stop(2) for _ in range(3)]
    console.print(f"\n[bold]Ray start-up and shut-down[/bold] (2 workers): {', '.join(f'{s:.1f}' for s in start_stop)} s "
                  f"(target <= 15 s: {'met' if max(start_stop) <= 15 else 'missed'})")

    if "--skip-imagenet" in flags:
        return
    import imagenet_table

    imagenet_table.prepare_workdir(workdir / "lite0", None)
    lite = ["tune", "--model", imagenet_table.MODEL, "--data", "test", "--calibration-data", "calibration", "--calibration-size", "100",
            "--validation-per-class", "100", "--method", "minmax", "--per-channel", "--max-float-layers", "0", "--json"]
    seconds, stdout = ptq([*lite, "--output", "tuned.onnx", "--results-dir", "results"], workdir / "lite0", env)
    count = len(json.loads(stdout)["candidates"])
    per_candidate = seconds / count
    console.print(f"\n[bold]EfficientNet-Lite0 tune[/bold]: {count} candidate(s) in {seconds:.1f} s: {per_candidate:.1f} s a candidate "
                  "(an upper bound: the command's model loading and FP32 scoring are counted in)")
    for workers in (8, 32):
        projected = math.ceil(PROJECTED_CANDIDATES / workers) * per_candidate + max(start_stop)
        console.print(f"  {PROJECTED_CANDIDATES} candidates on {workers} workers: about {projected / 60:.1f} min "
                      f"(against {PROJECTED_CANDIDATES * per_candidate / 60:.1f} min in one process)")


if __name__ == "__main__":
    main()
