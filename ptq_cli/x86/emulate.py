"""The saturating x86 int8 path on a CPU that has VNNI: onnxruntime's or PyTorch's real AVX2 kernels, in a child process
that sees an AVX2 CPU without VNNI.

Two ways to it, the first that works on this machine:
- CPUID masked (Linux on x86-64 with CPUID faulting, and a C compiler): the child starts with ptq's small shim
  (`avx2_cpuid.c`, compiled once into ptq's cache directory) preloaded, which answers CPUID without AVX-512, VNNI,
  AMX and AVX10; the libraries' CPU dispatch picks their AVX2 kernels, which run natively, at native speed.
- `qemu-x86_64 -cpu Haswell` (Debian's qemu-user): user-mode emulation of an AVX2 CPU, ten to a hundred times slower.
Both give the same bytes (tests/test_int8_paths.py). A stratified subset (`subset_indices`) is scored either way: by
default the whole split where it fits MASKED_INPUT_BYTES at native speed, DEFAULT_SUBSET images under qemu.
The children are the services' (services/models.py scores a model, services/measure/benchmark.py times one).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError
from ptq_cli.guards import cache, trust

QEMU = "qemu-x86_64"
QEMU_CPU = "Haswell"  # AVX2 and FMA, no AVX-512, no VNNI: what onnxruntime's CPU dispatch then picks is the saturating kernel
SHIM_SOURCE = Path(__file__).with_name("avx2_cpuid.c")
SHIM_PREFIX = "avx2-cpuid-"  # the compiled shim's file name: this, then its source's digest
MASKED_ENV = "PTQ_AVX2_SHIM"  # set in a child started with the shim: it checks that CPUID is masked before it loads a model
NOT_MASKED = 3  # the child's exit status where CPUID is not masked after all
DEFAULT_SUBSET = 1000  # images scored by default under qemu
# At native speed, the images scored by default: as many as this much model input holds (float32; it is written
# to a file for the child, which reads it whole), and at least DEFAULT_SUBSET: CIFAR-10's whole test set (123 MB).
MASKED_INPUT_BYTES = 512 << 20
TIMEOUT_SECONDS = 1800
MASK_CHECK = f"import sys; from ptq_cli.x86.emulate import masked_here; sys.exit(0 if masked_here() else {NOT_MASKED})"


def qemu() -> str | None:
    return shutil.which(QEMU)


def reachable() -> bool:
    """Whether this machine can run the AVX2 kernels one way or the other."""
    return masking_shim() is not None or qemu() is not None


def runs_natively() -> bool:
    """Whether the AVX2 kernels run natively here (CPUID masked), not only under qemu."""
    return masking_shim() is not None


def masking_shim() -> Path | None:
    """ptq's CPUID shim, compiled once into the cache directory (named by its source's digest), where it masks CPUID in
    a process here; None where it cannot (not x86-64 Linux, no C compiler, no cache directory, no CPUID faulting)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if sys.platform != "linux" or platform.machine() != "x86_64" or compiler is None:
        return None
    try:
        root = cache.directory()
    except PtqError:
        root = None
    if root is None:
        return None
    shim = root / f"{SHIM_PREFIX}{hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:16]}.so"
    # Code every emulated child loads: used only as ptq wrote it (cache.was_written), else built again.
    if not (shim.is_file() and cache.was_written(_digest(shim))) and not _build(compiler, shim):
        return None
    return shim if _masks(shim) else None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(compiler: str, shim: Path) -> bool:
    with tempfile.TemporaryDirectory(dir=shim.parent, prefix="ptq-shim-") as workdir:
        built = Path(workdir) / shim.name
        try:
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(SHIM_SOURCE)], capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if done.returncode != 0 or not built.is_file():
            return False
        cache.remember_written(_digest(built))
        os.replace(built, shim)
    return True


_MASKS: dict[Path, bool] = {}
PROBE_SECONDS = 300  # a Python start that imports ptq_cli: about a second, far longer on a machine loaded by other work


