"""ONNX Runtime: load and run ONNX models, quantize them with onnxruntime.quantization (QDQ)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ptq_cli import cpu as cpu_info
from ptq_cli import inputs, settings
from ptq_cli.backends import base
from ptq_cli.backends.base import (
    AUTO_METHOD,
    EMULATE,
    METHOD_CANDIDATES,
    METHOD_MARGIN_DB,
    PER_IMAGE,
    RANGE_SEARCH_PIXELS,
    Backend,
    Int8Paths,
    LoadedModel,
    ProgressCallback,
    QuantizationSettings,
    QuantizedFile,
    Quantizer,
    RunOptions,
    Runtime,
    chosen_method,
    closer_by_margin,
    finish_load,
    held_out_split,
    image_pixels,
    per_image_range,
    rounding_image_count,
    sqnr_figure,
)
from ptq_cli.backends.model_file import (
    EXACT_PATH_CONFIG,
    default_threads,
    describe_input,
    free_batch,
    in_fixed_batches,
    metadata,
    ort_session,
    quantized_dtype,
    read_bytes,
    read_onnx,
    resolve_threads,
)
from ptq_cli.cpu import EXACT, SATURATING
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import WRITE_FAILURES, atomic_output
from ptq_cli.transforms import overflow, ranges, rounding
from ptq_cli.transforms.graph import (
    computing_from,
    computing_only,
    float_scores,
    keep_float_layers,
    part_after,
    preprocess,
    private_activation_quantizers,
    private_weight_dequantizers,
    readers_up_to_quantizers,
    whole_map_average_pools,
    with_image_extremes,
)
from ptq_cli.transforms.space_to_depth import Rewrite, quantized_pads, space_to_depth_convs

NAME = "onnxruntime"
SUFFIX = ".onnx"
CALIBRATION_BATCH = 100
# Batches smaller than this per thread are run whole: splitting them costs more than it saves.
MIN_SHARD = 32
SEARCH_CHUNK_PIXELS = 1 << 20  # the range search runs its images this many pixels at a time (1,024 at 32x32)
SEARCH_FED_BYTES = 512 << 20  # the tensors the range search keeps to feed the part after a scale, at most; past it, whole runs




def _batch_session(path: Path, model, whole: bytes, described, exact_int8: bool):
    """(session, chunk, note): a fixed batch made symbolic where that computes the same (chunk 0), else the
    session tied to it and run `chunk` images at a time."""
    if described.batch is None:
        return ort_session(path, whole, exact_int8=exact_int8), 0, None
    freed = free_batch(path, model, described)
    if freed is not None:
        return ort_session(path, freed.SerializeToString(), exact_int8=exact_int8), 0, f"fixed batch {described.batch} made symbolic (same outputs)"
    images = f"{described.batch} image{'s' if described.batch > 1 else ''}"
    return ort_session(path, whole, exact_int8=exact_int8), described.batch, f"fixed batch {described.batch}: run {images} at a time"


def load(path: Path, options: RunOptions) -> LoadedModel:
    """One onnxruntime session for the model's whole life, run data-parallel over `threads` threads.

    Each run uses one intra-op thread and a large batch is split into one shard per thread, run
    concurrently on the same session (onnxruntime releases the GIL and allows concurrent runs): small
    convolutions split poorly inside one operator. A fixed batch dimension is made symbolic where that
    computes the same; otherwise the model runs on chunks of its fixed batch. `exact_int8` turns on
    onnxruntime's exact u8 x s8 kernels on a CPU without VNNI (which a default session does not use)."""
    path = Path(path)
    data = read_bytes(path)
    model = read_onnx(path, data)
    dtype, quantization = quantized_dtype(model)
    whole = data if model.ByteSize() == len(data) else model.SerializeToString()  # external weights read in
    threads, exact_int8 = resolve_threads(options.threads), options.exact_int8
    described, classes = describe_input(path, model, options.flags.size)
    session, chunk, note = _batch_session(path, model, whole, described, exact_int8)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="ptq-ort") if threads > 1 else None

    def run(batch: np.ndarray) -> np.ndarray:
        try:
            scores = session.run(None, {described.name: batch})[0]
        except Exception as error:  # onnxruntime's own exception types
            raise PtqError(f"{path}: onnxruntime failed to run it ({first_line(error)})") from error
        if scores.ndim > 2 and all(dim == 1 for dim in scores.shape[2:]):  # N x K x 1 x 1, a conv head's
            scores = scores.reshape(scores.shape[:2])
        return scores

    def run_fixed(batch: np.ndarray) -> np.ndarray:
        return in_fixed_batches(run, batch, chunk)

    def predict(batch: np.ndarray) -> np.ndarray:
        if chunk:
            if pool is None or len(batch) < 2 * chunk:
                return run_fixed(batch)[: len(batch)]
            count = len(batch)
            return np.concatenate(list(pool.map(run_fixed, np.array_split(batch, threads))))[:count]
        if pool is None or len(batch) < MIN_SHARD * threads:
            return run(batch)
        return np.concatenate(list(pool.map(run, np.array_split(batch, threads))))

    return finish_load(path, BACKEND, options, described=described, predict=predict, dtype=dtype, size_bytes=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), stored=metadata(model), declared_classes=classes, quantization=quantization, note=note)


def sniff(_head: bytes) -> bool:
    """Anything that is not another backend's file is tried as ONNX (which then says if it is not)."""
    return True


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
    from ptq_cli.guards import bounded

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
def _histograms(reader, chunked: bool, shared: dict | None = None):
    """onnxruntime's histogram calibrators (percentile, entropy), with threaded collectors, and over chunks
    the one-pass histograms, bin for bin; with `shared`, percentile histograms collected once for every percentile
    (`_replayed`), kept there once the calibration succeeded.

    They size each tensor's bins on the first chunk and extend them as later chunks reach further, so
    chunked calibration would find other ranges than one pass over the whole set (ResNet8's speed model:
    86.66% against 87.06%). Where ptq chunks, a MinMax pass over the same chunks first finds each tensor's
    largest magnitude, and the histogram collector starts from empty histograms over exactly the range one
    pass would have used: every chunk then adds its counts to the same bins."""
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
        ranges = real(model, op_types, augmented_model_path=str(Path(augmented_model_path).with_suffix(".minmax.onnx")),
                      calibrate_method=calibrate.CalibrationMethod.MinMax, **{**options, "extra_options": {}})
        for start in range(0, len(reader), reader.stride):
            reader.set_range(start, start + reader.stride)
            ranges.collect_data(reader)
        _empty_bins(collector, ranges.compute_data().data)
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


