"""One stage of `ptq run` as a task on a worker: its command runs against a private view of the run's folder,
and the files it writes come back to the driver, which alone writes them where the user sees them.

The view is a scratch folder laid out as the run's folder: the folders the stage writes into (its outputs'
folders, and the records' folder with everything under it) are real folders there, and every other entry
is a link to the run's own. The command reads what it would read in the run's folder, under the same relative
names (its records and models name the same paths), and whatever it writes lands in the scratch folder. A
worker killed mid-stage leaves nothing the user sees.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptq_cli.errors import Interrupted, PtqError
from ptq_cli.guards.atomic import companions, is_temporary, write_bytes

# Runs one ptq command in this process (cli.run_stage_command): its result, which names the files it wrote (`written`).
RunCommand = Callable[[str, tuple[str, ...]], Any]

OUTSIDE = ".outside"  # in the scratch folder: the view of a records folder that lies outside the run's folder


def written_by(result: Any) -> tuple[Path, ...]:
    """The files a command wrote, as its result names them (a list of results: each one's)."""
    if isinstance(result, (list, tuple)):
        return tuple(path for item in result for path in written_by(item))
    return tuple(Path(path) for path in result.written)


@dataclass(frozen=True)
class StageTask:
    command: str
    arguments: tuple[str, ...]
    folder: str  # the run's folder: the stage's relative paths are from there
    writes_in: tuple[str, ...]  # the folders its outputs go to (it writes those files only)
    records_in: str  # the records' folder, as the arguments give it (it writes anywhere under it)
    may_fail: bool = False  # a stage of an optional backend: its error comes back as StageFiles.failed, the wave goes on


@dataclass(frozen=True)
class StageFiles:
    """What a stage task made: each file it wrote (its path as the driver writes it) with its bytes, in an
    order that keeps a model's companions ahead of it; the files its command names; its seconds."""

    files: tuple[tuple[str, bytes], ...]
    named: tuple[str, ...]
    seconds: float
    failed: str | None = None  # the error of a stage that may fail (it made nothing)

    def write(self) -> None:
        """The driver's part: each file written (temporary file, then rename)."""
        for path, data in self.files:
            write_bytes(Path(path), data)


def run_stage_task(task: StageTask, run_command: RunCommand) -> StageFiles:
    """One stage as a task, on a worker of the machine (or of a cluster that shares the run's folder): its
    command run in a view of the run's folder; the files it wrote returned, not written."""
    folder = Path(task.folder)
    if not folder.is_dir():
        raise PtqError(f"{task.folder}: not on the worker's machine ({platform.node()}); on a cluster, ptq run needs its folder "
                       "on a filesystem every node shares")
    began, before = time.perf_counter(), Path.cwd()
    with tempfile.TemporaryDirectory(prefix="ptq-stage-") as scratch_name:
        scratch = Path(scratch_name)
        records = Path(os.path.normpath(folder / task.records_in))
        inside = records.is_relative_to(folder)
        records_view = scratch / records.relative_to(folder) if inside else scratch / OUTSIDE
        _view(folder, scratch, {folder / name for name in task.writes_in}, records if inside else None)
        if not inside:
            _view(records, records_view, set(), records) if records.is_dir() else records_view.mkdir()
        arguments = task.arguments if inside else tuple(str(records_view) if argument == task.records_in else argument for argument in task.arguments)
        os.chdir(scratch)
        try:
            named = tuple(str(path) for path in written_by(run_command(task.command, arguments)))
        except PtqError as error:
            if not task.may_fail or isinstance(error, Interrupted):
                raise
            return StageFiles((), (), time.perf_counter() - began, str(error))
        finally:
            os.chdir(before)
        made = _made(scratch, folder, (records_view, records))
        if not inside:
            named = tuple(str(records / Path(path).relative_to(records_view)) if Path(path).is_relative_to(records_view) else path for path in named)
    return StageFiles(_companions_first(made), named, time.perf_counter() - began)


def _view(source: Path, view: Path, shallow: set[Path], deep: Path | None) -> None:
    """`view` as `source`: real folders on the way to a folder written into (`shallow`: its files; `deep`:
    everything under it), links for every other entry."""
    view.mkdir(exist_ok=True)
    for written in shallow | ({deep} if deep else set()):
        if written.is_relative_to(source) and not written.exists():
            (view / written.relative_to(source)).mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        target = view / entry.name
        on_the_way = any(written.is_relative_to(entry) for written in shallow | ({deep} if deep else set()))
        if entry.is_dir() and not entry.is_symlink() and (on_the_way or (deep is not None and entry.is_relative_to(deep))):
            _view(entry, target, shallow, deep)
        elif not target.exists():
            target.symlink_to(entry)


def _made(scratch: Path, folder: Path, records: tuple[Path, Path]) -> dict[str, bytes]:
    """Every whole file the command wrote in the view (links are the run's own files), by the path it has
    for the driver: in the run's folder, or in the records' folder outside it."""
    records_view, records_folder = records
    made: dict[str, bytes] = {}
    for root, _, names in os.walk(scratch):
        for name in names:
            path = Path(root) / name
            if path.is_symlink() or is_temporary(path):
                continue
            if path.is_relative_to(records_view) and not records_folder.is_relative_to(folder):
                made[str(records_folder / path.relative_to(records_view))] = path.read_bytes()
            else:
                made[str(folder / path.relative_to(scratch))] = path.read_bytes()
    return made


def _companions_first(made: dict[str, bytes]) -> tuple[tuple[str, bytes], ...]:
    """The files in an order where a model's companions (weights beside an .xml, external data) come before it,
    so that a reader never finds a model without them."""
    companion = {str(other) for path in made for other in companions(Path(path))[1:]}
    return tuple(sorted(made.items(), key=lambda item: (item[0] not in companion, item[0])))
