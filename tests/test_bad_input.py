"""Bad input: one line naming the file or option, exit code 2, no traceback, no output left behind."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CIFAR, assert_clean_failure, ptq, ptq_ok, ptq_process, record_of

from ptq_cli.datasets import cifar10 as cifar


def _files(directory):
    return sorted(p.relative_to(directory) for p in directory.rglob("*") if p.is_file())


@pytest.fixture
def data_copy(tmp_path, assets):
    """A CIFAR directory of symlinks to the real batches, to break one file at a time."""
    data = tmp_path / "cifar"
    data.mkdir()
    for name in (*cifar.TRAIN_BATCHES, cifar.TEST_BATCH, cifar.META_FILE):
        (data / name).symlink_to(CIFAR / name)
    return data


def _truncate(data, name):
    real = (CIFAR / name).read_bytes()
    (data / name).unlink()
    (data / name).write_bytes(real[: len(real) // 3])


def test_missing_model_file(tmp_path, assets):
    # The installed entry point, as a shell sees it: its exit code and its stderr.
    for command in (["quantize", "--model", "nope.onnx"], ["evaluate", "--model", "nope.onnx"]):
        run = ptq_process(*command, cwd=tmp_path)
        assert_clean_failure(run, 2, "nope.onnx")
        assert "not found" in run.stderr
    assert _files(tmp_path) == []


def test_file_that_is_not_an_onnx_model(tmp_path, assets):
    (tmp_path / "fake.onnx").write_text("this is not a model\n" * 50)
    for command in (["quantize", "--model", "fake.onnx"], ["evaluate", "--model", "fake.onnx"]):
        run = ptq(*command, cwd=tmp_path)
        assert_clean_failure(run, 2, "fake.onnx")
        assert "not a valid ONNX model" in run.stderr
    assert [str(p) for p in _files(tmp_path)] == ["fake.onnx"]


def test_missing_data_directory(tmp_path):
    run = ptq("calibrate", "--data-dir", "no/such/dir", "--output", "c.npz", cwd=tmp_path)
    assert_clean_failure(run, 2, "no/such/dir")
    assert _files(tmp_path) == []


def test_truncated_training_batch(tmp_path, data_copy):
    _truncate(data_copy, "data_batch_3")
    run = ptq("calibrate", "--data-dir", data_copy, "--output", "out/c.npz", cwd=tmp_path)
    assert_clean_failure(run, 2, "data_batch_3")
    assert "truncated or corrupt" in run.stderr
    assert not (tmp_path / "out").exists()


def test_truncated_test_batch(tmp_path, data_copy, resnet8_onnx):
    _truncate(data_copy, "test_batch")
    run = ptq("evaluate", "--model", resnet8_onnx, "--data-dir", data_copy, "--results-dir", "res", cwd=tmp_path)
    assert_clean_failure(run, 2, "test_batch")
    assert not (tmp_path / "res").exists()


def test_missing_batches_meta(tmp_path, data_copy):
    (data_copy / "batches.meta").unlink()
    run = ptq("calibrate", "--data-dir", data_copy, "--output", "c.npz", cwd=tmp_path)
    assert_clean_failure(run, 2, "batches.meta")
    assert not (tmp_path / "c.npz").exists()


def test_unknown_dtype(tmp_path):
    run = ptq("quantize", "--dtype", "int4", cwd=tmp_path)
    assert_clean_failure(run, 2, "--dtype")
    assert "int4" in run.stderr
    assert _files(tmp_path) == []


def test_unknown_dtype_before_any_work(tmp_path, resnet8_onnx):
    run = ptq("quantize", "--model", resnet8_onnx, "--dtype", "int16", "--output", "q.onnx", cwd=tmp_path)
    assert_clean_failure(run, 2, "--dtype")
    assert _files(tmp_path) == []


def test_missing_calibration_file(tmp_path, resnet8_onnx):
    run = ptq("quantize", "--model", resnet8_onnx, "--calibration", "none.npz", "--output", "q.onnx", cwd=tmp_path)
    assert_clean_failure(run, 2, "none.npz")
    assert _files(tmp_path) == []


def test_report_without_records(tmp_path):
    (tmp_path / "results").mkdir()
    run = ptq("report", "--markdown", cwd=tmp_path)
    assert_clean_failure(run, 2, "results")
    assert _files(tmp_path) == []


def test_report_skips_a_corrupt_record_and_names_it(tmp_path, pipeline):
    results = tmp_path / "results"
    results.mkdir()
    source = next((pipeline / "results").glob("resnet8.onnx-??????@*.json"))
    (results / source.name).write_bytes(source.read_bytes())
    (results / "broken.json").write_text('{"model_path": ')
    run = ptq("report", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "broken.json" in run.stdout and "resnet8.onnx" in run.stdout


def test_missing_keras_file(tmp_path, assets):
    run = ptq("convert", "--keras", "missing.h5", cwd=tmp_path)
    assert_clean_failure(run, 2, "missing.h5")
    assert _files(tmp_path) == []


def _nchw_copy(source, target):
    """The same network behind a Transpose: an NCHW N x 3 x 32 x 32 input, as PyTorch exports make."""
    model = onnx.load(str(source))
    original = model.graph.input[0]
    nchw = onnx.helper.make_tensor_value_info("input_nchw", onnx.TensorProto.FLOAT, ["N", 3, 32, 32])
    model.graph.node.insert(0, onnx.helper.make_node("Transpose", ["input_nchw"], [original.name], perm=[0, 2, 3, 1]))
    model.graph.input.remove(original)
    model.graph.input.insert(0, nchw)
    onnx.save(model, str(target))


def _five_class_copy(source, target):
    model = onnx.load(str(source))
    scores = model.graph.output[0]
    for name, value in (("five_starts", 0), ("five_ends", 5), ("five_axes", 1)):
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([value], dtype=np.int64), name))
    model.graph.node.append(onnx.helper.make_node("Slice", [scores.name, "five_starts", "five_ends", "five_axes"], ["five_scores"]))
    model.graph.output.remove(scores)
    model.graph.output.append(onnx.helper.make_tensor_value_info("five_scores", onnx.TensorProto.FLOAT, ["N", 5]))
    onnx.save(model, str(target))


def test_nchw_model_is_detected_and_fed_transposed_images(tmp_path, resnet8_onnx):
    _nchw_copy(resnet8_onnx, tmp_path / "nchw.onnx")
    ptq_ok("evaluate", "--model", "nchw.onnx", "--results-dir", "res", cwd=tmp_path)
    assert record_of(tmp_path / "res", "nchw.onnx")["correct"] == 8719  # the NHWC model's 87.19%
    ptq_ok("quantize", "--model", "nchw.onnx", "--target", "speed", "--output", "nchw_q.onnx", cwd=tmp_path)
    ptq_ok("evaluate", "--model", "nchw_q.onnx", "--results-dir", "res", cwd=tmp_path)
    assert record_of(tmp_path / "res", "nchw_q.onnx")["accuracy"] >= 87.19 - 0.3  # calibrated on transposed images too
    # PyTorch's own layout is taken by the PyTorch backend too.
    ptq_ok("quantize", "--model", "nchw.onnx", "--backend", "pytorch", "--output", "nchw.pt", cwd=tmp_path)
    ptq_ok("evaluate", "--model", "nchw.pt", "--results-dir", "res", cwd=tmp_path)
    assert record_of(tmp_path / "res", "nchw.pt")["accuracy"] >= 87.19 - 0.5


def test_model_without_ten_class_scores_is_refused(tmp_path, resnet8_onnx):
    _five_class_copy(resnet8_onnx, tmp_path / "five.onnx")
    # Top-1 needs labels of the model's classes; calibrating and timing it do not (tests/test_datasets.py).
    for command in (["evaluate", "--model", "five.onnx", "--results-dir", "res"],):
        run = ptq(*command, cwd=tmp_path)
        assert_clean_failure(run, 2, "five.onnx")
        assert "class scores" in run.stderr
    assert _files(tmp_path) == [Path("five.onnx")]


def test_output_that_is_a_directory_or_empty_is_refused(tmp_path, pipeline):
    (tmp_path / "models").mkdir()
    model = pipeline / "models" / "resnet8.onnx"
    for command, mentions in ((["quantize", "--model", model, "--output", "models"], "models"), (["calibrate", "--output", ""], "."),
                              (["report", "--results-dir", pipeline / "results", "--markdown", "models"], "models")):
        run = ptq(*command, cwd=tmp_path)
        assert_clean_failure(run, 2, mentions)
        assert "is a directory" in run.stderr
    assert _files(tmp_path) == []


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can create files in, root included (tests often run as root, who ignores mode bits)."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    immutable = False
    if os.access(directory, os.W_OK) and shutil.which("chattr"):
        immutable = subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0
    try:
        (directory / "probe").touch()
    except OSError:
        pass
    else:
        pytest.fail(f"cannot make {directory} read-only here (chmod and chattr +i both ignored)")
    yield directory
    if immutable:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    directory.chmod(0o755)


def test_read_only_output_directory(tmp_path, pipeline, read_only_dir):
    model = pipeline / "models" / "resnet8.onnx"
    commands = (
        ["quantize", "--model", model, "--output", "read-only/q.onnx"],
        ["calibrate", "--output", "read-only/c.npz"],
        ["evaluate", "--model", model, "--results-dir", "read-only"],
        ["report", "--results-dir", pipeline / "results", "--markdown", "read-only/report.md"],
        ["convert", "--onnx", model, "--torch", "read-only/m.pt"],
    )
    for command in commands:
        run = ptq(*command, cwd=tmp_path)
        assert_clean_failure(run, 2, "read-only")
        assert "cannot write" in run.stderr
    run = ptq("run", cwd=read_only_dir)
    assert_clean_failure(run, 2, "cannot write")
    assert list(read_only_dir.iterdir()) == []


def _slow_classifier(target):
    """NHWC 32x32x3 in, 10 scores out, and about 100 million multiply-adds per image: evaluating the
    10,000 test images takes far longer than the test waits before pressing Ctrl-C."""
    helper, tensor = onnx.helper, onnx.numpy_helper.from_array
    width, depth = 1024, 100
    nodes = [helper.make_node("Reshape", ["images", "flat"], ["h0"]), helper.make_node("MatMul", ["h0", "w_in"], ["h1"])]
    nodes += [helper.make_node("MatMul", [f"h{i}", "w"], [f"h{i + 1}"]) for i in range(1, depth + 1)]
    nodes.append(helper.make_node("MatMul", [f"h{depth + 1}", "w_out"], ["scores"]))
    initializers = [
        tensor(np.array([-1, 3072], dtype=np.int64), "flat"),
        tensor(np.zeros((3072, width), dtype=np.float32), "w_in"),
        tensor(np.zeros((width, width), dtype=np.float32), "w"),
        tensor(np.zeros((width, 10), dtype=np.float32), "w_out"),
    ]
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, ["N", 32, 32, 3])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 10])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(target))


def test_ctrl_c_during_evaluation_leaves_no_record(tmp_path, assets):
    """SIGINT once `evaluate` shows its progress bar (stderr is a terminal here): exit 130, one line, no record."""
    _slow_classifier(tmp_path / "slow.onnx")
    env = {**os.environ, "PTQ_ASSETS": str(CIFAR.parent), "COLUMNS": "120"}
    primary, secondary = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "ptq_cli", "evaluate", "--model", "slow.onnx", "--results-dir", "res"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=secondary,
                               # as from an interactive shell: a background job (e.g. CI started with `&`) inherits SIGINT ignored
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(secondary)
    shown = _read_until(primary, b"Evaluating", seconds=120)
    shown += _read_until(primary, None, seconds=1.0)  # a second into the evaluation loop, still reading the terminal
    process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        shown += _read_until(primary, None, seconds=0.5)  # keep draining: a full terminal buffer would block the child
    shown += _read_until(primary, None, seconds=1)
    os.close(primary)
    if process.poll() is None:
        process.kill()
    stdout = process.stdout.read().decode()
    stderr = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", shown).decode(errors="replace")
    assert process.returncode == 130, (stdout, stderr)
    assert "Error: interrupted; no partial output was written" in stderr
    assert "Traceback" not in stderr + stdout
    assert _files(tmp_path) == [Path("slow.onnx")]


def _read_until(fd: int, marker: bytes | None, seconds: float) -> bytes:
    """What a terminal would show, read from a pty until `marker` appears (or the writer is gone)."""
    data, deadline = b"", time.monotonic() + seconds
    while (marker is None or marker not in data) and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            data += chunk
    return data