def _named(graph, nodes: list, prefix: str) -> list[str]:
    """The nodes' names, an unnamed one named here (`prefix`_index, unique in the graph) so that quantize_static
    can be told to leave it in float."""
    names = {node.name for node in graph.graph.node}
    for index, node in enumerate(nodes):
        if not node.name:
            node.name = f"{prefix}_{index}"
            while node.name in names:
                node.name += "_"
            names.add(node.name)
    return [node.name for node in nodes]


def stem_nodes(graph) -> list[str]:
    """The names of the stem's weighted nodes (`overflow.first_layers`) and of every node between the input and
    them, to be left in float. A float stem whose input came from a DequantizeLinear would not stay float:
    onnxruntime's optimizer quantizes the weights of a float Conv between a DequantizeLinear and a QuantizeLinear
    when it loads the model."""
    stem, before = overflow.walk_to_stem(graph)
    return _named(graph, [*stem, *before], "ptq_stem")


def output_softmax_nodes(graph) -> list[str]:
    """The Softmax / LogSoftmax nodes that give the graph's outputs, to be left in float, so the probabilities are
    not rounded to multiples of 1/255 (nothing runs after them to gain from int8)."""
    outputs = {value.name for value in graph.graph.output}
    found = [node for node in graph.graph.node if node.op_type in ("Softmax", "LogSoftmax") and outputs.intersection(node.output)]
    return _named(graph, found, "ptq_output_softmax")


def pooled_feature_nodes(graph) -> list[str]:
    """The average pools over a whole map (`whole_map_average_pools`), to be left in float: the layer that reads the
    pooled features then quantizes them on their own calibrated range, as after a GlobalAveragePool (which
    quantize_static leaves float), not on the scale of the map they average."""
    return _named(graph, whole_map_average_pools(graph), "ptq_pooled_features")


@dataclass(frozen=True)
class _Prepared:
    """What quantize_static takes, after onnxruntime's pre-processing and ptq's rewrites."""

    source: str  # the rewritten graph's path
    rewrites: list[Rewrite]  # space-to-depth
    overrides: dict | None  # the weight scales of the overflow fix
    float_nodes: list[str]  # the nodes left in float
    pools: list[str]  # of those, the average pools over a whole map


def _graph_to_quantize(model, settings: QuantizationSettings, workdir: Path) -> _Prepared:
    """onnxruntime's pre-processing, then ptq's rewrites, saved in `workdir` for quantize_static."""
    import onnx

    source = model
    if settings.preprocess:
        source = str(workdir / "preprocessed.onnx")
        preprocess(model, source)
    graph = onnx.load(source) if isinstance(source, str) else onnx.ModelProto.FromString(model.SerializeToString())
    float_nodes = list(settings.float_nodes)
    float_nodes += [name for name in output_softmax_nodes(graph) if name not in float_nodes]
    pools = [name for name in pooled_feature_nodes(graph) if name not in float_nodes]
    float_nodes += pools
    if settings.stem == "float":
        float_nodes += [name for name in stem_nodes(graph) if name not in float_nodes]
    missing = sorted(set(float_nodes) - {node.name for node in graph.graph.node})
    if missing:
        raise PtqError(f"{model.graph.name or 'model'}: no node named '{missing[0]}' to leave in float")
    rewrites: list[Rewrite] = []
    if _options(settings).space_to_depth:
        graph, rewrites = space_to_depth_convs(graph, skip=set(float_nodes))  # a float conv gains nothing
    source = str(workdir / "to_quantize.onnx")
    onnx.save(graph, source)
    return _Prepared(source, rewrites, _fix_overrides(graph, settings, float_nodes), float_nodes, pools)


def _fix_overrides(graph, settings: QuantizationSettings, float_nodes: list[str]) -> dict | None:
    """The weight scales of the settings' overflow fix (all-layers while it is judged), as TensorQuantOverrides."""
    fix = overflow.ALL_LAYERS if settings.overflow_fix == overflow.JUDGED else settings.overflow_fix
    if fix in overflow.OVERFLOW_FIXES and settings.weight_dtype == "int8":
        return overflow.weight_overrides(graph, fix, bool(settings.per_channel), set(float_nodes))
    return None


LEARNED, NEAREST = rounding.LEARNED, rounding.NEAREST


