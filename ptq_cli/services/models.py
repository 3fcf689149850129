"""Model files as the services see them: loaded through the backend table (the backend chosen by a file's
content, not its name), found in a folder, and checked against a dataset's classes."""

from __future__ import annotations

from pathlib import Path

from ptq_cli import backends, inputs
from ptq_cli.backends.base import LoadedModel, RunOptions
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded, hardstop, trust
from ptq_cli.guards.atomic import is_temporary
from ptq_cli.model_file import read_bytes


def models_in(directory: Path, suffixes: tuple[str, ...]) -> tuple[list[Path], list[Path]]:
    """(model files in `directory` that can be loaded, those left out): a TorchScript file ptq did not write
    runs code when loaded, so a folder scan never loads it (the user names it with the trust option)."""
    found, skipped = [], []
    for path in sorted(Path(directory).glob("*")):
        if path.suffix not in suffixes or is_temporary(path) or not path.is_file():
            continue
        if backends.loads_code(path) and not trust.trusting():
            try:
                written = trust.written_by_ptq(read_bytes(path))
            except PtqError:
                written = False
            if not written:
                skipped.append(path)
                continue
        found.append(path)
    return found, skipped


def check_classes(path: Path, model_classes: int, class_names: tuple[str, ...], where: Path | str) -> None:
    if model_classes != len(class_names):
        raise PtqError(f"{path}: the model gives {model_classes} class scores, but {where} has {len(class_names)} classes")


def input_of(path: Path, flags: inputs.PreprocessingFlags | None = None) -> inputs.ModelInput:
    """What a model takes (layout, channels, size, batch), read from its file where the backend can, else by loading it."""
    row = backends.for_file(path)
    return row.read_input(Path(path), flags.size if flags else None) if row.read_input is not None else load_model(path, 1, flags).input


def load_model(path: Path, threads: int | None = None, flags: inputs.PreprocessingFlags | None = None, runtime: str | None = None,
               precision: str | None = None, exact_int8: bool = False, saturating_int8: bool = False) -> LoadedModel:
    """The runner for a model file, the backend chosen by the file's content, not its name; `runtime` runs
    a file on another runtime that takes it (an ONNX file on OpenVINO), with the `precision` hint;
    `exact_int8` asks a runtime with a switch for its exact u8 x s8 kernels on a CPU without VNNI; `saturating_int8`
    one that can pick them for the kernels of CPUs without VNNI on a CPU with it."""
    backend = backends.for_file(path, runtime)
    precisions = backend.runtime.precisions
    if precision is not None and precision not in precisions:
        takes = f"one of {', '.join(precisions)}" if precisions else f"none: {path} runs on {backend.name}"
        raise PtqError(f"--precision: '{precision}' is not a precision hint of {backend.name} (it takes {takes})")
    bound = bounded.CALL_SECONDS.value()
    # Loading runs the model once on a probe image: a graph that never ends is reported, not waited on.
    stuck = f"{path}: loading it and running one image did not finish within {bound:,} s (raise {bounded.CALL_SECONDS.env} if it is only slow)"
    with hardstop.deadline(bound, stuck):
        return backend.runtime.load(Path(path), RunOptions(threads, flags or inputs.PreprocessingFlags(), precision, exact_int8, saturating_int8))
