"""TensorFlow Lite Micro: runs `.tflite` files (`--runtime tflm`) on the kernels a microcontroller runs.

TFLM's reference kernels are what a Cortex-M runs (CMSIS-NN reproduces them bit for bit); LiteRT's default
XNNPACK kernels, and even its own reference kernels, round some layers differently (docs: "TFLite Micro").
The scores come from TFLM's kernels. Where a model's ops are all in `tflm_kernels` (ptq's numpy copy of
them, whole batches at once, shared out over `threads` threads), they run there, and the tflite-micro Python
interpreter runs the first VERIFIED_IMAGES images of every call too: the output bytes must be identical, else that
model goes back to the interpreter for good. The interpreter runs one image per invoke, as on the device; large
batches are split across worker processes (it holds the GIL), each with its own interpreter, which gives the same
scores. The tensor arena is TFLM's own figure (its allocation recording).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import multiprocessing
import weakref
from pathlib import Path

import numpy as np

from ptq_cli.backends import litert
from ptq_cli.backends.base import Backend, LoadedModel, RunOptions, Runtime, finish_load
from ptq_cli.backends.tflm_interpreter import arena_bytes, available, fitted_interpreter
from ptq_cli.errors import PtqError, first_line
from ptq_cli.model_file import model_input, num_classes, read_bytes, resolve_threads
from ptq_cli.quantize import tflite
from ptq_cli.transforms import tflm_kernels

NAME = "tflm"
PARALLEL_FROM = 64  # images in one call from which the call is split across worker processes
VERIFIED_IMAGES = 4  # images of every call (128 by default) the interpreter runs too where ptq's copy of the kernels runs it


def _as_litert(detail: dict) -> dict:
    """A TFLM tensor's details in LiteRT's form (dtype, (scale, zero point)), for LiteRT's helpers to quantize and describe it."""
    parameters = detail.get("quantization_parameters") or {}
    scales, zero_points = parameters.get("scales", []), parameters.get("zero_points", [])
    return {"dtype": np.dtype(detail["dtype"]), "quantization": (float(scales[0]), int(zero_points[0])) if len(scales) else (0.0, 0)}


class _Scorer:
    """One interpreter scoring images one at a time (the model's own batch), input quantized and output dequantized."""

    def __init__(self, data: bytes, path: Path, arena_size: int | None = None) -> None:
        self.interpreter, self.arena_size = fitted_interpreter(data, path, arena_size)
        self.path = path
        self.image, self.scores = self.interpreter.get_input_details(0), self.interpreter.get_output_details(0)
        self.input, self.output = _as_litert(self.image), _as_litert(self.scores)
        self.output_quantization = tflite.io_quantization(self.output)
        self.batch = max(int(self.image["shape"][0]), 1)

    def codes(self, batch: np.ndarray) -> np.ndarray:
        """The model's int8 input for a batch in its input format."""
        return np.ascontiguousarray(tflite.as_input(batch, self.input))

    def dequantized(self, result: np.ndarray) -> np.ndarray:
        result = result.astype(np.float32)
        if self.output_quantization is not None:
            scale, zero_point = self.output_quantization
            result = (result - zero_point) * scale
        return result

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.dequantized(self.raw(self.codes(batch)))

    def raw(self, batch: np.ndarray) -> np.ndarray:
        """The interpreter's output tensor for a batch of input codes, one invoke per model batch."""
        results = []
        for start in range(0, len(batch), self.batch):
            part = batch[start : start + self.batch]
            filled = np.concatenate([part, np.repeat(part[-1:], self.batch - len(part), axis=0)]) if len(part) < self.batch else part
            try:
                self.interpreter.set_input(filled, 0)
                self.interpreter.invoke()
                results.append(np.array(self.interpreter.get_output(0)).reshape(self.batch, -1)[: len(part)])
            except (RuntimeError, ValueError) as error:
                raise PtqError(f"{self.path}: TFLite Micro failed to run it ({first_line(error)})") from error
        return np.concatenate(results)


_worker: _Scorer | None = None


def _start_worker(data: bytes, path: str, arena_size: int) -> None:
    global _worker  # noqa: PLW0603  a worker process's one scorer, set by the pool's initializer
    _worker = _Scorer(data, Path(path), arena_size)


def _score_in_worker(batch: np.ndarray) -> np.ndarray:
    assert _worker is not None
    return _worker.run(batch)


