"""Model files whose loading runs code (TorchScript: its `forward` and `__setstate__` are programs) are
loaded only when ptq wrote them (their sha256 is remembered in the user's cache) or when the user says they
trust the file's source: `--trust-remote-code`, as Hugging Face names it, or PTQ_TRUST_REMOTE_CODE=1."""

from __future__ import annotations

import contextlib
import hashlib
import os
from contextvars import ContextVar
from pathlib import Path

from ptq_cli.errors import PtqError
from ptq_cli.guards import cache
from ptq_cli.handed import handed_down

ENV = "PTQ_TRUST_REMOTE_CODE"
OPTION = "--trust-remote-code"
_trusted: ContextVar[bool] = ContextVar("trust_remote_code", default=False)


def scope() -> contextlib.AbstractContextManager[None]:
    """One command's extent: trust given by its option ends with it."""
    return handed_down(_trusted, False)


def trust_remote_code(enabled: bool = True) -> None:
    _trusted.set(bool(enabled))


def trusting() -> bool:
    return _trusted.get() or os.environ.get(ENV, "") == "1"


def remember(data: bytes) -> None:
    """ptq wrote these bytes: loading them later needs no opt-in. A cache that cannot be written costs
    only that opt-in."""
    with contextlib.suppress(PtqError, OSError):
        cache.remember_written(hashlib.sha256(data).hexdigest())


def written_by_ptq(data: bytes) -> bool:
    return cache.was_written(hashlib.sha256(data).hexdigest())


def require(path: Path, data: bytes, kind: str) -> None:
    """Refuse to load `data` (a `kind` file, whose loading runs code) unless trusted."""
    if trusting() or written_by_ptq(data):
        return
    raise PtqError(f"{path}: a {kind} file runs code when loaded and ptq did not write this one; "
                   f"if you trust where it came from, pass {OPTION} (or set {ENV}=1)")
