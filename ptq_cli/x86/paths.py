"""How a runtime reaches the x86 int8 path this CPU does not take: each backend's `Int8Paths`, one of two kinds
(`with_exact_switch`: onnxruntime's session switch; `without_exact_switch`: a proof, or emulation, for kernels with no
switch). The saturating path at native speed reaches the quantization engine's judges from the service quantizing
(QuantizeCall.saturating_scores), not through here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ptq_cli.errors import PtqError
from ptq_cli.x86.cpu import EXACT, SATURATING

EMULATE = "emulate"  # an int8 path reached by emulating a CPU of the other kind (Int8Paths.basis)


@dataclass(frozen=True)
class Int8Paths:
    """A runtime whose x86 int8 kernels differ between CPUs with and without VNNI: whether the path this CPU does
    not take can be scored here for a model made with an overflow fix (`reaches(overflow_fix, path)`), and how
    (`basis(model file, its settings, path)`: words for the record, or EMULATE; a PtqError where it cannot)."""

    reaches: Callable[[str | None, str], bool]
    basis: Callable[[Path, dict | None, str], str]
    # Where a proof gives the saturating path on a VNNI CPU: scored with the runtime's kernels for CPUs without VNNI
    # (RunOptions.saturating_int8), which compute there what they compute here; else this CPU's own compute the same.
    proof_loads_saturating_kernels: bool = False


def with_exact_switch(switch: str, saturation_proof: Callable[[Path], str | None]) -> Int8Paths:
    """A runtime with a session switch to its exact kernels (onnxruntime, `switch` names it): the exact path is always
    reached by it; the saturating one by `saturation_proof(model file)` (why the model cannot saturate, else None), or
    by emulation."""

    def basis(path: Path, _settings: dict | None, int8_path: str) -> str:
        if int8_path == EXACT:
            return switch
        why = saturation_proof(path)
        return f"proof ({why}): same as the exact path" if why else EMULATE

    return Int8Paths(reaches=lambda _overflow_fix, _int8_path: True, basis=basis)


def without_exact_switch(kind: str, kernels: str, proven_fix: str, proof: Callable[[dict, str], str],
                         proof_loads_saturating_kernels: bool = False) -> Int8Paths:
    """A runtime with no switch to its exact kernels (`kernels`: fbgemm, oneDNN). A model made with the overflow fix
    `proven_fix` computes the same on both paths (`proof(settings, path)` words it); another's saturating path is
    emulated, and its exact path needs a CPU with VNNI or AMX (no emulator here has them)."""

    def basis(path: Path, settings: dict | None, int8_path: str) -> str:
        if (settings or {}).get("overflow_fix") == proven_fix:
            return proof(settings or {}, int8_path)
        if int8_path == SATURATING:
            return EMULATE
        raise PtqError(f"--int8-path exact: {path} is {kind} that can saturate; {kernels}'s exact path needs a CPU with VNNI or AMX "
                       "(no emulator here has them)")

    return Int8Paths(reaches=lambda overflow_fix, int8_path: int8_path == SATURATING or overflow_fix == proven_fix, basis=basis,
                     proof_loads_saturating_kernels=proof_loads_saturating_kernels)
