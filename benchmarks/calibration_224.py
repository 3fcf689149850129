"""Calibration at 224x224: time and peak memory of `ptq quantize` for every method, on 300 images.

    .venv/bin/python benchmarks/calibration_224.py [--workdir DIR] [--images N] [--methods minmax,percentile,...]

The model: the pretrained EfficientNet-Lite0 (1000 classes, depthwise, ReLU6) from the registry packages the
dev extra installs (tests/imagenet_size.py), exported to ONNX; the images: CIFAR-10 training photos
upsampled to 224x224, an unlabelled folder (ROOT/*.jpg). Each method is one `ptq quantize` process, as a
user runs it; its wall time and its peak resident memory (the process's ru_maxrss) are printed against the
targets of issue 25: peak memory <= 2 GB and <= 60 s on 2 cores for 300 images, for every method.
Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import imagenet_size  # noqa: E402

from ptq_cli.x86 import cpu as cpu_info  # noqa: E402

PEAK_BYTES, SECONDS = 2 * 10**9, 60.0
# Each method as `ptq quantize` options: the speed target is its own configuration (uint8 x int8 per-channel, percentile).
METHODS = {"minmax": [], "percentile": ["--method", "percentile"], "entropy": ["--method", "entropy"], "speed": ["--target", "speed"]}


# A wrapper process per run: its RUSAGE_CHILDREN maxrss is the peak of that one `ptq quantize` alone.
PEAK_WRAPPER = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); sys.exit(code)")


def quantize(workdir: Path, images: int, options: list[str], output: str) -> tuple[float, int, int]:
    """(wall seconds, peak resident bytes, exit code) of one `ptq quantize` process."""
    command = [sys.executable, "-m", "ptq_cli", "quantize", "--model", "efficientnet_lite0.onnx", "--data", "calibration",
               "--calibration-data", "calibration", "--calibration-size", str(images), "--preprocess", "imagenet", "--output", output, *options]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, *command], cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - began
    lines = done.stderr.strip().splitlines()
    if done.returncode:
        print("\n".join(lines[-5:]), file=sys.stderr)
    return seconds, int(lines[-1]) if lines and lines[-1].isdigit() else 0, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--methods", default=",".join(METHODS))
    options = parser.parse_args()
    console = Console()
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="ptq-calibration-224-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cifar = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets")) / "cifar-10-batches-py"
    if not (workdir / "efficientnet_lite0.onnx").is_file():
        imagenet_size.efficientnet_lite0_onnx(workdir / "efficientnet_lite0.onnx")
    if not (workdir / "calibration").is_dir():
        train, _, _ = imagenet_size.cifar_photos(cifar, "train", options.images, seed=1)
        imagenet_size.write_jpegs(train, workdir / "calibration")
    table = Table(title=f"{cpu_info.current().describe()}, {os.cpu_count()} cores: `ptq quantize` of EfficientNet-Lite0 on {options.images} "
                        "images at 224x224, one process per method", title_justify="left")
    for column in ("method", "seconds", "peak memory (MB)", f"<= {SECONDS:.0f} s", f"<= {PEAK_BYTES / 1e9:.0f} GB"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name in options.methods.split(","):
        seconds, peak, code = quantize(workdir, options.images, METHODS[name], f"lite0_{name}.onnx")
        table.add_row(name if code == 0 else f"{name} (failed, exit {code})", f"{seconds:.1f}", f"{peak / 1e6:,.0f}",
                      "met" if seconds <= SECONDS else "missed", "met" if peak <= PEAK_BYTES else "missed")
    console.print(table)
    console.print(f"Models and images in {workdir}")


if __name__ == "__main__":
    main()
