"""Top-1 accuracy on a dataset's evaluation split, written as one JSON record per model and dataset."""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, overload

import numpy as np

import ptq_cli
from ptq_cli import settings
from ptq_cli.backends.base import LoadedModel
from ptq_cli.datasets import Dataset, SplitImages, open_dataset
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded, hardstop
from ptq_cli.guards.atomic import check_folder_writable, process_folder
from ptq_cli.inputs import PreprocessingFlags
from ptq_cli.metrics import packed_hits
from ptq_cli.model_file import file_sha256, files_of, resolve_threads
from ptq_cli.services.executor import HERE, Executor, Workers, executor
from ptq_cli.services.measure.evaluation_records import (
    OK,
    STALE,
    EvaluationRecord,
    as_flags,
    confusion_fields,
    flags_of,
    fp32_reference,
    load_records,
    path_tag,
    per_class,
    record_status,
    save_record,
    source_to_evaluate,
)
from ptq_cli.services.measure.fidelity import compare
from ptq_cli.services.models import int8_model, load_model, scores_under_emulation
from ptq_cli.services.progress import ProgressBar, ProgressCallback, no_progress_bar
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import emulate
from ptq_cli.x86 import plan as int8_plan
from ptq_cli.x86.paths import EMULATE


def _predict(model: LoadedModel, images: np.ndarray, batch_size: int, model_path: Path, where: str,
             progress: ProgressCallback | None = None) -> tuple[np.ndarray, float]:
    """(class scores, N x classes float32; inference seconds)."""
    total = len(images)
    bound = bounded.CALL_SECONDS.value()
    batch_size = bounded.images_per_call(math.prod(model.input.shape(1)), batch_size)  # a large input: fewer images a call
    predictions = np.empty((total, model.num_classes), dtype=np.float32)
    inference_seconds = 0.0
    for start in range(0, total, batch_size):
        batch = model.prepare(images[start : start + batch_size])
        began = time.perf_counter()
        with hardstop.deadline(bound, f"{model_path}: one inference call of {len(batch)} images did not return within {bound:,} s "
                                      f"(a graph that never ends? raise {bounded.CALL_SECONDS.env} if it is only slow)"):
            scores = model.predict(batch)
        inference_seconds += time.perf_counter() - began
        if scores.shape != (len(batch), model.num_classes):
            raise PtqError(f"{model_path}: outputs {list(scores.shape)} for {len(batch)} images; expected {len(batch)} x {model.num_classes} class scores")
        if not np.all(np.isfinite(scores)):
            raise PtqError(f"{model_path}: the model outputs NaN or infinite scores on {where}")
        predictions[start : start + len(batch)] = scores
        if progress:
            progress(start + len(batch), total)
    return predictions, inference_seconds


def _predict_split(model: LoadedModel, test: SplitImages, batch_size: int, model_path: Path, where: str,  # noqa: PLR0913,PLR0917  _predict's, for a split
                   progress: ProgressCallback | None = None, also: tuple[LoadedModel, Path, tuple] | None = None) -> tuple[np.ndarray, float]:
    """(class scores of every image of the split, inference seconds), with a part of the split held at a time, cut
    at whole calls: every image is computed as when the split is held whole. `also`: a second model (the FP32
    source: model, path, key of its scores) scored on each part while it is held, its scores kept for fidelity: a
    split decoded part by part is decoded once for both."""
    total = len(test.labels)
    scores = np.empty((total, model.num_classes), dtype=np.float32)
    also_parts: list[np.ndarray] = []
    inference_seconds = 0.0
    for start, images in test.parts(_images_per_part(model, batch_size)):
        told = (lambda done, _part, start=start: progress(start + done, total)) if progress else None
        scores[start : start + len(images)], seconds = _predict(model, images, batch_size, model_path, where, told)
        inference_seconds += seconds
        if also is not None:
            also_parts.append(_predict(also[0], images, batch_size, also[1], where)[0])
    if also is not None:
        _keep_reference_scores(also[2], np.concatenate(also_parts))
    return scores, inference_seconds


