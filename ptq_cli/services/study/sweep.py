"""Prune, then quantize, then evaluate, for several sparsities: what pruning before int8 costs and saves.

Every point uses the same calibration set and quantization settings. Each pruned FP32 model is
evaluated too, so the table separates what pruning alone costs from what quantization adds. The
compressed size (gzip -9 of the file) is the point of pruning before int8: zeros compress.
Each point is pruned and quantized as a task of the executor (here, or on Ray), from the model's bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ptq_cli import backends
from ptq_cli.datasets import Dataset
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import check_outputs, write_bytes
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.model_file import file_sha256, files_of
from ptq_cli.quantize.reuse import digest
from ptq_cli.services.executor import HERE, Executor, Workers, executor
from ptq_cli.services.make import prune as prune_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.services.make.calibration import CalibrationSet
from ptq_cli.services.make.quantize import calibration_inputs, load_source, quantize_source, resolve_settings, with_calibration
from ptq_cli.services.measure import evaluate as evaluate_service
from ptq_cli.services.measure.sweep_records import SWEEP_DIR, SweepPoint, SweepResult
from ptq_cli.services.progress import ProgressCallback, Steps
from ptq_cli.services.quant_settings import describe_quantization
from ptq_cli.services.records import write_record
from ptq_cli.services.study.candidates import images_content, measured_here, source_named


def parse_sparsities(text: str) -> tuple[float, ...]:
    """'0,0.3,0.5' -> (0.0, 0.3, 0.5), each checked to be in [0, 1)."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise PtqError(f"--sparsity: '{text}' is not a comma-separated list of numbers") from error
    if not values:
        raise PtqError("--sparsity: give at least one value, e.g. 0,0.3,0.5,0.7")
    for value in values:
        prune_service.make_settings(value)  # the range check, with its message
    return tuple(sorted(set(values)))


def gzip_size(path: Path) -> int:
    return len(gzip.compress(Path(path).read_bytes(), compresslevel=9, mtime=0))


MEASURED_DIR = "measured"  # under the sweep records: the points made and the top-1s measured, by what they depend on