def _masks(shim: Path) -> bool:
    """Whether a process started with the shim sees CPUID masked (once per process: the answer is the machine's; a
    probe that could not run, did not finish or failed otherwise (killed, out of memory) is not an answer and is asked
    again next time)."""
    if shim not in _MASKS:
        try:
            probe = subprocess.run([sys.executable, "-c", MASK_CHECK], env=_environment(shim, 1), capture_output=True, timeout=PROBE_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if probe.returncode not in (0, NOT_MASKED):
            return False
        _MASKS[shim] = probe.returncode == 0
    return _MASKS[shim]


def masked_here() -> bool:
    """Whether ptq's shim answers CPUID in this process, and leaf 7 shows neither AVX-512 F nor VNNI."""
    import ctypes

    library = ctypes.CDLL(None)
    try:
        status, leaf7 = library.ptq_avx2_status, library.ptq_avx2_leaf7
    except AttributeError:  # the shim is not loaded
        return False
    leaf7.restype = ctypes.c_ulonglong
    features = leaf7()
    return status() == 0 and not features & (1 << 16) and not features >> 32 & (1 << 11)


def _environment(shim: Path | None, threads: int) -> dict[str, str]:
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), **({trust.ENV: "1"} if trust.trusting() else {})}
    environment.pop("PYTHONFAULTHANDLER", None)  # its SIGSEGV handler would take the faulting CPUID's place
    if shim is not None:
        environment |= {"LD_PRELOAD": ":".join(filter(None, (str(shim), os.environ.get("LD_PRELOAD")))), MASKED_ENV: "1"}
    return environment


def describe() -> str:
    """How this machine reaches the AVX2 kernels."""
    return "AVX2 kernels run natively, CPUID masked of AVX-512, VNNI and AMX" if runs_natively() else f"{QEMU} -cpu {QEMU_CPU}"


def default_subset(image_bytes: int) -> int:
    """The images scored on the saturating path where the user names no count, for a model input of `image_bytes`
    an image: native speed allows whole test sets; qemu, a thousand images."""
    if not runs_natively():
        return DEFAULT_SUBSET
    return max(DEFAULT_SUBSET, MASKED_INPUT_BYTES // max(image_bytes, 1))


def subset_indices(labels: np.ndarray, size: int) -> np.ndarray:
    """The first images of each class, as evenly as the classes allow, `size` in all (sorted)."""
    if size >= len(labels):
        return np.arange(len(labels))
    classes = np.unique(labels)
    per_class = -(-size // len(classes))
    chosen = np.concatenate([np.flatnonzero(labels == label)[:per_class] for label in classes])
    return np.sort(chosen)[:size] if len(chosen) > size else np.sort(chosen)


def run_on_avx2_kernels(module: str, arguments: list[str], model_path: Path, threads: int, emulated: bool = False) -> None:
    """`python -m module arguments` in a child whose runtime takes the AVX2 kernels: natively (CPUID masked), else
    under qemu where `emulated` allows it. The child calls `enter_avx2_child` first. A PtqError naming `model_path` where none can, or the child fails."""
    shim, binary = masking_shim(), qemu()
    if shim is None and (binary is None or not emulated):
        raise PtqError(f"{model_path}: the saturating int8 path on this CPU (it has VNNI) is reached natively with CPUID masked (needs CPUID "
                       "faulting and a C compiler)"
                       + (f"; scores also under {QEMU} -cpu {QEMU_CPU}, which is not installed (Debian: apt-get install qemu-user; `make install` does it)"
                          if emulated else
                          f"; {QEMU}'s pace says nothing of a CPU's speed"))
    prefix = [] if shim is not None else [str(binary), "-cpu", QEMU_CPU]
    environment = _environment(shim, threads)  # under qemu, qemu is the masking: no shim to check
    try:
        done = subprocess.run([*prefix, sys.executable, "-m", module, *arguments], capture_output=True, text=True, timeout=TIMEOUT_SECONDS,
                              env=environment, check=False)
    except subprocess.TimeoutExpired as error:
        raise PtqError(f"{model_path}: emulation ({describe()}) took over {TIMEOUT_SECONDS} s") from error
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and "TCG doesn't support" not in line]
        raise PtqError(f"{model_path}: emulation ({describe()}) failed ({(lines or ['exit ' + str(done.returncode)])[-1].strip()})")


def enter_avx2_child() -> None:
    """In a child `run_on_avx2_kernels` started: exits unless its runtime takes the AVX2 kernels after all. The shim
    leaves LD_PRELOAD for the programs the child starts (a C++ compiler that Inductor runs, whose own SIGSEGV handler
    would take the shim's and crash at its first CPUID): the child's runtime is masked, what it compiles is not."""
    if os.environ.get(MASKED_ENV) and not masked_here():
        sys.exit("CPUID is not masked in this process: its answers would be this CPU's own")
    if os.environ.get(MASKED_ENV):
        kept = [entry for entry in os.environ.get("LD_PRELOAD", "").split(":") if entry and not Path(entry).name.startswith(SHIM_PREFIX)]
        if kept:
            os.environ["LD_PRELOAD"] = ":".join(kept)
        else:
            os.environ.pop("LD_PRELOAD", None)
