"""Time ptq on a user's own data and model contract: an image folder's first decode, evaluation from a warm
cache, and a model with a fixed batch of 1 against the same model with a symbolic batch.

    PTQ_ASSETS=../shared/assets .venv/bin/python benchmarks/own_data.py [--model resnet8.onnx] [--rounds 3]

In a scratch directory with an empty decoded-data cache:
- writes the 10,000 CIFAR-10 test images as ROOT/test/<class>/<n>.png, then times the first decode of that
  folder (Pillow, every file) and a load from the warm cache, in this process;
- times `evaluate` of the FP32 model on the folder from the warm cache, in this process (the service) and
  as a user runs it (`python -m ptq_cli evaluate`, a fresh process);
- builds the ResNet8 behind a third-party contract (NCHW, CIFAR mean/std, opset 9) three ways: batch fixed
  at 1 (ptq frees it), batch fixed at 1 with a flatten tied to it (ptq runs it image by image), and a
  symbolic batch; evaluates them in turns, `--rounds` times, and prints the median inference throughput.
Timing lives here, never in the unit tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the contract builder the real-asset tests use

from contracts import contract_variant  # noqa: E402
from PIL import Image  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ptq_cli import settings  # noqa: E402
from ptq_cli.datasets import open_dataset  # noqa: E402
from ptq_cli.datasets.cifar10 import Cifar10  # noqa: E402
from ptq_cli.inputs import make_flags  # noqa: E402
from ptq_cli.services.measure.evaluate import evaluate_model  # noqa: E402


def write_png_folder(root: Path) -> None:
    test = Cifar10(settings.cifar_dir()).load("test")
    for name in test.class_names:
        (root / "test" / name).mkdir(parents=True)
    for index, (image, label) in enumerate(zip(test.images, test.labels, strict=True)):
        Image.fromarray(image).save(root / "test" / test.class_names[label] / f"{index:05d}.png")
    (root / "classes.txt").write_text("\n".join(test.class_names) + "\n")


def timed(work) -> tuple[float, object]:
    began = time.perf_counter()
    result = work()
    return time.perf_counter() - began, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the FP32 ResNet8 ONNX (default: made with `ptq convert`)")
    parser.add_argument("--rounds", type=int, default=3, help="evaluations of each fixed/symbolic model, in turns")
    options = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="ptq-own-data-") as scratch:
        work = Path(scratch)
        os.environ[settings.CACHE_ENV] = str(work / "cache")  # an empty cache: the first decode is real
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        model = options.model
        if model is None:
            model = work / "resnet8.onnx"
            subprocess.run([sys.executable, "-m", "ptq_cli", "convert", "--output", str(model)], cwd=work, env=env, check=True,
                           capture_output=True)
        folder = work / "cifar10-png"
        console.print("writing 10,000 test PNGs ...")
        write_png_folder(folder)
        dataset = open_dataset(folder)
        first_decode, _ = timed(lambda: dataset.load("test", (32, 32), 3))
        warm_load, images = timed(lambda: dataset.load("test", (32, 32), 3))
        service_seconds, record = timed(lambda: evaluate_model(model, dataset))
        cli_began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ptq_cli", "evaluate", "--model", str(model), "--data", str(folder), "--results-dir",
                        str(work / "results")], cwd=work, env=env, check=True, capture_output=True)
        cli_seconds = time.perf_counter() - cli_began

        table = Table(title=f"Image folder of {len(images.labels):,} PNGs (32x32), {model.name}")
        table.add_column("step")
        table.add_column("seconds", justify="right")
        table.add_row("first decode (Pillow, every file, then cached)", f"{first_decode:.2f}")
        table.add_row("load from the warm cache", f"{warm_load:.3f}")
        table.add_row(f"evaluate, warm cache, in process (top-1 {record.accuracy:.2f}%)", f"{service_seconds:.2f}")
        table.add_row("`ptq evaluate --data FOLDER`, warm cache, fresh process", f"{cli_seconds:.2f}")
        console.print(table)

        flags = make_flags("cifar10-normalized", None, None, None, None)
        variants = {
            "batch fixed at 1, freed by ptq": contract_variant(model, work / "fixed.onnx"),
            "batch fixed at 1, tied flatten: image by image": contract_variant(model, work / "tied.onnx", opset=None, fixed_reshape=True),
            "symbolic batch": contract_variant(model, work / "symbolic.onnx", batch=None),
        }
        cifar = Cifar10(settings.cifar_dir())
        throughput: dict[str, list[float]] = {label: [] for label in variants}
        described: dict[str, str] = {}
        accuracy: dict[str, float] = {}
        for _ in range(options.rounds):
            for label, path in variants.items():
                result = evaluate_model(path, cifar, flags=flags)
                throughput[label].append(result.images_per_second)
                described[label], accuracy[label] = result.model_input, result.accuracy
        symbolic = statistics.median(throughput["symbolic batch"])
        table = Table(title=f"ResNet8 as NCHW, CIFAR mean/std, evaluated on 10,000 test images, median of {options.rounds} rounds in turns")
        for column in ("model", "input as ptq runs it", "top-1", "images/s", "x symbolic"):
            table.add_column(column, justify="left" if column.startswith(("model", "input")) else "right")
        for label in variants:
            median = statistics.median(throughput[label])
            table.add_row(label, described[label], f"{accuracy[label]:.2f}%", f"{median:,.0f}", f"{median / symbolic:.2f}")
        console.print(table)


if __name__ == "__main__":
    main()
