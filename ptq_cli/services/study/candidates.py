"""A candidate of a search (tune's settings, sensitivity's one quantized layer) as a task: quantized and
scored on the validation split wherever it runs, here or on a Ray worker, from inputs sent once."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ptq_cli import backends
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.services.make.calibration import CalibrationSet, stratified_subset
from ptq_cli.services.make.quantize import SourceModel, calibration_inputs, load_source, quantize_source
from ptq_cli.services.models import load_model
from ptq_cli.services.quant_settings import QuantizationSettings
from ptq_cli.services.study.validation import ValidationSet, score


@dataclass(frozen=True)
class CandidateInputs:
    """What every candidate reads, sent to the workers once: the FP32 model by content, how it is fed, the
    calibration set (a candidate takes it whole, or its first `per_class` images of each class) and the
    validation set."""

    model_bytes: bytes  # the model as loaded (its external weights in it, its opset upgraded)
    model_path: Path  # named in the candidate's metadata as in the chosen model's
    flags: PreprocessingFlags
    calibration: CalibrationSet
    validation: ValidationSet
    threads: int | None = None  # inference threads a candidate is scored with (the executor's task_threads)


# The FP32 model as each process loaded it for its tasks, by (content, preprocessing): one at a time.
_SOURCES: dict[tuple[str, str], SourceModel] = {}


def _source_of(inputs: CandidateInputs) -> SourceModel:
    key = (hashlib.sha256(inputs.model_bytes).hexdigest(), repr(inputs.flags))
    if key not in _SOURCES:
        _SOURCES.clear()
        with tempfile.TemporaryDirectory(prefix="ptq-task-") as workdir:
            path = Path(workdir) / inputs.model_path.name
            path.write_bytes(inputs.model_bytes)
            source = load_source(path, inputs.flags)
        source.model.graph.name = str(inputs.model_path)  # type: ignore[attr-defined]
        _SOURCES[key] = replace(source, path=inputs.model_path)
    return _SOURCES[key]


def score_candidate(job: tuple[QuantizationSettings, int | None], inputs: CandidateInputs) -> tuple[int, Any]:
    """One candidate, a task: (its file's size, its validation score). `job`: its settings (resolved) and the
    calibration subset it is calibrated on (None: the whole set). It writes nothing the user sees."""
    settings, per_class = job
    source = _source_of(inputs)
    calibration = inputs.calibration if per_class is None else stratified_subset(inputs.calibration, per_class)
    with tempfile.TemporaryDirectory(prefix="ptq-candidate-") as workdir:
        path = Path(workdir) / f"candidate{backends.backend(settings.backend).suffix}"
        written = quantize_source(source, path, settings, calibration, prepared=calibration_inputs(source, calibration))
        return written.size_bytes, score(load_model(path, inputs.threads), inputs.validation)


def inputs_for(source: SourceModel, flags: PreprocessingFlags | None, calibration: CalibrationSet, validation: ValidationSet,
               threads: int | None) -> CandidateInputs:
    return CandidateInputs(source.model.SerializeToString(), source.path, flags or PreprocessingFlags(), calibration, validation, threads)  # type: ignore[attr-defined]
