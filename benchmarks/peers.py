"""ptq's models against the best peers on the same model and photographs: fidelity on both x86 int8 paths and speed.

    make peers                       # EfficientNet-Lite0 on Tux Paint's stamp photographs (see imagenet_table.py)
    .venv/bin/python benchmarks/peers.py --workdir DIR [--stamps DIR] [--aimet-python .venv-peers/bin/python] [--lite 2]
    .venv/bin/python benchmarks/peers.py --model YOURS.onnx --calibration PHOTOS --test PHOTOS [--preprocess P | --scale S --mean M --std D]

Without --model: EfficientNet-Lite0 (or --lite 1|2) on photographs, as imagenet_table.py lays them out. With --model: any FP32
ONNX classifier and two folders of images (labels not needed); its preprocessing is what the model records (`ptq convert`
writes it) unless the preprocessing options say otherwise, and every tool is given the same inputs.

Every model is quantized from the same FP32 ONNX model with the same calibration photographs and judged on the
same held-out photographs against FP32's outputs (top-1 agreement, top-5 containment, SQNR of the scores):
- ptq: `ptq quantize` as a user runs it (default, which is `--target speed`, `--dtype int8`, `--cpus vnni`, `--rounding nearest`);
- plain onnxruntime: quant_pre_process, then quantize_static (QDQ, per-channel, MinMax: its own defaults otherwise);
- NNCF on ONNX, with full bias correction (`fast_bias_correction=False`);
- AIMET-ONNX 2.42 (QuantSim, then AdaRound on the first 6 weighted layers, where issue 33 found half of Lite0's
  loss, 1,000 iterations each), exported to QDQ and run in onnxruntime: its own virtual environment (`make peers`
  builds .venv-peers, with the local CPU torch), never part of `make test` or CI. An AIMET model already in the
  workdir is measured again, not made again.
The exact path is this CPU's own where it has VNNI (else onnxruntime's exact-kernel switch); the saturating path is
this CPU's own without VNNI, else emulated (qemu, an AVX2 CPU) on the first `--emulated` photographs. One `ptq
benchmark` call times FP32 and every model in turns (batch 32, 20 runs); speeds are ratios to onnxruntime FP32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

import imagenet_size  # noqa: E402
from imagenet_table import MODEL, prepare_workdir  # noqa: E402

from ptq_cli.datasets import open_dataset  # noqa: E402
from ptq_cli.errors import PtqError  # noqa: E402
from ptq_cli.inputs import PreprocessingFlags, parse_size, parse_triple  # noqa: E402
from ptq_cli.metrics import sqnr_db  # noqa: E402
from ptq_cli.model_file import read_onnx  # noqa: E402
from ptq_cli.services import models as model_service  # noqa: E402
from ptq_cli.services.models import load_model  # noqa: E402
from ptq_cli.x86 import cpu as cpu_info  # noqa: E402

PTQ_CONFIGS = {"default": [], "int8": ["--dtype", "int8"], "vnni": ["--cpus", "vnni"], "nearest": ["--rounding", "nearest"]}  # `--ptq` names
PREPROCESSING_OPTIONS = ("--preprocess", "--scale", "--mean", "--std")


@dataclass(frozen=True)
class Subject:
    """The FP32 model every tool quantizes (a file in the workdir), and its preprocessing: as ptq's options (given to
    `ptq quantize`) and as the flags they stand for (the inputs the other tools are given). None given: the model's own."""

    workdir: Path
    model: str
    given: dict[str, str]

    @property
    def preprocessing(self) -> list[str]:
        return [part for option, value in self.given.items() for part in (option, value)]

    @property
    def flags(self) -> PreprocessingFlags:
        scale = self.given.get("--scale")
        return PreprocessingFlags(preset=self.given.get("--preprocess"), scale=None if scale is None else float(scale),
                                  mean=parse_triple("--mean", self.given.get("--mean")), std=parse_triple("--std", self.given.get("--std")),
                                  size=parse_size("--input-size", self.given.get("--input-size")))


def own_workdir(workdir: Path, model: Path, calibration: Path, test: Path) -> None:
    """The user's model written into the workdir whole (read by ptq's own bounded reader, its external weights taken in)
    and their two photo folders linked there, so that every tool runs as on the EfficientNet-Lite workdir; nothing is
    written into the user's folders, and a workdir holding another model or other folders under those names is refused."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        whole = read_onnx(model).SerializeToString()
    except PtqError as error:  # one line naming the file, as ptq says it
        raise SystemExit(str(error)) from error
    placed = workdir / model.name
    if placed.is_file() and placed.read_bytes() != whole:
        raise SystemExit(f"{placed} already exists and is another model: give another --workdir")
    if not placed.is_file():
        placed.write_bytes(whole)
    for name, folder in (("calibration", calibration), ("test", test)):
        link = workdir / name
        if link.is_symlink() or link.exists():
            if link.resolve() != folder.resolve():
                raise SystemExit(f"{link} already exists and is not {folder}: give another --workdir")
            continue
        link.symlink_to(folder.resolve(), target_is_directory=True)


def photos(subject: Subject, folder: str) -> np.ndarray:
    """A folder of photographs in the model's input format."""
    loaded = load_model(subject.workdir / subject.model, None, subject.flags)
    dataset = open_dataset(subject.workdir / folder)
    images = dataset.load(dataset.evaluation_split(), (loaded.input.height, loaded.input.width), loaded.input.channels).images
    return loaded.prepare(images).astype(np.float32)


