"""ONNX Runtime: load and run ONNX models, quantize them with onnxruntime.quantization (QDQ)."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends.base import (
    CONVERT,
    FLOAT_KERNEL,
    INT8_KERNEL,
    LAYOUT,
    Backend,
    LoadedModel,
    OpTime,
    Quantizer,
    RunOptions,
    Runtime,
    RuntimeProfile,
    finish_load,
)
from ptq_cli.errors import PtqError, first_line
from ptq_cli.model_file import (
    EXACT_PATH_CONFIG,
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
from ptq_cli.quantize import overflow, qdq
from ptq_cli.quantize.placement import ONNXRUNTIME_X86, Options
from ptq_cli.quantize.settings import (
    QuantizationSettings,
)
from ptq_cli.x86 import paths as int8_paths

NAME, SUFFIX = qdq.WRITER, qdq.SUFFIX  # the engine's QDQ models are this runtime's
# Batches smaller than this per thread are run whole: splitting them costs more than it saves.
MIN_SHARD = 32


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


# How onnxruntime's kernels (after its fusions) compute, by op type: QLinear* and the integer products run in 8 bits.
INTEGER_OPS = frozenset({"QGemm", "MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention"})
CONVERT_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
LAYOUT_OPS = frozenset({"Transpose", "ReorderInput", "ReorderOutput", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Concat"})
PRODUCT_OPS = ("Conv", "Gemm", "MatMul")  # an op type holding one of these computes a convolution or a matrix product


def op_kind(op: str) -> str:
    if op.startswith("QLinear") or op in INTEGER_OPS:
        return INT8_KERNEL
    return CONVERT if op in CONVERT_OPS else LAYOUT if op in LAYOUT_OPS else FLOAT_KERNEL


def profile(path: Path, options: RunOptions, batch: np.ndarray, runs: int) -> RuntimeProfile:
    """onnxruntime's profiler on one session (1 intra-op thread; the exact kernels' switch as `options` say): each
    node's kernel time over `runs` runs of `batch` after one warm-up run, summed by the op type it ran as."""
    import json
    import tempfile

    path = Path(path)
    data = read_bytes(path)
    model = read_onnx(path, data)
    described, _ = describe_input(path, model, options.flags.size)
    freed = free_batch(path, model, described)
    if freed is None:
        batch = batch[: described.batch]
    whole = (freed or model).SerializeToString()
    with tempfile.TemporaryDirectory(prefix="ptq-profile-") as workdir:
        session = ort_session(path, whole, exact_int8=options.exact_int8, profile_prefix=str(Path(workdir) / "ort"))
        for _ in range(runs + 1):
            session.run(None, {described.name: batch})
        events = json.loads(Path(session.end_profiling()).read_text())
    run_starts = sorted(event["ts"] for event in events if event.get("cat") == "Session" and event.get("name") == "model_run")
    timed = [event for event in events if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time")
             and len(run_starts) > 1 and event["ts"] >= run_starts[1]]  # the warm-up run left out
    by_op: dict[str, tuple[set, float]] = {}
    for event in timed:
        names, micros = by_op.setdefault(event["args"]["op_name"], (set(), 0.0))
        names.add(event["name"])
        by_op[event["args"]["op_name"]] = (names, micros + event["dur"])
    ops = sorted((OpTime(op, op_kind(op), len(names), round(micros / 1000 / runs, 4)) for op, (names, micros) in by_op.items()),
                 key=lambda op: -op.milliseconds)
    products = [op for op in ops if any(kind in op.op for kind in PRODUCT_OPS) or op.op in INTEGER_OPS]
    return RuntimeProfile(tuple(ops), sum(op.nodes for op in products), sum(op.nodes for op in products if op.kind == INT8_KERNEL),
                          len(batch), runs, "onnxruntime's profiler (SessionOptions.enable_profiling), 1 intra-op thread")


def sniff(_head: bytes) -> bool:
    """Anything that is not another backend's file is tried as ONNX (which then says if it is not)."""
    return True


def _output_name(stem: str, settings: QuantizationSettings) -> str:
    return f"{stem}_{settings.dtype}{'_' + settings.target if settings.target else ''}{SUFFIX}"


def _saturation_proof(path: Path) -> str | None:
    proven, why = overflow.saturation_proof(read_onnx(path))
    return why if proven else None


def read_input(path: Path, size: tuple[int, int] | None = None) -> inputs.ModelInput:
    return describe_input(path, read_onnx(path), size)[0]


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format="QDQ", catch_all=True, read_input=read_input, summary="quantize_static, QDQ",
    quantizer=Quantizer(
        partial(qdq.quantize, placement=ONNXRUNTIME_X86),  # the QDQ engine, its pairs placed for onnxruntime's x86 kernels
        # The seed study's per-tensor default, its activation ranges chosen by measurement (choose_method).
        methods=qdq.METHODS, tune_methods=("minmax", "percentile"), per_channel=False,
        overflow_fixes=(overflow.FIRST_LAYER, overflow.ALL_LAYERS), clamped_overflow_fix=overflow.ALL_LAYERS, judges_overflow_fix=True, options=Options,
        output_name=_output_name,
        # onnxruntime's x86 int8 kernels (VNNI) multiply unsigned activations by signed weights; int8 x int8
        # and uint8 x uint8 fall back to slower paths. Per-channel weights keep the accuracy.
        speed_target={"dtype": "uint8", "weight_dtype": "int8", "per_channel": True},
        speed_by_default=True,
        learned_rounding=True,  # refine_rounding: GPTQ codes and bias correction on the QDQ model
        keeps_time_budget=True,  # the QDQ engine's judges
    ),
    runtime=Runtime(load, profile=profile, settings="CPUExecutionProvider, 1 intra-op thread per run, allow_spinning 0, one shard per thread"),
    # Its exact u8 x s8 kernels have a session switch: the other path is always reached.
    int8_paths=int8_paths.with_exact_switch(f"onnxruntime {EXACT_PATH_CONFIG}=1", _saturation_proof),
)