@dataclass(frozen=True)
class Measured:
    """What sweeps made and measured, kept in RESULTS_DIR/sweep/measured by the digest of what each depends on: a
    sweep run again, or cut short and resumed, makes and scores only what is new. A point made before is taken
    only while its files are in place, byte for byte; a damaged entry is made or measured again. The driver
    alone writes these (temporary file, then rename)."""

    folder: Path
    points: str  # digest of what every point depends on besides its sparsity
    scoring: str  # digest of the images top-1 is measured on, how they are fed, and where

    @classmethod
    def for_sweep(cls, results_dir: Path, inputs: PointInputs, dataset: Dataset) -> Measured:
        here, fed = measured_here(), repr(inputs.flags).encode()
        return cls(Path(results_dir) / SWEEP_DIR / MEASURED_DIR,
                   digest(*(data for _, data in inputs.files), repr(inputs.pruning).encode(), repr(inputs.quantization).encode(), fed,
                          *images_content(inputs.calibration.images, inputs.calibration.labels), *here),
                   digest(dataset.content_key(dataset.evaluation_split()).encode(), fed, *here))

    def _entry(self, key: str) -> dict:
        try:
            found = bounded.json_loads(bounded.read_text(self.folder / f"{key}.json", "entry"))
        except (PtqError, OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def made(self, sparsity: float, inputs: PointInputs) -> float | None:
        """The achieved sparsity of a point made before whose files are still what it made, else None."""
        entry = self._entry(digest(self.points.encode(), repr(sparsity).encode()))
        files = {str(inputs.fp32_output(sparsity)) if sparsity else "", str(inputs.int8_output(sparsity))} - {""}
        kept = entry.get("files")
        if not isinstance(kept, dict) or set(kept) != files or not isinstance(entry.get("achieved_sparsity"), float):
            return None
        try:
            if any(bounded.sha256(Path(name), bounded.MODEL_BYTES).hex() != sha256 for name, sha256 in kept.items()):
                return None
        except PtqError:  # gone, or no longer a regular file: made again
            return None
        return float(entry["achieved_sparsity"])

    def keep_made(self, point: MadePoint, inputs: PointInputs) -> None:
        files = {str(inputs.int8_output(point.sparsity)): point.int8_bytes}
        if point.fp32_bytes is not None:
            files[str(inputs.fp32_output(point.sparsity))] = point.fp32_bytes
        write_bytes(self.folder / f"{digest(self.points.encode(), repr(point.sparsity).encode())}.json", json.dumps(
            {"achieved_sparsity": float(point.achieved_sparsity), "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}).encode())

    def accuracy(self, sha256: str) -> float | None:
        found = self._entry(digest(self.scoring.encode(), sha256.encode())).get("accuracy")
        return float(found) if isinstance(found, (int, float)) and not isinstance(found, bool) and 0 <= found <= 100 else None

    def keep_accuracy(self, sha256: str, accuracy: float) -> None:
        write_bytes(self.folder / f"{digest(self.scoring.encode(), sha256.encode())}.json", json.dumps({"accuracy": accuracy}).encode())


class _Accuracies:
    """Top-1 of each model file on the dataset, each evaluated once (and not at all when `measured` has it)."""

    def __init__(self, dataset: Dataset, flags: PreprocessingFlags | None, runs: Executor | None, measured: Measured) -> None:
        self.dataset, self.flags, self.runs, self.measured = dataset, flags, runs, measured
        self.accuracies: dict[Path, float] = {}

    def __call__(self, path: Path) -> float:
        if path not in self.accuracies:
            sha256 = file_sha256(path)
            known = self.measured.accuracy(sha256)
            if known is None:
                known = evaluate_service.evaluate_model(path, self.dataset, flags=self.flags, runs=self.runs).accuracy
                if known is None:
                    raise PtqError(f"{self.dataset.root}: its labels are not the classes of {path}; the sweep compares top-1, which needs them")
                self.measured.keep_accuracy(sha256, known)
            self.accuracies[path] = known
        return self.accuracies[path]


@dataclass(frozen=True)
class PointInputs:
    """What every point's task reads, sent once: the FP32 model by content, and how each point is made."""

    files: tuple[tuple[str, bytes], ...]  # (file name, bytes): the model first, then the files that stand with it
    model_path: Path  # the user's model, as the made models name their source
    models_dir: Path
    pruning: prune_service.PruningSettings  # its sparsity replaced by each point's
    quantization: quantize_service.QuantizationSettings
    calibration: CalibrationSet
    flags: PreprocessingFlags | None

    def fp32_output(self, sparsity: float) -> Path:
        """The point's FP32 model: the source itself at sparsity 0, else its pruned copy."""
        return self.model_path if sparsity == 0 else Path(self.models_dir) / prune_service.default_output(self.model_path, sparsity, self.pruning.scope).name

    def int8_output(self, sparsity: float) -> Path:
        fp32 = self.fp32_output(sparsity)
        return Path(self.models_dir) / f"{fp32.stem}_{self.quantization.dtype}{fp32.suffix}"


@dataclass(frozen=True)
class MadePoint:
    """A point's models, made by a task: the pruned FP32 model (None at sparsity 0) and the quantized one."""

    sparsity: float
    achieved_sparsity: float
    fp32_bytes: bytes | None
    int8_bytes: bytes


def make_point(sparsity: float, inputs: PointInputs) -> MadePoint:
    """One point, a task: prune (above sparsity 0), then quantize, in a folder of its own; the files are
    returned, not written, so the driver alone writes what the user sees."""
    with tempfile.TemporaryDirectory(prefix="ptq-sweep-") as workdir:
        folder = Path(workdir)
        for name, data in inputs.files:
            (folder / name).write_bytes(data)
        fp32_path, achieved = folder / inputs.files[0][0], 0.0
        if sparsity > 0:
            pruned = folder / inputs.fp32_output(sparsity).name
            achieved = prune_service.prune_calibrated(fp32_path, pruned, replace(inputs.pruning, sparsity=sparsity), inputs.calibration.images,
                                                      inputs.flags, named=inputs.model_path).pruned_sparsity
            fp32_path = pruned
        source = source_named(load_source(fp32_path, inputs.flags or PreprocessingFlags(), inputs.quantization.per_channel is not False),
                              inputs.fp32_output(sparsity))
        prepared = calibration_inputs(source, inputs.calibration)
        settings = with_calibration(resolve_settings(source, inputs.quantization, prepared), inputs.calibration)
        quantized = folder / "quantized.onnx"
        quantize_source(source, quantized, settings, inputs.calibration, prepared=prepared)
        return MadePoint(sparsity, achieved, fp32_path.read_bytes() if sparsity > 0 else None, quantized.read_bytes())


def sweep(  # noqa: PLR0913,PLR0917  the options of `ptq sweep`, one each
    model_path: Path,
    sparsities: tuple[float, ...],
    quantization: quantize_service.QuantizationSettings,
    calibration: CalibrationSet,
    dataset: Dataset,
    models_dir: Path,
    results_dir: Path,
    pruning: prune_service.PruningSettings | None = None,
    progress: ProgressCallback | None = None,
    flags: PreprocessingFlags | None = None,
    workers: Workers = HERE,
) -> SweepResult:
    """`pruning` gives the scope, exclusions and re-fit; its sparsity is replaced by each of `sparsities`. The
    points are made by `workers` (here, or as tasks on Ray), and each model is evaluated there in shards."""
    model_path = Path(model_path)
    if quantization.backend != backends.DEFAULT:
        raise PtqError(f"--backend: the sweep quantizes with {backends.DEFAULT} (pruned ONNX models in, ONNX out)")
    inputs = PointInputs(files_of(model_path), model_path, Path(models_dir),
                         pruning or prune_service.make_settings(0.0), quantization, calibration, flags)
    record = Path(results_dir) / SWEEP_DIR / f"{model_path.stem}_{quantization.dtype}_{inputs.pruning.scope}.json"
    outputs: list[tuple[str, Path | None, tuple[str, ...]]] = [("--results-dir", record, (".json",))]
    outputs += [("--models-dir", path, (".onnx",)) for sparsity in sparsities for path in (inputs.fp32_output(sparsity), inputs.int8_output(sparsity))
                if path != model_path]
    check_outputs(outputs, [model_path])
    step, measured = Steps(2 * len(sparsities), progress), Measured.for_sweep(results_dir, inputs, dataset)
    with executor(workers) as runs:
        achieved = _made_points(runs, sparsities, inputs, measured, step)
        accuracy = _Accuracies(dataset, flags, runs if workers.on_ray else None, measured)
        reference = accuracy(model_path)
        points = []
        for sparsity in sparsities:
            fp32, quantized = inputs.fp32_output(sparsity), inputs.int8_output(sparsity)
            points.append(_point(sparsity, achieved[sparsity], fp32, accuracy(fp32), quantized, accuracy(quantized), reference))
            step()
    result = SweepResult(
        source=str(model_path), dtype=quantization.dtype, scope=inputs.pruning.scope, exclude_first=inputs.pruning.exclude_first,
        exclude_classifier=inputs.pruning.exclude_classifier, reconstruct=inputs.pruning.reconstruct,
        quantization=describe_quantization(quantization.as_dict() | {"calibration_samples": len(calibration.labels)}),
        points=points, record=str(record), fp32_accuracy=reference, dataset=str(dataset.root),
    )
    write_record(record, result)
    return result


def _made_points(runs: Executor, sparsities: tuple[float, ...], inputs: PointInputs, measured: Measured, step: Steps) -> dict[float, float]:
    """Each point's achieved sparsity: the points whose files are in place as made before are taken as they are;
    the others are made by `runs`, and their files written here."""
    achieved = {sparsity: measured.made(sparsity, inputs) for sparsity in sparsities}
    for _ in range(sum(found is not None for found in achieved.values())):
        step()
    for point in runs.map(make_point, [sparsity for sparsity, found in achieved.items() if found is None], inputs, done=lambda *_: step()):
        if point.fp32_bytes is not None:
            write_bytes(inputs.fp32_output(point.sparsity), point.fp32_bytes)
        write_bytes(inputs.int8_output(point.sparsity), point.int8_bytes)
        measured.keep_made(point, inputs)
        achieved[point.sparsity] = point.achieved_sparsity
    return {sparsity: found or 0.0 for sparsity, found in achieved.items()}


def _point(sparsity: float, achieved: float, fp32: Path, fp32_accuracy: float, quantized: Path, accuracy: float, reference: float) -> SweepPoint:
    return SweepPoint(
        sparsity=sparsity,
        achieved_sparsity=round(achieved, 4),
        fp32_model=str(fp32),
        fp32_accuracy=fp32_accuracy,
        fp32_size_bytes=fp32.stat().st_size,
        fp32_compressed_bytes=gzip_size(fp32),
        model=str(quantized),
        accuracy=accuracy,
        delta=round(accuracy - reference, 4),
        size_bytes=quantized.stat().st_size,
        compressed_bytes=gzip_size(quantized),
    )
