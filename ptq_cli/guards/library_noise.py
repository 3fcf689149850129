"""Native libraries that print: silenced where their output would mix with ptq's own."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """TensorFlow's C++ start-up logs (absl, oneDNN) ignore TF_CPP_MIN_LOG_LEVEL; hide them during import only."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def torchao_pt2e_imported() -> None:
    """torchao's PT2E modules (which also register the quantized_decomposed operators programs call), imported with
    torch's own log handler set aside: torch prints its loggers' warnings itself, in its own format, in the middle of
    ptq's output (`W1207 ... torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass ...`, which
    torchao's import gives). Set aside, they go through Python's logging as other libraries' do, and the CLI says each
    once after the command's output (cli/console.py). Nothing is silenced."""
    import logging

    import torch  # noqa: F401  its loggers and their handler set up

    torch_logger = logging.getLogger("torch")
    handlers, propagate = list(torch_logger.handlers), torch_logger.propagate
    for handler in handlers:
        torch_logger.removeHandler(handler)
    torch_logger.propagate = True
    try:
        import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401
    finally:
        for handler in handlers:
            torch_logger.addHandler(handler)
        torch_logger.propagate = propagate