def _probe_session(model, threads: int, exact_kernels: bool = True):
    """A session for quantize's own measurements, on the exact kernels: the same codes on every CPU, VNNI or not.
    Where onnxruntime cannot build the exact session, the default kernels measure instead: the choices stay
    measured, on this CPU's kernels. Without `exact_kernels`: this CPU's own kernels."""
    import onnxruntime as ort

    if not exact_kernels:
        return ort.InferenceSession(model.SerializeToString(), _session_options(threads, exact=False), providers=["CPUExecutionProvider"])

    try:
        exact = private_weight_dequantizers(model).SerializeToString()
        return ort.InferenceSession(exact, _session_options(threads, exact=True), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  onnxruntime's own exception types
        return ort.InferenceSession(model.SerializeToString(), _session_options(threads, exact=False), providers=["CPUExecutionProvider"])


def _session_options(threads: int, exact: bool):
    import onnxruntime as ort

    chosen = ort.SessionOptions()
    if exact:
        chosen.add_session_config_entry(EXACT_PATH_CONFIG, "1")
    chosen.intra_op_num_threads = threads
    chosen.log_severity_level = 4
    chosen.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return chosen


def _tensor_batches(input_name: str, images: np.ndarray, threads: int, chunk: int = 16, exact_kernels: bool = True):
    """A `rounding.ActivationSource`: one named tensor of a model, over `images`, a chunk at a time (`_probe_session`'s kernels)."""
    import onnx

    def batches(model, name: str):
        cut = computing_only(model, name)  # a layer's input costs only the layers before it
        if cut is not None:
            session = _probe_session(cut, threads, exact_kernels)
        else:
            existing = [output.name for output in model.graph.output]
            if name not in existing:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            try:
                session = _probe_session(model, threads, exact_kernels)
            finally:
                if name not in existing:
                    model.graph.output.pop()
        for start in range(0, len(images), chunk):
            yield session.run([name], {input_name: images[start : start + chunk]})[0]

    return batches


HELD_ACTIVATIONS_BYTES = 256 << 20  # the quantized model's 8-bit activations one refinement keeps for the layers after, at most


def _layer_by_layer_batches(input_name: str, images: np.ndarray, threads: int, chunk: int = 16):
    """A `rounding.ActivationSource` for the quantized model under `rounding.refine`, which asks for its layers' inputs
    in graph order and changes a layer only after reading its input: a layer's input is computed from the 8-bit
    activations (QuantizeLinear outputs) that earlier layers' passes computed, which no later change alters, instead
    of a pass of every layer before it. An activation is let go once every node reading it has run, or, the least
    recently read first, past HELD_ACTIVATIONS_BYTES (a later pass then reaches further back). The same batches as
    `_tensor_batches`."""
    single = _tensor_batches(input_name, images, threads, chunk)
    held: dict[str, list[np.ndarray]] = {}
    ran: set[str] = set()  # the nodes (by first output) the passes ran

    def batches(model, name: str):
        part = computing_from(model, name, set(held))
        if part is None:
            yield from single(model, name)
            return
        cut, reads, made, leading = part
        for tensor in reads:
            if tensor in held:
                held[tensor] = held.pop(tensor)  # most recently read last
        session, computed = _probe_session(cut, threads), []
        for index, start in enumerate(range(0, len(images), chunk)):
            feeds = {tensor: images[start : start + chunk] if tensor == input_name else held[tensor][index] for tensor in reads}
            values = session.run([name, *made], feeds)
            computed.append(values[1:])
            yield values[0]
        ran.update(node.output[0] for node in cut.graph.node)
        ran.difference_update(leading)  # the layer reading `name` runs next, from where these start
        held.update({tensor: [values[position] for values in computed] for position, tensor in enumerate(made)})
        _let_go(held, ran, model)

    return batches


def _let_go(held: dict[str, list[np.ndarray]], ran: set[str], model) -> None:
    """Drop the held activations no later pass reads: those whose readers, and the readers of their float outputs up to
    the next QuantizeLinear outputs, have all run; then the least recently read past HELD_ACTIVATIONS_BYTES."""
    readers = readers_up_to_quantizers(model)
    for tensor in [tensor for tensor in held if all(node.output[0] in ran for node in readers(tensor).values())]:
        del held[tensor]
    while len(held) > 1 and sum(values.nbytes for batches in held.values() for values in batches) > HELD_ACTIVATIONS_BYTES:
        held.pop(next(iter(held)))


FLOAT_INPUTS_BYTES = 256 << 20  # the float model's layer inputs one pass collects for the layers after, at most


def _collected_batches(input_name: str, images: np.ndarray, threads: int, coming: list[str], chunk: int = 16):
    """A `rounding.ActivationSource` for the float model, which does not change under the refinement: asked for a
    layer's input, one pass also collects the inputs of the layers `coming` after it, as many as FLOAT_INPUTS_BYTES
    holds, instead of a pass of the layers before each one. The same batches as `_tensor_batches`."""
    single = _tensor_batches(input_name, images, threads, chunk)
    collected: dict[str, list[np.ndarray]] = {}

    def batches(model, name: str):
        if name not in collected:
            collected.clear()
            names = _fitting(model, name, coming[coming.index(name):] if name in coming else [name], input_name, images, threads)
            cut = computing_only(model, *names) if len(names) > 1 else None
            if cut is None:
                yield from single(model, name)
                return
            parts = _chunked_run(cut, names, input_name, images, threads, chunk)
            assert parts is not None  # no byte bound asked
            collected.update({tensor: [part[index] for part in parts] for index, tensor in enumerate(names)})
        yield from collected[name]

    return batches


def _fitting(model, name: str, wanted: list[str], input_name: str, images: np.ndarray, threads: int) -> list[str]:
    """`name` and the tensors after it in `wanted` whose values on all the images fit in FLOAT_INPUTS_BYTES (measured on one image)."""
    wanted = list(dict.fromkeys(wanted))
    cut = computing_only(model, *wanted) if len(wanted) > 1 else None
    if cut is None:
        return [name]
    sizes = [values.nbytes * len(images) for values in _probe_session(cut, threads).run(wanted, {input_name: images[:1]})]
    fitting: list[str] = []
    held = 0
    for tensor, size in zip(wanted, sizes, strict=True):
        if fitting and held + size > FLOAT_INPUTS_BYTES:
            break
        fitting.append(tensor)
        held += size
    return fitting


def _chunked_run(cut, names: list[str], input_name: str, images: np.ndarray, threads: int, chunk: int,
                max_bytes: int | None = None) -> list[list[np.ndarray]] | None:
    """The tensors `names` as the model `cut` computes them on `images`, a chunk at a time (per chunk, one array a name);
    None once they hold more than `max_bytes`."""
    session, parts, held = _probe_session(cut, threads), [], 0
    for start in range(0, len(images), chunk):
        parts.append(session.run(names, {input_name: images[start : start + chunk]}))
        held += sum(values.nbytes for values in parts[-1])
        if max_bytes is not None and held > max_bytes:
            return None
    return parts


def judged_output(model) -> str:
    """The tensor nearest and learned rounding are compared on: the scores before a final Softmax (its
    probabilities hide most of the difference in a few saturated images), else the first output."""
    output = model.graph.output[0].name
    producer = next((node for node in model.graph.node if output in node.output), None)
    return producer.input[0] if producer is not None and producer.op_type in ("Softmax", "LogSoftmax") else output


def judged_in(quantized, judged: str) -> str:
    """The tensor of the quantized model compared with the float model's `judged` one: the same name where the quantized
    graph computes it, else its first output."""
    return judged if judged in {output for node in quantized.graph.node for output in node.output} else quantized.graph.output[0].name


def _outputs(model, name: str, input_name: str, images: np.ndarray, threads: int, chunk: int = 16, exact_kernels: bool = True) -> np.ndarray:
    return np.concatenate(list(_tensor_batches(input_name, images, threads, chunk, exact_kernels)(model, name)))


def _float_memo(float_model, images: np.ndarray) -> rounding.FloatMemo:
    """Within one run (base.computed_once), the float model's sums of a layer's input rows, shared by the refinements
    of every quantized model made from the same float model and images: `--method auto`'s MinMax model, the model
    for VNNI CPUs that measures portability, and `ptq run`'s other 8-bit models."""
    @cache
    def prefix() -> bytes:
        return base.digest(float_model.SerializeToString(), repr((images.shape, str(images.dtype))).encode(), np.ascontiguousarray(images).tobytes()).encode()

    def memo(key: tuple, compute):
        return base.computed_once(lambda: base.digest(b"float rows", prefix(), repr(key).encode()), compute,
                                  size=lambda value: 0 if value[0] is None else value[0].nbytes)

    return memo


def _quantized_source(layers: list[rounding.Layer]):
    """How the refinement reads the quantized model's layer inputs: layer by layer, unless a layer shares its codes or
    bias with an earlier one (changing it changes that one too), where each input is computed from the image."""
    biases = [layer.bias_codes for layer in layers if layer.bias_codes]
    shared = len({layer.codes for layer in layers}) < len(layers) or len(set(biases)) < len(biases)
    return _tensor_batches if shared else _layer_by_layer_batches


def refine_rounding(quantized, float_path: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings,
                    progress: ProgressCallback | None = None) -> tuple[Any, QuantizationSettings, list[str]]:
    """(model, settings with the rounding decided, notes): learned codes and corrected biases where they bring
    the output closer to FP32 than nearest rounding on held-out calibration images (or where asked)."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if settings.rounding == LEARNED or len(held_out) == 0:
        rest = calibration  # nothing to judge with, or nothing to judge: every image refines
    count = rounding_image_count(image_pixels(calibration))
    refining = rest[np.linspace(0, len(rest) - 1, min(count, len(rest))).astype(int)] if len(rest) else rest
    threads = resolve_threads(None)
    float_model = onnx.load(float_path)
    nearest_model = onnx.ModelProto.FromString(quantized.SerializeToString())

    def refine(model, own_error: bool = False):
        found = rounding.find_layers(model)
        return rounding.refine(model, float_model, _quantized_source(found)(input_name, refining, threads),
                               _collected_batches(input_name, refining, threads, [layer.float_input for layer in found]), len(refining),
                               progress=progress, float_memo=_float_memo(float_model, refining), own_error=own_error)
    try:
        refined, layers = refine(quantized)
    except Exception as error:  # noqa: BLE001  onnxruntime's and numpy's own errors: the user keeps the nearest-rounded model
        return nearest_model, replace(settings, rounding=NEAREST), [f"learned rounding: not applied ({first_line(error)}); weights rounded to nearest"]
    changed = sum(layer.codes_changed for layer in layers)
    notes = [f"learned rounding: {len(layers)} layers, {changed:,} of {sum(layer.codes for layer in layers):,} weight codes moved off nearest, "
             f"{sum(layer.bias_corrected for layer in layers)} biases corrected, from {len(refining)} calibration images"]
    stepped = sum(layer.codes_stepped_back for layer in layers)
    if stepped:
        notes.append(f"learned rounding: {stepped:,} codes stepped back towards zero to follow the pair rule")
    if settings.rounding == LEARNED or len(held_out) == 0:
        return refined, replace(settings, rounding=LEARNED), notes
    judged = judged_output(float_model)
    reference = _outputs(float_model, judged, input_name, held_out, threads)
    quantized_judged = judged_in(refined, judged)
    nearest_db = image_sqnr_db(reference, _outputs(nearest_model, quantized_judged, input_name, held_out, threads))
    learned_db = image_sqnr_db(reference, _outputs(refined, quantized_judged, input_name, held_out, threads))
    if learned_db <= nearest_db:  # the biases matched FP32's means past what the codes cost: each takes up its own layer's error
        with contextlib.suppress(Exception):  # onnxruntime's and numpy's own errors: the first pass's figures stand
            refined = refine(onnx.ModelProto.FromString(nearest_model.SerializeToString()), own_error=True)[0]
            learned_db = image_sqnr_db(reference, _outputs(refined, quantized_judged, input_name, held_out, threads))
            notes.append("learned rounding: each bias corrected for its own layer's codes only (matching FP32's means measured worse than nearest)")
    choice = LEARNED if learned_db > nearest_db else NEAREST
    measured = replace(settings, rounding=choice, rounding_nearest_db=sqnr_figure(nearest_db), rounding_learned_db=sqnr_figure(learned_db))
    verdict = f"image SQNR on {len(held_out)} held-out calibration images: {nearest_db:.2f} dB nearest, {learned_db:.2f} dB learned; kept {choice}"
    return (refined if choice == LEARNED else nearest_model), measured, [*notes, f"learned rounding: {verdict}"]


@contextlib.contextmanager
def _library_warnings(into: list[str]):
    """onnxruntime.quantization's warnings (logging.warning on the root logger), kept for the result's notes
    rather than printed among ptq's output."""

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())

    root, handler = logging.getLogger(), Keep(logging.WARNING)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def _warning_notes(warnings: list[str]) -> list[str]:
    clipped = [line for line in warnings if "exceeds the range of a int32" in line]
    notes = [f"onnxruntime clipped the int32 biases of {len(clipped)} layer{'s' if len(clipped) > 1 else ''}: their scale "
             "(input scale x weight scale) is too small for them"] if clipped else []
    return notes + [f"onnxruntime: {line}" for line in dict.fromkeys(warnings) if line not in clipped][:3]


