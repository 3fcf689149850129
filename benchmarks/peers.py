"""ptq's models against the best peers on the same model and photographs: fidelity on both x86 int8 paths and speed.

    make peers                       # EfficientNet-Lite0 on Tux Paint's stamp photographs (see imagenet_table.py)
    .venv/bin/python benchmarks/peers.py --workdir DIR [--stamps DIR] [--aimet-python .venv-peers/bin/python] [--lite 2]

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
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

import imagenet_size  # noqa: E402
from imagenet_table import MODEL, prepare_workdir  # noqa: E402

from ptq_cli import cpu as cpu_info  # noqa: E402
from ptq_cli.datasets import open_dataset  # noqa: E402
from ptq_cli.inputs import PreprocessingFlags  # noqa: E402
from ptq_cli.metrics import sqnr_db  # noqa: E402
from ptq_cli.services.measure import emulate  # noqa: E402
from ptq_cli.services.models import load_model  # noqa: E402

PTQ_CONFIGS = {"default": [], "int8": ["--dtype", "int8"], "vnni": ["--cpus", "vnni"], "nearest": ["--rounding", "nearest"]}  # `--ptq` names
FLAGS = PreprocessingFlags(preset="imagenet")


def photos(workdir: Path, folder: str, model: Path) -> np.ndarray:
    """A folder of photographs in the model's input format (NCHW, ImageNet normalisation)."""
    loaded = load_model(model, None, FLAGS)
    dataset = open_dataset(workdir / folder)
    images = dataset.load(dataset.evaluation_split(), (loaded.input.height, loaded.input.width), loaded.input.channels).images
    return loaded.prepare(images).astype(np.float32)


def ptq_model(workdir: Path, name: str, options: list[str]) -> tuple[Path, float]:
    output = workdir / f"peer_{name.replace(' ', '_').replace('-', '')}.onnx"
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ptq_cli", "quantize", "--model", MODEL, "--data", "test", "--calibration-data", "calibration",
                           "--calibration-size", str(len(list((workdir / "calibration").glob("*.jpg")))), "--preprocess", "imagenet",
                           "--output", output.name, *options], cwd=workdir, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: {done.stderr.strip()[-400:]}")
    return output, time.perf_counter() - began


def plain_onnxruntime(workdir: Path, calibration: np.ndarray) -> tuple[Path, float]:
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
    preprocessed, output = workdir / "peer_plain_pre.onnx", workdir / "peer_plain_onnxruntime.onnx"
    quant_pre_process(str(workdir / MODEL), str(preprocessed))
    quantize_static(str(preprocessed), str(output), Reader(onnx.load(str(preprocessed)).graph.input[0].name), quant_format=QuantFormat.QDQ, per_channel=True)
    return output, time.perf_counter() - began


def nncf_onnx(workdir: Path, calibration: np.ndarray) -> tuple[Path, float]:
    import nncf
    import onnx

    began = time.perf_counter()
    model = onnx.load(str(workdir / MODEL))
    input_name = model.graph.input[0].name
    dataset = nncf.Dataset([calibration[index : index + 1] for index in range(len(calibration))], lambda item: {input_name: item})
    quantized = nncf.quantize(model, dataset, subset_size=len(calibration), fast_bias_correction=False)
    output = workdir / "peer_nncf_onnx.onnx"
    onnx.save(quantized, str(output))
    return output, time.perf_counter() - began


def aimet(workdir: Path, python: Path, calibration: np.ndarray, iterations: int, first_layers: int) -> list[tuple[str, Path, float]]:
    """AIMET's QuantSim and AdaRound models; one already in `workdir` (with the seconds it took beside it) is measured
    again, not made again: AdaRound takes most of an hour on 2 cores."""
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
        done = subprocess.run([str(python), str(REPO / "benchmarks" / "peers_aimet.py"), str(workdir / MODEL), str(workdir / "calibration_inputs.npy"),
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
    options = parser.parse_args()
    unknown = set(options.ptq.split(",")) - set(PTQ_CONFIGS)
    if unknown:
        parser.error(f"--ptq: unknown configuration {', '.join(sorted(unknown))}")
    workdir = prepare_workdir(options.workdir or Path(tempfile.mkdtemp(prefix="ptq-peers-")), options.stamps, options.lite)
    calibration, test = photos(workdir, "calibration", workdir / MODEL), photos(workdir, "test", workdir / MODEL)
    names = {key: f"ptq {' '.join(PTQ_CONFIGS[key]) or 'default'}" for key in options.ptq.split(",")}
    made = [(name, *ptq_model(workdir, name, PTQ_CONFIGS[key])) for key, name in names.items()]
    made.append(("plain onnxruntime (per-channel MinMax)", *plain_onnxruntime(workdir, calibration)))
    made.append(("NNCF on ONNX (full bias correction)", *nncf_onnx(workdir, calibration)))
    if options.aimet_python:
        made += aimet(workdir, options.aimet_python, calibration, options.aimet_iterations, options.aimet_first_layers)
    reference = load_model(workdir / MODEL).predict(test)
    exact_cpu = cpu_info.current().int8_path == cpu_info.EXACT
    subset = slice(0, options.emulated) if exact_cpu else slice(None)
    rows = []
    for name, path, seconds in made:
        exact = load_model(path, exact_int8=True).predict(test)
        saturating = emulate.scores_under_emulation(path, test[subset]) if exact_cpu else load_model(path).predict(test)
        rows.append((name, path, seconds, fidelity(reference, exact), fidelity(reference[subset], saturating)))
        print(f"{name}: {seconds:.1f} s; exact {rows[-1][3]}; saturating {rows[-1][4]}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "ptq_cli", "benchmark", "--model", MODEL, *(part for row in rows for part in ("--model", row[1].name)),
                           "--data", "test", "--batch-size", "32", "--runs", "20", "--results-dir", "peer-results", "--json"],
                          cwd=workdir, capture_output=True, text=True)
    speeds = {Path(record["model_path"]).name: record["images_per_second"] for record in json.loads(done.stdout)} if done.returncode == 0 else {}
    saturating_basis = f"emulated on the first {options.emulated}" if exact_cpu else "native"
    print(f"\n{cpu_info.current().describe()}, {os.cpu_count()} cores; {len(test)} photographs measured, {len(calibration)} calibrate; "
          f"saturating path {saturating_basis}\n")
    print("| tool / config | time | agreement exact / saturating | top-5 exact | SQNR exact / saturating | x ORT FP32 |\n|---|---|---|---|---|---|")
    for name, path, seconds, exact, saturating in rows:
        speed = f"{speeds[path.name] / speeds[MODEL]:.2f}x" if path.name in speeds and MODEL in speeds else "-"
        print(f"| {name} | {seconds:.0f} s | {exact[0]:.1f}% / {saturating[0]:.1f}% | {exact[1]:.1f}% | {exact[2]:.1f} / {saturating[2]:.1f} dB | {speed} |")
    print(f"\nModels and photographs in {workdir}")


if __name__ == "__main__":
    main()
