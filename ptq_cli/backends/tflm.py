"""TensorFlow Lite Micro: runs `.tflite` files (`--runtime tflm`) on the kernels a microcontroller runs.

TFLM's reference kernels are what a Cortex-M runs (CMSIS-NN reproduces them bit for bit); LiteRT's default
XNNPACK kernels, and even its own reference kernels, round some layers differently (README, "TFLite Micro").
The scores come from TFLM's kernels. Where a model's ops are all in `tflm_kernels` (ptq's numpy copy of
them, whole batches at once), they run there, and the tflite-micro Python interpreter runs the first
VERIFIED_IMAGES images of every call too: the output bytes must be identical, else that model goes back to the
interpreter for good. The interpreter runs one image per invoke, as on the device; large batches are split
across worker processes (it holds the GIL), each with its own interpreter, which gives the same scores. The
tensor arena is TFLM's own figure (its allocation recording).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import weakref
from pathlib import Path

import numpy as np

from ptq_cli.backends import litert, tflm_kernels
from ptq_cli.backends.base import Backend, LoadedModel, RunOptions, Runtime, finish_load
from ptq_cli.backends.model_file import model_input, num_classes, read_bytes, resolve_threads
from ptq_cli.backends.tflm_interpreter import arena_bytes, available, fitted_interpreter
from ptq_cli.errors import PtqError

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
        self.output_quantization = litert.io_quantization(self.output)
        self.batch = max(int(self.image["shape"][0]), 1)

    def codes(self, batch: np.ndarray) -> np.ndarray:
        """The model's int8 input for a batch in its input format."""
        return np.ascontiguousarray(litert.as_input(batch, self.input))

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
                raise PtqError(f"{self.path}: TFLite Micro failed to run it ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from error
        return np.concatenate(results)


_worker: _Scorer | None = None


def _start_worker(data: bytes, path: str, arena_size: int) -> None:
    global _worker  # noqa: PLW0603  a worker process's one scorer, set by the pool's initializer
    _worker = _Scorer(data, Path(path), arena_size)


def _score_in_worker(batch: np.ndarray) -> np.ndarray:
    assert _worker is not None
    return _worker.run(batch)


def load(path: Path, options: RunOptions) -> LoadedModel:
    """The model in TFLM's interpreter; with more than one thread, calls of PARALLEL_FROM images or more are
    split across that many worker processes."""
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
    state: dict = {"pool": None, "kernels": tflm_kernels.covers(data) if scorer.batch == 1 else None}

    def copied_kernels(batch: np.ndarray) -> np.ndarray | None:
        """The call on ptq's copy of TFLM's kernels, if it has them and they give the interpreter's bytes on the first images."""
        kernels = state["kernels"]
        if not callable(kernels) or len(batch) < PARALLEL_FROM:
            return None
        codes = scorer.codes(batch)
        try:
            result = kernels(codes)
        except Exception:  # noqa: BLE001  a gap in ptq's copy: the interpreter is the reference, and it runs the call
            result = None
        checked = scorer.raw(codes[:VERIFIED_IMAGES])
        if result is None or not np.array_equal(result.reshape(len(codes), -1)[:VERIFIED_IMAGES], checked.reshape(len(checked), -1)):
            state["kernels"] = None
            return None
        return scorer.dequantized(result.reshape(len(codes), -1))

    def predict(batch: np.ndarray) -> np.ndarray:
        copied = copied_kernels(batch)
        if copied is not None:
            return copied
        if threads < 2 or len(batch) < PARALLEL_FROM:
            return scorer.run(batch)
        pool = state["pool"]
        if pool is None:
            # fork: the workers inherit the loaded modules; TFLM itself starts no threads.
            pool = state["pool"] = concurrent.futures.ProcessPoolExecutor(
                threads, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker, initargs=(data, str(path), scorer.arena_size))
            weakref.finalize(predict, pool.shutdown, wait=False, cancel_futures=True)
        try:
            return np.concatenate(list(pool.map(_score_in_worker, np.array_split(batch, threads))))
        except concurrent.futures.process.BrokenProcessPool as error:
            raise PtqError(f"{path}: TFLite Micro crashed running it") from error

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
                    settings="TFLM reference kernels: ptq's numpy copy where it has the model's ops (the tflite-micro Python interpreter checks the "
                             f"first {VERIFIED_IMAGES} images of every call byte for byte, and runs the model where they differ), else the "
                             "interpreter, one image per invoke, calls split across threads worker processes"),
)
