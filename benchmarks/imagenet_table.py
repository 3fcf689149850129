"""An ImageNet-size classifier quantized as a new user would: time, peak memory, fidelity on both int8 paths, speed.

    .venv/bin/python benchmarks/imagenet_table.py [--workdir DIR] [--stamps DIR] [--configs default,speed,...]

The model: the pretrained EfficientNet-Lite0 (tests/imagenet_size.py), or with `--lite 1` EfficientNet-Lite1 at 240x240
(no choice of ptq's was tuned on it) or `--lite 2` EfficientNet-Lite2 at 260x260 (written as efficientnet_lite0.onnx in
its own workdir, so that every command line stays the same). The photos, unlabelled folders
(ROOT/*.jpg) whose classes are not ImageNet's:
- by default 300 CIFAR-10 training photos to calibrate and 300 test photos to measure, upsampled to 224x224;
- with `--stamps DIR`, the photographs of Tux Paint's stamp collection (Debian's tuxpaint-stamps-default:
  `apt-get download tuxpaint-stamps-default && dpkg-deb -x tuxpaint-stamps-default_*.deb x`, then
  `--stamps x/usr/share/tuxpaint/stamps`): animals, food, vehicles, instruments... cut out, here laid on
  white, the drawings (`cartoon`, `symbols`) and images under 150x150 left out; alternate ones calibrate
  and measure.
Each configuration is one `ptq quantize` process (wall time, peak resident memory), then `ptq evaluate
--int8-path both` (top-1 agreement, top-5 containment and SQNR of the scores against FP32 on the exact and
saturating x86 int8 paths); one `ptq benchmark` call times FP32 and every model in turns (batch 32, 20 runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

import imagenet_size  # noqa: E402
from calibration_224 import PEAK_WRAPPER  # noqa: E402

from ptq_cli.x86 import cpu as cpu_info  # noqa: E402

CONFIGS = {
    "default": [],  # onnxruntime's default: --target speed
    "int8": ["--dtype", "int8"],  # int8 activations and weights (the default before it was --target speed)
    "nearest": ["--rounding", "nearest"],
    "vnni": ["--cpus", "vnni"],
    "speed-nearest": ["--target", "speed", "--rounding", "nearest"],
    "first-layer": ["--overflow-fix", "first-layer"],
    "int8-stem": ["--stem", "int8"],
    "per-tensor": ["--per-tensor"],
    "speed": ["--target", "speed"],
    "speed-minmax": ["--target", "speed", "--method", "minmax"],
    "openvino": ["--backend", "openvino"],
    "openvino-nncf": ["--backend", "openvino", "--method", "nncf"],
    "pytorch": ["--backend", "pytorch"],
}
SUFFIXES = {"openvino": ".xml", "openvino-nncf": ".xml", "pytorch": ".pt"}
MODEL = "efficientnet_lite0.onnx"


def stamp_photos(stamps: Path, calibration: Path, test: Path, smallest: int = 150 * 150) -> int:
    """Alternate stamp photographs, on white, into the two folders; how many were written."""
    from PIL import Image

    calibration.mkdir(parents=True, exist_ok=True)
    test.mkdir(parents=True, exist_ok=True)
    written = 0
    for path in sorted(stamps.rglob("*.png")):
        if {"cartoon", "symbols"} & set(path.relative_to(stamps).parts):
            continue
        with Image.open(path) as image:
            if image.size[0] * image.size[1] < smallest:
                continue
            rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        white.alpha_composite(rgba)
        name = "_".join(path.relative_to(stamps).with_suffix(".jpg").parts)
        white.convert("RGB").save((calibration if written % 2 == 0 else test) / name, quality=92)
        written += 1
    return written


def prepare_workdir(workdir: Path, stamps: Path | None, variant: int = 0) -> Path:
    """The model and the two photo folders in `workdir`, made where missing: stamp photographs, or upsampled CIFAR-10.
    EfficientNet-Lite1 or -Lite2 (`variant` 1 or 2) is written under the same file name in its own workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / MODEL).is_file():
        imagenet_size.efficientnet_lite_onnx(workdir / MODEL, variant)
    if not (workdir / "test").is_dir():
        if stamps:
            stamp_photos(stamps, workdir / "calibration", workdir / "test")
        else:
            cifar = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets")) / "cifar-10-batches-py"
            imagenet_size.write_jpegs(imagenet_size.cifar_photos(cifar, "train", 300, seed=1)[0], workdir / "calibration")
            imagenet_size.write_jpegs(imagenet_size.cifar_photos(cifar, "test", 300, seed=2)[0], workdir / "test")
    return workdir


