"""A time budget for one quantization (`ptq quantize --time-budget SECONDS`): the engine's optional steps start only
where what they are expected to take still fits in it, and what did not fit is said.

The clock starts when the service begins (loading the model and its calibration images count). What each optional step
is expected to take is measured as the quantization goes (the last `--method auto` candidate's time, learned rounding's
mean time per layer so far): a budget makes the model depend on the machine and its load, so it is asked for, never a
default (the same command otherwise makes the same bytes on every machine)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ptq_cli.errors import PtqError

# What the rounding keeps of the budget for what follows it: judging it against nearest rounding and writing the model.
AFTER_ROUNDING_SHARE = 0.1
# What `--method auto`'s candidates after MinMax keep for what follows them, in MinMax candidates' times: the kept model
# calibrated on every image and written (about one and a half) and learned rounding (about three and a half), as
# EfficientNet-Lite0's default quantize spent them (docs/speed.md). The rounding comes first: it gains the most.
AFTER_CANDIDATES = 5.0


@dataclass(frozen=True)
class Deadline:
    """`seconds` from `started` (time.monotonic)."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def fits(self, expected: float, keep: float = 0.0) -> bool:
        """Whether a step expected to take `expected` seconds ends with `keep` seconds still left."""
        return expected <= self.left() - keep

    def describe(self) -> str:
        return f"the time budget of {self.seconds:g} s"


def deadline(seconds: float | None) -> Deadline | None:
    """The budget `--time-budget` asks for, from now; None without one."""
    if seconds is None:
        return None
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise PtqError(f"--time-budget: must be a number of seconds above 0, got {seconds}")
    return Deadline(float(seconds))


class StepClock:
    """Whether one more of a run of alike steps (candidates, layers) fits in a deadline with `keep` seconds left, each
    expected to take what the steps before it took on average; the first `first` (by default nothing: what it takes is
    not known before it ran, so that it runs wherever there is time left)."""

    def __init__(self, until: Deadline, keep: float = 0.0, first: float = 0.0) -> None:
        self.until, self.keep, self.first = until, keep, first
        self.began, self.steps, self.stopped = time.monotonic(), 0, False

    def another(self) -> bool:
        expected = (time.monotonic() - self.began) / self.steps if self.steps else self.first
        if self.stopped or not self.until.fits(expected, self.keep):
            self.stopped = True
            return False
        self.steps += 1
        return True
