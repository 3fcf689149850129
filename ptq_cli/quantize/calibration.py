"""Calibration statistics and the QDQ writer every backend's model starts from: onnxruntime.quantization's
quantize_static (QDQ format), fed in chunks within the memory budget, its histograms built on threads and shared by the
calls of one scope, and `--method per-image`'s ranges from each image's own extremes."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ptq_cli import settings
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import WRITE_FAILURES
from ptq_cli.model_file import (
    default_threads,
    resolve_threads,
)
from ptq_cli.quantize import reuse
from ptq_cli.quantize.job import Job
from ptq_cli.quantize.policy import held_out_mask, image_pixels, judged_indices, per_image_range
from ptq_cli.quantize.settings import (
    CANDIDATE_VALUES,
    PER_IMAGE,
    ProgressCallback,
    QuantizationSettings,
)
from ptq_cli.transforms.qdq_edits import with_image_extremes

CALIBRATION_BATCH = 100
SEARCH_CHUNK_PIXELS = 1 << 20  # the range search runs its images this many pixels at a time (1,024 at 32x32)


# What one image's activations cost, as a multiple of their bytes, while onnxruntime calibrates: the
# session's outputs, the list the calibrator merges them into and the array a histogram is built from.
ACTIVATION_COPIES = 3
# A `ptq quantize` process before calibrating, as the budget counts it: Python, numpy, onnx and onnxruntime (docs: Limits).
BASE_PROCESS_BYTES = 400 * 10**6


def activation_bytes(source) -> int:
    """Bytes of every float tensor of the graph for one image (what a calibrator asks the session to output),
    from ONNX shape inference; a tensor of unknown shape counts as the largest known one."""
    import onnx

    model = onnx.load(source, load_external_data=False) if isinstance(source, str) else source
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  a graph shape inference cannot follow: the values it declares
        inferred = model
    graph = inferred.graph
    sizes: dict[str, int | None] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.elem_type != onnx.TensorProto.FLOAT:
            continue
        dims = [dim.dim_value if dim.HasField("dim_value") else (1 if dim.dim_param else 0) for dim in tensor.shape.dim] if tensor.HasField("shape") else [0]
        sizes[value.name] = int(np.prod(dims, dtype=np.int64)) * 4 if all(dims) else None
    outputs = {name for node in graph.node for name in node.output}
    largest = max((size for size in sizes.values() if size), default=0)
    known = sum(size or largest for name, size in sizes.items())
    unseen = len(outputs - sizes.keys())  # outputs shape inference said nothing of
    return known + unseen * largest


def calibration_chunk(source, images: np.ndarray, fixed_batch: int | None, where: str) -> int:
    """How many images onnxruntime may calibrate on at once within bounded.CALIBRATION_BYTES (the process's
    memory now included), or a one-line error when not even one image (one fixed batch) fits."""

    budget = bounded.CALIBRATION_BYTES.value()
    per_image = ACTIVATION_COPIES * activation_bytes(source)
    model_bytes = Path(source).stat().st_size if isinstance(source, str) else source.ByteSize()
    # Estimated, not read from the process, so that the ranges (and the file) never depend on what else the
    # process holds (`ptq run`, the tests): ptq itself, the images, the augmented model and the session's copy.
    left = budget - BASE_PROCESS_BYTES - images.nbytes - 3 * model_bytes
    step = fixed_batch or 1
    if per_image * step > left:
        raise PtqError(f"{where}: calibrating needs about {per_image * step / 1e6:,.0f} MB of activations for {step} image{'s' if step > 1 else ''} at a time, "
                       f"more than the {max(left, 0) / 1e6:,.0f} MB left of the {budget / 1e9:.1f} GB calibration budget; raise "
                       f"{bounded.CALIBRATION_BYTES.env} (bytes) or give fewer --calibration-size images")
    return int(max(step, min(len(images), left // max(per_image, 1))))


def _reader(input_name: str, images: np.ndarray, batch: int | None, progress: ProgressCallback | None = None):
    """onnxruntime's CalibrationDataReader over `images`: batches of about CALIBRATION_BATCH images (of the
    fixed batch, whole ones only), and `set_range` over batch indices for quantize_static's strided loop."""
    from onnxruntime.quantization import CalibrationDataReader

    if batch is None:
        batches = np.array_split(images, max(1, len(images) // CALIBRATION_BATCH))
    else:  # a fixed batch: full batches only
        batches = [images[start : start + batch] for start in range(0, len(images) - batch + 1, batch)]
    total = sum(len(item) for item in batches)

    class BatchReader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = batches
            self.stride = len(batches)
            self._end = len(batches)
            self._next = 0
            self._done = 0

        def __len__(self) -> int:  # whole strides: quantize_static requires it
            return -(-len(batches) // self.stride) * self.stride

        def set_range(self, start_index: int, end_index: int) -> None:
            self._next, self._end = start_index, min(end_index, len(batches))

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self._next >= self._end:
                return None
            item = batches[self._next]
            self._next += 1
            if progress is not None:
                progress(self._done, total)
                self._done += len(item)
            return {input_name: item}

        def finished(self) -> None:
            if progress is not None:
                progress(total, total)

    return BatchReader()


def _in_chunks(reader, fitting: int, extra_options: dict) -> None:
    """When the batches do not all fit at once (`fitting` images), quantize_static collects a stride of them
    at a time (its CalibStridedMinMax loop, which every method honours); otherwise in one call, as before, so
    that histograms are built in one pass where memory allows it."""
    largest = max((len(batch) for batch in reader.batches), default=1)
    if sum(map(len, reader.batches)) <= fitting:
        return
    if largest > fitting:  # smaller batches
        reader.batches[:] = [part for batch in reader.batches for part in np.array_split(batch, -(-len(batch) // fitting))]
        largest = max(len(batch) for batch in reader.batches)
    reader.stride = max(1, fitting // largest)
    extra_options["CalibStridedMinMax"] = reader.stride


# Threads that build histograms, one tensor each: numpy's sort, which dominates, releases the GIL.
MAX_HISTOGRAM_THREADS = 4


def _threaded_collector(calibrator, calibrate):
    """onnxruntime's own histogram collector for `calibrator`, its tensors spread over the threads ptq may use (at
    most MAX_HISTOGRAM_THREADS): each tensor's histogram is built by the same code from the same data, and the
    tensors keep their order."""
    threads = min(MAX_HISTOGRAM_THREADS, default_threads())

    def flat(values):  # onnxruntime stacks a tensor's batches with np.asarray, which fails on batches of unequal sizes
        return np.concatenate([np.ravel(value) for value in values]) if isinstance(values, list) and values else values

    class ThreadedHistogramCollector(calibrate.HistogramCollector):
        def collect(self, name_to_arr):
            order = [*self.histogram_dict, *(name for name in name_to_arr if name not in self.histogram_dict)]
            with ThreadPoolExecutor(threads, thread_name_prefix="ptq-histogram") as pool:
                list(pool.map(lambda item: calibrate.HistogramCollector.collect(self, {item[0]: flat(item[1])}), name_to_arr.items()))
            self.histogram_dict = {name: self.histogram_dict[name] for name in order}

    return ThreadedHistogramCollector(method=calibrator.method, symmetric=calibrator.symmetric, num_bins=calibrator.num_bins,
                                      num_quantized_bins=calibrator.num_quantized_bins, percentile=calibrator.percentile,
                                      scenario=calibrator.scenario)


def _histogram_key(calibrator) -> tuple:
    """What a histogram collector's bins depend on besides the model and the images."""
    return calibrator.method, calibrator.symmetric, calibrator.num_bins, calibrator.num_quantized_bins, calibrator.scenario


def _replayed(calibrator, shared: dict | None) -> bool:
    """Whether `calibrator` (a percentile) took the histograms an earlier percentile calibration collected into `shared`
    (the caller's scope: the same model and images): it then reads its own percentile off a copy of them and runs
    nothing (onnxruntime's compute_percentile reads only the histograms and the percentile)."""
    collected = shared.get(_histogram_key(calibrator)) if shared is not None and calibrator.method == "percentile" else None
    if collected is None:
        return False
    calibrator.collector = copy.copy(collected)
    calibrator.collector.percentile = calibrator.percentile
    calibrator.collect_data = lambda _reader: None
    return True


@contextlib.contextmanager
def _histograms(reader, chunked: bool, shared: dict | None = None, minmax_cache: Path | None = None):
    """onnxruntime's histogram calibrators (percentile, entropy), with threaded collectors, and over chunks
    the one-pass histograms, bin for bin; with `shared`, percentile histograms collected once for every percentile
    (`_replayed`), kept there once the calibration succeeded.

    They size each tensor's bins on the first chunk and extend them as later chunks reach further, so
    chunked calibration would find other ranges than one pass over the whole set (ResNet8's speed model:
    86.66% against 87.06%). Where ptq chunks, a MinMax pass over the same chunks first finds each tensor's
    largest magnitude, and the histogram collector starts from empty histograms over exactly the range one
    pass would have used: every chunk then adds its counts to the same bins. That pass is MinMax's own: read from
    `minmax_cache` where a MinMax calibration of the same images left it (`--method auto`'s first candidate), kept
    there otherwise."""
    import importlib

    from onnxruntime.quantization import calibrate

    ort_quantize = importlib.import_module("onnxruntime.quantization.quantize")  # the module: the package exports its function
    real = ort_quantize.create_calibrator
    collected: list = []

    def seeded(model, op_types, augmented_model_path="augmented_model.onnx", calibrate_method=None, **options):
        calibrator = real(model, op_types, augmented_model_path=augmented_model_path, calibrate_method=calibrate_method, **options)
        _within_task_cpus(calibrator)
        if not isinstance(calibrator, calibrate.HistogramCalibrater) or calibrator.method == "distribution" or _replayed(calibrator, shared):
            return calibrator
        calibrator.collector = collector = _threaded_collector(calibrator, calibrate)
        collected.append(collector)
        if not chunked:
            return calibrator
        if minmax_cache is not None and minmax_cache.is_file():
            found = calibrate.load_tensors_data(minmax_cache)
        else:
            ranges = real(model, op_types, augmented_model_path=str(Path(augmented_model_path).with_suffix(".minmax.onnx")),
                          calibrate_method=calibrate.CalibrationMethod.MinMax, **{**options, "extra_options": {}})
            _within_task_cpus(ranges)
            found = _collected(ranges, reader)
            if minmax_cache is not None:
                calibrate.save_tensors_data(found, minmax_cache)
        _empty_bins(collector, found.data)
        reader.set_range(0, len(reader))
        return calibrator

    # quantize_static calls the name its module imported: that name is replaced for this one call.
    setattr(ort_quantize, "create_calibrator", seeded)  # noqa: B010  a module attribute the type checker cannot see
    try:
        yield
        if shared is not None:
            shared.update((_histogram_key(collector), collector) for collector in collected if collector.method == "percentile")
    finally:
        setattr(ort_quantize, "create_calibrator", real)  # noqa: B010


def _collected(calibrator, reader):
    """What `calibrator` computes over every batch of `reader`, a stride at a time (as quantize_static's strided loop)."""
    for start in range(0, len(reader), reader.stride):
        reader.set_range(start, start + reader.stride)
        calibrator.collect_data(reader)
    return calibrator.compute_data()


@contextlib.contextmanager
def _weights_quantized_once():
    """Within one run (reuse.computed_once), onnxruntime's QDQ writer hands back the codes it computed before for the
    same weight, type, scales and zero points: `--method auto`'s candidates and the final model differ in their
    activations' ranges, and the writer quantizes each weight channel by channel in Python. Its own function still
    computes each, once."""
    import importlib

    writer = importlib.import_module("onnxruntime.quantization.qdq_quantizer")
    real = getattr(writer, "quantize_onnx_initializer", None)
    if real is None:  # an onnxruntime whose writer quantizes otherwise
        yield
        return

    def once(weight, quant_type, zero_point, scale, axis=None, quant_weight_name=None, block_size=0):
        def key() -> str:
            arrays = (np.ascontiguousarray(zero_point).tobytes(), np.ascontiguousarray(scale).tobytes())
            described = (quant_type, axis, quant_weight_name, block_size, *((np.shape(value), np.asarray(value).dtype.str) for value in (zero_point, scale)))
            return reuse.digest(b"weight codes", weight.SerializeToString(), *arrays, repr(described).encode())

        blocks = {"block_size": block_size} if block_size else {}  # onnxruntime before block-wise quantization has no such argument
        made = reuse.computed_once(key, lambda: real(weight, quant_type, zero_point, scale, axis, quant_weight_name, **blocks),
                                   size=lambda codes: codes.ByteSize())
        return copy.deepcopy(made)

    writer.quantize_onnx_initializer = once
    quantizer = getattr(writer, "QDQQuantizer", None)
    real_params = getattr(quantizer, "_calc_initializer_quant_params", None)
    if real_params is not None:
        quantizer._calc_initializer_quant_params = _params_computed_once(real_params)  # type: ignore[union-attr]
    try:
        yield
    finally:
        writer.quantize_onnx_initializer = real
        if real_params is not None:
            quantizer._calc_initializer_quant_params = real_params  # type: ignore[union-attr]


def _params_computed_once(real):
    """onnxruntime's QDQ writer's scales and zero points of every weight (`_calc_initializer_quant_params`, a Python loop
    over each output channel: a second of EfficientNet-Lite0's every candidate), within one run (reuse.computed_once)
    handed back from an earlier writer of the same weights, types and options. What it reads: the initializers it
    quantizes, each one's role and axis, their overrides, the types and the options of symmetry, range and blocks."""
    def params(self):
        def key() -> str:
            initializers = {init.name: init for init in self.model.initializer()}
            named = sorted(name for name in self.tensors_to_quantize if name in initializers)
            described = [(name, self.tensors_to_quantize[name].tensor_type, self.tensors_to_quantize[name].axis,
                          self.tensors_to_quantize[name].data_type, _spelled(self.tensor_quant_overrides.get(name))) for name in named]
            options = (self.weight_qType, self.activation_qType, self.reduce_range, self._is_weight_symmetric, self.is_activation_symmetric,
                       getattr(self, "block_size", 0), getattr(self, "min_real_range", None))
            return reuse.digest(b"initializer quant params", *(initializers[name].SerializeToString() for name in named),
                                repr((described, options)).encode())

        return copy.deepcopy(reuse.computed_once(key, lambda: real(self)))

    return params


def _spelled(value):
    """`value` (overrides: lists and dicts of numbers, arrays, types) for a key: each array by its type, shape and bytes
    (numpy's repr elides a long one)."""
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.shape, value.tobytes()
    if isinstance(value, dict):
        return sorted((key, _spelled(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return [_spelled(item) for item in value]
    return value


def _empty_bins(collector, ranges: dict) -> None:
    """`collector`'s histograms, empty, each over the range one pass over every image would give it (`ranges`: a MinMax
    pass's TensorData by tensor)."""
    absolute = collector.method == "percentile" and collector.symmetric  # histograms of |x|, from its smallest to its largest
    for name, found in ranges.items():
        low, high = (np.float32(value) for value in np.asarray(found.range_value, dtype=np.float32).reshape(-1)[:2])
        lowest, highest = np.array(np.inf, np.float32), np.array(-np.inf, np.float32)  # a chunk's own min/max replace them
        if absolute:  # the smallest magnitude: 0 where the range crosses it (exact after a ReLU, a hair below it otherwise)
            edges = np.histogram_bin_edges(np.array([0.0 if low <= 0 <= high else min(abs(low), abs(high)), max(abs(low), abs(high))]),
                                           bins=collector.num_bins).astype(np.float32)
            collector.histogram_dict[name] = (np.zeros(collector.num_bins, np.int64), edges, lowest, highest)
        else:
            threshold = np.array(max(abs(low), abs(high)), dtype=np.float32)
            empty, edges = np.histogram(np.zeros(0, np.float32), collector.num_bins, range=(-threshold, threshold))  # type: ignore[arg-type]  # float32 bounds, as onnxruntime's collector passes them: float ones give other edges
            collector.histogram_dict[name] = (empty, edges, lowest, highest, threshold)


def _within_task_cpus(calibrator) -> None:
    """The calibrator's session on the CPUs this process was given, where it was given a share (a Ray task):
    onnxruntime's own takes every core, and spins on them between runs."""
    cpus = settings.task_cpus()
    if cpus is None:
        return
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as onnxruntime makes it
    options.intra_op_num_threads = cpus
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    calibrator.infer_session = ort.InferenceSession(calibrator.augmented_model_path, sess_options=options, providers=calibrator.execution_providers)


@contextlib.contextmanager
def _library_warnings(into: list[str]):
    """onnxruntime.quantization's warnings (logging.warning on the root logger), kept for the result's notes
    rather than printed among ptq's output."""

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())
            record.ptq_kept = True  # said in the result: the CLI does not say it again (cli/console.py)

    root, handler = logging.getLogger(), Keep(logging.WARNING)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def warning_notes(warnings: list[str]) -> list[str]:
    clipped = [line for line in warnings if "exceeds the range of a int32" in line]
    notes = [f"onnxruntime clipped the int32 biases of {len(clipped)} layer{'s' if len(clipped) > 1 else ''}: their scale "
             "(input scale x weight scale) is too small for them"] if clipped else []
    others = [f"onnxruntime: {line}" for line in dict.fromkeys(warnings) if line not in clipped]
    return notes + others[:3] + ([f"onnxruntime: {len(others) - 3} more warnings of the same run"] if len(others) > 3 else [])


QUANT_TYPES = {"int8": "QInt8", "uint8": "QUInt8"}
CALIBRATION_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", PER_IMAGE: "MinMax"}
MINMAX = CALIBRATION_METHODS["minmax"]


def per_image_ranges(source: str, images: np.ndarray, input_name: str, percentile: float, fixed_batch: int | None = None,  # noqa: PLR0913  one keyword more
                     shared: dict | None = None) -> dict[str, list[dict]]:
    """onnxruntime `TensorQuantOverrides` setting each activation's range (rmin, rmax) to the `percentile`-th
    percentile, over the images, of each image's own largest value, and likewise of its smallest: a few images whose
    activations reach far beyond every other's (MobileNetV3's last blocks: 25 times the 99th percentile) no longer
    set the scale every image is quantized on. NNCF's default for per-tensor activations takes the mean of the same
    per-image values. A graph tied to a fixed batch runs whole batches of it (its extremes are then each batch's).
    `shared`: a scope's cache (the same source and images, as `_histograms`'), where every percentile reads one pass."""
    key = ("per-image extremes", fixed_batch)
    extremes = None if shared is None else shared.get(key)
    if extremes is None:
        extremes = image_extremes(source, images, input_name, fixed_batch)
        if shared is not None:
            shared[key] = extremes
    activations, found = extremes
    ranges = [per_image_range(found[2 * index], found[2 * index + 1], percentile) for index in range(len(activations))]
    return {name: [{"rmin": np.float32(low), "rmax": np.float32(high)}] for name, (low, high) in zip(activations, ranges, strict=True)}


def image_extremes(source: str, images: np.ndarray, input_name: str, fixed_batch: int | None) -> tuple[list[str], list[np.ndarray]]:
    """(the activations, and for each its smallest then its largest value in each image)."""
    import onnx
    import onnxruntime as ort

    extremes = with_image_extremes(onnx.load(source))
    if not extremes.activations:
        return [], []
    options = ort.SessionOptions()
    options.intra_op_num_threads = resolve_threads(None)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # onnxruntime's default order runs the reductions late and holds every activation until then (Lite0, 20 images at
    # 224x224: 2.3 GB); by priority, as the model alone (0.7 GB).
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    session = ort.InferenceSession(extremes.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    chunk = fixed_batch or max(1, SEARCH_CHUNK_PIXELS // image_pixels(images))
    end = len(images) - chunk + 1 if fixed_batch else len(images)  # whole batches only
    kept = _batch_first(session, extremes, images, input_name, fixed_batch)
    runs = [session.run(None, {input_name: images[start : start + chunk]}) for start in range(0, end, chunk)]
    return ([name for name, keep in zip(extremes.activations, kept, strict=True) if keep],
            [np.concatenate([run[index] for run in runs]) for index in range(len(runs[0])) if kept[index // 2]])


def _batch_first(session, extremes, images: np.ndarray, input_name: str, fixed_batch: int | None) -> list[bool]:
    """Which of the activations have the batch as their first axis: shape inference's word where it has one, else a run on
    one image and on two, whose reductions give one value per image exactly there (a graph tied to a fixed batch: the
    word alone)."""
    if fixed_batch is not None or len(images) < 2 or extremes.known.issuperset(extremes.activations):
        return [name in extremes.known for name in extremes.activations]
    one, two = session.run(None, {input_name: images[:1]}), session.run(None, {input_name: images[:2]})
    return [name in extremes.known or (len(one[2 * index]) == 1 and len(two[2 * index]) == 2) for index, name in enumerate(extremes.activations)]


# A placement's writer options that are quantize_static's arguments, not extra options.
OP_TYPES, EXCLUDED = "op_types_to_quantize", "nodes_to_exclude"


def write_qdq(job: Job, target: Path, images: np.ndarray, settings: QuantizationSettings, overrides: dict | None,  # noqa: PLR0913  the bar, the shared histograms, the batch
              progress: ProgressCallback | None, histograms: dict | None = None, *, fixed_batch: int | None) -> list[str]:
    """onnxruntime's quantize_static (QDQ) of the job's graph into `target`, calibrated on `images` with the settings'
    method, run `fixed_batch` images at a time where the graph is tied to a batch; returns the library's warnings.
    Calibration is chunked to the memory budget. `histograms`: percentile histograms and per-image extremes shared by
    the calls of one scope (the same source and images; see `_histograms`)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    source, input_name, float_nodes, output, model_name = job.source, job.input_name, job.float_nodes, job.output, job.model_name
    extra_options: dict[str, object] = {"CalibPercentile": settings.percentile} if settings.method == "percentile" else {}
    placed = dict(job.writer_options)
    extra_options |= {name: list(value) if isinstance(value, tuple) else value for name, value in placed.items() if name not in (OP_TYPES, EXCLUDED)}
    if overrides:
        extra_options["TensorQuantOverrides"] = overrides
    fitting = calibration_chunk(source, images, fixed_batch, model_name)
    reader = _reader(input_name, images, fixed_batch, progress)
    _in_chunks(reader, fitting, extra_options)
    cached_ranges, minmax_cache = _calibration_caches(source, images, extra_options, CALIBRATION_METHODS[settings.method], MINMAX)
    # quantize_static print()s its histogram progress; stdout belongs to ptq's own output (--json).
    warnings: list[str] = []
    with contextlib.redirect_stdout(io.StringIO()), _histograms(reader, "CalibStridedMinMax" in extra_options, histograms, minmax_cache), \
            _library_warnings(warnings), _weights_quantized_once():
        try:
            if images is job.calibration and fixed_batch is None and (cached_ranges == minmax_cache or "CalibStridedMinMax" in extra_options):
                _minmax_of_all(job, settings, overrides, minmax_cache)  # read by the calibration, or by its histograms' bins
            if settings.method == PER_IMAGE and settings.percentile is not None:
                extra_options["TensorQuantOverrides"] = {**per_image_ranges(source, images, input_name, settings.percentile, fixed_batch,
                                                                        histograms), **(overrides or {})}
            quantize_static(
                source, str(target), reader,
                quant_format=QuantFormat.QDQ,
                per_channel=settings.per_channel,
                activation_type=getattr(QuantType, QUANT_TYPES[settings.dtype]),
                weight_type=getattr(QuantType, QUANT_TYPES[settings.weight_dtype]),
                calibrate_method=getattr(CalibrationMethod, CALIBRATION_METHODS[settings.method]),
                nodes_to_exclude=[*float_nodes, *placed.get(EXCLUDED, ())],
                op_types_to_quantize=list(placed.get(OP_TYPES, ())) or None,
                extra_options=extra_options,
                calibration_cache_path=cached_ranges,
            )
        except PtqError:
            raise
        except OSError as error:
            if error.errno in WRITE_FAILURES:
                raise PtqError(f"{output}: cannot write ({error.strerror})") from error  # the output's disk, not the model
            raise PtqError(f"{model_name}: onnxruntime.quantization failed (OSError: {error.strerror or error})") from error
        except Exception as error:  # onnxruntime.quantization raises many types for graphs it cannot handle
            raise PtqError(f"{model_name}: onnxruntime.quantization failed ({type(error).__name__}: {first_line(error, '')})") from error
    reader.finished()
    return warnings


def _calibration_caches(source: str, images: np.ndarray, extra_options: dict, *methods: str) -> list[Path | None]:
    """Within one run (reuse.reused_file), onnxruntime's calibration cache for each method's ranges: what its calibrator
    computed from the same float model, images and calibration options, loaded instead of collected again (`--method
    auto`'s candidates, the overflow fix's judge and the model for VNNI CPUs calibrate alike; per-image ranges start
    from MinMax's, and percentile histograms from MinMax's ranges where calibration runs in chunks). Weights,
    overrides and excluded nodes play no part in calibration; nor do chunks in MinMax's (the smallest and largest
    value of each tensor, which no grouping of the images changes), nor a percentile. The model and images are
    hashed once for all the methods."""
    @functools.cache
    def inputs() -> str:
        return reuse.digest(b"calibration", Path(source).read_bytes(), np.ascontiguousarray(images).reshape(-1).view(np.uint8).data)

    def key(method: str) -> str:
        ignored = ("CalibStridedMinMax", "CalibPercentile") if method == MINMAX else ()
        options = {name: value for name, value in extra_options.items() if name.startswith("Calib") and name not in ignored}
        return reuse.digest(inputs().encode(), repr((images.shape, str(images.dtype), method, sorted(options.items()))).encode())

    return [reuse.reused_file(functools.partial(key, method), ".json") for method in methods]


@dataclass(frozen=True)
class JudgedImages:
    """How a job's calibration images serve the judges: the held-out images that judge, the images the candidates are
    calibrated on, and the others (every image in one of the two, once), each taken from the images where it is read."""

    images: np.ndarray
    calibrating_index: np.ndarray
    others_index: np.ndarray
    not_held_out: int  # the images the candidates would read within the budget

    @property
    def held_out(self) -> np.ndarray:
        return self.images[held_out_mask(len(self.images))]

    @property
    def calibrating(self) -> np.ndarray:
        return self.images[self.calibrating_index]

    @property
    def others(self) -> np.ndarray:
        return self.images[self.others_index]

    @property
    def drawn(self) -> bool:
        """Whether the candidates read a draw of the images not held out rather than all of them."""
        return len(self.calibrating_index) < self.not_held_out


def judged_images(job: Job) -> JudgedImages:
    """The held-out images (policy.held_out_split) and, of the rest, those `--method auto`'s candidates are calibrated
    on: every one, or an even draw of them within CANDIDATE_VALUES activation values (policy.judged_indices)."""
    fitting = max(1, CANDIDATE_VALUES // max(1, _activation_values(job.source)))
    return JudgedImages(job.calibration, *judged_indices(len(job.calibration), fitting))


@functools.lru_cache(maxsize=4)
def _activation_values_of(source: str, _version: tuple[int, int]) -> int:
    return activation_bytes(source) // 4


def _activation_values(source: str) -> int:
    """Float values of every activation of one image (activation_bytes), read once for a file as it is (its size and
    time of change in the key)."""
    status = Path(source).stat()
    return _activation_values_of(source, (status.st_size, status.st_mtime_ns))


def _minmax_of_all(job: Job, settings: QuantizationSettings, overrides: dict | None, cache: Path | None) -> None:
    """MinMax's ranges over all the job's calibration images, into `cache` (which quantize_static then reads), where
    `--method auto` left those of the images it calibrates its candidates on (`judged_images`): the other images
    calibrated alone and merged into them (a quarter of the images, where the candidates read all the rest).
    onnxruntime reduces each tensor to its smallest and largest value (NaN left out), which the two parts give as they
    are. Nothing where the writer would calibrate another graph than the job's (quantize_static converts an old opset
    first)."""
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData, create_calibrator, load_tensors_data, save_tensors_data
    from onnxruntime.quantization.quant_utils import update_opset_version
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    judged = judged_images(job)
    (part,) = _calibration_caches(job.source, judged.calibrating, {}, MINMAX)
    if cache is None or cache.is_file() or part is None or not part.is_file() or len(judged.others_index) == 0:
        return
    others = judged.others
    graph = onnx.load(job.source, load_external_data=False)
    types = [getattr(QuantType, QUANT_TYPES[dtype]) for dtype in (settings.weight_dtype, settings.dtype)]
    if update_opset_version(graph, *types, tensor_quant_overrides=overrides, block_size=0) is not graph:
        return
    op_types = list(dict(job.writer_options).get(OP_TYPES, ())) or list(set(QLinearOpsRegistry) | set(QDQRegistry))  # as quantize_static
    reader = _reader(job.input_name, others, None)
    _in_chunks(reader, calibration_chunk(job.source, others, None, job.model_name), {})
    with tempfile.TemporaryDirectory(prefix="ort.quant.", dir=job.workdir) as scratch:
        calibrator = create_calibrator(Path(job.source), op_types, augmented_model_path=str(Path(scratch) / "augmented_model.onnx"),
                                       calibrate_method=CalibrationMethod.MinMax, extra_options={})
        _within_task_cpus(calibrator)
        held = _collected(calibrator, reader).data
        del calibrator
    calibrated = load_tensors_data(part).data
    if set(held) != set(calibrated):
        return
    merged = {name: TensorData(lowest=np.fmin(calibrated[name].range_value[0], held[name].range_value[0]),
                               highest=np.fmax(calibrated[name].range_value[1], held[name].range_value[1])) for name in calibrated}
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, merged), cache)
