"""Right on every CPU: ptq's default models on both x86 int8 paths, and their speed on this CPU.

    .venv/bin/python benchmarks/int8_paths.py [--workdir DIR] [--runs N] [--threads T]

In a scratch directory (or DIR, reusing what is already there), as a user would: `ptq run --no-benchmark`
(which evaluates every 8-bit onnxruntime and PyTorch model on both int8 paths), then one `ptq benchmark`
call over the models, in turns. Prints the CPU, each model's top-1 on the exact and the saturating path,
its throughput at batch 256 and its ratio to onnxruntime FP32, then the targets of issue 22 for this
CPU's instruction set, each as met or missed:
- every default model >= FP32 - 0.3 points on both paths; the speed model >= 87.0%; PyTorch int8 >= FP32 - 0.3;
- without VNNI (AVX2): the portable speed model >= 1.35x onnxruntime FP32, and the fastest model within
  0.10 points of FP32 on both paths >= 2.0x;
- with VNNI: the portable speed model >= 2.30x onnxruntime FP32.
Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import json

from pipeline import ptq, setup
from rich.table import Table

from ptq_cli.x86 import cpu as cpu_info

FP32 = "resnet8.onnx"
SPEED = "resnet8_uint8_speed.onnx"
PYTORCH = "resnet8_pytorch_int8.pt"
MODELS = (FP32, "resnet8_int8.onnx", "resnet8_uint8.onnx", SPEED, PYTORCH, "resnet8_openvino_int8.xml", "resnet8_int8.tflite")
EVERY_MODEL_POINTS, SPEED_ACCURACY, WITHIN_POINTS = 0.3, 87.0, 0.10
SPEED_TARGET = {cpu_info.SATURATING: 1.35, cpu_info.EXACT: 2.30}
FASTEST_TARGET = {cpu_info.SATURATING: 2.0}


def main() -> None:
    options, workdir, env, console = setup(__doc__.splitlines()[0], "ptq-int8-paths-")
    threads = ["--threads", str(options.threads)] if options.threads else []
    ptq(["run", "--no-benchmark", *threads], workdir, env)
    ptq(["benchmark", *[arg for model in MODELS for arg in ("--model", f"models/{model}")], "--runs", str(options.runs), *threads], workdir, env)
    _, output = ptq(["report", "--json"], workdir, env)
    rows = {row["model"]: row for row in json.loads(output)["groups"][0]["rows"]
            if row["model"] in MODELS and (row["model"].endswith(".xml") or row["runtime"] != "openvino") and not row["label"]}
    baseline = rows[FP32]
    cpu = cpu_info.current()

    def ratio(name: str) -> float:
        return rows[name]["images_per_second"] / baseline["images_per_second"]

    def worst(name: str) -> float:
        """The lower of its two paths, as a delta against FP32 (one path only where the runtime has one)."""
        row = rows[name]
        deltas = [value for value in (row["delta"], row["saturating_delta"]) if value is not None]  # delta: the row's own path
        return min(deltas) if deltas else 0.0

    table = Table(title=f"{cpu.describe()}: one `ptq benchmark` call, {options.runs} runs, batch 256, models in turns", title_justify="left")
    for column in ("model", "runtime", "exact path", "saturating path", "images/s", "x onnxruntime FP32"):
        table.add_column(column, justify="left" if column in ("model", "runtime") else "right")
    for name in MODELS:
        row = rows.get(name)
        if row is None:
            continue
        saturating = "-" if row["saturating_accuracy"] is None else f"{row['saturating_accuracy']:.2f}%" + (
            " (proof)" if row["saturating_basis"].startswith("proof") else " (emulated subset)" if row["saturating_basis"].startswith("emulated") else "")
        exact = "-" if row["int8_path"] == cpu_info.SATURATING else f"{row['accuracy']:.2f}%"  # a row of the saturating path alone
        table.add_row(name, row["runtime"], exact, saturating if row["dtype"] != "fp32" else "=",
                      f"{row['images_per_second']:,.0f}", f"{ratio(name):.2f}x")
    console.print(table)

    quantized = [name for name in MODELS if name in rows and name != FP32]
    targets = [(f"every default model within {EVERY_MODEL_POINTS} points of FP32 on both paths",
                all(worst(name) >= -EVERY_MODEL_POINTS for name in quantized),
                ", ".join(f"{name} {worst(name):+.2f}" for name in quantized)),
               (f"speed model >= {SPEED_ACCURACY}% on both paths",
                min(rows[SPEED]["accuracy"], rows[SPEED]["saturating_accuracy"] or 0) >= SPEED_ACCURACY,
                f"exact {rows[SPEED]['accuracy']:.2f}%, saturating {rows[SPEED]['saturating_accuracy']}%")]
    speed_target = SPEED_TARGET[cpu.int8_path]
    targets.append((f"portable speed model >= {speed_target}x onnxruntime FP32 ({cpu.int8_path} path CPU)", ratio(SPEED) >= speed_target,
                    f"{ratio(SPEED):.2f}x"))
    if cpu.int8_path in FASTEST_TARGET:
        within = [name for name in quantized if worst(name) >= -WITHIN_POINTS]
        fastest = max(within, key=ratio, default=None)
        targets.append((f"fastest within {WITHIN_POINTS} points of FP32 on both paths >= {FASTEST_TARGET[cpu.int8_path]}x",
                        fastest is not None and ratio(fastest) >= FASTEST_TARGET[cpu.int8_path],
                        f"{fastest}: {ratio(fastest):.2f}x" if fastest else "none within the budget"))
    for target, met, measured in targets:
        console.print(f"{'met   ' if met else 'missed'}  {target}: {measured}")
    console.print(f"work directory: {workdir}")


if __name__ == "__main__":
    main()
