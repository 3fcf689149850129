"""Bad input: one line naming the file or option, exit code 2, no traceback, no output left behind."""

from __future__ import annotations

import pytest

from conftest import CIFAR, assert_clean_failure, ptq
from ptq_cli.services import cifar


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
    for command in (["quantize", "--model", "nope.onnx"], ["evaluate", "--model", "nope.onnx"]):
        run = ptq(*command, cwd=tmp_path)
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


def test_truncated_test_batch(tmp_path, data_copy, pipeline):
    _truncate(data_copy, "test_batch")
    run = ptq("evaluate", "--model", pipeline / "models" / "resnet8.onnx", "--data-dir", data_copy, "--results-dir", "res", cwd=tmp_path)
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


def test_unknown_dtype_before_any_work(tmp_path, pipeline):
    run = ptq("quantize", "--model", pipeline / "models" / "resnet8.onnx", "--dtype", "int16", "--output", "q.onnx", cwd=tmp_path)
    assert_clean_failure(run, 2, "--dtype")
    assert _files(tmp_path) == []


def test_missing_calibration_file(tmp_path, pipeline):
    run = ptq("quantize", "--model", pipeline / "models" / "resnet8.onnx", "--calibration", "none.npz", "--output", "q.onnx", cwd=tmp_path)
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
    (results / "resnet8.onnx.json").write_bytes((pipeline / "results" / "resnet8.onnx.json").read_bytes())
    (results / "broken.json").write_text('{"model_path": ')
    run = ptq("report", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "broken.json" in run.stdout and "resnet8.onnx" in run.stdout


def test_missing_keras_file(tmp_path, assets):
    run = ptq("convert", "--keras", "missing.h5", cwd=tmp_path)
    assert_clean_failure(run, 2, "missing.h5")
    assert _files(tmp_path) == []