QUANT_TYPES = {"int8": "QInt8", "uint8": "QUInt8"}
CALIBRATION_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", PER_IMAGE: "MinMax"}


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
        extremes = _image_extremes(source, images, input_name, fixed_batch)
        if shared is not None:
            shared[key] = extremes
    activations, found = extremes
    ranges = [per_image_range(found[2 * index], found[2 * index + 1], percentile) for index in range(len(activations))]
    return {name: [{"rmin": np.float32(low), "rmax": np.float32(high)}] for name, (low, high) in zip(activations, ranges, strict=True)}


def _image_extremes(source: str, images: np.ndarray, input_name: str, fixed_batch: int | None) -> tuple[list[str], list[np.ndarray]]:
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


def _quantize_static(source: str, target: Path, images: np.ndarray, input_name: str, fixed_batch: int | None, settings: QuantizationSettings,  # noqa: PLR0913,PLR0917  quantize_static's own arguments, passed through
                     float_nodes: list[str], overrides: dict | None, output: Path, model_name: str, progress: ProgressCallback | None,
                     histograms: dict | None = None) -> list[str]:
    """onnxruntime's quantize_static (QDQ) of `source` into `target`, calibrated on `images` with the settings'
    method; returns the library's warnings. Calibration is chunked to the memory budget. `histograms`: percentile
    histograms and per-image extremes shared by the calls of one scope (the same source and images; see `_histograms`)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    extra_options: dict[str, object] = {"CalibPercentile": settings.percentile} if settings.method == "percentile" else {}
    if overrides:
        extra_options["TensorQuantOverrides"] = overrides
    fitting = calibration_chunk(source, images, fixed_batch, model_name)
    reader = _reader(input_name, images, fixed_batch, progress)
    _in_chunks(reader, fitting, extra_options)
    cached_ranges = _calibration_cache(source, images, settings, extra_options)
    # quantize_static print()s its histogram progress; stdout belongs to ptq's own output (--json).
    warnings: list[str] = []
    with contextlib.redirect_stdout(io.StringIO()), _histograms(reader, "CalibStridedMinMax" in extra_options, histograms), _library_warnings(warnings):
        try:
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
                nodes_to_exclude=float_nodes,
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


def _calibration_cache(source: str, images: np.ndarray, settings: QuantizationSettings, extra_options: dict) -> Path | None:
    """Within one run (base.reused_file), onnxruntime's calibration cache for these ranges: what its calibrator
    computed from the same float model, images and calibration options, loaded instead of collected again (`--method
    auto`'s candidates, the overflow fix's judge and the model for VNNI CPUs calibrate alike; per-image ranges start
    from MinMax's). Weights, overrides and excluded nodes play no part in calibration."""
    options = {name: value for name, value in extra_options.items() if name.startswith("Calib")}
    method = CALIBRATION_METHODS[settings.method]
    return base.reused_file(lambda: base.digest(b"calibration", Path(source).read_bytes(), np.ascontiguousarray(images).reshape(-1).view(np.uint8).data,
                                                repr((images.shape, str(images.dtype), method, sorted(options.items()))).encode()), ".json")


def choose_method(source: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings, float_nodes: list[str],  # noqa: PLR0913,PLR0917  quantize_static's own arguments, passed through
                  overrides: dict | None, finish, workdir: Path, output: Path, model_name: str,
                  progress: ProgressCallback | None) -> tuple[QuantizationSettings, list[str]]:
    """(settings with the activation ranges chosen, notes): each METHOD_CANDIDATES range calibrated on 3/4 of the
    calibration images, nearest-rounded, and judged by the image SQNR against FP32 on the other 1/4 (the
    scores before a final Softmax); `chosen_method` keeps one (MinMax unless a percentile measures better by a
    margin). A candidate onnxruntime cannot calibrate scores nothing. `finish` applies ptq's edits to a quantized graph."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if len(held_out) == 0 or len(rest) == 0:
        first = METHOD_CANDIDATES[0][0]
        return replace(settings, method=first, percentile=None), [f"method auto: {first} (too few calibration images to compare ranges)"]
    threads = resolve_threads(None)
    float_model = onnx.load(source)
    judged = judged_output(float_model)
    reference = _outputs(float_model, judged, input_name, held_out, threads)
    scores: list[tuple[str, float | None, float | None]] = []
    histograms: dict = {}  # the percentiles read off one collection of histograms
    for index, (method, percentile) in enumerate(METHOD_CANDIDATES):
        candidate = replace(settings, method=method, percentile=percentile)
        step = (lambda done, _total, index=index: progress(index * len(rest) + done, len(METHOD_CANDIDATES) * len(rest))) if progress else None
        try:
            quantized = _calibrated_model(source, rest, input_name, candidate, float_nodes, overrides, finish, workdir, output, model_name, step,
                                          histograms)
        except PtqError:
            if index == 0:
                raise  # MinMax itself: the model cannot be calibrated, said in onnxruntime's words
            scores.append((method, percentile, None))
            continue
        name = judged_in(quantized, judged)
        scores.append((method, percentile, sqnr_figure(image_sqnr_db(reference, _outputs(quantized, name, input_name, held_out, threads)))))
    method, percentile = chosen_method(tuple(scores))
    return replace(settings, method=method, percentile=percentile, method_sqnr_db=tuple(scores)), []


def _judged_choices(source: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings, float_nodes: list[str],  # noqa: PLR0913,PLR0917  quantize's state
                    overrides: dict | None, finish, files: tuple[Path, Path, str], fixed_batch: int | None,
                    progress: ProgressCallback | None) -> tuple[QuantizationSettings, dict | None, list[str], int]:
    """`--method auto`, then a judged overflow fix, on held-out calibration images (not where the graph is tied to a
    fixed batch): (settings, the overrides of the fix kept, notes, images shown on the progress bar). `files`: the
    working folder, the output and the model's name."""
    workdir, output, model_name = files
    notes: list[str] = []
    done = 0  # images already shown on the progress bar, before this phase
    if settings.method == AUTO_METHOD:
        if fixed_batch is not None:
            settings = replace(settings, method=METHOD_CANDIDATES[0][0])
            notes.append(f"method auto: {METHOD_CANDIDATES[0][0]} (the graph is tied to its fixed batch of {fixed_batch})")
        else:
            settings, chosen = choose_method(source, calibration, input_name, settings, float_nodes, overrides, finish, workdir, output, model_name,
                                             progress)
            notes += chosen
            done = len(METHOD_CANDIDATES) * len(held_out_split(calibration)[1])
    if settings.overflow_fix == overflow.JUDGED:
        settings, overrides, judged = _judge_overflow_fix(source, calibration, input_name, settings, float_nodes, overrides, finish, files,
                                                          fixed_batch)
        notes += judged
    return settings, overrides, notes, done


def _judge_overflow_fix(source: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings, float_nodes: list[str],  # noqa: PLR0913,PLR0917  quantize's state
                        all_layers: dict | None, finish, files: tuple[Path, Path, str],
                        fixed_batch: int | None) -> tuple[QuantizationSettings, dict | None, list[str]]:
    """all-layers (proven: the model cannot saturate) against first-layer (measured: it can elsewhere), each
    calibrated with the method kept on 3/4 of the calibration images and judged, nearest-rounded, by the image SQNR on
    the other 1/4; first-layer on both x86 paths where this machine runs the saturating one at native speed, by the
    worse; all-layers kept unless first-layer is METHOD_MARGIN_DB closer. (settings, its overrides, notes)."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    float_model = onnx.load(source)
    first_layer = _fix_overrides(float_model, replace(settings, overflow_fix=overflow.FIRST_LAYER), float_nodes)
    held_out, rest = held_out_split(calibration)
    if fixed_batch is not None or len(held_out) == 0 or len(rest) == 0:
        return replace(settings, overflow_fix=overflow.FIRST_LAYER), first_layer, [f"overflow fix: {overflow.FIRST_LAYER} (not judged: too few "
                                                                                 "calibration images, or a graph tied to its fixed batch)"]
    threads = resolve_threads(None)
    judged = judged_output(float_model)
    reference = _outputs(float_model, judged, input_name, held_out, threads)

    def score(overrides: dict | None) -> tuple[float | None, Any]:
        quantized = _calibrated_model(source, rest, input_name, settings, float_nodes, overrides, finish, *files)
        return sqnr_figure(image_sqnr_db(reference, _outputs(quantized, judged_in(quantized, judged), input_name, held_out, threads))), quantized

    kept_method = [db for method, percentile, db in settings.method_sqnr_db if (method, percentile) == (settings.method, settings.percentile)]
    all_db = kept_method[0] if kept_method else score(all_layers)[0]
    first_db, first_model = score(first_layer)
    saturating, notes = _saturating_figure(first_model, judged_in(first_model, judged), input_name, held_out, threads, files[0], reference)
    figures = ((overflow.ALL_LAYERS, all_db), (overflow.FIRST_LAYER, first_db), *saturating)
    worst_first = min((db for _, db in figures[1:]), key=lambda db: np.inf if db is None else db) if first_db is not None else None
    keep_first = closer_by_margin(worst_first, all_db)
    settings = replace(settings, overflow_fix=overflow.FIRST_LAYER if keep_first else overflow.ALL_LAYERS, overflow_fix_db=figures)
    return settings, first_layer if keep_first else all_layers, notes  # the figures: the CPUs' description (quant_settings.describe_cpus)


SATURATING_FIRST_LAYER = f"{overflow.FIRST_LAYER} on the saturating path"


def _saturating_figure(model, name: str, input_name: str, images: np.ndarray, threads: int, workdir: Path,  # noqa: PLR0913,PLR0917  the judge's state
                       reference: np.ndarray) -> tuple[tuple[tuple[str, float | None], ...], list[str]]:
    """The first-layer model's image SQNR on the saturating x86 path, as an overflow fix's figure ((), where it
    provably computes the same on both paths), and a note where this machine does not reach that path at native speed."""
    from ptq_cli.metrics import image_sqnr_db

    if overflow.saturation_proof(model)[0]:
        return (), []
    outputs = _saturating_outputs(model, name, input_name, images, threads, workdir)
    if outputs is None:
        return (), ["overflow fix: judged on the exact int8 path only (this machine does not run the saturating path natively for this "
                    "model; under emulation it is too slow for a judge)"]
    return ((SATURATING_FIRST_LAYER, sqnr_figure(image_sqnr_db(reference, outputs))),), []


def _saturating_outputs(model, name: str, input_name: str, images: np.ndarray, threads: int, workdir: Path) -> np.ndarray | None:
    """The tensor `name` on the saturating x86 int8 path: this CPU's own kernels where they saturate, else onnxruntime's
    AVX2 kernels where this machine runs them natively (base.saturating_outputs); None where neither can."""
    import onnx

    if cpu_info.current().int8_path == SATURATING:
        return _outputs(model, name, input_name, images, threads, exact_kernels=False)
    cut = computing_only(model, name)
    if cut is None:
        return None
    typed = copy.deepcopy(model.graph.output[0])  # for the loader's checker: the scores a final Softmax reads have its type
    typed.name = name
    del cut.graph.output[:]
    cut.graph.output.append(typed)
    path = workdir / "saturating-judge.onnx"
    onnx.save(cut, str(path))
    try:
        return base.saturating_outputs(path, images, threads)
    finally:
        path.unlink(missing_ok=True)


def _calibrated_model(source: str, images: np.ndarray, input_name: str, settings: QuantizationSettings, float_nodes: list[str],  # noqa: PLR0913,PLR0917  quantize_static's own arguments, passed through
                      overrides: dict | None, finish, workdir: Path, output: Path, model_name: str, progress: ProgressCallback | None = None,
                      histograms: dict | None = None):
    """The model quantize_static makes with these settings' ranges, calibrated on `images`, with ptq's edits (`finish`),
    nearest-rounded: a candidate `--method auto` judges."""
    import onnx

    target = workdir / "candidate.onnx"
    _quantize_static(source, target, images, input_name, None, settings, float_nodes, overrides, output, model_name, progress, histograms)
    quantized = onnx.load(str(target))
    finish(quantized)
    target.unlink()
    return quantized


class _PartScores:
    """`ranges.search`'s score: the output's image SQNR (metrics.image_sqnr_db) against `reference` on `images`, from
    a run of only the part of the model that depends on the moved scale (transforms/graph.py, part_after), fed the tensors the rest of the model
    computes, once a scale (they do not depend on it). The whole model where there is no such part, or its tensors would
    take more than SEARCH_FED_BYTES. The part's scores differ from the whole model's by float rounding alone (a
    convolution onnxruntime runs in float in one and on integers in the other); what the search keeps is measured on
    the whole model."""

    def __init__(self, output: str, input_name: str, images: np.ndarray, threads: int, chunk: int, reference: np.ndarray) -> None:
        self._output, self._input_name, self._images, self._threads, self._chunk = output, input_name, images, threads, chunk
        self._reference = reference
        self._fed_for: str | None = None
        self._fed: dict[str, np.ndarray] | None = None

    def __call__(self, model, moved: str | None) -> float:
        from ptq_cli.metrics import image_sqnr_db

        part = None if moved is None else part_after(model, moved, self._output)
        if part is not None and moved != self._fed_for:
            self._fed, self._fed_for = self._feeds(model, part[1]), moved
        if part is not None and self._fed is not None:
            try:
                session, fed = _probe_session(part[0], self._threads), self._fed
                scores = [session.run([self._output], {name: values[start : start + self._chunk] for name, values in fed.items()})[0]
                          for start in range(0, len(self._images), self._chunk)]
                return image_sqnr_db(self._reference, np.concatenate(scores))
            except Exception:  # noqa: BLE001  onnxruntime's own errors on the part alone: this scale's candidates run whole
                self._fed = None
        return image_sqnr_db(self._reference, _outputs(model, self._output, self._input_name, self._images, self._threads, self._chunk))

    def _feeds(self, model, reads: list[str]) -> dict[str, np.ndarray] | None:
        """The tensors the part reads, over all the images; None past SEARCH_FED_BYTES or where the rest cannot be cut out."""
        made = [name for name in reads if name != self._input_name]
        fed = {self._input_name: self._images} if self._input_name in reads else {}
        if not made:
            return fed
        before = computing_only(model, *made)
        parts = None if before is None else _chunked_run(before, made, self._input_name, self._images, self._threads, self._chunk, SEARCH_FED_BYTES)
        if parts is None:
            return None
        return fed | {name: np.concatenate([part[index] for part in parts]) for index, name in enumerate(made)}


def search_ranges(quantized, float_path: str, calibration: np.ndarray, input_name: str, settings: QuantizationSettings,
                  progress: ProgressCallback | None = None) -> tuple[Any, QuantizationSettings, list[str]]:
    """(model, settings with `ranges` decided, notes): every activation scale searched (transforms/ranges.py) on
    the images learned rounding reads, kept where that brings the output closer to FP32 on held-out calibration
    images by METHOD_MARGIN_DB."""
    import onnx

    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = held_out_split(calibration)
    if len(held_out) == 0 or len(rest) == 0:
        return quantized, settings, []
    pixels = image_pixels(calibration)
    searching = rest[np.linspace(0, len(rest) - 1, min(rounding_image_count(pixels), len(rest))).astype(int)]
    runs, needed = max(1, RANGE_SEARCH_PIXELS // (pixels * len(searching))), len(ranges.activation_scales(quantized)) * len(ranges.FACTORS) + 1
    if needed > runs:  # a sweep cut short would search the first layers only: none at all, and said
        return quantized, settings, [f"range search: not run (one sweep over its activation scales takes {needed} runs of {len(searching)} "
                                     f"calibration images, over the budget of {runs})"]
    threads = resolve_threads(None)
    float_model = onnx.load(float_path)
    judged = judged_output(float_model)
    name = judged_in(quantized, judged)
    reference, held_reference = (_outputs(float_model, judged, input_name, images, threads) for images in (searching, held_out))
    calibrated = onnx.ModelProto.FromString(quantized.SerializeToString())
    try:
        chunk = max(16, SEARCH_CHUNK_PIXELS // pixels)  # small images in few runs: the search calls the model hundreds of times
        searched, result = ranges.search(quantized, _PartScores(name, input_name, searching, threads, chunk, reference), runs, progress)
    except Exception as error:  # noqa: BLE001  onnxruntime's own errors: the user keeps the calibrated ranges
        return calibrated, settings, [f"range search: not applied ({first_line(error)})"]
    before, after = (image_sqnr_db(held_reference, _outputs(model, name, input_name, held_out, threads)) for model in (calibrated, searched))
    choice = "searched" if closer_by_margin(after, before) else "calibrated"
    measured = replace(settings, ranges=choice, ranges_calibrated_db=sqnr_figure(before), ranges_searched_db=sqnr_figure(after))
    note = (f"range search: {result.moved} of {result.scales} activation scales moved ({result.searched} searched, {result.evaluations} runs "
            f"of {len(searching)} calibration images); image SQNR on {len(held_out)} held-out images {before:.2f} dB calibrated, "
            f"{after:.2f} dB searched; kept {choice}")
    return (searched if choice == "searched" else calibrated), measured, [note]


def _finish(quantized, rewrites: list, float_nodes) -> int:
    """ptq's edits to what quantize_static wrote; how many roundings of the output scores were removed."""
    if rewrites:
        quantized_pads(quantized)
    keep_float_layers(quantized, float_nodes)
    return float_scores(quantized)


def _private_int8_pairs(quantized) -> list[str]:
    added = private_activation_quantizers(quantized)
    return [f"int8 activations read by several layers: {added} QuantizeLinear/DequantizeLinear pair(s) added, one per reader, the same "
            "arithmetic (onnxruntime on x86 runs a layer on integer kernels only where its int8 input's pair has one reader)"] if added else []


def _after(progress: ProgressCallback | None, done: int) -> ProgressCallback | None:
    """The progress of a phase, shown after the `done` steps of the phases before it on the same bar."""
    return (lambda steps, total: progress(done + steps, done + total)) if progress else None


def _refined(quantized, source, calibration: np.ndarray, input_name: str, settings: QuantizationSettings,  # noqa: PLR0913,PLR0917  the refinements' arguments, the fixed batch that rules them out, and the bar
             fixed_batch: int | None, search: bool, progress: ProgressCallback | None,
             minmax_model: Callable[..., Any] | None = None) -> tuple[Any, QuantizationSettings, list[str]]:
    """The quantized model after ptq's refinements on the calibration images: learned rounding, then the activation
    ranges searched (`search`: `--method auto`); each kept where it measures closer to FP32 on held-out images.
    `minmax_model(settings=...)`, where `--method auto` kept a percentile: the model calibrated with MinMax instead, to be rounded too."""
    notes: list[str] = []
    if fixed_batch is not None:
        if settings.rounding != NEAREST:
            settings, notes = replace(settings, rounding=NEAREST), [f"learned rounding: not applied (the graph is tied to its fixed batch of {fixed_batch})"]
        return quantized, settings, notes
    done = 0
    if settings.rounding != NEAREST:
        asked = settings
        quantized, settings, notes = refine_rounding(quantized, source, calibration, input_name, settings, progress)
        done = len(rounding.find_layers(quantized))
        if minmax_model is not None and _kept_rounding_db(settings) is not None:
            minmax = replace(asked, method=METHOD_CANDIDATES[0][0], percentile=None)
            rounded = refine_rounding(minmax_model(settings=minmax), source, calibration, input_name, minmax, _after(progress, done))
            quantized, settings, notes = _rounded_method((quantized, settings, notes), rounded)
            done *= 2
    if search:  # after the rounding: what the weights no longer cost, the ranges can still win back
        quantized, settings, searched_notes = search_ranges(quantized, source, calibration, input_name, settings, _after(progress, done))
        notes += searched_notes
    return quantized, settings, notes


def _kept_rounding_db(settings: QuantizationSettings) -> float | None:
    """The held-out SQNR of the rounding `refine_rounding` kept, where it compared the two."""
    return settings.rounding_learned_db if settings.rounding == LEARNED else settings.rounding_nearest_db


def _rounded_method(percentile: tuple[Any, QuantizationSettings, list[str]], minmax: tuple[Any, QuantizationSettings, list[str]]
                    ) -> tuple[Any, QuantizationSettings, list[str]]:
    """Of the percentile `--method auto` kept on nearest-rounded models and MinMax, both after learned rounding: the
    percentile where it still measures better by METHOD_MARGIN_DB on the held-out images, else MinMax. Nearest rounding's
    error can hide what a clipped range costs once the weights are rounded well."""
    (_, chosen, _), (_, other, _) = percentile, minmax
    chosen_db, other_db = _kept_rounding_db(chosen), _kept_rounding_db(other)
    kept = percentile if other_db is None or (chosen_db is not None and chosen_db >= other_db + METHOD_MARGIN_DB) else minmax
    measured = ((chosen.method, chosen.percentile, chosen_db), (other.method, None, other_db))
    model, settings, notes = kept

    def label(made: QuantizationSettings) -> str:
        return f"{made.method} {made.percentile:g}" if made.percentile is not None else made.method

    def figure(db: float | None) -> str:
        return "-" if db is None else f"{db:.2f}"

    note = (f"method auto: after weight rounding, image SQNR on held-out calibration images {label(chosen)} {figure(chosen_db)} dB, "
            f"{label(other)} {figure(other_db)} dB; kept {label(kept[1])}")
    return model, replace(settings, method_sqnr_db=chosen.method_sqnr_db, method_rounded_db=measured), [*notes, note]


def _stored_props(settings: QuantizationSettings, rewrites, stored: dict[str, str], source) -> dict[str, str]:
    """The quantized model's metadata: its settings and rewrites, what the caller keeps in it, and the source's pruning."""
    described_settings = {**settings.as_dict(), "space_to_depth_convs": [asdict(rewrite) for rewrite in rewrites]}
    extra = bounded.json_loads(stored.pop(base.QUANTIZATION_METADATA_KEY, "{}"))
    props = {base.QUANTIZATION_METADATA_KEY: json.dumps({**described_settings, **extra}), **stored}
    props.update({key: value for key, value in metadata(source).items() if key == base.PRUNING_METADATA_KEY})  # a pruned source stays described
    return props


def quantize(model, output: Path, settings: QuantizationSettings, calibration: np.ndarray, stored: dict[str, str],
             progress: ProgressCallback | None = None) -> QuantizedFile:
    """onnxruntime.quantization.quantize_static in QDQ format, written atomically.

    `calibration` is the calibration images in the model's input format; `stored` is metadata to keep
    in the model (settings, input contract, source sha256, tune's validation scores). Within `ptq run`, a
    model already made from the same inputs is written again rather than made again (base.made_once)."""
    return base.made_once(lambda: base.digest(model.SerializeToString(), repr((calibration.shape, str(calibration.dtype))).encode(),
                                              np.ascontiguousarray(calibration).tobytes(), repr(settings).encode(), repr(sorted(stored.items())).encode()),
                          Path(output), lambda: _quantize(model, output, settings, calibration, stored, progress))


def _quantize(model, output: Path, settings: QuantizationSettings, calibration: np.ndarray, stored: dict[str, str],
              progress: ProgressCallback | None = None) -> QuantizedFile:
    import onnx

    described, _ = describe_input(Path(model.graph.name or "model"), model)
    model_name = model.graph.name or "model"
    notes: list[str] = []
    fixed_batch = described.batch
    freed = free_batch(Path(model_name), model, described) if described.batch is not None else None
    if freed is not None:
        model, fixed_batch = freed, None
        notes.append(f"fixed batch {described.batch} made symbolic in the quantized model (same outputs)")

    with tempfile.TemporaryDirectory(prefix="ptq-quantize-") as workdir:
        prepared = _graph_to_quantize(model, settings, Path(workdir))
        source, rewrites, overrides, float_nodes = prepared.source, prepared.rewrites, prepared.overrides, prepared.float_nodes
        notes += base.pools_in_float_note(prepared.pools, "onnxruntime")
        finish = partial(_finish, rewrites=rewrites, float_nodes=float_nodes)
        search = settings.method == AUTO_METHOD
        settings, overrides, chosen, done = _judged_choices(source, calibration, described.name, settings, float_nodes, overrides, finish,
                                                            (Path(workdir), output, model_name), fixed_batch, progress)
        notes += chosen
        with atomic_output(output) as tmp:
            warnings = _quantize_static(source, tmp, calibration, described.name, fixed_batch, settings, float_nodes, overrides, output, model_name,
                                        _after(progress, done))
            quantized = onnx.load(str(tmp))
            if finish(quantized):
                notes.append("output scores: left in float after the last weighted layer (computed from 8-bit inputs and weights, not rounded again)")
            # The same bar goes on: past the calibration images, one step per refined layer, then per run of the range search.
            minmax_model = partial(_calibrated_model, source, calibration, described.name, float_nodes=float_nodes, overrides=overrides, finish=finish,
                                   workdir=Path(workdir), output=output, model_name=model_name) if search and settings.percentile is not None else None
            quantized, settings, refined_notes = _refined(quantized, source, calibration, described.name, settings, fixed_batch, search,
                                                          _after(progress, done + len(calibration)), minmax_model)
            notes += refined_notes + _private_int8_pairs(quantized)
            onnx.helper.set_model_props(quantized, _stored_props(settings, rewrites, stored, model))
            onnx.save(quantized, str(tmp))
            return QuantizedFile(tmp.stat().st_size, tuple(rewrites), tuple(notes + _warning_notes(warnings)), settings)


@dataclass(frozen=True)
class Options(base.BackendOptions):
    panel: ClassVar[str] = "onnxruntime (--backend onnxruntime)"
    word: ClassVar[str] = "an onnxruntime option"

    space_to_depth: bool | None = base.option(
        None, "--space-to-depth/--no-space-to-depth", cli=bool,
        help="Regroup convolutions the fast x86 int8 kernel handles poorly (input channels not a multiple of 4, like the RGB stem; fewer than 32 "
             "output channels) over blocks of pixels along the width; same products, more zeros in the file. (default: on for uint8 activations "
             "with int8 weights, where that kernel runs)")

    def settle(self, common: base.CommonChoices) -> tuple[Options, base.CommonChoices]:
        settled = self
        if self.space_to_depth is None:  # on where it speeds the model up: uint8 activations x int8 weights
            settled = replace(self, space_to_depth=(common.dtype, common.weight_dtype) == ("uint8", "int8"))
        if common.weight_dtype == "uint8":
            common = replace(common, overflow_fix=overflow.NO_FIX)  # u8 x u8 runs on a kernel that widens to 16 bits first: nothing to fix
        return settled, common


def _options(settings: QuantizationSettings) -> Options:
    return settings.options if isinstance(settings.options, Options) else Options(space_to_depth=False)


def _output_name(stem: str, settings: QuantizationSettings) -> str:
    return f"{stem}_{settings.dtype}{'_' + settings.target if settings.target else ''}{SUFFIX}"


def _int8_basis(path: Path, _settings: dict | None, int8_path: str) -> str:
    """The exact path through the session option; the saturating one proven equal, or emulated."""
    if int8_path == EXACT:
        return f"onnxruntime {EXACT_PATH_CONFIG}=1"
    proven, why = overflow.saturation_proof(read_onnx(path))
    return f"proof ({why}): same as the exact path" if proven else EMULATE


def read_input(path: Path, size: tuple[int, int] | None = None) -> inputs.ModelInput:
    return describe_input(path, read_onnx(path), size)[0]


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format="QDQ", catch_all=True, read_input=read_input, summary="quantize_static, QDQ",
    quantizer=Quantizer(
        quantize,
        # The seed study's per-tensor default, its activation ranges chosen by measurement (choose_method).
        # Entropy is not tuned: quantize_static does not pass a histogram size to it, and with its default 128 bins
        # equal to its 128 quantized bins the KL search has a single candidate, the full range (the MinMax model).
        methods=(AUTO_METHOD, "minmax", "entropy", "percentile", PER_IMAGE), tune_methods=("minmax", "percentile"), per_channel=False,
        overflow_fixes=(overflow.FIRST_LAYER, overflow.ALL_LAYERS), clamped_overflow_fix=overflow.ALL_LAYERS, judges_overflow_fix=True, options=Options,
        output_name=_output_name,
        # onnxruntime's x86 int8 kernels (VNNI) multiply unsigned activations by signed weights; int8 x int8
        # and uint8 x uint8 fall back to slower paths. Per-channel weights keep the accuracy.
        speed_target={"dtype": "uint8", "weight_dtype": "int8", "per_channel": True},
        speed_by_default=True,
        learned_rounding=True,  # refine_rounding: GPTQ codes and bias correction on the QDQ model
    ),
    runtime=Runtime(load, settings="CPUExecutionProvider, 1 intra-op thread per run, allow_spinning 0, one shard per thread"),
    # Its exact u8 x s8 kernels have a session switch: the other path is always reached.
    int8_paths=Int8Paths(reaches=lambda _overflow_fix, _int8_path: True, basis=_int8_basis),
)
