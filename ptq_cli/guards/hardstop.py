"""Ending ptq when Python cannot stop it the usual way: a second Ctrl-C/SIGTERM ends it at once; a first
one the main thread does not answer within GRACE_SECONDS (stuck in a runtime's C++ loop, e.g. an ONNX
`Loop` that never ends) ends it then; one inference call past its bound (bounded.CALL_SECONDS) is reported
and ends it. Each way removes the temporary files of unfinished writes and says why in one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from ptq_cli.guards.atomic import remove_own_temporaries

GRACE_SECONDS = 5.0
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def stop_now(message: str, code: int) -> None:
    remove_own_temporaries()
    with contextlib.suppress(OSError):
        os.write(2, f"Error: {' '.join(message.split())}\n".encode("utf-8", "backslashreplace"))
    os._exit(code)


def exit_at_once(number: int, _frame: object) -> None:
    """A signal handler for a process already stopping, whose one line says so: the second signal ends it now, with
    the signal's exit code and no second line."""
    remove_own_temporaries()
    os._exit(EXIT_CODES.get(signal.Signals(number), 130))


@contextlib.contextmanager
def signals_watched() -> Iterator[None]:
    """Watch SIGINT and SIGTERM from a thread (Python's handlers run only when the main thread returns to
    Python code): the second one, or a first left unanswered for GRACE_SECONDS, ends the process."""
    try:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    done = threading.Event()

    def watch() -> None:
        timer = None
        while True:
            try:
                received = os.read(read_end, 16)
            except OSError:
                return
            if done.is_set() or not received:
                return
            for number in received:
                if number not in EXIT_CODES:
                    continue
                code = EXIT_CODES[signal.Signals(number)]
                if timer is not None:
                    stop_now("interrupted again; stopped at once, no partial output was written", code)
                timer = threading.Timer(GRACE_SECONDS, stop_now, ("interrupted; stopped (the runtime did not return), no partial output was written", code))
                timer.daemon = True
                timer.start()

    watcher = threading.Thread(target=watch, name="ptq-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        with contextlib.suppress(OSError):
            os.write(write_end, b"\0")
        watcher.join(1)
        os.close(write_end)
        os.close(read_end)


@contextlib.contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """End the process with `message` (exit 2) if the block has not finished within `seconds`."""
    timer = threading.Timer(seconds, stop_now, (message, 2))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
