"""A `--backend pt2e` model compiled with Inductor's Python wrapper and with its C++ wrapper (ptq's), against onnxruntime
FP32 of the same model: one process, the three in turns, the median of the rounds.

    .venv/bin/python benchmarks/pt2_wrapper.py --model M.pt2 --onnx M.onnx [--batch-size 1] [--calls 300] [--rounds 7]

M.pt2 from `ptq quantize --backend pt2e --model M.onnx`; the images are uniform noise over --pixel-range in the
program's input shape. Prints each one's compile seconds and time an image, and whether the two compiled models give the
same scores bit for bit. Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ptq_cli.guards import pt2_archive  # noqa: E402
from ptq_cli.quantize import pt2e  # noqa: E402
from ptq_cli.services.models import load_model  # noqa: E402


def python_wrapper(module):
    """How ptq compiled a program before the C++ wrapper: freezing alone, entered at every call."""
    import torch
    import torch._inductor.config as inductor

    pt2e._imports()
    program = torch.compile(module, dynamic=False)

    def run(batch):
        with torch.no_grad(), inductor.patch(freezing=True):
            return program(batch)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a .pt2 from ptq quantize --backend pt2e")
    parser.add_argument("--onnx", type=Path, required=True, help="the FP32 ONNX model it was made from")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300, help="calls a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pixel-range", type=float, default=255.0, help="the images' values lie in 0..this")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    described = load_model(args.onnx, args.threads).input
    images = np.random.default_rng(0).uniform(0, args.pixel_range, described.shape(args.batch_size)).astype(np.float32)
    program, _ = pt2_archive.load(args.model, args.model.read_bytes())
    batch = torch.from_numpy(images)
    runs, scores = {}, {}
    for name, make in (("python wrapper", python_wrapper), ("C++ wrapper (ptq)", pt2e.compiled)):
        began = time.perf_counter()
        runs[name] = make(program.module())
        scores[name] = runs[name](batch)
        print(f"{name}: compiled in {time.perf_counter() - began:.1f} s")
    print("the same scores bit for bit:", torch.equal(*scores.values()))
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(args.onnx), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: images}
    runs["onnxruntime FP32"] = lambda _batch: session.run(None, feed)
    for run in runs.values():
        for _ in range(3):
            run(batch)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            began = time.perf_counter()
            for _ in range(args.calls):
                run(batch)
            seconds[name].append((time.perf_counter() - began) / args.calls / args.batch_size)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, median in medians.items():
        print(f"{name}: {median * 1e6:,.0f} µs an image at batch {args.batch_size}")
    print(f"C++ wrapper: {medians['python wrapper'] / medians['C++ wrapper (ptq)']:.2f}x the Python wrapper, "
          f"{medians['onnxruntime FP32'] / medians['C++ wrapper (ptq)']:.2f}x onnxruntime FP32")


if __name__ == "__main__":
    main()
