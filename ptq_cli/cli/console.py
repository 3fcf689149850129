"""The command line's output: tables and JSON on stdout, one-line errors, progress bars and spinners on a terminal, and
plain progress lines where stderr is piped or logged."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.text import Text

from ptq_cli import render
from ptq_cli.errors import PtqError


class _StandardOutput:
    """sys.stdout as it is at each write (a test runner swaps it), a failed write named as standard output's."""

    def write(self, text: str) -> int:
        try:
            return sys.stdout.write(text)
        except OSError as error:
            raise PtqError(f"standard output: cannot write ({error.strerror or error})") from error

    def flush(self) -> None:
        try:
            sys.stdout.flush()
        except OSError as error:
            raise PtqError(f"standard output: cannot write ({error.strerror or error})") from error

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stdout, name)


# No markup and no emoji codes in what is printed: names come from users' files ("[/]" in a class name is a name, not a
# tag; ":cat:" is a name, not a cat).
out = Console(file=_StandardOutput(), markup=False, emoji=False)  # type: ignore[arg-type]


err = Console(stderr=True, markup=False, emoji=False)


def _fail(message: str, exit_code: int) -> int:
    message = " ".join(str(message).split())  # one line, whatever a library put in its message
    try:
        err.print(Text.assemble(("Error:", "red"), f" {message}"), highlight=False, soft_wrap=True)
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr that cannot take the line (/dev/full, closed): the exit code still says it
        pass
    return exit_code


def _emit(as_json: bool, result: Any, renderable: Any) -> None:
    if as_json:  # the text itself, unwrapped: nothing of rich's (highlighting took longer than the command on a large report)
        out.file.write(render.as_json(result) + "\n")
    else:
        out.print(renderable)
    out.file.flush()  # a full disk or closed pipe behind stdout is said now, naming it


@contextmanager
def _working(message: str) -> Iterator[None]:
    """A spinner on stderr for work with no measurable progress (piped: _heartbeat's lines, for long work only)."""
    if not err.is_terminal:
        with _heartbeat(message.rstrip("…")):
            yield
        return
    with err.status(message):
        yield


# Piped or logged, long work says it is alive: a line once it has run this long, then at least every HEARTBEAT_SECONDS.
HEARTBEAT_START_SECONDS, HEARTBEAT_SECONDS = 5.0, 30.0


@contextmanager
def _heartbeat(description: str) -> Iterator[Callable[[int, int], None]]:
    """Where stderr is not a terminal: nothing for work done within HEARTBEAT_START_SECONDS (an error after it stays
    one line); past it, a line saying what runs (and how far, when the work counts), one at least every
    HEARTBEAT_SECONDS, and one when it ends."""
    began, state = time.monotonic(), {"done": 0, "total": 0, "said": False}
    counting: dict = {"total": None, "since": began, "start": 0}  # when and where the count towards the present total began
    stopped = threading.Event()

    def update(done: int, total: int) -> None:
        if total != counting["total"]:  # a new phase, or a total that grew: its pace is measured afresh
            counting.update(total=total, since=time.monotonic(), start=done)
        state.update(done=done, total=total)

    def left() -> str:
        """", about N s left" at the pace since the present total began, once there is a pace to go by."""
        done, total, counted = state["done"], state["total"], state["done"] - counting["start"]
        elapsed = time.monotonic() - counting["since"]
        if not total or counted <= 0 or done >= total or elapsed < 1.0:
            return ""
        return f", about {elapsed / counted * (total - done):,.0f} s left"

    def say(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            err.print(text, highlight=False, soft_wrap=True)
            err.file.flush()

    def beat() -> None:
        wait = HEARTBEAT_START_SECONDS
        while not stopped.wait(wait):
            counted = f", {state['done']:,}/{state['total']:,}{left()}" if state["total"] else ""
            say(f"{description}: running, {time.monotonic() - began:,.0f} s{counted}")
            state["said"], wait = True, HEARTBEAT_SECONDS

    beater = threading.Thread(target=beat, name="ptq-heartbeat", daemon=True)
    beater.start()
    try:
        yield update
    finally:
        stopped.set()
        beater.join()
        if state["said"]:
            say(f"{description}: ended after {time.monotonic() - began:,.0f} s")


@contextmanager
def _progress_bar(description: str, lines: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr (only on a terminal); yields the (done, total) callback services take. With
    `lines`, where stderr is not a terminal (a log), one line as each step finishes instead."""
    if lines and not err.is_terminal:
        yield lambda done, total: err.print(f"{description}: {done}/{total}", highlight=False, soft_wrap=True)
        return
    if not err.is_terminal:
        with _heartbeat(description) as update:
            yield update
        return
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@contextmanager
def _byte_progress() -> Iterator[Callable[[str, int, int], None]]:
    """One download/copy bar per asset on stderr (only on a terminal)."""
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        tasks: dict[str, Any] = {}

        def update(asset: str, done: int, total: int) -> None:
            if asset not in tasks:
                tasks[asset] = bar.add_task(f"Fetching {asset}", total=total or None)
            bar.update(tasks[asset], completed=done, total=total or None)

        yield update


class LibraryLog(UserWarning):
    """A warning a library logged through Python's logging with no handler of its own (torchao's "Failed to load" of
    its CUDA extensions): kept with the warnings and said the same way, after the command's output."""


class _KeepLogged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def keeping_library_logs(caught: list[warnings.WarningMessage]) -> Iterator[None]:
    """Within it, warnings logged to the root logger (by libraries whose loggers have no handler) join `caught` at its
    end instead of being printed where they happen, through a table or a progress line; those a service kept for its
    result (marked `ptq_kept`, as onnxruntime.quantization's are: quantize/calibration.py) are not said twice."""
    handler, root = _KeepLogged(), logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        caught.extend(warnings.WarningMessage(_message(record), LibraryLog, record.pathname, record.lineno)
                      for record in handler.records if not getattr(record, "ptq_kept", False))


def _message(record: logging.LogRecord) -> str:
    """The record's text; its bare format string where a library's arguments do not fit it (logging's own handlers
    report that and go on: so does ptq, after the command)."""
    try:
        return record.getMessage()
    except (TypeError, ValueError):
        return str(record.msg)


def show_library_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Each distinct warning the libraries gave during a command, once, on stderr after the command's own output:
    `warning: <first line> (<category>, <package>)`."""
    said = set()
    for warning in caught:
        text = str(warning.message).strip().splitlines()[0] if str(warning.message).strip() else warning.category.__name__
        origin = _package_of(warning.filename)
        if (warning.category, text) in said:
            continue
        said.add((warning.category, text))
        kind = "log" if warning.category is LibraryLog else warning.category.__name__
        print(f"warning: {text} ({kind}, {origin})", file=sys.stderr)


def _package_of(filename: str) -> str:
    """The top-level package a warning came from (`torch`, `onnxruntime`), else the file's name ("generated code" for
    code a library wrote and ran, such as torch.fx's)."""
    if filename.startswith("<"):
        return "generated code"
    parts = Path(filename).parts
    if "site-packages" in parts and parts.index("site-packages") + 1 < len(parts):
        return Path(parts[parts.index("site-packages") + 1]).stem
    return "ptq" if "ptq_cli" in parts else Path(filename).name