def _images_per_part(model: LoadedModel, batch_size: int) -> int:
    """Whole inference calls of images at the model's input size within bounded.HELD_IMAGE_BYTES, at least one call."""
    calls = bounded.images_per_call(math.prod(model.input.shape(1)), batch_size)
    image_bytes = model.input.height * model.input.width * model.input.channels
    return calls * max(1, bounded.HELD_IMAGE_BYTES.value() // image_bytes // calls)


@dataclass(frozen=True)
class _Pass:
    """One model's pass over one split, as every step of measuring it reads it."""

    model: LoadedModel
    model_path: Path
    test: SplitImages
    where: str  # the dataset and split, for messages
    batch_size: int
    threads: int | None
    labels_fit: bool  # whether the split's labels are the model's classes


@dataclass(frozen=True)
class ShardedModel:
    """A model as every shard's task loads it: its files by content (the model and those that stand with it) and
    the options it was loaded with here, so that each image is computed as it is in one process."""

    files: tuple[tuple[str, bytes], ...]  # (file name, bytes), the model first
    flags: PreprocessingFlags | None
    runtime: str | None
    precision: str | None
    exact_int8: bool
    saturating_int8: bool
    threads: int | None
    batch_size: int  # images a call, as the one-process evaluation calls the model
    where: str


# Each process's loaded model for its shards, by content: (its folder, kept while the model is, and the model). A
# cluster's worker that is killed (as Ray stops a cluster) leaves its folder: the next worker to load a model removes it.
SHARD_FOLDER_PREFIX = "ptq-shard-"
_SHARD_MODELS: dict[str, tuple[tempfile.TemporaryDirectory, LoadedModel]] = {}


def predict_shard(images: np.ndarray, shared: ShardedModel) -> tuple[np.ndarray, float]:
    """One shard's class scores and inference seconds, a task: the model loaded once per process from its bytes."""
    key = hashlib.sha256(b"".join(data for _, data in shared.files) + repr((shared.flags, shared.runtime, shared.precision,
                                                                               shared.exact_int8, shared.saturating_int8, shared.threads)).encode()).hexdigest()
    if key not in _SHARD_MODELS:
        _SHARD_MODELS.clear()
        folder = process_folder(SHARD_FOLDER_PREFIX)
        for name, data in shared.files:
            (Path(folder.name) / name).write_bytes(data)
        model_path = Path(folder.name) / shared.files[0][0]
        _SHARD_MODELS[key] = folder, load_model(model_path, shared.threads, shared.flags, shared.runtime, shared.precision,
                                                exact_int8=shared.exact_int8, saturating_int8=shared.saturating_int8)
    model = _SHARD_MODELS[key][1]
    return _predict(model, images, shared.batch_size, Path(shared.files[0][0]), shared.where)


def _predict_in_shards(runs: Executor, run: _Pass, how: ShardedModel, progress: ProgressCallback | None) -> tuple[np.ndarray, float]:
    """The split in one shard per worker call, cut at whole calls (so that every image is computed as in one
    process), each scored as a task; (scores, wall seconds). Each shard is read as it is sent (_Shards)."""
    values = math.prod(run.model.input.shape(1))
    calls = bounded.images_per_call(values, run.batch_size)
    total = len(run.test.labels)
    per_shard = calls * max(1, min(math.ceil(math.ceil(total / calls) / SHARDS_PER_RUN), SHARD_BYTES // (4 * values * calls)))
    shards = _Shards(run.test, per_shard)
    began = time.perf_counter()
    done = (lambda finished, _total: progress(min(finished * per_shard, total), total)) if progress else None
    scored = runs.map(predict_shard, shards, how, done=done)
    return np.concatenate([scores for scores, _ in scored]), time.perf_counter() - began


SHARDS_PER_RUN = 8  # shards of the split: enough for a few workers to finish together
SHARD_BYTES = 128 << 20  # at most (as float32 values, whole calls apart): a large split is cut finer, not held whole


class _Shards(Sequence[np.ndarray]):
    """The split's images in shards of `per_shard`, each read from the dataset when asked for: the executor holds
    only those it has sent and not yet had back."""

    def __init__(self, test: SplitImages, per_shard: int) -> None:
        self.test, self.per_shard, self.total = test, per_shard, len(test.labels)

    def __len__(self) -> int:
        return math.ceil(self.total / self.per_shard)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | Sequence[np.ndarray]:
        if isinstance(index, slice):
            return [self[position] for position in range(len(self))[index]]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        start = (index % len(self)) * self.per_shard
        return self.test.take(np.arange(start, min(start + self.per_shard, self.total)))


def evaluate_model(  # noqa: PLR0913,PLR0917  EvaluationRequest's fields for one model, for ptq run's stages
    model_path: Path,
    dataset: Dataset,
    batch_size: int = settings.EVALUATION_BATCH,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    flags: PreprocessingFlags | None = None,
    runtime: str | None = None,
    precision: str | None = None,
    label: str | None = None,
    int8_path: str | None = None,
    subset: int | None = None,  # None: emulate.default_subset
    against: Path | None = None,
    loaded: LoadedModel | None = None,
    runs: Executor | None = None,
) -> EvaluationRecord:
    """Top-1 on the dataset's evaluation split, and fidelity to the FP32 model (`against`, else the source it
    was made from while that file is at hand) on the same images: the only measure where the labels are not
    the model's classes, and then a model with no FP32 model to compare with is refused. `runtime`
    "openvino" runs an ONNX file on OpenVINO with the `precision` hint; `label` names the model in the report. `int8_path`
    ("exact" or "saturating", default this CPU's): the x86 int8 path the figure is for, as x86/plan.py reaches it (an
    emulated path on `subset` images of the split, stratified). `loaded`: the model already loaded with these
    options, where the path needs no other session. `runs`: an executor that scores the split in shards (Ray's);
    the record is the one a single process writes, but for the times."""
    _check_options(batch_size, int8_path)
    cpu = cpu_info.current()
    model, planned = int8_plan.loaded_for_path(int8_path, cpu, partial(load_model, Path(model_path), threads, flags, runtime, precision),
                                               lambda loaded_model: int8_model(loaded_model.info), loaded)
    basis = planned.basis
    split = dataset.evaluation_split()
    test = _as_many_classes(dataset, dataset.open_split(split, model.input.size, model.input.channels), model.num_classes)
    reference_path, labels_fit = _what_to_measure(model, test, dataset.root, against)
    run = _Pass(model, Path(model_path), test, f"{dataset.root} ({split})", batch_size, threads, labels_fit)
    if basis == EMULATE:
        chosen, scores, inference_seconds, exact_same, basis = _emulated_subset(run, subset, progress)
    else:
        sharded = None if runs is None else ShardedModel(files_of(Path(model_path)), flags, runtime, precision, planned.exact_int8,
                                                         planned.saturating_int8, threads, batch_size, run.where)
        alongside = _reference_alongside(reference_path, run) if sharded is None else None
        chosen, scores, inference_seconds, exact_same = _whole_split(run, progress, runs, sharded, alongside)
    fidelity = _fidelity(run, chosen, scores, reference_path, own_runtime=runtime is None and precision is None)
    record = EvaluationRecord(
        **_model_fields(model), dataset=str(dataset.root), images=len(chosen),
        **_accuracy_fields(test.labels[chosen], scores.argmax(axis=1), test.class_names if labels_fit else None),
        images_per_second=round(len(chosen) / max(inference_seconds, 1e-9), 1), batch_size=batch_size, threads=resolve_threads(threads),
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"), tool_version=ptq_cli.__version__, dataset_format=dataset.format, split=split,
        dataset_sha256=test.content_sha256, label=label, cpu=cpu.as_record(), int8_path=planned.path, int8_basis=basis,
        exact_accuracy_same_images=exact_same, fidelity=fidelity,
    )
    return replace(record, warnings=plausibility_warnings(record.accuracy, len(record.class_names), asdict(model.preprocessing)))


# A top-1 under this many times chance is no measurement of a model but of how its images were fed.
CHANCE_FACTOR = 2.0
FLAGS_TO_TRY = "--preprocess, or --scale/--mean/--std, and --bgr"


def plausibility_warnings(accuracy: float | None, classes: int, preprocessing: dict) -> tuple[str, ...]:
    """One line per sign that the images reach the model wrongly: a top-1 within CHANCE_FACTOR of chance, or a mean/std
    given in 0-1 units (the torchvision habit) on 0-255 pixels without --scale."""
    found = []
    scale, mean, std = float(preprocessing["scale"]), [float(v) for v in preprocessing["mean"]], [float(v) for v in preprocessing["std"]]
    if scale == 1.0 and (mean, std) != ([0.0] * len(mean), [1.0] * len(std)) and max(map(abs, mean)) <= 1.0 and max(std) <= 1.0:
        found.append(f"--mean {','.join(f'{v:g}' for v in mean)} --std {','.join(f'{v:g}' for v in std)} look like 0-1 units, but the pixels "
                     "are fed 0-255: add --scale 0.00392156862745098 (1/255)")
    if accuracy is not None and classes >= 2 and accuracy < CHANCE_FACTOR * 100.0 / classes:
        found.append(f"top-1 {accuracy:.2f}% is within {CHANCE_FACTOR:g}x of chance ({100.0 / classes:.2f}% on {classes} classes): the images "
                     f"likely reach the model wrongly; check how the model was trained to be fed ({FLAGS_TO_TRY})")
    return tuple(found)


def _as_many_classes(dataset: Dataset, test: SplitImages, classes: int) -> SplitImages:
    """Labels numbered, not named (an .npz without class_names): their highest says too few classes, never too many."""
    if dataset.names_its_classes or not test.labelled or classes <= len(test.class_names):
        return test
    return replace(test, class_names=tuple(str(index) for index in range(classes)))


def _fidelity(run: _Pass, chosen: np.ndarray, scores: np.ndarray, reference_path: Path | None, own_runtime: bool) -> dict | None:
    """Fidelity to the FP32 model at `reference_path` on the chosen images (None without one), with the images each
    alone classifies right where the labels are the model's classes; a float model's scores on its own runtime, over
    the whole split, are kept for the models made from it."""
    fidelity, test, model = None, run.test, run.model
    if reference_path is not None:
        reference = _reference_scores(reference_path, test, model, run.batch_size, run.threads, run.where)
        fidelity = asdict(compare(reference[chosen], scores, str(reference_path), file_sha256(reference_path),
                                  test.labels[chosen] if run.labels_fit else None))
    if model.info.dtype == "fp32" and own_runtime and np.array_equal(chosen, np.arange(len(test.labels))):
        _keep_reference_scores(_reference_key(model.info.sha256, test, model), scores)  # the models made from it compare with these
    return fidelity


def _check_options(batch_size: int, int8_path: str | None) -> None:
    if batch_size < 1:
        raise PtqError(f"--batch-size: must be at least 1, got {batch_size}")
    int8_plan.check_path(int8_path)


def _what_to_measure(model: LoadedModel, test: SplitImages, root: Path, against: Path | None) -> tuple[Path | None, bool]:
    """(the FP32 model to measure fidelity against, whether the labels are the model's classes); a model with
    neither is refused in one line, but for a float model on images without labels: it is the reference its
    quantized models are measured against, and its record holds its speed and the images it ran on."""
    if len(test.labels) == 0:
        raise PtqError(f"{root}: the {test.split} split has no images")
    reference_path = fp32_model_for(model, against)
    labels_fit = test.labelled and model.num_classes == len(test.class_names)
    # Labels of other classes than the model's are a wrong model or wrong data, float or not: refused.
    if not labels_fit and reference_path is None and (model.info.dtype != "fp32" or test.labelled):
        found = f"{root} has {len(test.class_names)} classes" if test.labelled else f"{root} has no labels"
        raise PtqError(f"{model.info.path}: the model gives {model.num_classes} class scores, but {found}; "
                       "give --against-fp32 FP32_MODEL to measure it against its float model on these images")
    return reference_path, labels_fit


def _accuracy_fields(labels: np.ndarray, predictions: np.ndarray, class_names: tuple[str, ...] | None) -> dict:
    """Top-1, per class and the confusion matrix; none of them where the labels are not the model's classes."""
    if class_names is None:
        return {"correct": None, "accuracy": None, "class_names": [], "per_class_accuracy": [], "confusion_matrix": []}
    confusion = np.zeros((len(class_names), len(class_names)), dtype=np.int64)
    np.add.at(confusion, (labels, predictions), 1)
    return {"correct": int(np.trace(confusion)), "accuracy": round(100.0 * int(np.trace(confusion)) / len(labels), 4), "class_names": list(class_names),
            "per_class_accuracy": per_class(confusion), **confusion_fields(confusion), "right_images": packed_hits(labels == predictions)}


def fp32_model_for(model: LoadedModel, against: Path | None) -> Path | None:
    """The FP32 model to measure fidelity against: `against`, else the file the model was made from while it
    is still those bytes (its stored sha256); None for a model with neither."""
    if against is not None:
        return Path(against)
    path = (model.info.quantization or {}).get("source_model")
    if not model.info.source_sha256 or not path or not Path(path).is_file() or file_sha256(Path(path)) != model.info.source_sha256:
        return None
    return Path(path)


# FP32 scores by (model sha256, images, preprocessing): each model of a study is compared with the same
# source on the same images, which runs once per process; and the source as loaded for them, by (sha256,
# threads, preprocessing), which evaluating the source itself then uses.
_REFERENCE_SCORES: dict[tuple, np.ndarray] = {}
_REFERENCE_MODEL: dict[tuple, LoadedModel] = {}


def _reference_model(path: Path, sha256: str, model: LoadedModel, threads: int | None) -> LoadedModel:
    """The FP32 model at `path` (its file_sha256), loaded to be fed as `model` is (kept for evaluating the source itself next)."""
    reference = load_model(path, threads, as_flags(asdict(model.preprocessing)))
    _REFERENCE_MODEL.clear()
    _REFERENCE_MODEL[_reference_model_key(sha256, threads, asdict(model.preprocessing))] = reference
    if reference.info.dtype != "fp32":
        raise PtqError(f"--against-fp32: {path} is a {reference.info.dtype} model; fidelity is measured against a float model")
    return reference


def _reference_alongside(reference_path: Path | None, run: _Pass) -> tuple[LoadedModel, Path, tuple] | None:
    """The FP32 source to score in the model's own pass over the split (in one process): where its scores are not at
    hand yet and the split is decoded a part at a time (else the split is held whole, and scoring the two apart costs
    nothing more)."""
    if reference_path is None or len(run.test.labels) <= _images_per_part(run.model, run.batch_size):
        return None
    sha256 = file_sha256(reference_path)
    key = _reference_key(sha256, run.test, run.model)
    return None if key in _REFERENCE_SCORES else (_reference_model(reference_path, sha256, run.model, run.threads), reference_path, key)


def _reference_scores(path: Path, test: SplitImages, model: LoadedModel, batch_size: int, threads: int | None, where: str) -> np.ndarray:
    """The FP32 model's scores on every image of the split, fed as `model` is."""
    sha256 = file_sha256(path)
    key = _reference_key(sha256, test, model)
    if key not in _REFERENCE_SCORES:
        _keep_reference_scores(key, _predict_split(_reference_model(path, sha256, model, threads), test, batch_size, path, where)[0])
    if _REFERENCE_SCORES[key].shape[1] != model.num_classes:
        raise PtqError(f"{path}: gives {_REFERENCE_SCORES[key].shape[1]} class scores, {model.info.path} gives {model.num_classes}: not its FP32 model")
    return _REFERENCE_SCORES[key]


def _reference_key(sha256: str, test: SplitImages, fed_as: LoadedModel) -> tuple:
    return (sha256, test.content_sha256, len(test.labels), test.size, test.channels, fed_as.preprocessing.to_json())


def _reference_model_key(sha256: str | None, threads: int | None, preprocessing: dict | None) -> tuple:
    """The FP32 source as loaded for fidelity: its bytes, threads, and how it was fed (Preprocessing as a dict)."""
    return (sha256, threads, json.dumps(preprocessing, sort_keys=True))


def _keep_reference_scores(key: tuple, scores: np.ndarray) -> None:
    _REFERENCE_SCORES.clear()  # one source at a time: a 1000-class split's scores are tens of MB
    _REFERENCE_SCORES[key] = scores


def _model_fields(model: LoadedModel) -> dict:
    """What an evaluation record says of the model: its file, how it was made, and how it was fed."""
    return {
        "model_path": str(model.info.path), "model_sha256": model.info.sha256, "model_size_bytes": model.info.size_bytes,
        "runtime": model.info.runtime, "dtype": model.info.dtype, "quantization": model.info.quantization, "pruning": model.info.pruning,
        "source_sha256": model.info.source_sha256, "precision": model.info.precision, "model_input": model.describe_input(),
        "preprocessing": model.preprocessing.describe(), "preprocessing_settings": asdict(model.preprocessing),
        "arena_bytes": model.info.arena_bytes,
    }


def _whole_split(run: _Pass, progress: ProgressCallback | None, runs: Executor | None, sharded: ShardedModel | None,
                 reference: tuple[LoadedModel, Path, tuple] | None) -> tuple[np.ndarray, np.ndarray, float, None]:
    """(every image of the split, their scores, inference seconds, None): here, or in shards on `runs` with the model
    loaded as `sharded` says. `reference`: the FP32 source, scored on the whole split in the same pass."""
    if runs is not None and sharded is not None:
        scores, seconds = _predict_in_shards(runs, run, sharded, progress)
    else:
        scores, seconds = _predict_split(run.model, run.test, run.batch_size, run.model_path, run.where, progress, reference)
    return np.arange(len(run.test.labels)), scores, seconds, None


def _emulated_subset(run: _Pass, subset: int | None, progress: ProgressCallback | None) -> tuple[np.ndarray, np.ndarray, float, float | None, str]:
    """(the images measured, their scores on the saturating path under emulation, the exact path's inference seconds,
    the exact path's top-1 on them, the basis): `subset` images of the split, the first of each class (the first ones
    where the labels are not the model's; None: emulate.default_subset)."""
    model, test = run.model, run.test
    if subset is None:
        subset = emulate.default_subset(4 * model.input.channels * model.input.height * model.input.width)
    chosen = emulate.subset_indices(test.labels, subset) if run.labels_fit else np.arange(min(subset, len(test.labels)))
    images, labels = test.take(chosen), test.labels[chosen]
    exact_scores, seconds = _predict(model, images, run.batch_size, run.model_path, run.where)
    scores = scores_under_emulation(run.model_path, model.prepare(images), resolve_threads(run.threads))
    if progress:
        progress(len(chosen), len(chosen))
    exact_same = round(100.0 * float(np.mean(exact_scores.argmax(axis=1) == labels)), 4) if run.labels_fit else None
    on_same = f"exact path on the same images: {exact_same:.2f}%" if exact_same is not None else "no labels"
    which = f"all {len(chosen):,} images" if len(chosen) == len(test.labels) else f"{len(chosen):,} of {len(test.labels):,} images (first of each class)"
    return chosen, scores.astype(np.float32), seconds, exact_same, f"emulated ({emulate.describe()}) on {which}; {on_same}"


def refresh_stale(results_dir: Path, threads: int | None = None, progress_for: Callable[[str], ProgressCallback | None] | None = None) -> list[Path]:
    """Evaluate again every model whose file changed since its record was written, on the record's dataset
    and fed as that record says; returns the records rewritten."""
    rewritten = []
    for record in load_records(results_dir).records:
        if record_status(record) != STALE:
            continue
        dataset = open_dataset(Path(record.dataset))
        progress = progress_for(record.name) if progress_for else None
        fresh = evaluate_model(Path(record.model_path), dataset, record.batch_size or settings.EVALUATION_BATCH, threads, progress, flags_of(record),
                               record.runtime, record.precision, int8_path=record.int8_path if path_tag(record.int8_path, record.int8_basis) else None)
        rewritten.append(save_record(fresh, results_dir))
    return rewritten


@dataclass(frozen=True)
class Evaluated:
    record: EvaluationRecord
    path: Path  # where the record was written
    reference: EvaluationRecord | None  # the FP32 model it is compared with, if any record has it
    source_evaluated: Path | None = None  # the FP32 source, evaluated too because its record was missing
    reference_status: str = OK  # whether the reference's file is still the one its record measured
    source_record: Path | None = None  # where the source's record was written, if it was evaluated

    @property
    def written(self) -> tuple[Path, ...]:
        return (self.path, *((self.source_record,) if self.source_record is not None else ()))


def evaluate_and_save(model_path: Path, dataset: Dataset, results_dir: Path, progress: ProgressCallback | None = None, **how: Any) -> Evaluated:
    """Evaluate (`how`: evaluate_model's options), write the record, and evaluate the model's FP32 source
    too when its record on this dataset is missing (fed exactly as the model was), so the delta is always
    against a measurement."""
    record = evaluate_model(model_path, dataset, progress=progress, **how)
    path = save_record(record, results_dir)
    records = load_records(results_dir).records
    source, source_path = source_to_evaluate(record, records), None
    if source is not None:  # without labels of its classes, the source is measured against itself: the reference row
        threads = how.get("threads")
        loaded = _REFERENCE_MODEL.get(_reference_model_key(record.source_sha256, threads, record.preprocessing_settings))
        source_record = evaluate_model(source, dataset, how.get("batch_size", settings.EVALUATION_BATCH), threads, None, flags_of(record),
                                       against=source if record.accuracy is None else None, loaded=loaded)
        records.append(source_record)
        source_path = save_record(source_record, results_dir)
    reference = fp32_reference(records, record) if record.dtype != "fp32" or record.source_sha256 else None
    if reference is not None and reference.model_sha256 == record.model_sha256:
        reference = None
    return Evaluated(record, path, reference, source, record_status(reference) if reference is not None else OK, source_path)


@dataclass(frozen=True)
class EvaluationRequest:
    """What `ptq evaluate` asks: these models on the dataset's evaluation split, on these int8 paths."""

    models: tuple[Path, ...]
    dataset: Dataset
    results_dir: Path
    int8_path: str = int8_plan.NATIVE_PATH  # one of int8_plan.INT8_PATH_CHOICES
    batch_size: int = settings.EVALUATION_BATCH
    threads: int | None = None
    flags: PreprocessingFlags | None = None
    runtime: str | None = None
    precision: str | None = None
    label: str | None = None
    subset: int | None = None  # None: emulate.default_subset
    against: Path | None = None
    workers: Workers = HERE  # where the split is scored: here, or in shards as tasks on Ray


def evaluate(request: EvaluationRequest, progress_bar: ProgressBar = no_progress_bar) -> Iterator[Evaluated]:
    """Each model of the request evaluated and its record written, on each int8 path asked for that its runtime
    has here (both only where they differ by CPU and can be reached), each model loaded once (the exact path on a
    CPU without VNNI needs its own session); `progress_bar(description)` gives each evaluation's progress callback."""
    if request.label is not None and len(request.models) != 1:
        raise PtqError(f"--label: names one model, but {len(request.models)} are being evaluated")
    wanted = int8_plan.paths_asked(request.int8_path)
    check_folder_writable(request.results_dir)  # said before the evaluations, not after them
    with executor(request.workers) as runs:
        for model_path in request.models:
            model = load_model(model_path, request.threads, request.flags, request.runtime, request.precision)
            for int8_path in int8_plan.paths_to_measure(int8_model(model.info), wanted):
                with progress_bar(f"Evaluating {Path(model_path).name}" + (f" ({int8_path} int8 path)" if int8_path else "")) as progress:
                    evaluated = evaluate_and_save(model_path, request.dataset, request.results_dir, progress, batch_size=request.batch_size,
                                                  threads=request.threads, flags=request.flags, runtime=request.runtime, precision=request.precision,
                                                  label=request.label, int8_path=int8_path, subset=request.subset, against=request.against, loaded=model,
                                                  runs=runs if request.workers.on_ray else None)
                yield evaluated


def outside_target(model_path: Path | str, target: str | None) -> str | None:
    """One line when this CPU is outside the CPUs a model was quantized for (`--cpus vnni` on a CPU
    without VNNI): its figures here are not the ones it gives where it is meant to run."""
    cpu = cpu_info.current()
    if target not in cpu_info.CPU_TARGETS or cpu_info.covers(target, cpu):
        return None
    return (f"{Path(model_path).name} is for {cpu_info.CPU_TARGETS[target]}; this CPU, {cpu.describe()}, "
            "is not among them: its figures here are not the ones it gives there")
