"""TensorFlow Lite Micro: runs `.tflite` files (`--runtime tflm`) on the kernels a microcontroller runs.

TFLM's reference kernels are what a Cortex-M runs (CMSIS-NN reproduces them bit for bit); LiteRT's default
XNNPACK kernels, and even its own reference kernels, round some layers differently (README, "TFLite Micro").
The scores come from the tflite-micro Python interpreter itself, one image per invoke as on the device;
large batches are split across worker processes (the interpreter holds the GIL), each with its own
interpreter, which gives the same scores. The tensor arena is TFLM's own figure (its allocation recording).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import weakref
from pathlib import Path

import numpy as np

from ptq_cli.backends import litert
from ptq_cli.backends.base import Backend, LoadedModel, RunOptions, finish_load
from ptq_cli.backends.model_file import model_input, num_classes, read_bytes, resolve_threads
from ptq_cli.backends.tflm_interpreter import arena_bytes, available, fitted_interpreter
from ptq_cli.errors import PtqError

NAME = "tflm"
PARALLEL_FROM = 64  # images in one call from which the call is split across worker processes


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

    def run(self, batch: np.ndarray) -> np.ndarray:
        batch = np.ascontiguousarray(litert.as_input(batch, self.input))
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
        result = np.concatenate(results).astype(np.float32)
        if self.output_quantization is not None:
            scale, zero_point = self.output_quantization
            result = (result - zero_point) * scale
        return result


_worker: _Scorer | None = None


def _start_worker(data: bytes, path: str, arena_size: int) -> None:
    global _worker
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
    state: dict = {"pool": None}

    def predict(batch: np.ndarray) -> np.ndarray:
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
    NAME, (litert.SUFFIX,), lambda head: False, load, available=available, format=litert.FORMAT,
    summary="TensorFlow Lite Micro's reference kernels (what a microcontroller runs): runs .tflite files",
    runs_suffixes=(litert.SUFFIX,), microcontroller=True,
    runtime_settings="tflite-micro Python interpreter (TFLM reference kernels), one image per invoke, calls split across threads worker processes",
)
