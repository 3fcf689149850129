"""What every step of one quantization reads, travelling together: the float graph prepared for the QDQ writer, the
calibration images in the model's input format, the nodes left in float, ptq's edits to each graph written, and where
the work happens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli.quantize.budget import Deadline
from ptq_cli.quantize.settings import SaturatingScores


@dataclass(frozen=True)
class Job:
    source: str  # the prepared float graph's path (onnxruntime's pre-processing and the runtime's rewrites applied)
    calibration: np.ndarray  # every calibration image, in the model's input format
    input_name: str
    float_nodes: list[str]  # the nodes left in float (names in the prepared graph)
    finish: Callable[[Any], int]  # ptq's edits to a graph the writer made (returns the output roundings removed)
    workdir: Path  # a temporary folder of the quantization's own
    output: Path  # the file being made: named in write errors
    model_name: str  # named in the library's errors
    fixed_batch: int | None = None  # the batch the graph is tied to, if any: calibration runs in it, no choice is judged
    # The runtime's say in where pairs go (placement.Placement.writer_options): quantize_static's extra options.
    writer_options: tuple[tuple[str, Any], ...] = ()
    # The saturating x86 int8 path at native speed, from the service quantizing (QuantizeCall.saturating_scores).
    saturating_scores: SaturatingScores | None = None
    # The time budget the optional steps keep to (`--time-budget`, QuantizeCall.deadline), if any.
    deadline: Deadline | None = None

    @property
    def files(self) -> tuple[Path, Path, str]:
        return self.workdir, self.output, self.model_name
