"""The x86 runtimes against onnxruntime FP32: the targets of ptq's OpenVINO backend, measured.

    .venv/bin/python benchmarks/runtimes.py [--workdir DIR] [--runs N] [--threads T]

In a scratch directory (or DIR, reusing what is already there), as a user would, one process per command:
`ptq run` (every model, OpenVINO and TFLite ones included), `ptq tune --backend openvino --max-drop 0.05`,
`ptq evaluate` of the tuned IR on the test set, then one `ptq benchmark` call over the x86 models, so
every ratio comes from one process with the models in turns. Prints each model's top-1, throughput at
batch 256, its ratio to onnxruntime FP32 and batch-1 p50, then each target as met or missed:
- the fastest model within 0.10 points of FP32 runs at >= 5.0x onnxruntime FP32;
- the tuned OpenVINO model scores >= 87.14% at >= 4.5x;
- the tuned OpenVINO model's batch-1 p50 is below onnxruntime FP32's.
Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import json
import sys

from pipeline import ptq, setup
from rich.table import Table

FP32 = "resnet8.onnx"
TUNED = "resnet8_openvino_int8_tuned.xml"
MODELS = (FP32, "resnet8_uint8_speed.onnx", "resnet8_openvino_int8.xml", TUNED, "resnet8_int8.tflite", "resnet8_int8_ranges.tflite")
WITHIN_POINTS, FASTEST_TARGET = 0.10, 5.0
TUNED_ACCURACY, TUNED_TARGET = 87.14, 4.5


def main() -> None:
    options, workdir, env, console = setup(__doc__.splitlines()[0], "ptq-runtimes-")
    threads = ["--threads", str(options.threads)] if options.threads else []

    ptq(["run", "--no-benchmark", *threads], workdir, env)
    ptq(["tune", "--backend", "openvino", "--max-drop", "0.05"], workdir, env)
    ptq(["evaluate", "--model", f"models/{TUNED}", *threads], workdir, env)
    ptq(["benchmark", *[arg for model in MODELS for arg in ("--model", f"models/{model}")], "--runs", str(options.runs), *threads], workdir, env)
    _, output = ptq(["report", "--json"], workdir, env)
    # Each file on the runtime it is deployed on (the report also holds resnet8.onnx run on OpenVINO).
    rows = {row["model"]: row for row in json.loads(output)["groups"][0]["rows"]
            if row["model"] in MODELS and (row["model"].endswith(".xml") or row["runtime"] != "openvino")}
    missing = [name for name in MODELS if name not in rows]
    if missing:
        sys.exit(f"no figures for {', '.join(missing)} in {workdir}: are the openvino and litert extras installed (make install)?")
    baseline = rows[FP32]

    def ratio(name: str) -> float:
        return rows[name]["images_per_second"] / baseline["images_per_second"]

    table = Table(title=f"Batch 256 throughput and batch-1 p50, one `ptq benchmark` call, {options.runs} runs, models in turns", title_justify="left")
    for column in ("model", "runtime", "top-1", "images/s", "x onnxruntime FP32", "p50 ms"):
        table.add_column(column, justify="left" if column in ("model", "runtime") else "right")
    for name in MODELS:
        row = rows[name]
        runtime = row["runtime"] + (f" {row['precision']}" if row["precision"] else "")
        table.add_row(name, runtime, f"{row['accuracy']:.2f}%", f"{row['images_per_second']:,.0f}", f"{ratio(name):.2f}x", f"{row['latency_ms_p50']:.3f}")
    console.print(table)

    within = [name for name in MODELS if name != FP32 and rows[name]["accuracy"] >= baseline["accuracy"] - WITHIN_POINTS]
    fastest = max(within, key=ratio, default=None)
    tuned = rows[TUNED]
    targets = [
        (f"fastest within {WITHIN_POINTS:.2f} points of FP32 at >= {FASTEST_TARGET}x",
         fastest is not None and ratio(fastest) >= FASTEST_TARGET,
         f"{fastest}: {ratio(fastest):.2f}x, {rows[fastest]['accuracy']:.2f}%" if fastest else "no model within the budget"),
        (f"tuned OpenVINO model >= {TUNED_ACCURACY}% at >= {TUNED_TARGET}x",
         tuned["accuracy"] >= TUNED_ACCURACY and ratio(TUNED) >= TUNED_TARGET, f"{tuned['accuracy']:.2f}% at {ratio(TUNED):.2f}x"),
        ("tuned OpenVINO model's batch-1 p50 below onnxruntime FP32's",
         tuned["latency_ms_p50"] < baseline["latency_ms_p50"], f"{tuned['latency_ms_p50']:.3f} ms vs {baseline['latency_ms_p50']:.3f} ms"),
    ]
    for target, met, measured in targets:
        console.print(f"{'met   ' if met else 'missed'}  {target}: {measured}")
    console.print(f"work directory: {workdir}")


if __name__ == "__main__":
    main()
