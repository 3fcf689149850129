"""Speed features: the cached CIFAR decode, data-parallel inference, the benchmark command, --target speed."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
from conftest import CIFAR, assert_clean_failure, benchmark_of, cifar_split, ptq, ptq_ok, read_json, record_of

from ptq_cli import settings
from ptq_cli.backends.pytorch import TORCH_CHUNK
from ptq_cli.datasets import cifar10 as cifar
from ptq_cli.quantize.policy import chosen_method
from ptq_cli.services.models import load_model as load_onnx
from ptq_cli.services.models import load_model as load_torchscript


def test_cifar_cache_is_used_and_invalidated_when_a_file_changes(tmp_path, monkeypatch, assets):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    data = tmp_path / "cifar"
    data.mkdir()
    for name in (cifar.TEST_BATCH, cifar.META_FILE):
        shutil.copy(CIFAR / name, data / name)
    first = cifar.Cifar10(data).load("test")
    cached = sorted((tmp_path / "cache").glob("*.npz"))  # beside the cache's key
    assert len(cached) == 1
    again = cifar.Cifar10(data).load("test")
    assert np.array_equal(first.images, again.images) and sorted((tmp_path / "cache").glob("*.npz")) == cached

    # Change one label in test_batch: the next load must see it, never the cached arrays.
    with (data / cifar.TEST_BATCH).open("rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    batch[b"labels"][0] = (batch[b"labels"][0] + 1) % 10
    with (data / cifar.TEST_BATCH).open("wb") as handle:
        pickle.dump(batch, handle, protocol=2)
    changed = cifar.Cifar10(data).load("test")
    assert changed.labels[0] == (first.labels[0] + 1) % 10
    assert np.array_equal(changed.labels[1:], first.labels[1:])
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2


def test_data_parallel_inference_matches_one_thread(pipeline):
    images = cifar_split("test").images[:300].astype(np.float32)
    for name in ("resnet8.onnx", "resnet8_uint8.onnx"):
        one = load_onnx(pipeline / "models" / name, threads=1).predict(images)
        two = load_onnx(pipeline / "models" / name, threads=2).predict(images)
        assert np.array_equal(one.argmax(axis=1), two.argmax(axis=1))
        assert np.allclose(one, two, atol=1e-5)


def test_torchscript_large_batch_runs_in_chunks_with_the_same_results(pipeline):
    images = cifar_split("test").images[: 3 * TORCH_CHUNK + 5].astype(np.float32)
    for name in ("resnet8.pt", "resnet8_pytorch_int8.pt"):
        model = load_torchscript(pipeline / "models" / name)
        whole = model.predict(images)
        one_by_one = np.concatenate([model.predict(images[start:start + 7]) for start in range(0, len(images), 7)])
        assert whole.shape == (len(images), 10)
        assert np.allclose(whole, one_by_one, atol=1e-5) and np.array_equal(whole.argmax(axis=1), one_by_one.argmax(axis=1))


def test_target_speed_quantizes_u8s8_per_channel_within_budget(pipeline):
    """The study's `ptq quantize --target speed` stage (the command as a user types it, in the manifest), as its
    record has it: u8s8 per channel, the range method `--method auto` chose, within 0.3 points of FP32."""
    (stage,) = [stage for stage in read_json(pipeline / "results" / "manifest.json")["stages"] if stage["name"] == "quantize resnet8_uint8_speed.onnx"]
    assert "--target speed" in stage["command"] and "--dtype" not in stage["command"]
    record = record_of(pipeline / "results", "resnet8_uint8_speed.onnx")
    assert record["model_sha256"] == stage["outputs"]["models/resnet8_uint8_speed.onnx"]
    settings_used = record["quantization"]
    assert (settings_used["dtype"], settings_used["weight_dtype"], settings_used["per_channel"]) == ("uint8", "int8", True)
    kept = chosen_method(tuple(tuple(score) for score in settings_used["method_sqnr_db"]))  # --method auto
    assert (settings_used["method"], settings_used["percentile"]) == kept
    assert settings_used["target"] == "speed"
    assert record["accuracy"] >= 87.19 - 0.3


def test_benchmark_records_latency_and_throughput_and_report_uses_them(pipeline, tmp_path):
    for name in ("resnet8.onnx", "resnet8_int8.onnx"):
        found = next((pipeline / "results").glob(f"{name}-??????@*.json"))
        shutil.copy(found, tmp_path / found.name)
    results = tmp_path
    run = ptq_ok("benchmark", "--model", "models/resnet8.onnx", "--model", "models/resnet8_int8.onnx", "--runs", "5",
                 "--batch-size", "64", "--results-dir", results, "--json", cwd=pipeline)
    figures = {row["model_path"]: row for row in json.loads(run.stdout)}
    fp32, int8 = figures["models/resnet8.onnx"], figures["models/resnet8_int8.onnx"]
    for row in (fp32, int8):
        assert 0 < row["latency_ms_p50"] <= row["latency_ms_p95"] <= row["latency_ms_p99"]
        assert row["batch_size"] == 64 and row["runs"] == 5 and row["images_per_second"] > 0
    assert fp32["speedup_vs_fp32"] is None
    assert int8["speedup_vs_fp32"] == round(int8["images_per_second"] / fp32["images_per_second"], 3)
    saved = benchmark_of(results, "resnet8_int8.onnx")  # speed is not tied to a dataset
    assert saved["images_per_second"] == int8["images_per_second"]

    report = json.loads(ptq_ok("report", "--results-dir", results, "--json", cwd=pipeline).stdout)
    rows = {row["model"]: row for row in report["groups"][0]["rows"]}
    assert rows["resnet8_int8.onnx"]["speed_source"] == "benchmark"
    assert rows["resnet8_int8.onnx"]["images_per_second"] == int8["images_per_second"]
    assert rows["resnet8_int8.onnx"]["latency_ms_p50"] == int8["latency_ms_p50"]
    assert rows["resnet8_int8.onnx"]["speedup"] == round(int8["images_per_second"] / fp32["images_per_second"], 3)


def test_benchmark_rejects_bad_options(resnet8_onnx, tmp_path):
    run = ptq("benchmark", "--model", resnet8_onnx, "--runs", "0", "--results-dir", "r", cwd=tmp_path)
    assert_clean_failure(run, 2, "--runs")
    assert list(tmp_path.iterdir()) == []


def test_thread_count_below_one_is_refused(pipeline, tmp_path):
    for model in ("resnet8.onnx", "resnet8.pt"):
        run = ptq("evaluate", "--model", pipeline / "models" / model, "--threads", "0", "--results-dir", "r", cwd=tmp_path)
        assert_clean_failure(run, 2, "--threads")
    assert list(tmp_path.iterdir()) == []
