"""Numbers tied to the bytes they measured, and no traceback, no leftover, under faults and bad input.
In-process on tests/synthetic.py's tiny classifier and images."""

from __future__ import annotations

import builtins
import errno
import io
import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic import CLASSES, channel_mean_classifier, colour_images, colours_npz, colours_project, invoke, ok, one_line_error

from ptq_cli import settings
from ptq_cli.errors import PtqError


def files_under(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()) if directory.exists() else []


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """models/m.onnx and colours.npz, with a private decoded-data cache."""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return colours_project(tmp_path)



def report_rows(cwd: Path, *extra) -> dict[str, dict]:
    report = json.loads(ok("report", "--json", *extra, cwd=cwd).stdout)
    return {row["model"]: row for group in report["groups"] for row in group["rows"]}


# Leftovers of a killed run.

def test_leftover_temporary_files_are_never_models_and_the_next_write_removes_them(project):
    leftovers = [project / "models" / ".m_uint8.onnx.4194303-k3j2ab_9.partial.onnx", project / "models" / ".m.pt.4194302-abcdefgh.partial.pt"]
    for leftover in leftovers:
        leftover.write_bytes(b"")  # a 0-byte leftover broke evaluate and benchmark
    # Files of the user's that only look like leftovers are never deleted: ptq did not name them.
    kept = [project / "models" / ".notes.partial.txt", project / "models" / ".m.onnx.12-abc.partial.onnx", project / "models" / ".x.onnx.4194303-k3j2ab_9.partial.pt"]
    for path in kept:
        path.write_bytes(b"mine")
    result = ok("evaluate", "--data", "colours.npz", "--json", cwd=project)
    assert Path(json.loads(result.stdout)["model_path"]).name == "m.onnx"  # one model: one record
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/m_uint8.onnx", cwd=project)
    assert not any(leftover.exists() for leftover in leftovers)  # no process 4194303 runs: its file goes
    assert all(path.read_bytes() == b"mine" for path in kept)
    assert [name for name in files_under(project / "models") if not name.startswith(".")] == ["m.onnx", "m_uint8.onnx"]


# Every figure tied to the bytes it measured.

def test_report_marks_a_changed_model_stale_and_a_deleted_one_missing(project):
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/q.onnx", cwd=project)
    ok("evaluate", "--data", "colours.npz", cwd=project)
    assert {row["model"]: row["status"] for row in report_rows(project).values()} == {"m.onnx": "ok", "q.onnx": "ok"}
    # Re-quantized with other settings: the file changes, its record does not.
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--dtype", "uint8", "--output", "models/q.onnx", cwd=project)
    rows = report_rows(project)
    assert rows["q.onnx"]["status"] == "stale" and rows["m.onnx"]["status"] == "ok"
    text = ok("report", cwd=project).stdout
    assert "stale" in text and "--refresh" in text
    refreshed = report_rows(project, "--refresh")
    assert refreshed["q.onnx"]["status"] == "ok"
    assert refreshed["q.onnx"]["dtype"] == "uint8"
    (project / "models" / "q.onnx").unlink()
    assert report_rows(project)["q.onnx"]["status"] == "missing"


def test_two_models_with_one_file_name_in_two_folders_keep_two_records(project):
    (project / "other").mkdir()
    channel_mean_classifier(project / "other" / "m.onnx", layout="NHWC")
    ok("evaluate", "--model", "models/m.onnx", "--model", "other/m.onnx", "--data", "colours.npz", "--results-dir", "res", cwd=project)
    records = [json.loads(path.read_text()) for path in (project / "res").glob("*.json")]
    assert sorted(record["model_input"][:4] for record in records) == ["NCHW", "NHWC"]


# The cache verifies what it serves.

@pytest.mark.parametrize("damage", ["empty", "npy", "labels changed", "directory"])
def test_a_damaged_cache_file_is_rebuilt_never_served_never_fatal(project, damage):
    ok("evaluate", "--data", "colours.npz", "--results-dir", "first", cwd=project)
    (cache,) = (project / "cache").glob("*test*.npz")
    if damage == "empty":
        cache.write_bytes(b"")
    elif damage == "npy":
        np.save(cache.open("wb"), np.zeros(3))
    elif damage == "directory":
        cache.unlink()
        cache.mkdir()
    else:
        with np.load(cache) as data:
            arrays = dict(data)
        arrays["labels"] = np.zeros_like(arrays["labels"])  # digest stays: the arrays no longer match it
        np.savez(cache, **arrays)
    ok("evaluate", "--data", "colours.npz", "--results-dir", "second", cwd=project)
    first, second = (json.loads(next((project / name).glob("*.json")).read_text()) for name in ("first", "second"))
    assert second["correct"] == first["correct"] == 18