def run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ptq_cli", *args], cwd=workdir, capture_output=True, text=True)


def quantize(workdir: Path, name: str, options: list[str]) -> tuple[str, float, int]:
    """(the model file, wall seconds, peak resident bytes) of one `ptq quantize` process."""
    output = f"lite0_{name}{SUFFIXES.get(options[1] if options[:1] == ['--backend'] else '', '.onnx')}"
    command = [sys.executable, "-m", "ptq_cli", "quantize", "--model", MODEL, "--data", "test", "--calibration-data", "calibration",
               "--calibration-size", str(len(list((workdir / "calibration").glob("*.jpg")))), "--preprocess", "imagenet", "--output", output, *options]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, *command], cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - began
    lines = done.stderr.strip().splitlines()
    if done.returncode:
        raise SystemExit(f"{name}: ptq quantize failed:\n" + "\n".join(lines[-5:]))
    return output, seconds, int(lines[-1])


def fidelity(workdir: Path, model: str) -> str:
    """"exact / saturating" top-1 agreement (with its 95% interval), top-5 containment and SQNR from the records `evaluate
    --int8-path both` wrote."""
    done = run(workdir, "evaluate", "--model", model, "--data", "test", "--int8-path", "both", "--results-dir", "results")
    if done.returncode:
        raise SystemExit(f"{model}: ptq evaluate failed: {done.stderr.strip()[-400:]}")
    records = {}
    for path in (workdir / "results").glob(f"{model}-*.json"):
        record = json.loads(path.read_text())
        records[record.get("int8_path") or "one path"] = record["fidelity"]
    paths = [path for path in ("exact", "saturating", "one path") if path in records]
    top1 = " / ".join(f"{records[path]['top1_agreement']:.1f}% ({records[path]['top1_agreement_low']:.0f}-{records[path]['top1_agreement_high']:.0f})" for path in paths)
    top5 = " / ".join(f"{records[path]['top5_containment']:.1f}%" for path in paths)
    sqnr = " / ".join(f"{records[path]['sqnr_db']:.1f} dB" for path in paths)
    return f"{top1} | {top5} | {sqnr}" + (" (one path)" if paths == ["one path"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--stamps", type=Path, default=None, help="Tux Paint's stamps folder (see above); default: CIFAR-10 upsampled")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--lite", type=int, choices=sorted(imagenet_size.LITE_VARIANTS), default=0, help="EfficientNet-Lite0 (224 px), -Lite1 (240 px) or -Lite2 (260 px)")
    options = parser.parse_args()
    workdir = prepare_workdir(options.workdir or Path(tempfile.mkdtemp(prefix="ptq-imagenet-table-")), options.stamps, options.lite)
    rows = []
    for name in options.configs.split(","):
        model, seconds, peak = quantize(workdir, name, CONFIGS[name])
        rows.append((name, model, seconds, peak, fidelity(workdir, model)))
        print(f"{name}: {seconds:.1f} s, {peak / 1e9:.2f} GB, {rows[-1][-1]}", file=sys.stderr, flush=True)
    done = run(workdir, "benchmark", "--model", MODEL, *(argument for row in rows for argument in ("--model", row[1])),
               "--data", "test", "--batch-size", "32", "--runs", "20", "--results-dir", "results", "--json")
    if done.returncode:
        raise SystemExit(f"ptq benchmark failed: {done.stderr.strip()[-400:]}")
    speeds = {Path(record["model_path"]).name: record for record in json.loads(done.stdout)}
    count = len(list((workdir / "test").glob("*.jpg")))
    print(f"{cpu_info.current().describe()}, {os.cpu_count()} cores; {count} photos measured, FP32 {speeds[MODEL]['images_per_second']:.1f} images/s\n")
    print("| `ptq quantize` | time | peak | top-1 agreement (95% interval) exact / saturating | top-5 exact / saturating | SQNR exact / saturating | x FP32 |\n|---|---|---|---|---|---|---|")
    for name, model, seconds, peak, figures in rows:
        ratio = speeds[model]["images_per_second"] / speeds[MODEL]["images_per_second"]  # same call, in turns: every runtime against onnxruntime FP32
        print(f"| {' '.join(CONFIGS[name]) or '(default)'} | {seconds:.1f} s | {peak / 1e9:.2f} GB | {figures} | {ratio:.2f}x |")
    print(f"\nModels, photos and records in {workdir}")


if __name__ == "__main__":
    main()
