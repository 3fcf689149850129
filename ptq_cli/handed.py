"""A value a caller hands down to the code it calls, for the extent of a `with` block (a ContextVar set, then reset):
one command's trust in code-carrying files (guards/trust.py). What a service gives a backend's quantize travels in
its QuantizeCall instead (quantize/settings.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

Value = TypeVar("Value")


@contextmanager
def handed_down(variable: ContextVar[Value], value: Value) -> Iterator[None]:
    """`variable` holds `value` within the block, and what it held before after it."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
