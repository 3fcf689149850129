"""The saturating x86 int8 path on a CPU that has VNNI: onnxruntime's or PyTorch's real kernels run under
user-mode emulation of an AVX2 CPU (`qemu-x86_64 -cpu Haswell`, Debian's qemu-user), in a child process.

Emulation runs about 50-100 images/s on ResNet8 (PyTorch: about 25 s to start), so it scores a
stratified subset (`subset_indices`).
Run as `python -m ptq_cli.services.measure.emulate MODEL INPUTS.npy OUTPUT.npy`, it is that child.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError
from ptq_cli.guards import trust

QEMU = "qemu-x86_64"
QEMU_CPU = "Haswell"  # AVX2 and FMA, no AVX-512, no VNNI: what onnxruntime's CPU dispatch then picks is the saturating kernel
DEFAULT_SUBSET = 1000
TIMEOUT_SECONDS = 1800


def qemu() -> str | None:
    return shutil.which(QEMU)


def describe() -> str:
    return f"{QEMU} -cpu {QEMU_CPU}"


def subset_indices(labels: np.ndarray, size: int) -> np.ndarray:
    """The first images of each class, as evenly as the classes allow, `size` in all (sorted)."""
    if size >= len(labels):
        return np.arange(len(labels))
    classes = np.unique(labels)
    per_class = -(-size // len(classes))
    chosen = np.concatenate([np.flatnonzero(labels == label)[:per_class] for label in classes])
    return np.sort(chosen)[:size] if len(chosen) > size else np.sort(chosen)


def scores_under_emulation(model_path: Path, batch: np.ndarray, threads: int = 1) -> np.ndarray:
    """The model's scores on `batch` (already in its input format), computed as an AVX2 CPU without VNNI
    computes them, by the model's own runtime (onnxruntime or PyTorch)."""
    binary = qemu()
    if binary is None:
        raise PtqError(f"{model_path}: the saturating int8 path on this CPU (it has VNNI) is measured under {describe()}, "
                       f"and {QEMU} is not installed (Debian: apt-get install qemu-user; `make install` does it)")
    with tempfile.TemporaryDirectory(prefix="ptq-emulate-") as workdir:
        inputs, outputs = Path(workdir) / "inputs.npy", Path(workdir) / "scores.npy"
        np.save(inputs, batch)
        command = [binary, "-cpu", QEMU_CPU, sys.executable, "-m", __name__, str(Path(model_path).resolve()), str(inputs), str(outputs), str(threads)]
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), **({trust.ENV: "1"} if trust.trusting() else {})}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, env=environment, check=False)
        except subprocess.TimeoutExpired as error:
            raise PtqError(f"{model_path}: emulation under {describe()} took over {TIMEOUT_SECONDS} s") from error
        if done.returncode != 0 or not outputs.is_file():
            lines = [line for line in done.stderr.splitlines() if line.strip() and "TCG doesn't support" not in line]
            raise PtqError(f"{model_path}: emulation under {describe()} failed ({(lines or ['exit ' + str(done.returncode)])[-1].strip()})")
        return np.load(outputs, allow_pickle=False)


def _child(model: str, inputs: str, outputs: str, threads: str) -> None:
    from ptq_cli.services.models import load_model

    loaded = load_model(Path(model), int(threads))  # qemu runs each guest thread on a host thread
    batch = np.load(inputs, allow_pickle=False)
    np.save(outputs, np.concatenate([loaded.predict(part) for part in np.array_split(batch, max(1, -(-len(batch) // 256)))]))


if __name__ == "__main__":
    _child(*sys.argv[1:5])
