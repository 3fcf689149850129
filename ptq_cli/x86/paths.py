"""How a runtime reaches the x86 int8 path this CPU does not take: each backend's `Int8Paths` (a session switch, a
proof, or emulation), and the hand-off through which the quantization engine's judges reach the saturating path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


# How a backend's judges reach the saturating x86 int8 path where this CPU's own kernels are exact: given by the service
# that quantizes (x86/emulate.py through services/models.py), as (model file, inputs in its format, threads) -> its outputs, None
# where this machine cannot run those kernels at native speed, a PtqError where it can but the run failed. Backends import no service: it is handed down.
SaturatingScores = Callable[[Path, np.ndarray, int], "np.ndarray | None"]
_SATURATING: ContextVar[SaturatingScores | None] = ContextVar("saturating_scores", default=None)


@contextmanager
def reaching_saturating_path(scores: SaturatingScores) -> Iterator[None]:
    """Within it, `saturating_outputs` runs models on the saturating path with `scores`."""
    token = _SATURATING.set(scores)
    try:
        yield
    finally:
        _SATURATING.reset(token)


def saturating_outputs(path: Path, batch: np.ndarray, threads: int) -> np.ndarray | None:
    """The model file's outputs on the saturating x86 path at native speed, where the service quantizing gave a way to
    it (`reaching_saturating_path`) and this machine has one; else None (a PtqError where that run failed)."""
    scores = _SATURATING.get()
    return None if scores is None else scores(path, batch, threads)


