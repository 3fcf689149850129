"""TensorFlow Lite Micro's interpreter made for a flatbuffer, with a tensor arena it fits in, and the arena it
measured: what the tflm runtime and the LiteRT quantizer (which lays files out by it) share."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ptq_cli.errors import PtqError, first_line

ARENA_START = 1 << 20  # bytes of tensor arena tried first; doubled while TFLM says it is too small
ARENA_LIMIT = 1 << 30
ARENA_LINE = re.compile(r"Arena allocation total (\d+) bytes")


def available() -> bool:
    try:
        from tflite_micro.python.tflite_micro import runtime  # noqa: F401
    except ImportError:
        return False
    return True


def _runtime():
    try:
        from tflite_micro.python.tflite_micro import runtime
    except ImportError as error:
        raise PtqError("TFLite Micro is not installed: pip install 'ptq-cli[litert]' (make install does)") from error
    return runtime


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """TFLM prints (MicroPrintf) to the C library's stderr: what it says inside the block, as a list of lines."""
    lines: list[str] = []
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as sink:
        libc.fflush(None)
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            libc.fflush(None)
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read(1 << 20).decode("utf-8", "replace").splitlines())


def fitted_interpreter(data: bytes, path: Path, arena_size: int | None = None):
    """A TFLM interpreter of the model with a tensor arena it fits in (grown from ARENA_START); (interpreter,
    arena size given)."""
    runtime = _runtime()
    size = arena_size or ARENA_START
    while True:
        with _captured_stderr() as said:
            try:
                return runtime.Interpreter.from_bytes(data, arena_size=size), size
            except Exception as error:  # noqa: BLE001  its Python side raises whatever a malformed model makes it raise
                failure = error
        too_small = any("Failed to resize buffer" in line or "too small" in line for line in said)
        if too_small and arena_size is None and size < ARENA_LIMIT:
            size *= 2
            continue
        why = next((line.strip() for line in said if line.strip()), first_line(failure))
        raise PtqError(f"{path}: TFLite Micro cannot run it ({why})") from failure


def arena_bytes(interpreter) -> int | None:
    """The tensor arena TFLM allocated for the model (its recording allocator's total), after one invoke."""
    with _captured_stderr() as said:
        interpreter.print_allocations()
    found = [int(match.group(1)) for match in map(ARENA_LINE.search, said) if match]
    return found[0] if found else None


def arena_of(data: bytes) -> int | None:
    """TFLM's tensor arena for a flatbuffer, after one invoke on zeros; None where TFLM cannot run it."""
    try:
        interpreter, _ = fitted_interpreter(data, Path("model.tflite"))
        image = interpreter.get_input_details(0)
        interpreter.set_input(np.zeros(image["shape"], image["dtype"]), 0)
        interpreter.invoke()
    except (PtqError, RuntimeError, ValueError):
        return None
    return arena_bytes(interpreter)
