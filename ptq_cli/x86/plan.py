"""Which x86 int8 path a figure holds for, and how this machine gets it: the plan evaluate, benchmark and `ptq run`
read. cpu.py says which path this CPU takes natively; a backend's Int8Paths (paths.py) what its runtime can do on
the other (a session switch, a proof, kernels it can load); emulate.py how the other path's kernels run here at all.
The plan reads a model as an Int8Model, which the services make from a loaded model's description."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ptq_cli.errors import PtqError
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import emulate
from ptq_cli.x86.paths import EMULATE, Int8Paths

NATIVE = "native"  # a figure's basis: the CPU's own kernels
# What `evaluate --int8-path` and `benchmark --int8-path` take besides the two paths themselves.
NATIVE_PATH, BOTH_PATHS = "native", "both"
INT8_PATH_CHOICES = (NATIVE_PATH, *cpu_info.INT8_PATHS, BOTH_PATHS)
KERNEL_PATH_CHOICES = (NATIVE_PATH, cpu_info.SATURATING)  # benchmark: this CPU's kernels, or those of CPUs without VNNI
# On a VNNI CPU the saturating path of a model that cannot be proven exact is emulated. With CPUID masked (native
# speed) `ptq run` scores what `evaluate` does by default, the whole test split; under qemu (about 35 to 70 s for
# 1,000 images on 2 cores) this many, so that `ptq run` stays within minutes.
RUN_EMULATED_IMAGES = 500


@dataclass(frozen=True)
class Int8Model:
    """What the plan reads of one model: its file, its runtime's int8 paths (None for a float model, or a runtime
    whose x86 int8 kernels do not differ by CPU) and its quantization settings."""

    path: Path
    paths: Int8Paths | None
    settings: dict | None = None


@dataclass(frozen=True)
class Int8Plan:
    """How one model's figure on one int8 path is obtained on this CPU."""

    path: str | None  # the int8 path the figure holds for; None for a model whose figures hold on every x86 CPU
    basis: str  # NATIVE, the runtime's session switch, a proof, or EMULATE
    exact_int8: bool = False  # loaded with the runtime's exact u8 x s8 kernels (a CPU without VNNI, the exact path)
    saturating_int8: bool = False  # loaded with the kernels of CPUs without VNNI (a VNNI CPU, a proven model)

    @property
    def emulated(self) -> bool:
        return self.basis == EMULATE


def paths_asked(choice: str) -> tuple[str | None, ...]:
    """The paths `--int8-path CHOICE` asks for (None: this CPU's own); a PtqError for a choice it does not take."""
    if choice not in INT8_PATH_CHOICES:
        raise PtqError(f"--int8-path: '{choice}' is not one of {', '.join(INT8_PATH_CHOICES)}")
    return {NATIVE_PATH: (None,), BOTH_PATHS: cpu_info.INT8_PATHS}.get(choice, (choice,))


def other_path_measurable(paths: Int8Paths | None, overflow_fix: str | None, int8_path: str) -> bool:
    """Whether an 8-bit model of a runtime with these `paths` made with `overflow_fix` can be scored on `int8_path` on
    this CPU (PyTorch's exact path away from a VNNI CPU only by proof)."""
    return paths is not None and paths.reaches(overflow_fix, int8_path)


def paths_to_measure(model: Int8Model, asked: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """The paths to score a model on: both only where they differ by CPU (8-bit onnxruntime and PyTorch models) and
    can be reached here; one otherwise."""
    if len(asked) < 2:
        return asked
    if model.paths is None:
        return (None,)
    fix = (model.settings or {}).get("overflow_fix")
    here = cpu_info.current().int8_path
    return tuple(path for path in asked if path == here or (path is not None and other_path_measurable(model.paths, fix, path)))


def needs_exact_switch(wanted: str | None, cpu: cpu_info.Cpu) -> bool:
    """Whether the model is to be loaded with its runtime's exact kernels: the exact path asked on a CPU without VNNI."""
    return wanted == cpu_info.EXACT and cpu.int8_path == cpu_info.SATURATING


def plan(model: Int8Model, wanted: str | None, cpu: cpu_info.Cpu) -> Int8Plan:
    """The plan for a model (as loaded for `wanted`) on this CPU; a PtqError where a path is asked of a model whose
    figures hold on every x86 CPU."""
    paths, exact_int8 = model.paths, needs_exact_switch(wanted, cpu)
    if paths is None:
        if wanted not in (None, cpu.int8_path):
            raise PtqError(f"--int8-path {wanted}: {model.path} is not an 8-bit model of a runtime whose kernels differ by x86 CPU "
                           "(its figures hold on every x86 CPU)")
        return Int8Plan(None, "", exact_int8)
    wanted = wanted or cpu.int8_path
    if wanted == cpu.int8_path:
        return Int8Plan(wanted, NATIVE, exact_int8)
    basis = paths.basis(model.path, model.settings, wanted)
    saturating_int8 = (wanted == cpu_info.SATURATING and cpu.int8_path == cpu_info.EXACT and basis not in (NATIVE, EMULATE)
                       and paths.proof_loads_saturating_kernels)
    return Int8Plan(wanted, basis, exact_int8, saturating_int8)


def emulated_images(asked: int | None) -> int | None:
    """The images `ptq run` scores a model on the saturating path: as asked, else the evaluation's default (None) where
    its AVX2 kernels run natively here, RUN_EMULATED_IMAGES under qemu."""
    if asked is not None:
        return asked
    return None if emulate.runs_natively() else RUN_EMULATED_IMAGES
