"""The `ptq` application: its one error handler (one line on stderr, exit code 2), signals, the version, and `ptq run`'s
stages run as commands in this process."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import io
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer._click.exceptions import ClickException, UsageError  # typer >= 0.22 vendors click (pyproject: typer>=0.29)

from ptq_cli import settings
from ptq_cli.cli import console
from ptq_cli.cli import help as help_fit
from ptq_cli.cli.console import _fail, keeping_library_logs, show_library_warnings
from ptq_cli.errors import Interrupted, PtqError, Terminated, TerminateSignal
from ptq_cli.guards import atomic, bounded, hardstop, trust

# The command line as ptq was given it (recorded in `ptq run`'s manifest).
COMMAND_LINE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("command_line", default=("ptq",))


class PtqGroup(typer.core.TyperGroup):
    """The one error handler: bad input and usage errors become one line on stderr and exit code 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        given = list(sys.argv[1:] if args is None else args)
        COMMAND_LINE.set(("ptq", *given))
        args = _fill_optional_values(given)
        _tolerant_streams()
        args, show_all = help_fit.asked_for_all(args)
        if help_fit.may_show_help(args):  # fitting every command's options takes longer than a small command
            help_fit.fit(self, show_all)
        try:
            with _terminate_as_interrupt(), trust.scope(), warnings.catch_warnings(record=True) as caught, keeping_library_logs(caught):
                # Library warnings (deprecations above all) are kept, not hidden, and said once each after the
                # command's own output, where they cannot break a table or a progress line.
                warnings.simplefilter("default")
                code = super().main(args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra)
            if not isinstance(code, int) or code == 0:  # a command's value, or a clean exit: never beside an error line
                show_library_warnings(caught)
        except PtqError as error:
            code = _fail(str(error), error.exit_code)
        except UsageError as error:
            if not error.format_message():  # `ptq` alone: the help was asked for, and has been printed
                return self._exit(0, standalone_mode)
            command = error.ctx.command_path if error.ctx else "ptq"
            code = _fail(f"{error.format_message()} (see `{command} --help`)", error.exit_code)
        except ClickException as error:
            code = _fail(error.format_message(), error.exit_code)
        except OSError as error:  # a full disk, a vanished directory: the file and the reason, not a traceback
            code = _fail(f"{error.filename or 'ptq'}: {error.strerror or error}", 2)
        return self._exit(code, standalone_mode)

    @staticmethod
    def _exit(code: Any, standalone_mode: bool) -> Any:
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        # Typer turns Ctrl-C into a silent exit 130 before main() sees it; say what happened instead.
        try:
            for limit in bounded.LIMITS:  # a limit set to something unusable fails now, whether or not this run meets it
                limit.value()
            return super().invoke(ctx)
        except KeyboardInterrupt as interrupt:
            kind = Terminated if isinstance(interrupt, TerminateSignal) else Interrupted
            raise kind("interrupted; no partial output was written") from interrupt


def _tolerant_streams() -> None:
    """A terminal or pipe that cannot show a character (PYTHONIOENCODING=ascii, a C locale) gets an
    escape for it, not a UnicodeEncodeError in the middle of a table."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a CI timeout, systemd) ends ptq the way Ctrl-C does: temporary files removed."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise TerminateSignal

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    stopping = False
    try:
        with hardstop.signals_watched():
            yield
    except (KeyboardInterrupt, Interrupted):
        stopping = True
        raise
    finally:
        # Ended by a signal, the process is on its way out (threads a runtime left running may hold it a moment): a
        # second signal then ends it at once with the signal's exit code, not by the signal itself (-15).
        signal.signal(signal.SIGTERM, hardstop.exit_at_once if stopping else previous)
        if stopping:
            signal.signal(signal.SIGINT, hardstop.exit_at_once)


# Options whose value may be left out (`--markdown` alone means the default path). Typer has no such
# option type, so a bare occurrence gets its default value inserted before parsing.
OPTIONAL_VALUES = {"--markdown": str(settings.MARKDOWN_REPORT)}


def _fill_optional_values(args: list[str]) -> list[str]:
    filled: list[str] = []
    for index, arg in enumerate(args):
        filled.append(arg)
        following = args[index + 1] if index + 1 < len(args) else None
        if arg in OPTIONAL_VALUES and (following is None or following.startswith("-")):
            filled.append(OPTIONAL_VALUES[arg])
    return filled


app = typer.Typer(
    cls=PtqGroup,
    help="Post-training quantization of image classifiers (ONNX in; 8-bit models out for onnxruntime, PyTorch, OpenVINO and LiteRT), measured on your images. Defaults: the MLPerf Tiny ResNet8 study on CIFAR-10.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",  # paragraphs reflow to the width; markdown mode ate `_x_` and `<name>` in defaults
)


def _show_version(asked: bool) -> None:
    if asked:
        import ptq_cli

        typer.echo(f"ptq {ptq_cli.__version__}")
        raise typer.Exit


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version, help="Print ptq's version and exit.")] = False) -> None:
    """Post-training quantization of image classifiers, measured on your images."""


@functools.cache
def _command_group() -> Any:
    """The click group typer builds from the app: built once, not once a stage (it takes longer than a small stage)."""
    return typer.main.get_command(app)


def run_stage_command(command: str, arguments: tuple[str, ...]) -> Any:
    """One stage of `ptq run`: the ptq command it is, parsed and run in this process as typed, its tables and
    progress kept off the terminal (the run shows its stages); returns the command's result. Its errors are
    the run's, said once by the run's own handler."""
    shown = console.out, console.err  # each command prints through these; a stage's go nowhere
    console.out = console.err = Console(file=io.StringIO(), markup=False, emoji=False)
    try:
        group = _command_group()
        with group.make_context("ptq", _fill_optional_values([command, *arguments])) as context:
            return group.invoke(context)
    finally:
        console.out, console.err = shown


def _reflow(text: str) -> str:
    """Docstring paragraphs as one line each (typer's rich mode keeps single line breaks); list items stay lines."""
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.splitlines()
        joined = lines[:1]
        for line in lines[1:]:
            if line.lstrip().startswith(("- ", "* ")):
                joined.append(line)
            else:
                joined[-1] += " " + line.strip()
        paragraphs.append("\n".join(joined))
    return "\n\n".join(paragraphs)


# Parameters that name what a command writes; every other path it is given, it reads.
OUTPUT_PARAMETERS = frozenset({"output", "torch_output", "output_dir", "results_dir", "models_dir", "destination", "markdown"})


def _read_paths(arguments: dict[str, Any]) -> list[Path]:
    paths: list[Path] = []
    for name, value in arguments.items():
        if name in OUTPUT_PARAMETERS:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Path):
                paths.append(item)
    return paths


def _guarding_inputs(command: Callable[..., Any]) -> Callable[..., Any]:
    """The command's input paths held for its duration: no output may be one of them (atomic.reading)."""

    @functools.wraps(command)
    def guarded(**arguments: Any) -> Any:
        with atomic.reading(_read_paths(arguments)):
            return command(**arguments)

    return guarded


def main() -> None:
    app()
