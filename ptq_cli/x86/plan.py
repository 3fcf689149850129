"""Which x86 int8 path a figure holds for, and how this machine gets it: the plan evaluate, benchmark, `ptq run` and
report read (which paths a model is scored on, how it is loaded for one, whether the AVX2 kernels can be timed here,
a model's two records folded into one row). cpu.py says which path this CPU takes natively; a backend's Int8Paths
(paths.py) what its runtime can do on the other (a session switch, a proof, kernels it can load); emulate.py how the
other path's kernels run here at all. The plan reads a model as an Int8Model, which the services make from a loaded
model's description, and loads it through the services' loader: nothing here imports a service or a backend."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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

Loaded = TypeVar("Loaded")
Measured = TypeVar("Measured")


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


def check_path(wanted: str | None) -> None:
    """A PtqError unless `wanted` is one of the two paths (None: this CPU's own)."""
    if wanted not in (None, *cpu_info.INT8_PATHS):
        raise PtqError(f"--int8-path: '{wanted}' is not one of {', '.join(cpu_info.INT8_PATHS)}")


def other_path(cpu: cpu_info.Cpu) -> str:
    """The int8 path this CPU does not take."""
    return next(path for path in cpu_info.INT8_PATHS if path != cpu.int8_path)


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


def loaded_for_path(wanted: str | None, cpu: cpu_info.Cpu, load: Callable[..., Loaded], describe: Callable[[Loaded], Int8Model],
                    loaded: Loaded | None = None) -> tuple[Loaded, Int8Plan]:
    """(the model loaded with the kernels of the path `wanted`, the plan that says how). `load(exact_int8=..., saturating_int8=...)`
    loads it; `loaded`, the model already loaded with this CPU's kernels, serves where no other session is needed.
    onnxruntime's exact kernels away from VNNI come from its switch; a proven model's saturating path on a VNNI CPU
    from the kernels of CPUs without VNNI, where the runtime can load them."""
    exact_int8 = needs_exact_switch(wanted, cpu)
    model = loaded if loaded is not None and not exact_int8 else load(exact_int8=exact_int8)
    planned = plan(describe(model), wanted, cpu)
    if planned.saturating_int8:
        model = load(saturating_int8=True)
    return model, planned


def times_in_avx2_child(choice: str, cpu: cpu_info.Cpu) -> bool:
    """Whether `benchmark --int8-path CHOICE` times the kernels of CPUs without VNNI in a child process with CPUID masked
    (saturating asked on a CPU with VNNI; never under qemu, whose pace says nothing of a CPU's); a PtqError for a choice
    it does not take."""
    if choice not in KERNEL_PATH_CHOICES:
        raise PtqError(f"--int8-path: {choice} is not {' or '.join(KERNEL_PATH_CHOICES)}")
    return choice == cpu_info.SATURATING and cpu.int8_path == cpu_info.EXACT


def check_avx2_timing(first_model: Path) -> None:
    """A PtqError where the kernels of CPUs without VNNI cannot be timed natively here."""
    if not emulate.runs_natively():
        raise PtqError(f"{first_model}: --int8-path saturating times the kernels of CPUs without VNNI natively; on this CPU (it has VNNI) they run "
                       "so only with CPUID masked, which needs CPUID faulting and a C compiler, not both here")


def timed_in_avx2_child() -> tuple[str, str]:
    """(the path, the basis) of a figure timed in that child."""
    return cpu_info.SATURATING, emulate.describe()


def fold_paths(records: Iterable[Measured], model_key: Callable[[Measured], Any]) -> tuple[list[Measured], dict[int, Measured]]:
    """A model's figures on the two paths, one row: (the records that make rows, by id of an exact-path record the
    saturating-path one beside it). A record with no path is a row; a model with only a saturating figure has it as its row."""
    by_model: dict[Any, list[Measured]] = {}
    for record in records:
        by_model.setdefault(model_key(record), []).append(record)
    rows: list[Measured] = []
    saturating: dict[int, Measured] = {}
    for group in by_model.values():
        paths = {getattr(record, "int8_path", None): record for record in group}
        rows += [record for record in group if getattr(record, "int8_path", None) is None]
        if cpu_info.EXACT in paths:
            rows.append(paths[cpu_info.EXACT])
            if cpu_info.SATURATING in paths:
                saturating[id(paths[cpu_info.EXACT])] = paths[cpu_info.SATURATING]
        elif cpu_info.SATURATING in paths:
            rows.append(paths[cpu_info.SATURATING])
    return rows, saturating


def measured_on_other_path(record_cpu: dict | None) -> bool:
    """Whether a figure's CPU (its record's `cpu`) took the other int8 path than this one."""
    return bool(record_cpu) and (record_cpu or {}).get("int8_path") != cpu_info.current().int8_path


def emulated_images(asked: int | None) -> int | None:
    """The images `ptq run` scores a model on the saturating path: as asked, else the evaluation's default (None) where
    its AVX2 kernels run natively here, RUN_EMULATED_IMAGES under qemu."""
    if asked is not None:
        return asked
    return None if emulate.runs_natively() else RUN_EMULATED_IMAGES
