"""Model files as the services see them: loaded through the backend table (the backend chosen by a file's
content, not its name), found in a folder, checked against a dataset's classes, and scored on the kernels of x86
CPUs without VNNI (x86/emulate.py starts the child: `python -m ptq_cli.services.models MODEL INPUTS.npy OUTPUT.npy THREADS`)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from ptq_cli import backends, inputs
from ptq_cli.backends.base import LoadedModel, ModelInfo, RunOptions
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded, hardstop, trust
from ptq_cli.guards.atomic import is_temporary
from ptq_cli.model_file import read_bytes
from ptq_cli.x86 import emulate
from ptq_cli.x86 import plan as int8_plan


def models_in(directory: Path, suffixes: tuple[str, ...]) -> tuple[list[Path], list[Path]]:
    """(model files in `directory` that can be loaded, those left out): a TorchScript file ptq did not write
    runs code when loaded, so a folder scan never loads it (the user names it with the trust option)."""
    found, skipped = [], []
    for path in sorted(Path(directory).glob("*")):
        if path.suffix not in suffixes or is_temporary(path) or not path.is_file():
            continue
        if backends.loads_code(path) and not trust.trusting():
            try:
                written = trust.written_by_ptq(read_bytes(path))
            except PtqError:
                written = False
            if not written:
                skipped.append(path)
                continue
        found.append(path)
    return found, skipped


def check_classes(path: Path, model_classes: int, class_names: tuple[str, ...], where: Path | str) -> None:
    if model_classes != len(class_names):
        raise PtqError(f"{path}: the model gives {model_classes} class scores, but {where} has {len(class_names)} classes")


def input_of(path: Path, flags: inputs.PreprocessingFlags | None = None) -> inputs.ModelInput:
    """What a model takes (layout, channels, size, batch), read from its file where the backend can, else by loading it."""
    row = backends.for_file(path)
    return row.read_input(Path(path), flags.size if flags else None) if row.read_input is not None else load_model(path, 1, flags).input


def load_model(path: Path, threads: int | None = None, flags: inputs.PreprocessingFlags | None = None, runtime: str | None = None,
               precision: str | None = None, exact_int8: bool = False, saturating_int8: bool = False) -> LoadedModel:
    """The runner for a model file, the backend chosen by the file's content, not its name; `runtime` runs
    a file on another runtime that takes it (an ONNX file on OpenVINO), with the `precision` hint;
    `exact_int8` asks a runtime with a switch for its exact u8 x s8 kernels on a CPU without VNNI; `saturating_int8`
    one that can pick them for the kernels of CPUs without VNNI on a CPU with it."""
    backend = backends.for_file(path, runtime)
    precisions = backend.runtime.precisions
    if precision is not None and precision not in precisions:
        takes = f"one of {', '.join(precisions)}" if precisions else f"none: {path} runs on {backend.name}"
        raise PtqError(f"--precision: '{precision}' is not a precision hint of {backend.name} (it takes {takes})")
    bound = bounded.CALL_SECONDS.value()
    # Loading runs the model once on a probe image: a graph that never ends is reported, not waited on.
    stuck = f"{path}: loading it and running one image did not finish within {bound:,} s (raise {bounded.CALL_SECONDS.env} if it is only slow)"
    with hardstop.deadline(bound, stuck):
        return backend.runtime.load(Path(path), RunOptions(threads, flags or inputs.PreprocessingFlags(), precision, exact_int8, saturating_int8))


def int8_model(info: ModelInfo) -> int8_plan.Int8Model:
    """What x86/plan.py reads of a model: its runtime's int8 paths where it is an 8-bit model whose kernels differ by CPU."""
    paths = None if info.dtype == "fp32" else backends.backend(info.runtime).int8_paths
    return int8_plan.Int8Model(info.path, paths, info.quantization)


def scores_under_emulation(model_path: Path, batch: np.ndarray, threads: int = 1) -> np.ndarray:
    """The model's scores on `batch` (already in its input format), computed as an AVX2 CPU without VNNI
    computes them, by the model's own runtime (onnxruntime or PyTorch)."""
    with tempfile.TemporaryDirectory(prefix="ptq-emulate-") as workdir:
        fed, outputs = Path(workdir) / "inputs.npy", Path(workdir) / "scores.npy"
        np.save(fed, batch)
        emulate.run_on_avx2_kernels(__name__, [str(Path(model_path).resolve()), str(fed), str(outputs), str(threads)], model_path, threads,
                                    emulated=True)
        if not outputs.is_file():
            raise PtqError(f"{model_path}: emulation ({emulate.describe()}) wrote no scores")
        return np.load(outputs, allow_pickle=False)


def native_scores(model_path: Path, batch: np.ndarray, threads: int = 1) -> np.ndarray | None:
    """`scores_under_emulation` where this machine runs the model's AVX2 kernels natively, at a judge's pace (qemu's is
    about a hundred times slower): None where it does not. A child that failed is started once more (a loaded machine
    can kill one); a PtqError if it fails again."""
    if not emulate.runs_natively():
        return None
    try:
        return scores_under_emulation(model_path, batch, threads)
    except PtqError:
        return scores_under_emulation(model_path, batch, threads)


def _child(model: str, fed: str, outputs: str, threads: str) -> None:
    """The child `scores_under_emulation` starts: the model's scores on the inputs, on the AVX2 kernels."""
    emulate.enter_avx2_child()
    loaded = backends.for_file(Path(model)).runtime.load(Path(model), RunOptions(int(threads)))  # qemu runs each guest thread on a host thread
    batch = np.load(fed, allow_pickle=False)
    np.save(outputs, np.concatenate([loaded.predict(part) for part in np.array_split(batch, max(1, -(-len(batch) // 256)))]))


if __name__ == "__main__":
    _child(*sys.argv[1:5])
