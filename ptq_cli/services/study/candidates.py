"""A candidate of a search (tune's settings, sensitivity's one quantized layer) as a task: quantized and
scored on the validation split wherever it runs, here or on a Ray worker, from inputs sent once."""

from __future__ import annotations

import hashlib
import io
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli import backends
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import write_bytes
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.quantize.reuse import digest
from ptq_cli.services.executor import Done, Executor
from ptq_cli.services.make.calibration import CalibrationSet, stratified_subset
from ptq_cli.services.make.quantize import SourceModel, calibration_inputs, load_source, quantize_source
from ptq_cli.services.models import load_model
from ptq_cli.services.quant_settings import QuantizationSettings
from ptq_cli.services.study.validation import ValidationScore, ValidationSet, score


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
            _SOURCES[key] = source_named(load_source(path, inputs.flags), inputs.model_path)
    return _SOURCES[key]


def source_named(source: SourceModel, model_path: Path) -> SourceModel:
    """A source a task loaded from its copy of the model, named as the user's file (in the models made from it)."""
    source.model.graph.name = str(model_path)  # type: ignore[attr-defined]
    return replace(source, path=model_path)


def score_candidate(job: tuple[QuantizationSettings, int | None], inputs: CandidateInputs) -> tuple[int, ValidationScore]:
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


TUNING_DIR = "tuning"  # under the results directory; not read as evaluation records
CANDIDATES_DIR = "candidates"  # under the tuning records: each candidate's scores (tune's, sensitivity's), by what they measured


def scores_folder(results_dir: Path) -> Path:
    """Where every search of a results directory keeps its candidates' scores (tune and sensitivity share them)."""
    return Path(results_dir) / TUNING_DIR / CANDIDATES_DIR


def measured_here() -> tuple[bytes, ...]:
    """What a stored measurement also depends on besides its inputs: this CPU's int8 path and the versions of
    ptq and onnxruntime (a figure measured elsewhere or by other code is measured again)."""
    import onnxruntime

    import ptq_cli
    from ptq_cli.x86 import cpu as cpu_info

    return cpu_info.current().int8_path.encode(), ptq_cli.__version__.encode(), onnxruntime.__version__.encode()


@dataclass(frozen=True)
class ScoreStore:
    """The candidates already scored, kept in the results folder by what they measured: a candidate scored
    once, here or on any worker of a cluster, is not scored again (a search run again, or cut short and
    resumed). Its file is named by the digest of everything its score depends on: the model's bytes and
    preprocessing, the calibration and validation images, the candidate's settings and subset, this CPU's
    int8 path, and the versions of ptq and onnxruntime. The driver alone writes it (temporary file, then rename)."""

    folder: Path
    basis: str  # the digest of what every candidate of the search shares

    @classmethod
    def for_search(cls, folder: Path, inputs: CandidateInputs) -> ScoreStore:
        return cls(Path(folder), digest(inputs.model_bytes, repr(inputs.flags).encode(), *images_content(inputs.calibration.images, inputs.calibration.labels),
                                        *images_content(inputs.validation.images, inputs.validation.labels), *measured_here()))

    def file(self, job: tuple[QuantizationSettings, int | None]) -> Path:
        settings, per_class = job
        key = hashlib.sha256(f"{self.basis}\n{settings!r}\n{per_class!r}".encode()).hexdigest()
        return self.folder / f"{key}.npz"

    def get(self, job: tuple[QuantizationSettings, int | None], validation: ValidationSet) -> tuple[int, ValidationScore] | None:
        """The candidate's (file size, score) if scored before; its accuracy recomputed from the stored outputs.
        An entry that is unreadable or does not fit the validation set is measured again."""
        path = self.file(job)
        if not path.is_file():
            return None
        try:
            arrays = bounded.npz_arrays(path, ("size_bytes", "images_per_second", "outputs"), "score")
        except PtqError:
            return None
        outputs = arrays.get("outputs")
        if (outputs is None or outputs.ndim != 2 or outputs.dtype.kind != "f" or len(outputs) != len(validation.labels)
                or not np.isfinite(outputs).all() or {"size_bytes", "images_per_second"} - arrays.keys()):
            return None
        accuracy = round(100.0 * float(np.mean(outputs.argmax(axis=1) == validation.labels)), 4)
        return int(arrays["size_bytes"]), ValidationScore(accuracy, float(arrays["images_per_second"]), outputs)

    def put(self, job: tuple[QuantizationSettings, int | None], scored: tuple[int, ValidationScore]) -> None:
        size, measured = scored
        buffer = io.BytesIO()
        np.savez(buffer, size_bytes=np.int64(size), images_per_second=np.float64(measured.images_per_second), outputs=measured.outputs)
        write_bytes(self.file(job), buffer.getvalue())


def images_content(images: np.ndarray, labels: np.ndarray) -> tuple[bytes, bytes]:
    return repr((images.shape, str(images.dtype))).encode() + np.ascontiguousarray(images).tobytes(), np.ascontiguousarray(labels).astype(np.int64).tobytes()


def score_candidates(runs: Executor, jobs: list[tuple[QuantizationSettings, int | None]], inputs: CandidateInputs, store: ScoreStore | None,
                     done: Done | None = None) -> list[tuple[int, ValidationScore]]:
    """Every job's (file size, score): those in `store` read from it, the others scored by `runs` and stored as each finishes."""
    known = [store.get(job, inputs.validation) if store else None for job in jobs]
    missing = [index for index, found in enumerate(known) if found is None]
    for finished in range(1, len(jobs) - len(missing) + 1):
        if done:
            done(finished, len(jobs))
    offset = len(jobs) - len(missing)

    def keep(position: int, scored: tuple[int, ValidationScore]) -> None:
        if store:
            store.put(jobs[missing[position]], scored)

    measured = runs.map(score_candidate, [jobs[index] for index in missing], inputs, each=keep,
                        done=(lambda finished, _total: done(offset + finished, len(jobs))) if done else None)
    for index, scored in zip(missing, measured, strict=True):
        known[index] = scored
    return [scored for scored in known if scored is not None]