def ptq_model(subject: Subject, name: str, options: list[str], calibration_count: int) -> tuple[Path, float]:
    output = subject.workdir / f"peer_{name.replace(' ', '_').replace('-', '')}.onnx"
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ptq_cli", "quantize", "--model", subject.model, "--data", "test", "--calibration-data", "calibration",
                           "--calibration-size", str(calibration_count), *subject.preprocessing,
                           "--output", output.name, *options], cwd=subject.workdir, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: {done.stderr.strip()[-400:]}")
    return output, time.perf_counter() - began


def plain_onnxruntime(subject: Subject, calibration: np.ndarray) -> tuple[Path, float]:
    """The five-line script a user writes from onnxruntime's documentation."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self, name: str) -> None:
            self.batches = iter([{name: calibration[start : start + 16]} for start in range(0, len(calibration), 16)])

        def get_next(self):
            return next(self.batches, None)

    began = time.perf_counter()
    preprocessed, output = subject.workdir / "peer_plain_pre.onnx", subject.workdir / "peer_plain_onnxruntime.onnx"
    quant_pre_process(str(subject.workdir / subject.model), str(preprocessed))
    quantize_static(str(preprocessed), str(output), Reader(onnx.load(str(preprocessed)).graph.input[0].name), quant_format=QuantFormat.QDQ, per_channel=True)
    return output, time.perf_counter() - began


def nncf_onnx(subject: Subject, calibration: np.ndarray) -> tuple[Path, float]:
    import nncf
    import onnx

    began = time.perf_counter()
    model = onnx.load(str(subject.workdir / subject.model))
    input_name = model.graph.input[0].name
    dataset = nncf.Dataset([calibration[index : index + 1] for index in range(len(calibration))], lambda item: {input_name: item})
    quantized = nncf.quantize(model, dataset, subset_size=len(calibration), fast_bias_correction=False)
    output = subject.workdir / "peer_nncf_onnx.onnx"
    onnx.save(quantized, str(output))
    return output, time.perf_counter() - began


def aimet(subject: Subject, python: Path, calibration: np.ndarray, iterations: int, first_layers: int) -> list[tuple[str, Path, float]]:
    """AIMET's QuantSim and AdaRound models; one already in `workdir` (with the seconds it took beside it) is measured
    again, not made again: AdaRound takes most of an hour on 2 cores."""
    workdir = subject.workdir
    np.save(workdir / "calibration_inputs.npy", calibration)
    made = []
    layers = str(first_layers) if first_layers else "every"
    adaround = ["--adaround", "--iterations", str(iterations), *(["--first-layers", str(first_layers)] if first_layers else [])]
    for name, extra in (("AIMET default (QuantSim)", []), (f"AIMET AdaRound ({layers} first layers, {iterations} iterations)", adaround)):
        output = workdir / (f"peer_aimet_adaround_{layers}x{iterations}.onnx" if extra else "peer_aimet.onnx")  # named by its settings: reused only for them
        took = output.with_suffix(".seconds")
        if output.is_file() and took.is_file():
            made.append((name, output, float(took.read_text())))
            continue
        began = time.perf_counter()
        done = subprocess.run([str(python), str(REPO / "benchmarks" / "peers_aimet.py"), str(workdir / subject.model), str(workdir / "calibration_inputs.npy"),
                               str(output), *extra], capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: failed: {done.stderr.strip()[-600:]}", file=sys.stderr)
            continue
        made.append((name, output, time.perf_counter() - began))
        took.write_text(f"{made[-1][2]:.1f}")
    return made


def fidelity(reference: np.ndarray, scores: np.ndarray) -> tuple[float, float, float]:
    top1 = float(np.mean(scores.argmax(axis=1) == reference.argmax(axis=1))) * 100
    top5 = float(np.mean([row in set(np.argsort(-got)[:5]) for row, got in zip(reference.argmax(axis=1), scores, strict=True)])) * 100
    return top1, top5, sqnr_db(reference, scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--stamps", type=Path, default=None, help="Tux Paint's stamps folder (imagenet_table.py); default: CIFAR-10 upsampled")
    parser.add_argument("--lite", type=int, choices=sorted(imagenet_size.LITE_VARIANTS), default=0, help="EfficientNet-Lite0, -Lite1 or -Lite2 (imagenet_table.py)")
    parser.add_argument("--ptq", default=",".join(PTQ_CONFIGS), help=f"ptq's configurations, comma-separated, of: {', '.join(PTQ_CONFIGS)}")
    parser.add_argument("--aimet-python", type=Path, default=None, help="the Python of a virtual environment with aimet-onnx (make peers)")
    parser.add_argument("--aimet-iterations", type=int, default=1000, help="AdaRound's optimisation steps a layer")
    parser.add_argument("--aimet-first-layers", type=int, default=6,
                        help="AdaRound the first N Conv/Gemm/MatMul layers (0: every layer; with 1,000 iterations a layer, not finished in 74 CPU-minutes)")
    parser.add_argument("--emulated", type=int, default=24, help="photographs scored under emulation for the saturating path on a VNNI CPU")
    parser.add_argument("--model", type=Path, default=None, help="your FP32 ONNX classifier instead of EfficientNet-Lite (with --calibration and --test)")
    parser.add_argument("--calibration", type=Path, default=None, help="with --model: the folder of images every tool calibrates on")
    parser.add_argument("--test", type=Path, default=None, help="with --model: the folder of images every model is judged on")
    for option in PREPROCESSING_OPTIONS:
        parser.add_argument(option, default=None, help=f"with --model: ptq's {option} for it (default: what the model records)")
    options = parser.parse_args()
    unknown = set(options.ptq.split(",")) - set(PTQ_CONFIGS)
    if unknown:
        parser.error(f"--ptq: unknown configuration {', '.join(sorted(unknown))}")
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="ptq-peers-"))
    if options.model:
        if not (options.calibration and options.test):
            parser.error("--model needs --calibration DIR and --test DIR")
        own_workdir(workdir, options.model, options.calibration, options.test)
        given = {option: getattr(options, option[2:]) for option in PREPROCESSING_OPTIONS if getattr(options, option[2:]) is not None}
        subject = Subject(workdir, options.model.name, given)
    else:
        subject = Subject(prepare_workdir(workdir, options.stamps, options.lite), MODEL, {"--preprocess": "imagenet"})
    model = subject.model
    calibration, test = photos(subject, "calibration"), photos(subject, "test")
    names = {key: f"ptq {' '.join(PTQ_CONFIGS[key]) or 'default'}" for key in options.ptq.split(",")}
    made = [(name, *ptq_model(subject, name, PTQ_CONFIGS[key], len(calibration))) for key, name in names.items()]
    made.append(("plain onnxruntime (per-channel MinMax)", *plain_onnxruntime(subject, calibration)))
    made.append(("NNCF on ONNX (full bias correction)", *nncf_onnx(subject, calibration)))
    if options.aimet_python:
        made += aimet(subject, options.aimet_python, calibration, options.aimet_iterations, options.aimet_first_layers)
    reference = load_model(workdir / model).predict(test)
    exact_cpu = cpu_info.current().int8_path == cpu_info.EXACT
    subset = slice(0, options.emulated) if exact_cpu else slice(None)
    rows = []
    for name, path, seconds in made:
        exact = load_model(path, exact_int8=True).predict(test)
        saturating = model_service.scores_under_emulation(path, test[subset]) if exact_cpu else load_model(path).predict(test)
        rows.append((name, path, seconds, fidelity(reference, exact), fidelity(reference[subset], saturating)))
        print(f"{name}: {seconds:.1f} s; exact {rows[-1][3]}; saturating {rows[-1][4]}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "ptq_cli", "benchmark", "--model", model, *(part for row in rows for part in ("--model", row[1].name)),
                           "--data", "test", "--batch-size", "32", "--runs", "20", "--results-dir", "peer-results", "--json"],
                          cwd=workdir, capture_output=True, text=True)
    speeds = {Path(record["model_path"]).name: record["images_per_second"] for record in json.loads(done.stdout)} if done.returncode == 0 else {}
    saturating_basis = f"emulated on the first {options.emulated}" if exact_cpu else "native"
    print(f"\n{model}: {cpu_info.current().describe()}, {os.cpu_count()} cores; {len(test)} photographs measured, {len(calibration)} calibrate; "
          f"saturating path {saturating_basis}\n")
    print("| tool / config | time | agreement exact / saturating | top-5 exact | SQNR exact / saturating | x ORT FP32 |\n|---|---|---|---|---|---|")
    for name, path, seconds, exact, saturating in rows:
        speed = f"{speeds[path.name] / speeds[model]:.2f}x" if path.name in speeds and model in speeds else "-"
        print(f"| {name} | {seconds:.0f} s | {exact[0]:.1f}% / {saturating[0]:.1f}% | {exact[1]:.1f}% | {exact[2]:.1f} / {saturating[2]:.1f} dB | {speed} |")
    print(f"\nModels and photographs in {workdir}")


if __name__ == "__main__":
    main()
