"""What `evaluate` records of one model on one dataset, how a record is named, read and checked, and which record
another is measured against (the same images fed the same way); `report` reads these and computes nothing new."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ptq_cli import backends
from ptq_cli.datasets.base import split_slug
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.inputs import Preprocessing, PreprocessingFlags
from ptq_cli.metrics import unpacked_hits
from ptq_cli.model_file import file_sha256
from ptq_cli.services.measure.fidelity import Fidelity
from ptq_cli.services.measure.fidelity import check as check_fidelity
from ptq_cli.services.quant_settings import describe_model
from ptq_cli.services.records import DEFAULT_FEEDING, MeasurementKey, from_dict, model_key, record_files, same_feeding, write_record
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86.plan import NATIVE  # how a figure for an int8 path was obtained: the CPU's own kernels

OK, STALE, MISSING = "ok", "stale", "missing"

RECORD_SCHEMA = 2


@dataclass(frozen=True)
class EvaluationRecord:
    """What `evaluate` measured for one model file on one dataset; `report` reads these and computes nothing new."""

    # The fields held as JSON objects, and what each is checked against when a record is read (records.from_dict).
    NESTED_FIELDS: ClassVar[dict[str, type]] = {"cpu": cpu_info.CpuRecord, "fidelity": Fidelity, "preprocessing_settings": Preprocessing}

    model_path: str
    model_sha256: str
    model_size_bytes: int
    runtime: str
    dtype: str
    quantization: dict | None
    dataset: str  # the dataset's path
    images: int
    correct: int | None  # None: the images' labels are not the model's classes (or there are none); fidelity says how it did
    accuracy: float | None  # top-1, percent; None as correct is
    class_names: list[str]
    per_class_accuracy: list[float | None]  # percent, in class_names order; None for a class with no images
    confusion_matrix: list[list[int]]  # rows: true class, columns: predicted class; [] when confusion_counts holds it
    images_per_second: float  # inference only, at batch_size
    batch_size: int
    threads: int
    timestamp: str
    tool_version: str
    schema: int = RECORD_SCHEMA
    pruning: dict | None = None  # how `ptq prune` pruned the model (or its FP32 source), if it did
    dataset_format: str = ""
    split: str = ""
    dataset_sha256: str = ""  # content key of the split: records of one dataset compare only with each other
    source_sha256: str | None = None  # the float model this one was made from: its delta is against that model's record
    model_input: str = ""  # e.g. "NCHW 3x32x32, batch 1 (made symbolic)"
    preprocessing: str = ""  # e.g. "cifar10-normalized"
    preprocessing_settings: dict | None = None  # scale, mean, std, bgr, preset: what the images were fed as
    precision: str | None = None  # OpenVINO's inference precision hint (f32, bf16); None for the other runtimes
    label: str | None = None  # what the report calls the model instead of its file name (e.g. the MLPerf Tiny reference)
    cpu: dict | None = None  # the CPU it ran on: model, arch, int8 flags, its native int8 path (cpu.Cpu.as_record)
    int8_path: str | None = None  # "exact" or "saturating": the x86 int8 path the figure holds for; None for a float model
    int8_basis: str = ""  # how that path was reached: native, a session option, a proof, or emulation (and on how many images)
    exact_accuracy_same_images: float | None = None  # emulated on a subset: the exact path's top-1 on those images, to compare with
    # Over DENSE_CLASSES classes the matrix is kept as its nonzero cells, [true, predicted, count] each: a
    # 1000-class matrix is a million numbers, its nonzero cells at most one per image.
    confusion_counts: list[list[int]] | None = None
    # Against the FP32 model on the same images (fidelity.Fidelity): top-1 agreement, top-5 containment,
    # SQNR and KL of the scores. Measured whenever the FP32 model is at hand; needs no labels.
    fidelity: dict | None = None
    arena_bytes: int | None = None  # the working memory its runtime measured for it (TFLM's tensor arena), where it does
    # What the figures suggest went wrong before the model (plausibility_warnings): a top-1 near chance, mean/std in 0-1
    # units on 0-255 pixels. Shown by evaluate and report beside the figures.
    warnings: tuple[str, ...] = ()
    # Which images it classified right, a bit each in the images' order (metrics.packed_hits): two models measured on
    # the same images are then compared image by image (McNemar), not by their totals alone. None without labels.
    right_images: str | None = None

    @property
    def agreement(self) -> float | None:
        """Top-1 agreement with the FP32 model, percent, if measured."""
        return None if self.fidelity is None else self.fidelity["top1_agreement"]

    def images_per_class(self) -> list[int]:
        """How many of the images measured belong to each class (its confusion matrix's rows)."""
        counts = np.zeros(len(self.class_names), dtype=np.int64)
        cells = self.confusion_cells()
        np.add.at(counts, cells[:, 0], cells[:, 2])
        return [int(count) for count in counts]

    def confusion_cells(self) -> np.ndarray:
        """The confusion matrix's cells as (true class, predicted class, count) rows, from whichever form the
        record keeps: never a classes x classes array for a record that keeps its nonzero cells."""
        classes = len(self.class_names)
        if self.confusion_counts is None:
            dense = np.array(self.confusion_matrix, dtype=np.int64).reshape(len(self.confusion_matrix), -1)
            true, predicted = np.nonzero(dense)
            return np.stack([true, predicted, dense[true, predicted]], axis=1)
        cells = np.array(self.confusion_counts, dtype=np.int64).reshape(-1, 3)
        if ((cells[:, :2] < 0) | (cells[:, :2] >= classes)).any():
            raise ValueError(f"a confusion cell names a class outside its {classes} classes")
        return cells

    def class_images(self) -> tuple[np.ndarray, np.ndarray]:
        """(images of each true class, of those the correct ones): the confusion matrix's row sums and diagonal."""
        cells, classes = self.confusion_cells(), len(self.class_names)
        correct = cells[cells[:, 0] == cells[:, 1]]
        return (np.bincount(cells[:, 0], weights=cells[:, 2], minlength=classes).astype(np.int64),
                np.bincount(correct[:, 0], weights=correct[:, 2], minlength=classes).astype(np.int64))

    def confusion(self) -> np.ndarray:
        """The whole confusion matrix (true class x predicted class): classes x classes numbers."""
        matrix = np.zeros((len(self.class_names),) * 2, dtype=np.int64)
        cells = self.confusion_cells()
        np.add.at(matrix, (cells[:, 0], cells[:, 1]), cells[:, 2])
        return matrix

    @property
    def timed_natively(self) -> bool:
        """Whether its speed is the model's on that CPU: a float model, or its int8 path run on the CPU's own kernels (not
        onnxruntime's exact-kernel switch on a CPU without VNNI, nor an emulator)."""
        return not self.int8_basis or self.int8_basis == NATIVE

    @property
    def name(self) -> str:
        return Path(self.model_path).name

    @property
    def dataset_label(self) -> str:
        return f"{Path(self.dataset).name} ({self.split})" if self.split else Path(self.dataset).name


# Class counts up to which a record keeps the whole confusion matrix (CIFAR-10's, and any with few classes).
DENSE_CLASSES = 100


def confusion_fields(confusion: np.ndarray) -> dict:
    if len(confusion) <= DENSE_CLASSES:
        return {"confusion_matrix": confusion.tolist()}
    true, predicted = np.nonzero(confusion)
    return {"confusion_matrix": [], "confusion_counts": [[int(t), int(p), int(confusion[t, p])] for t, p in zip(true, predicted, strict=True)]}


# A class's figure counts when it has this many images (or as many as the best-covered class has, if fewer):
# a one-image class at -100 points says nothing about the model.
MIN_CLASS_IMAGES = 10


# `--per-class` shows every class up to this many; past it, the classes that lose the most.
PER_CLASS_ROWS = 20


def measured_classes(record: EvaluationRecord) -> list[int]:
    """The classes whose figures count: those with enough images (MIN_CLASS_IMAGES)."""
    images, _ = record.class_images()
    enough = min(MIN_CLASS_IMAGES, int(images.max(initial=0)))
    return [index for index, count in enumerate(images) if count >= max(enough, 1)]


def classes_to_show(record: EvaluationRecord, reference: EvaluationRecord | None, rows: int = PER_CLASS_ROWS) -> list[int]:
    """What `--per-class` lists: every class of a small set; of a large one, the measured classes that lose
    the most against the reference (or score lowest without one), worst first."""
    if len(record.class_names) <= rows:
        return list(range(len(record.class_names)))
    def loss(index: int) -> tuple[float, int]:
        accuracy = record.per_class_accuracy[index] or 0.0
        other = reference.per_class_accuracy[index] if reference is not None and index < len(reference.per_class_accuracy) else None
        return (accuracy - other if other is not None else accuracy), index
    return sorted(measured_classes(record), key=loss)[:rows]


def per_class(confusion: np.ndarray) -> list[float | None]:
    """Top-1 of each class in percent (its row of the confusion matrix); None for a class with no images."""
    rows = confusion.sum(axis=1)
    return [round(100.0 * float(confusion[index, index]) / rows[index], 4) if rows[index] else None for index in range(len(confusion))]


def path_tag(int8_path: str | None, int8_basis: str = "") -> str:
    """"~exact" or "~saturating" for a figure of the int8 path this CPU does not take natively (so both
    paths of one model keep their records); "" for the native one."""
    return f"~{int8_path}" if int8_path and int8_basis and int8_basis != NATIVE else ""


def runtime_tag(model_path: Path | str, runtime: str | None, precision: str | None) -> str:
    """"" for a model on its own runtime at its default precision; "~openvino-f32" for a file run on another
    runtime (an ONNX file on OpenVINO), "~bf16" for another precision hint, so each run keeps its record."""
    if runtime is None:
        return ""
    precisions = backends.backend(runtime).runtime.precisions
    default = precisions[0] if precisions else None
    if _own_backend(Path(model_path)) != runtime:
        return f"~{runtime}" + (f"-{precision or default}" if default else "")
    return f"~{precision}" if precision not in (None, default) else ""


def _own_backend(path: Path) -> str | None:
    """The backend a file is, by content (by suffix where it cannot be read)."""
    try:
        return backends.for_file(path).name
    except PtqError:
        return next((row.name for row in backends.TABLE.values() if path.suffix in row.suffixes), None)


def record_file(folder: Path, record: Any) -> Path:
    """The one place a record (an evaluation's or a benchmark's) is named, once it is measured, from what it
    measured (its MeasurementKey) and the model file's name and folder: FOLDER/resnet8.onnx-4d5e6f~openvino-f32@cifar-10-batches-py-test-1a2b3c.json.
    A figure on the int8 path the CPU took natively, on the file's own runtime at its default precision, carries no tag."""
    key = MeasurementKey.of(record)
    tag = runtime_tag(record.model_path, key.runtime, key.precision or None) + path_tag(key.int8_path or None, getattr(record, "int8_basis", ""))
    split = getattr(record, "split", "")
    images = f"@{split_slug(Path(record.dataset), split)}" if split else ""
    if key.feeding and key.feeding != DEFAULT_FEEDING:  # the images fed two ways: two records, each named by its feeding
        images += f"%{key.feeding[:6]}"
    return Path(folder) / f"{model_key(record.model_path)}{tag}{images}.json"


def save_record(record: EvaluationRecord, results_dir: Path) -> Path:
    return write_record(record_file(results_dir, record), record)


def read_record(path: Path) -> EvaluationRecord:
    try:
        data = bounded.json_loads(bounded.read_text(Path(path), "record"), parse_constant=_refuse_constant)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        record = from_dict(EvaluationRecord, data)
        if record.images <= 0 or record.model_size_bytes < 0:
            raise ValueError("images or size out of range")
        if record.fidelity is not None:
            check_fidelity(record.fidelity)
        if record.accuracy is None:  # measured against its FP32 model alone, or the FP32 model itself on images without its labels
            if record.correct is not None or record.per_class_accuracy or record.confusion_matrix or record.confusion_counts or record.right_images:
                raise ValueError("no accuracy, yet per-class figures")
            if record.fidelity is None and record.dtype != "fp32":
                raise ValueError("a quantized model with no accuracy and no fidelity either")
        else:
            _check_accuracy(path, record)
        describe_model(record.quantization, record.pruning)  # its settings must read as ptq wrote them
        return record
    except (OSError, ValueError, TypeError, AttributeError, KeyError, OverflowError) as error:  # Overflow: a count past 64 bits
        raise PtqError(f"{path}: not a ptq evaluation record ({error})") from error


def _check_accuracy(path: Path, record: EvaluationRecord) -> None:
    if record.correct is None or not (0 <= record.accuracy <= 100 and 0 <= record.correct <= record.images):  # type: ignore[operator]
        raise ValueError("accuracy or correct/images out of range")
    classes = len(record.class_names)
    bounded.check_count(path, classes, bounded.CLASSES, f"{classes:,} class names")
    dense_ok = len(record.confusion_matrix) == classes and all(len(row) == classes for row in record.confusion_matrix)
    counts_ok = record.confusion_counts is not None and not record.confusion_matrix \
        and len(record.confusion_counts) <= record.images and all(len(cell) == 3 for cell in record.confusion_counts)
    if len(record.per_class_accuracy) != classes or not (dense_ok or counts_ok):
        raise ValueError(f"per-class figures do not match its {classes} classes")
    _check_figures_agree(record)


# Figures are stored rounded to 4 decimals.
ROUNDING = 1e-3


def _check_figures_agree(record: EvaluationRecord) -> None:
    """A record's figures are all derived from its confusion matrix: one edited by hand disagrees."""
    cells = record.confusion_cells()
    if (cells[:, 2] < 0).any():
        raise ValueError("its confusion matrix holds a negative count")
    rows, diagonal = record.class_images()
    if int(rows.sum()) != record.images or int(diagonal.sum()) != record.correct:
        raise ValueError(f"its confusion matrix does not add up to its {record.images} images and {record.correct} correct")
    if record.accuracy is None or record.correct is None or abs(record.accuracy - 100.0 * record.correct / record.images) > ROUNDING:
        raise ValueError(f"accuracy {record.accuracy}% is not its {record.correct}/{record.images} correct")
    if record.right_images is not None and int(unpacked_hits(record.right_images, record.images).sum()) != record.correct:
        raise ValueError(f"its images right are not its {record.correct} correct")
    for index, stored in enumerate(record.per_class_accuracy):
        row = int(rows[index])
        if (stored is None) != (row == 0) or (row and abs(stored - 100.0 * diagonal[index] / row) > ROUNDING):
            raise ValueError(f"per-class accuracy of '{record.class_names[index]}' is not its confusion matrix row")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


@dataclass(frozen=True)
class RecordSet:
    records: list[EvaluationRecord]
    skipped: list[str]  # one line per unreadable file: "path: problem"


def load_records(results_dir: Path) -> RecordSet:
    """Every record under `results_dir`; unreadable ones are skipped and named, never fatal."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise PtqError(f"{results_dir}: results directory not found (run `ptq evaluate` first)")
    records, skipped = [], []
    for path in record_files(results_dir):
        try:
            records.append(read_record(path))
        except PtqError as error:
            skipped.append(str(error))
    return RecordSet(newest_per_measurement(records), skipped)


def newest_per_measurement(records: list[EvaluationRecord]) -> list[EvaluationRecord]:
    """One record per model file and measurement (MeasurementKey: its bytes, runtime, precision, int8 path and
    images): the newest. Records written under an older naming scheme, or copied in, would otherwise show one
    model twice."""
    newest: dict[tuple, EvaluationRecord] = {}
    for record in records:
        key = (str(Path(record.model_path).resolve()), MeasurementKey.of(record))
        if key not in newest or record.timestamp > newest[key].timestamp:
            newest[key] = record
    return list(newest.values())


def record_status(record: EvaluationRecord) -> str:
    """Whether the record still describes the file at its path: "ok", "stale" (the file changed since it
    was measured) or "missing". A figure is only as good as the bytes it was measured on."""
    path = Path(record.model_path)
    if not path.is_file():
        return MISSING
    try:
        return OK if file_sha256(path) == record.model_sha256 else STALE
    except OSError:
        return MISSING


def _closeness(record: EvaluationRecord):
    """How near another run of the same file is to `record`'s: same runtime and precision first, then the
    table's order; the sort key makes the choice the same on every run."""
    def key(other: EvaluationRecord) -> tuple:
        return (other.runtime != record.runtime, other.precision != record.precision, backends.order(other.runtime),
                other.precision or "", other.int8_path or "", other.model_path)
    return key


def reference_for(record: EvaluationRecord, records: list[EvaluationRecord]) -> EvaluationRecord | None:
    """The record of the float model `record`'s model was made from, measured on the same images (its run
    on the same runtime where there is one)."""
    if not record.source_sha256:
        return None
    found = [other for other in records if other.model_sha256 == record.source_sha256 and other.dataset_sha256 == record.dataset_sha256
             and other is not record and same_feeding(other, record)]
    return min(found, key=_closeness(record), default=None)


def source_to_evaluate(record: EvaluationRecord, records: list[EvaluationRecord]) -> Path | None:
    """The source model file to evaluate too, when its record on this dataset is missing and the file is
    still the one the model was made from."""
    if not record.source_sha256 or reference_for(record, records) is not None:
        return None
    path = (record.quantization or {}).get("source_model")
    if not path or not Path(path).is_file() or file_sha256(Path(path)) != record.source_sha256:
        return None
    return Path(path)


def fp32_reference(records: list[EvaluationRecord], record: EvaluationRecord) -> EvaluationRecord | None:
    """The float model to compare a model with: its source; for a model ptq did not make, the one float
    model on its dataset (of its runtime, else of any), and none where that is ambiguous."""
    source = reference_for(record, records)
    if source is not None or record.source_sha256:
        return source
    floats = [other for other in records if other.dtype == "fp32" and not other.pruning and other.dataset_sha256 == record.dataset_sha256
              and other is not record and same_feeding(other, record)]
    roots = [other for other in floats if reference_for(other, records) is None]  # not made from another float model here
    for candidates in ([other for other in floats if other.runtime == record.runtime], roots):
        files = {other.model_sha256 for other in candidates}
        if len(files) == 1:
            return min(candidates, key=_closeness(record))
    return None


def flags_of(record: EvaluationRecord) -> PreprocessingFlags:
    """The preprocessing a record's images were fed with, as flags (to feed its FP32 source the same)."""
    return as_flags(record.preprocessing_settings or asdict(Preprocessing()))


def as_flags(stored: dict) -> PreprocessingFlags:
    """Resolved preprocessing (Preprocessing as a dict) as the flags that feed another model the same way."""
    size = stored.get("size")
    return PreprocessingFlags(None, stored["scale"], tuple(stored["mean"]), tuple(stored["std"]), stored["bgr"], tuple(size) if size else None)