# Disk full, injected as ENOSPC on every file opened for writing under the project.

@pytest.fixture
def full_disk(project, monkeypatch):
    real_open = builtins.open

    class Full(io.RawIOBase):
        def __init__(self, name):
            self.name = name

        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.name))

    def fake_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(flag in mode for flag in "wax") and str(project) in str(Path(file).absolute()) and "cache" not in str(file):
            return io.BufferedWriter(Full(file)) if "b" in mode else io.TextIOWrapper(io.BufferedWriter(Full(file)))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    return project


@pytest.mark.parametrize("command, named", [
    (("evaluate", "--data", "colours.npz"), "results/"),
    (("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/q.onnx"), "models/q.onnx: cannot write"),
    (("calibrate", "--data", "colours.npz", "--samples-per-class", "2"), "calibration/"),
])
def test_disk_full_is_one_line_naming_the_output_and_leaves_nothing(full_disk, command, named):
    before = files_under(full_disk)
    result = invoke(*command, cwd=full_disk)
    one_line_error(result, named)  # the output that could not be written, never the model read
    assert "models/m.onnx" not in result.stderr
    assert [name for name in files_under(full_disk) if "cache" not in name] == [name for name in before if "cache" not in name]


def test_report_on_a_full_disk(project, monkeypatch):
    ok("evaluate", "--data", "colours.npz", cwd=project)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "reports/QUANTIZATION_ANALYSIS.md")

    monkeypatch.setattr(Path, "write_text", no_space)
    one_line_error(invoke("report", "--markdown", cwd=project), "No space left on device")
    assert not (project / "reports").exists() or files_under(project / "reports") == []


# Options checked before any work.

@pytest.mark.parametrize("option", [("--seed", "-1"), ("--seed", "1" * 30), ("--samples-per-class", "0"), ("--threads", "0"),
                                    ("--threads", "999"), ("--runs", "0")])
def test_run_options_are_checked_before_any_work(project, option):
    result = invoke("run", "--model", "models/m.onnx", "--data", "colours.npz", *option, cwd=project)
    one_line_error(result, option[0])
    assert files_under(project / "models") == ["m.onnx"] and not (project / "results").exists()


@pytest.mark.parametrize("command", [("calibrate", "--data", "colours.npz"), ("evaluate", "--data", "colours.npz"),
                                     ("benchmark", "--model", "models/m.onnx")])
@pytest.mark.parametrize("option", [("--seed", "-1"), ("--threads", "999"), ("--batch-size", "0"), ("--runs", "0")])
def test_numeric_options_are_range_checked(project, command, option):
    result = invoke(*command, *option, cwd=project)
    if result.exit_code == 2 and "No such option" in result.stderr:
        return  # not an option of this command
    one_line_error(result, option[0])


# Bad models.

def test_an_onnx_model_with_a_uint8_input_is_refused(project):
    import onnx

    model = onnx.load(str(project / "models" / "m.onnx"))
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.UINT8
    onnx.save(model, str(project / "u8.onnx"))
    one_line_error(invoke("evaluate", "--model", "u8.onnx", "--data", "colours.npz", cwd=project), "u8.onnx")


class TupleOut(torch.nn.Module):
    def forward(self, x):
        means = x.mean(dim=(2, 3))
        return means, means * 2


class DictOut(torch.nn.Module):
    def forward(self, x):
        return {"scores": x.mean(dim=(2, 3))}


def test_a_torchscript_model_returning_a_dict_is_refused_and_a_tuple_gives_its_first_output(project):
    torch.jit.save(torch.jit.trace(DictOut(), torch.zeros(1, 3, 8, 8), strict=False), str(project / "dict.pt"))
    one_line_error(invoke("evaluate", "--model", "dict.pt", "--data", "colours.npz", "--results-dir", "res", "--trust-remote-code", cwd=project), "dict.pt")
    assert not (project / "res").exists()
    # (scores, auxiliary) as detection-style exports return: the first output is the class scores, as for ONNX.
    torch.jit.save(torch.jit.trace(TupleOut(), torch.zeros(1, 3, 8, 8), strict=False), str(project / "tuple.pt"))
    result = ok("evaluate", "--model", "tuple.pt", "--data", "colours.npz", "--results-dir", "res", "--json", "--trust-remote-code", cwd=project)
    assert json.loads(result.stdout)["accuracy"] == 100.0


