"""The one error type services raise for bad input; the CLI turns it into one line and an exit code."""

from __future__ import annotations


class PtqError(Exception):
    """Bad input or an unusable file: the message names the file or option and the problem."""

    exit_code = 2


class Interrupted(PtqError):
    """Ctrl-C: outputs are written through temporary files, so nothing half-written is left behind."""

    exit_code = 130


class Terminated(Interrupted):
    """SIGTERM (kill, a CI timeout): ended as Ctrl-C ends ptq, with the shell's code for that signal."""

    exit_code = 143


class TerminateSignal(KeyboardInterrupt):
    """Raised in the main thread by the SIGTERM handler, to unwind as Ctrl-C does."""


class CheckFailed(PtqError):
    """A verification (e.g. converted model vs source) did not pass: the input was fine, the result is not."""

    exit_code = 1


def first_line(error: BaseException, otherwise: str | None = None) -> str:
    """A library error's first line, for a one-line message (its type's name, or `otherwise`, when it has none)."""
    return str(error).splitlines()[0] if str(error) else (type(error).__name__ if otherwise is None else otherwise)