def _blas_threads(count: int) -> contextlib.AbstractContextManager:
    """BLAS kept to `count` threads while the copied kernels run (threadpoolctl, which the litert extra installs;
    without it, BLAS keeps its own count: the same bytes, slower)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(count, user_api="blas")


class _Calls:
    """How a call is scored: on ptq's copy of TFLM's kernels where it has them (and they give the
    interpreter's bytes on the first images), else by the interpreter, split across worker processes
    for large calls."""

    def __init__(self, scorer: _Scorer, data: bytes, path: Path, threads: int, kernels) -> None:
        self.scorer, self.data, self.path, self.threads, self.kernels = scorer, data, path, threads, kernels
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.kernel_threads: concurrent.futures.ThreadPoolExecutor | None = None

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        copied = self._on_copied_kernels(batch)
        if copied is not None:
            return copied
        if self.threads < 2 or len(batch) < PARALLEL_FROM:
            return self.scorer.run(batch)
        return self._in_workers(batch)

    def _on_copied_kernels(self, batch: np.ndarray) -> np.ndarray | None:
        if not callable(self.kernels) or len(batch) < PARALLEL_FROM:
            return None
        codes = self.scorer.codes(batch)
        try:
            result = self._kernels_on_threads(codes)
        except Exception:  # noqa: BLE001  a gap in ptq's copy: the interpreter is the reference, and it runs the call
            result = None
        checked = self.scorer.raw(codes[:VERIFIED_IMAGES])
        if result is None or not np.array_equal(result.reshape(len(codes), -1)[:VERIFIED_IMAGES], checked.reshape(len(checked), -1)):
            self.kernels = None
            return None
        return self.scorer.dequantized(result.reshape(len(codes), -1))

    def _kernels_on_threads(self, codes: np.ndarray) -> np.ndarray:
        """The copied kernels on `threads` parts of the call at once: numpy lets go of the GIL in its array work, so
        threads share it out without the processes the interpreter needs; the images stay independent."""
        assert callable(self.kernels)
        parts = min(self.threads, len(codes))  # no empty part, whatever --threads says
        if parts < 2:
            with _blas_threads(self.threads):
                return self.kernels(codes)
        if self.kernel_threads is None:
            self.kernel_threads = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="tflm-kernels")
            weakref.finalize(self, self.kernel_threads.shutdown, wait=False, cancel_futures=True)
        # One core a thread: a convolution's matrix product left to BLAS's own threads in each would share the cores twice over.
        with _blas_threads(1):
            return np.concatenate(list(self.kernel_threads.map(self.kernels, np.array_split(codes, parts))))

    def _in_workers(self, batch: np.ndarray) -> np.ndarray:
        if self.pool is None:
            # fork: the workers inherit the loaded modules; TFLM itself starts no threads.
            self.pool = concurrent.futures.ProcessPoolExecutor(self.threads, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker,
                                                               initargs=(self.data, str(self.path), self.scorer.arena_size))
            weakref.finalize(self, self.pool.shutdown, wait=False, cancel_futures=True)
        try:
            return np.concatenate(list(self.pool.map(_score_in_worker, np.array_split(batch, self.threads))))
        except concurrent.futures.process.BrokenProcessPool as error:
            raise PtqError(f"{self.path}: TFLite Micro crashed running it") from error


def load(path: Path, options: RunOptions) -> LoadedModel:
    """The model in TFLM's interpreter; with more than one thread, calls of PARALLEL_FROM images or more are
    split across that many threads (ptq's copy of the kernels) or worker processes (the interpreter)."""
    path = Path(path)
    data = read_bytes(path)
    if not litert.sniff(data[:8]):
        raise PtqError(f"{path}: not a TFLite flatbuffer (no TFL3 identifier); TFLite Micro runs .tflite files")
    litert.verify(data, path)  # TFLM does not verify the flatbuffer it is given; LiteRT does
    threads = resolve_threads(options.threads)
    scorer = _Scorer(data, path)
    image = scorer.image
    described = model_input(path, image.get("name", "input"), [int(dim) for dim in image["shape"]])
    classes = num_classes(path, [int(dim) for dim in scorer.scores["shape"]])
    predict = _Calls(scorer, data, path, threads, tflm_kernels.covers(data) if scorer.batch == 1 else None)
    stored = litert.metadata(data)
    dtype, quantization = litert.made(path, litert.tensor_types(data), stored, scorer.input["dtype"], litert.describe_io(scorer.input),
                                      litert.describe_io(scorer.output))
    scorer.run(np.zeros(described.shape(1), np.float32))  # one invoke, so that the arena is all allocated
    return finish_load(path, BACKEND, options, described=described, predict=predict, dtype=dtype, size_bytes=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), stored=stored, declared_classes=classes, quantization=quantization,
                       arena_bytes=arena_bytes(scorer.interpreter))


BACKEND = Backend(
    NAME, (litert.SUFFIX,), lambda _head: False, available=available, format=litert.FORMAT,
    summary="TensorFlow Lite Micro's reference kernels (what a microcontroller runs): runs .tflite files",
    runtime=Runtime(load, runs_suffixes=(litert.SUFFIX,), microcontroller=True,
                    settings="TFLM reference kernels: ptq's numpy copy where it has the model's ops, calls split across --threads threads "
                             f"(the tflite-micro Python interpreter checks the first {VERIFIED_IMAGES} images of every call byte for byte, "
                             "and runs the model where they differ), else the interpreter, one image per invoke, "
                             "calls split across --threads worker processes"),
)