def test_a_model_that_outputs_nan_is_refused(project):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(project / "models" / "m.onnx"))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.full((3, 3), np.nan, np.float32), "weights"))
    onnx.save(model, str(project / "nan.onnx"))
    one_line_error(invoke("evaluate", "--model", "nan.onnx", "--data", "colours.npz", "--results-dir", "res", cwd=project), "NaN")
    assert not (project / "res").exists()


# Bad data.

def cifar_like(root: Path, labels: list, images: np.ndarray | None = None) -> Path:
    """A CIFAR-10-python-layout directory of 8x8-free 32x32 images (the format fixes 32x32x3)."""
    root.mkdir(parents=True)
    count = len(labels)
    pixels = np.zeros((count, 3072), np.uint8) if images is None else images
    for name in [f"data_batch_{index}" for index in range(1, 6)] + ["test_batch"]:
        with open(root / name, "wb") as handle:
            pickle.dump({b"data": pixels, b"labels": labels}, handle)
    with open(root / "batches.meta", "wb") as handle:
        pickle.dump({b"label_names": [b"a", b"b", b"c"]}, handle)
    return root


@pytest.mark.parametrize("labels, mentions", [([], "no images"), (["cat", "dog"], "labels")], ids=["empty", "string labels"])
def test_an_empty_or_string_labelled_test_batch_is_refused(project, labels, mentions):
    channel_mean_classifier(project / "big.onnx", size=32)
    cifar_like(project / "cifar", labels, np.zeros((len(labels), 3072), np.uint8))
    one_line_error(invoke("evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "res", cwd=project), "cifar")
    assert not (project / "res").exists()


@pytest.mark.parametrize("images, mentions", [
    (np.zeros((0, 8, 8, 3), np.uint8), "N > 0"),
    (np.full((3, 8, 8, 3), np.nan, np.float32), "uint8"),
    (np.random.default_rng(0).random((3, 8, 8, 3)).astype(np.float32), "uint8"),  # scaled to 0-1
], ids=["no images", "NaN", "scaled 0-1"])
def test_a_bad_calibration_file_is_refused_before_anything_is_written(project, images, mentions):
    np.savez(project / "calib.npz", images=images, labels=np.zeros(len(images), np.int64), indices=np.arange(len(images)),
             seed=np.int64(0), samples_per_class=np.int64(1), class_names=np.array(CLASSES))
    result = invoke("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx", cwd=project)
    one_line_error(result, "calib.npz")
    assert mentions in result.stderr and not (project / "q.onnx").exists()


def test_labels_all_of_one_class_give_a_record_without_nan(project):
    images, _ = colour_images(4, seed=3)
    colours_npz(project / "zeros.npz", test_images=images, test_labels=np.zeros(len(images), np.int64))
    result = ok("evaluate", "--data", "zeros.npz", "--results-dir", "res", "--json", cwd=project)
    text = next((project / "res").glob("*.json")).read_text()

    def refuse(name):
        raise AssertionError(f"{name} in a record")

    record = json.loads(text, parse_constant=refuse)
    json.loads(result.stdout, parse_constant=refuse)
    assert record["per_class_accuracy"][1:] == [None, None]


# The command line itself.

def test_ptq_alone_prints_help_and_no_error(project):
    result = invoke(cwd=project)
    assert result.exit_code == 0 and "Usage" in result.stdout and "Error" not in result.output


def test_help_shows_every_default_and_name_whole():
    """Markdown help mode ate `_pruned` (italics) and `<model file>` (an HTML tag)."""
    import typer.main

    from ptq_cli.cli import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        rendered = " ".join(invoke(name, "--help-all", cwd=Path.cwd()).stdout.replace("│", " ").split())
        for param in command.params:
            if type(param).__name__ != "TyperOption" or not param.help:
                continue
            for token in re.findall(r"\S*[_<*]\S*", param.help):
                assert token.strip("`.,;()") in rendered.replace("`", ""), (name, param.name, token)


# What the user sees.

def test_run_ends_with_the_comparison_table(project):
    result = ok("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-benchmark", cwd=project)
    after_stages = result.stdout.split("stages ran in", 1)[1]
    assert "Quantization report" in after_stages and "Top-1" in after_stages
    for name in ("m.onnx", "m_int8.onnx", "m_uint8.onnx", "m_uint8_speed.onnx"):
        assert name in after_stages


def test_the_report_fits_80_columns_without_cutting_a_number_and_keys_a_long_name(project):
    long_name = project / "models" / "m_pytorch_int8_tuned_with_a_long_name.onnx"
    long_name.write_bytes((project / "models" / "m.onnx").read_bytes())
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/m_uint8_speed.onnx", "--target", "speed", cwd=project)
    ok("evaluate", "--data", "colours.npz", cwd=project)
    report = json.loads(ok("report", "--json", cwd=project).stdout)
    result = invoke("report", cwd=project, columns=80)
    assert result.exit_code == 0 and f"(a) {long_name.name}" in result.stdout.splitlines()  # cut in the table, whole below it
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    for row in report["groups"][0]["rows"]:  # every figure of the table whole: top-1 (in the title or its column), the speed-up
        assert f"{row['accuracy']:.2f}" in result.stdout
        assert row["speedup"] is None or f"{row['speedup']:.2f}x" in result.stdout


def test_per_class_marks_an_fp32_reference_whose_file_changed(project):
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/q.onnx", cwd=project)
    ok("evaluate", "--data", "colours.npz", cwd=project)
    channel_mean_classifier(project / "models" / "m.onnx", layout="NHWC")  # the FP32 file changes
    result = ok("evaluate", "--model", "models/q.onnx", "--data", "colours.npz", "--per-class", cwd=project)
    assert "FP32 record stale" in result.stdout


def test_sigterm_ends_ptq_like_ctrl_c_with_nothing_half_written(project):
    """A real process: `kill` (SIGTERM) during a long benchmark: exit 143 (as the README says), one line, no record, no temp file."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, settings.CACHE_ENV: str(project / "cache")}
    process = subprocess.Popen([sys.executable, "-m", "ptq_cli", "benchmark", "--model", "models/m.onnx", "--data", "colours.npz",
                                "--runs", "10000", "--batch-size", "100000"],  # the most runs, of a large batch: minutes
                               cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (project / "cache").exists() and process.poll() is None:
        time.sleep(0.1)  # the cache appears once ptq has loaded the data: it is past its imports
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in stderr
    assert not (project / "results").exists() and files_under(project / "models") == ["m.onnx"]


def test_a_full_disk_behind_standard_output_is_named(tmp_path):
    """`ptq ... > /dev/full`: one line naming standard output, exit 2 (a real process: the stream is the point)."""
    import subprocess
    import sys

    from synthetic import channel_mean_classifier, photo_folder

    channel_mean_classifier(tmp_path / "m.onnx", size=16, classes=5)
    photo_folder(tmp_path / "photos", count=4, size=16)
    with open("/dev/full", "w") as full:
        process = subprocess.run([sys.executable, "-m", "ptq_cli", "evaluate", "--model", "m.onnx", "--data", "photos"], cwd=tmp_path,
                                 stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    assert process.returncode == 2 and lines == ["Error: standard output: cannot write (No space left on device)"], process.stderr


def test_no_output_is_a_file_or_folder_the_command_reads(tmp_path):
    """By a hard link, a symbolic link or a path inside an image folder it reads: refused before writing, inputs unchanged."""
    import os

    from synthetic import channel_mean_classifier, colours_npz, image_folder, invoke, one_line_error

    channel_mean_classifier(tmp_path / "m.onnx")
    image_folder(tmp_path / "folder")
    colours_npz(tmp_path / "colours.npz")
    os.link(tmp_path / "colours.npz", tmp_path / "hard.npz")
    os.symlink(tmp_path / "m.onnx", tmp_path / "soft.onnx")
    before = {path.name: path.read_bytes() for path in (tmp_path / "m.onnx", tmp_path / "colours.npz")}
    one_line_error(invoke("calibrate", "--data", "colours.npz", "--output", "hard.npz", cwd=tmp_path), "colours.npz")
    one_line_error(invoke("quantize", "--model", "m.onnx", "--data", "colours.npz", "--output", "soft.onnx", cwd=tmp_path), "m.onnx")
    one_line_error(invoke("calibrate", "--data", "folder", "--output", "folder/test/cal.npz", cwd=tmp_path), "a folder this command reads")
    assert {path.name: path.read_bytes() for path in (tmp_path / "m.onnx", tmp_path / "colours.npz")} == before
    assert not (tmp_path / "folder" / "test" / "cal.npz").exists()


def test_a_model_named_at_the_file_name_limit_gets_a_record(tmp_path):
    """A 245-byte model name: its record's name is shortened with a digest (never "File name too long"), and reads back."""
    import shutil

    from synthetic import channel_mean_classifier, colours_npz, invoke

    channel_mean_classifier(tmp_path / "m.onnx")
    colours_npz(tmp_path / "colours.npz")
    long_name = "é" * 60 + "m" * 120 + ".onnx"  # 245 bytes in UTF-8
    assert len(long_name.encode()) == 245
    shutil.copy(tmp_path / "m.onnx", tmp_path / long_name)
    result = invoke("evaluate", "--model", long_name, "--data", "colours.npz", "--results-dir", "res", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    (record,) = (tmp_path / "res").glob("*.json")
    assert len(record.name.encode()) <= 255
    report = json.loads(invoke("report", "--results-dir", "res", "--json", cwd=tmp_path).stdout)
    assert [row["model"] for row in report["groups"][0]["rows"]] == [long_name]


def test_library_warnings_are_said_once_after_the_output_and_never_beside_an_error(project, monkeypatch):
    """A library's warnings are not hidden: each distinct one once, after the command's own output, naming its category
    and package; where the command fails, the one error line stays alone."""
    import warnings

    from ptq_cli.services.measure import evaluate as evaluate_service

    real_evaluate = evaluate_service.evaluate

    def warning_evaluate(*args, **kwargs):
        for _ in range(3):
            warnings.warn("this call is deprecated", DeprecationWarning, stacklevel=1)
        yield from real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluate_service, "evaluate", warning_evaluate)
    shown = invoke("evaluate", "--data", "colours.npz", "--json", cwd=project)
    assert shown.exit_code == 0, shown.output
    json.loads(shown.stdout)  # the output itself is untouched
    said = [line for line in shown.stderr.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and re.fullmatch(r"warning: this call is deprecated \(DeprecationWarning, [\w.]+\)", said[0]), shown.stderr
    assert shown.stderr.rstrip().endswith(said[0])

    def failing_evaluate(*args, **kwargs):
        warnings.warn("this call is deprecated", DeprecationWarning, stacklevel=1)
        raise PtqError("colours.npz: broken")
        yield

    monkeypatch.setattr(evaluate_service, "evaluate", failing_evaluate)
    one_line_error(invoke("evaluate", "--data", "colours.npz", cwd=project), "colours.npz: broken")


def test_a_librarys_logged_warning_is_said_after_the_output_as_warnings_are(project, monkeypatch):
    """torchao logs "Failed to load ..." through a logger with no handler of its own, which Python prints wherever it
    happens (through a table or a progress line): it is kept and said once after the output, as warnings are."""
    import logging

    from ptq_cli.services.measure import evaluate as evaluate_service

    real_evaluate = evaluate_service.evaluate

    def logging_evaluate(*args, **kwargs):
        for _ in range(2):
            logging.getLogger("somelibrary.extensions").warning("Failed to load %s", "_C_cuda.so")
        yield from real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluate_service, "evaluate", logging_evaluate)
    shown = invoke("evaluate", "--data", "colours.npz", "--json", cwd=project)
    assert shown.exit_code == 0, shown.output
    json.loads(shown.stdout)
    said = [line for line in shown.stderr.splitlines() if "_C_cuda.so" in line]
    assert len(said) == 1 and re.fullmatch(r"warning: Failed to load _C_cuda\.so \(log, [\w.]+\)", said[0]), shown.stderr
    assert shown.stderr.rstrip().endswith(said[0])
    assert logging.getLogger().handlers == [handler for handler in logging.getLogger().handlers if type(handler).__name__ != "_KeepLogged"]


def test_a_logged_warning_whose_arguments_do_not_fit_its_text_is_said_as_written(project, monkeypatch):
    """A library's log call whose arguments do not fit its format string does not break the command after its output."""
    import logging

    from ptq_cli.services.measure import evaluate as evaluate_service

    real_evaluate = evaluate_service.evaluate

    def logging_evaluate(*args, **kwargs):
        logging.getLogger("somelibrary").warning("loaded %s from %s", "only one")
        yield from real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluate_service, "evaluate", logging_evaluate)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # as a released program runs: pytest's own log handler raises otherwise
    shown = invoke("evaluate", "--data", "colours.npz", "--json", cwd=project)
    assert shown.exit_code == 0, shown.output
    assert re.search(r"^warning: loaded %s from %s \(log, [\w.]+\)$", shown.stderr, re.MULTILINE), shown.stderr
