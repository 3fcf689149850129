"""Edge cases on small synthetic data."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ptq_cli import settings
from ptq_cli.cli import _fill_optional_values
from ptq_cli.datasets import cifar10 as cifar
from ptq_cli.datasets import open_dataset
from ptq_cli.errors import CheckFailed, PtqError
from ptq_cli.guards.atomic import atomic_output, write_text
from ptq_cli.services.make.calibration import stratified_indices
from ptq_cli.services.make.convert import _checked_write, compare_outputs
from ptq_cli.services.measure.evaluation_records import EvaluationRecord, newest_per_measurement
from ptq_cli.services.measure.report import build_report


def test_stratified_indices_are_balanced_unique_and_seeded():
    labels = np.repeat(np.arange(10), 50)
    np.random.default_rng(0).shuffle(labels)
    first = stratified_indices(labels, 7, seed=3)
    assert np.bincount(labels[first], minlength=10).tolist() == [7] * 10
    assert len(np.unique(first)) == 70
    assert np.array_equal(first, stratified_indices(labels, 7, seed=3))
    assert not np.array_equal(first, stratified_indices(labels, 7, seed=4))


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "sub" / "model.onnx"
    with pytest.raises(RuntimeError), atomic_output(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert not target.exists()
    assert list((tmp_path / "sub").iterdir()) == []


def test_atomic_output_replaces_whole_file(tmp_path):
    target = tmp_path / "report.md"
    write_text(target, "old")
    write_text(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_failed_conversion_check_writes_nothing(tmp_path):
    reference = np.eye(10, dtype=np.float32)
    with pytest.raises(CheckFailed) as failure:
        _checked_write(tmp_path / "src", tmp_path / "out.onnx", lambda tmp: tmp.write_bytes(b"x"), reference, lambda tmp: reference + 2e-3)
    assert failure.value.exit_code == 1 and "max |diff|" in str(failure.value)
    assert list(tmp_path.iterdir()) == []


def test_conversion_check_allows_float_rounding_in_proportion_to_the_outputs():
    probabilities = np.full((2, 10), 0.1, dtype=np.float32)
    logits = probabilities * 400  # outputs up to 40
    assert compare_outputs(probabilities, probabilities + 5e-5).passed
    assert not compare_outputs(probabilities, probabilities + 5e-4).passed  # beyond 0.1% of 0.1
    assert compare_outputs(logits, logits + 3e-2).passed
    assert not compare_outputs(logits, logits + 5e-2).passed


def test_compare_outputs_counts_top1_agreement():
    reference = np.eye(4, dtype=np.float32)
    converted = reference.copy()
    converted[0] = [0, 2, 0, 0]
    check = compare_outputs(reference, converted)
    assert check.top1_agreement == 0.75 and check.max_abs_diff == 2.0 and not check.passed


def test_markdown_option_value_is_optional():
    assert _fill_optional_values(["report", "--markdown"]) == ["report", "--markdown", "reports/QUANTIZATION_ANALYSIS.md"]
    assert _fill_optional_values(["report", "--markdown", "--json"])[2] == "reports/QUANTIZATION_ANALYSIS.md"
    assert _fill_optional_values(["report", "--markdown", "x.md"]) == ["report", "--markdown", "x.md"]


def _batch_file(tmp_path, data, labels):
    path = tmp_path / "batch"
    with path.open("wb") as handle:
        pickle.dump({b"data": data, b"labels": labels}, handle, protocol=2)
    return path


def test_load_batch_converts_planar_rows_to_nhwc(tmp_path):
    data = np.zeros((2, 3072), dtype=np.uint8)
    data[1, 1024 + 5] = 200  # green plane, row 0, column 5 of image 1
    images, labels = cifar.load_batch(_batch_file(tmp_path, data, [3, 4]))
    assert images.shape == (2, 32, 32, 3) and images[1, 0, 5].tolist() == [0, 200, 0]
    assert labels.tolist() == [3, 4]


@pytest.mark.parametrize(
    "data, labels, problem",
    [
        (np.zeros((2, 100), dtype=np.uint8), [0, 1], "expected uint8 N x 3072"),
        (np.zeros((2, 3072), dtype=np.uint8), [0], "1 labels for 2 images"),
        (np.zeros((2, 3072), dtype=np.uint8), [0, 12], "labels outside"),
    ],
)
def test_load_batch_rejects_wrong_structure(tmp_path, data, labels, problem):
    with pytest.raises(PtqError, match=problem):
        cifar.load_batch(_batch_file(tmp_path, data, labels))


def _record(name, runtime, dtype, accuracy, size, speed, per_class, source="f.onnx", converted_from=None):
    """A quantized model is made from `source`; a float one from nothing, or converted from `converted_from`."""
    return EvaluationRecord(
        model_path=f"models/{name}", model_sha256=f"sha-{name}", model_size_bytes=size, runtime=runtime, dtype=dtype,
        quantization=None if dtype == "fp32" else {"dtype": dtype, "method": "minmax", "calibration_samples": 10},
        dataset="test_batch", images=100, correct=int(accuracy), accuracy=accuracy,
        class_names=["a", "b"], per_class_accuracy=per_class, confusion_matrix=[[1, 0], [0, 1]], images_per_second=speed,
        batch_size=10, threads=1, timestamp="t", tool_version="0", dataset_sha256="d",
        source_sha256=f"sha-{converted_from}" if converted_from else None if dtype == "fp32" else f"sha-{source}",
    )


def test_report_compares_each_model_with_its_framework_fp32():
    report = build_report([
        _record("q.onnx", "onnxruntime", "int8", 86.0, 100, 2000.0, [80.0, 92.0]),
        _record("f.onnx", "onnxruntime", "fp32", 87.0, 400, 1000.0, [85.0, 89.0]),
        _record("f.pt", "pytorch", "fp32", 87.0, 800, 500.0, [85.0, 89.0], converted_from="f.onnx"),
        _record("q.pt", "pytorch", "int8", 86.5, 200, 1000.0, [84.0, 89.0]),
    ])
    rows = {row.model: row for row in report.rows}
    assert [row.model for row in report.rows] == ["f.onnx", "q.onnx", "f.pt", "q.pt"]
    # Accuracy deltas against the FP32 source (f.onnx for both quantized models); size and speed against
    # the same runtime's FP32 model.
    assert (rows["q.onnx"].delta, rows["q.onnx"].reference) == (-1.0, "f.onnx")
    assert (rows["q.pt"].delta, rows["q.pt"].reference) == (-0.5, "f.onnx")
    assert rows["f.onnx"].delta is None and len(report.groups) == 1 and report.groups[0].baseline.model == "f.onnx"
    assert rows["q.onnx"].size_reduction == 0.75 and rows["q.onnx"].speedup == 2.0
    assert rows["q.pt"].size_reduction == 0.75 and rows["q.pt"].speedup == 2.0
    assert rows["f.onnx"].size_reduction is None
    assert (report.groups[0].class_losses[0].model, report.groups[0].class_losses[0].class_name, report.groups[0].class_losses[0].delta) == ("q.onnx", "a", -5.0)
    assert report.groups[0].recommendation.best_accuracy.model == "q.pt"
    assert report.groups[0].recommendation.smallest.model == "q.onnx"
    assert report.groups[0].recommendation.fastest is None  # both lose more than 0.10 points



def test_the_other_choices_say_what_the_best_was_ranked_by():
    """Top-1 on labels of the model's classes is accuracy, not faithfulness: a model can beat FP32 by chance."""
    from ptq_cli.render_report import describe_choices

    labelled = build_report([_record("q.onnx", "onnxruntime", "int8", 87.5, 100, 2000.0, [80.0, 92.0]),
                             _record("f.onnx", "onnxruntime", "fp32", 87.0, 400, 1000.0, [85.0, 89.0])])
    said = describe_choices(labelled.groups[0])
    assert "best accuracy q.onnx" in said and "faithful" not in said
    unlabelled = build_report([replace(_record("q.onnx", "onnxruntime", "int8", 0.0, 100, 2000.0, [0.0, 0.0]), accuracy=None, correct=None,
                                       per_class_accuracy=[], confusion_matrix=[], fidelity={"top1_agreement": 97.0, "top5_containment": 100.0}),
                               replace(_record("f.onnx", "onnxruntime", "fp32", 0.0, 400, 1000.0, [0.0, 0.0]), accuracy=None, correct=None,
                                       per_class_accuracy=[], confusion_matrix=[])])
    assert "most faithful q.onnx" in describe_choices(unlabelled.groups[0])

def _study(prefix, fp32_accuracy, int8_accuracy, fp32_size, fp32_speed):
    """One user's classifier and its 8-bit model, evaluated into a shared results folder."""
    fp32 = _record(f"{prefix}.onnx", "onnxruntime", "fp32", fp32_accuracy, fp32_size, fp32_speed, [fp32_accuracy] * 2)
    int8 = _record(f"{prefix}_int8.onnx", "onnxruntime", "int8", int8_accuracy, fp32_size // 4, fp32_speed * 3, [int8_accuracy] * 2,
                   source=f"{prefix}.onnx")
    return [fp32, int8]


def test_two_studies_in_one_results_folder_are_each_compared_with_their_own_source():
    import random

    from ptq_cli.render_report import report_markdown

    records = _study("alpha", 70.0, 69.0, 4000, 100.0) + _study("beta", 90.0, 88.5, 800, 1000.0)
    report = build_report(records)
    assert len(report.groups) == 2  # one study each, on the same images
    rows = {row.model: row for row in report.rows}
    assert (rows["alpha_int8.onnx"].reference, rows["alpha_int8.onnx"].delta) == ("alpha.onnx", -1.0)
    assert (rows["beta_int8.onnx"].reference, rows["beta_int8.onnx"].delta) == ("beta.onnx", -1.5)
    assert rows["alpha_int8.onnx"].speedup == 3.0 and rows["beta_int8.onnx"].speedup == 3.0
    assert rows["alpha_int8.onnx"].size_reduction == 0.75 and rows["beta_int8.onnx"].size_reduction == 0.75
    for group in report.groups:
        names = {row.model for row in group.rows}
        assert group.baseline.model in names and group.recommendation.best_accuracy.model in names
        assert group.label.endswith(f"models made from models/{group.baseline.model}")
    # The same records in any order (as a folder listing or a set may give them): the same report, byte for byte.
    first = report_markdown(report)
    for seed in range(10):
        shuffled = records[:]
        random.Random(seed).shuffle(shuffled)
        assert report_markdown(build_report(shuffled)) == first


def test_report_compares_openvino_rows_with_fp32_at_their_precision_and_with_onnxruntime_fp32():
    ort_fp32 = _record("f.onnx", "onnxruntime", "fp32", 87.0, 400, 1000.0, [85.0, 89.0])
    ov_f32 = replace(ort_fp32, runtime="openvino", precision="f32", images_per_second=800.0)
    ov_bf16 = replace(ort_fp32, runtime="openvino", precision="bf16", images_per_second=2000.0, accuracy=86.8)
    nncf = replace(_record("q.xml", "openvino", "int8", 86.95, 150, 4000.0, [85.0, 89.0]), precision="f32")
    qdq = _record("q.onnx", "onnxruntime", "uint8", 86.5, 100, 3000.0, [80.0, 92.0])
    rows = {(row.model, row.runtime, row.precision): row for row in build_report([ort_fp32, ov_f32, ov_bf16, nncf, qdq]).rows}
    # Against the FP32 model on OpenVINO at the same precision hint (f32: 800 images/s), not the bf16 run.
    assert rows["q.xml", "openvino", "f32"].speedup == 5.0
    # And against onnxruntime's run of its FP32 source, for every runtime.
    assert rows["q.xml", "openvino", "f32"].speedup_vs_onnxruntime == 4.0
    assert rows["f.onnx", "openvino", "bf16"].speedup_vs_onnxruntime == 2.0
    assert rows["f.onnx", "onnxruntime", None].speedup_vs_onnxruntime is None
    report = build_report([ort_fp32, ov_f32, ov_bf16, nncf, qdq])
    assert report.groups[0].recommendation.fastest.model == "q.xml"  # -0.05 points: within the budget, and the fastest
    slower_but_within = build_report([ort_fp32, replace(nncf, accuracy=86.8), qdq, replace(qdq, model_path="models/r.onnx",
                                      model_sha256="sha-r", accuracy=86.95, images_per_second=1500.0)])
    assert slower_but_within.groups[0].recommendation.fastest.model == "r.onnx"  # q.xml and q.onnx lose more than 0.10 points


def test_a_model_s_evaluation_speed_is_its_run_on_the_cpu_s_own_int8_kernels():
    """On a CPU without VNNI, `evaluate --int8-path both` runs the exact path through onnxruntime's exact-kernel switch,
    slower than the kernels the model runs there: the report's speed is the native (saturating) run's."""
    avx2 = {"model": "AMD EPYC", "arch": "x86_64", "flags": ["avx2"], "int8_path": "saturating"}
    fp32 = replace(_record("f.onnx", "onnxruntime", "fp32", 87.0, 400, 1000.0, [85.0, 89.0]), cpu=avx2)
    quantized = replace(_record("q.onnx", "onnxruntime", "uint8", 86.9, 100, 1500.0, [85.0, 89.0]), cpu=avx2)
    exact = replace(quantized, int8_path="exact", int8_basis="onnxruntime session.x64quantprecision=1", images_per_second=600.0)
    native = replace(quantized, int8_path="saturating", int8_basis="native")
    for records in ([fp32, exact, native], [fp32, native, exact]):
        (row,) = [row for row in build_report(records).rows if row.model == "q.onnx"]
        assert (row.int8_path, row.images_per_second, row.speedup, row.speedup_vs_onnxruntime) == ("exact", 1500.0, 1.5, 1.5)
    (alone,) = [row for row in build_report([fp32, exact]).rows if row.model == "q.onnx"]
    assert alone.speedup is None and alone.speedup_vs_onnxruntime is None  # only the switch timed it: no speed-up from that
    # On a CPU with VNNI the exact path is the native one, and its speed stands.
    vnni = {"model": "Xeon", "arch": "x86_64", "flags": ["avx512_vnni"], "int8_path": "exact"}
    on_vnni = [replace(fp32, cpu=vnni), replace(native, cpu=vnni, int8_path="exact", images_per_second=2500.0),
               replace(native, cpu=vnni, int8_basis="emulated (qemu) on 24 images", images_per_second=30.0)]
    (row,) = [row for row in build_report(on_vnni).rows if row.model == "q.onnx"]
    assert (row.images_per_second, row.speedup) == (2500.0, 2.5)


def test_a_model_tied_to_a_batch_runs_any_batch_in_parts_of_it():
    from ptq_cli.model_file import in_fixed_batches

    parts = []

    def run(part):
        parts.append(len(part))
        return part.sum(axis=1, keepdims=True)

    batch = np.arange(14, dtype=np.float32).reshape(7, 2)
    scores = in_fixed_batches(run, batch, 3)
    assert parts == [3, 3, 3] and np.array_equal(scores, batch.sum(axis=1, keepdims=True))  # the padding's scores dropped


def test_only_the_newest_record_of_one_measurement_is_kept():
    old = replace(_record("q.onnx", "onnxruntime", "int8", 80.0, 100, 1.0, [80.0, 80.0]), timestamp="2026-01-01T00:00:00+00:00")
    new = replace(old, accuracy=86.0, timestamp="2026-02-01T00:00:00+00:00")
    other_runtime = replace(old, runtime="openvino", precision="f32")
    kept = newest_per_measurement([new, old, other_runtime])
    assert sorted((record.runtime, record.accuracy) for record in kept) == [("onnxruntime", 86.0), ("openvino", 80.0)]


def test_stratified_subset_keeps_classes_balanced_and_within_the_set():
    from ptq_cli.services.make.calibration import CalibrationSet, stratified_subset

    labels = np.repeat(np.arange(10), 6)
    full = CalibrationSet(
        images=np.arange(60, dtype=np.float32)[:, None, None, None] * np.ones((1, 32, 32, 3), np.float32),
        labels=labels, indices=np.arange(100, 160), seed=1, samples_per_class=6,
        dataset="synthetic", split="train", dataset_sha256="", class_names=tuple("abcdefghij"), source="synthetic",
    )
    small = stratified_subset(full, 2)
    assert np.bincount(small.labels, minlength=10).tolist() == [2] * 10
    assert set(small.indices) <= set(full.indices)
    assert np.array_equal(small.images[:, 0, 0, 0], small.indices - 100)  # images stay with their indices
    with pytest.raises(PtqError):
        stratified_subset(full, 7)


def _candidate(accuracy_drop, sqnr, float_nodes=(), dtype="int8", weight_dtype="int8", rejected=None):
    from ptq_cli.services.quant_settings import make_settings
    from ptq_cli.services.study.tune import Candidate

    settings = replace(make_settings(dtype, weight_dtype=weight_dtype), float_nodes=tuple(float_nodes))
    return Candidate("method", settings, 92.0 - accuracy_drop, accuracy_drop, sqnr, 1000, 0.3, accuracy_drop <= 0.05, rejected)


def test_tune_keeps_the_candidate_closest_to_fp32_within_the_budget():
    from ptq_cli.services.study.tune import choose

    more_accurate = _candidate(-0.30, 24.0)  # +0.30 points on validation, but further from FP32
    closer = _candidate(0.02, 26.0)
    float_layer = _candidate(-0.40, 30.0, float_nodes=["conv"])  # a float layer costs size: only if nothing else fits
    too_large = _candidate(-0.50, 40.0, rejected="too large")
    out_of_budget = _candidate(0.20, 35.0)
    chosen, met, reason = choose([more_accurate, closer, float_layer, too_large, out_of_budget], 0.05)
    assert (chosen, met) == (closer, True) and "output SQNR" in reason
    fast = _candidate(0.04, 20.0, dtype="uint8")  # uint8 x int8: the x86 fast path comes before fidelity
    assert choose([closer, fast], 0.05)[0] == fast
    chosen, met, reason = choose([out_of_budget, _candidate(0.10, 20.0)], 0.05)
    assert (chosen.accuracy_drop, met) == (0.10, False) and "most accurate" in reason


def test_benchmark_measures_models_in_turns(monkeypatch, tmp_path):
    """Each timed run goes round every model before the next run: a slow spell of the machine reaches all alike."""
    from ptq_cli.backends.base import LoadedModel, ModelInfo
    from ptq_cli.inputs import NHWC, ModelInput, Preprocessing
    from ptq_cli.services.measure import benchmark

    calls: list[tuple[str, int]] = []

    def fake_model(path, threads, flags=None, runtime=None, precision=None):
        runtime = {".pt": "pytorch", ".xml": "openvino", ".tflite": "litert"}.get(path.suffix, "onnxruntime")
        info = ModelInfo(path, runtime, "fp32" if "fp32" in str(path) else "uint8", None, 1, str(path))
        return LoadedModel(info, lambda images: calls.append((str(path), len(images))) or np.zeros((len(images), 10), np.float32),
                           ModelInput("x", NHWC, 3, 32, 32, None), Preprocessing(), 10)

    monkeypatch.setattr(benchmark, "load_model", fake_model)
    images = tmp_path / "images.npz"
    np.savez(images, images=np.zeros((8, 32, 32, 3), np.uint8), labels=np.zeros(8, np.int64), class_names=np.array(list("abcdefghij")))
    names = ("fp32.onnx", "fp32.pt", "q.xml", "q.onnx", "q.pt", "q.tflite")
    records = benchmark.benchmark_models([tmp_path / name for name in names], open_dataset(images), batch_size=8, threads=1, runs=3, warmup=1)
    # Batch 1 in turns within each runtime (threads stay as warm as serving alone); the batch in turns
    # across onnxruntime, OpenVINO and LiteRT; PyTorch's models last (its spinning threads would slow the
    # next model), in turns among themselves.
    turns = [(1, ("fp32.onnx", "q.onnx")), (1, ("q.xml",)), (1, ("q.tflite",)), (8, ("fp32.onnx", "q.xml", "q.onnx", "q.tflite")),
             (1, ("fp32.pt", "q.pt")), (8, ("fp32.pt", "q.pt"))]
    expected = [(str(tmp_path / name), size) for size, turn in turns for _ in range(4) for name in turn]
    assert calls == expected
    assert [Path(record.model_path).name for record in records] == list(names)
    assert all(record.runtime_settings for record in records)  # every record says how its runtime ran
    assert all(record.runs == 3 for record in records)


@pytest.mark.parametrize("side,batch", [(32, 256), (64, 64), (224, 16)])
def test_the_default_benchmark_batch_keeps_the_pixels_of_256_cifar_images(tmp_path, monkeypatch, side, batch):
    """256 images of 32x32, as many pixels for a larger input, never fewer than 16 images (a 224x224 model at
    256 held 10.5 GB)."""
    from ptq_cli.backends.base import LoadedModel, ModelInfo
    from ptq_cli.inputs import NHWC, ModelInput, Preprocessing
    from ptq_cli.services.measure import benchmark

    sizes: list[int] = []

    def fake_model(path, threads, flags=None, runtime=None, precision=None):
        return LoadedModel(ModelInfo(path, "onnxruntime", "fp32", None, 1, str(path)),
                           lambda images: sizes.append(len(images)) or np.zeros((len(images), 10), np.float32),
                           ModelInput("x", NHWC, 3, side, side, None), Preprocessing(), 10)

    monkeypatch.setattr(benchmark, "load_model", fake_model)
    images = tmp_path / "images.npz"
    np.savez(images, images=np.zeros((4, 8, 8, 3), np.uint8), labels=np.zeros(4, np.int64), class_names=np.array(list("abcdefghij")))
    (record,) = benchmark.benchmark_models([tmp_path / "m.onnx"], open_dataset(images), threads=1, runs=1, warmup=1)
    assert record.batch_size == batch and max(sizes) == batch


def test_pipeline_stage_made_by_another_ptq_version_is_not_up_to_date(tmp_path):
    import ptq_cli
    from ptq_cli.services.study.pipeline import Stage, _Hashes, _up_to_date

    output = tmp_path / "model.onnx"
    output.write_bytes(b"made")
    hashes = _Hashes()
    stage = Stage("quantize", "quantize", ("--target", "speed"), (), (output,), {"target": "speed"})
    entry = {"options": {"target": "speed"}, "inputs": {}, "outputs": {str(output): hashes(output)}, "tool_version": ptq_cli.__version__}
    assert _up_to_date(entry, stage, {}, hashes)
    assert not _up_to_date({**entry, "tool_version": "0.0.1"}, stage, {}, hashes)
    assert not _up_to_date({key: value for key, value in entry.items() if key != "tool_version"}, stage, {}, hashes)


def test_a_pipeline_stage_renders_the_command_it_stands_for():
    from ptq_cli.services.study.pipeline import Stage

    stage = Stage("evaluate ref", "evaluate", ("--model", "models/ref.tflite", "--label", "MLPerf Tiny reference int8"), (), (), {})
    assert stage.command_line == "ptq evaluate --model models/ref.tflite --label 'MLPerf Tiny reference int8'"


def test_report_sets_each_tflite_model_against_the_mlperf_reference():
    from ptq_cli.render_report import report_markdown
    from ptq_cli.services.measure.benchmark import BenchmarkRecord
    from ptq_cli.services.records import MeasurementKey

    reference = replace(_record("ref.tflite", "litert", "int8", 86.97, 98_496, 900.0, [85.0, 89.0]), label=settings.MLPERF_REFERENCE_LABEL,
                        source_sha256=None)
    ours = _record("q.tflite", "litert", "int8", 87.11, 99_136, 950.0, [86.0, 89.0])
    fp32 = _record("f.onnx", "onnxruntime", "fp32", 87.19, 320_000, 300.0, [86.0, 89.0])
    other = _record("q.onnx", "onnxruntime", "int8", 87.0, 100_000, 800.0, [86.0, 89.0])

    def timed(record, p50):
        return BenchmarkRecord(record.model_path, record.model_sha256, record.model_size_bytes, record.runtime, record.dtype, 1, 1, 1,
                               p50, p50, p50, 10, record.images_per_second, "t", "0")

    benchmarks = {MeasurementKey.of(r, with_dataset=False): timed(r, p50) for r, p50 in ((reference, 0.05), (ours, 0.06))}
    group = build_report([fp32, other, ours, reference], benchmarks=benchmarks).groups[0]
    assert group.reference.model == "ref.tflite"
    (versus,) = group.versus_reference  # the TFLite model only: not the reference, not the ONNX model
    assert (versus.model, versus.accuracy_delta, versus.size_delta_bytes, versus.latency_ratio) == ("q.tflite", 0.14, 640, 1.2)
    markdown = report_markdown(build_report([fp32, other, ours, reference], benchmarks=benchmarks))
    assert f"### TFLite models vs the {settings.MLPERF_REFERENCE_LABEL}, both on litert" in markdown
    assert "| q.tflite | 87.11% | +0.14 | 99,136 | +640 | - | 0.060 | 1.20x |" in markdown
    assert build_report([fp32, other, ours]).groups[0].versus_reference == ()  # no reference evaluated: no comparison
    # Run on a microcontroller's kernels too, the comparison is the microcontroller's: TFLM rows against TFLM's reference, arenas beside.
    on_device = [replace(record, runtime="tflm", accuracy=accuracy, arena_bytes=arena)
                 for record, accuracy, arena in ((reference, 87.07, 55_984), (ours, 86.88, 56_000))]
    group = build_report([fp32, other, ours, reference, *on_device], benchmarks=benchmarks).groups[0]
    assert (group.reference.runtime, group.reference.accuracy) == ("tflm", 87.07)
    (versus,) = group.versus_reference
    assert (versus.model, versus.accuracy_delta, versus.arena_bytes) == ("q.tflite", -0.19, 56_000)
    assert "| q.tflite | 86.88% | -0.19 | 99,136 | +640 | 56,000 |" in report_markdown(build_report([fp32, other, ours, reference, *on_device]))


def test_benchmark_speedups_are_against_each_model_s_own_source():
    from ptq_cli.services.measure.benchmark import BenchmarkRecord, speedups

    def timed(name, dtype, per_second, source=None):
        return BenchmarkRecord(f"models/{name}", f"sha-{name}", 1000, "onnxruntime", dtype, 2, 1, 1, 1.0, 1.0, 1.0, 64, per_second, "t", "0",
                               source_sha256=source)

    alpha, beta = timed("alpha.onnx", "fp32", 100.0), timed("beta.onnx", "fp32", 1000.0)
    alpha_int8 = timed("alpha_int8.onnx", "int8", 300.0, "sha-alpha.onnx")
    beta_int8 = timed("beta_int8.onnx", "int8", 2500.0, "sha-beta.onnx")
    foreign = timed("found.onnx", "int8", 500.0)  # not made by ptq: two FP32 models, no way to tell which
    ratios = speedups([beta_int8, alpha, foreign, alpha_int8, beta])
    assert ratios[("models/alpha_int8.onnx", "onnxruntime", None)] == 3.0 and ratios[("models/beta_int8.onnx", "onnxruntime", None)] == 2.5
    assert ratios[("models/found.onnx", "onnxruntime", None)] is None
    assert speedups([alpha, foreign])[("models/found.onnx", "onnxruntime", None)] == 5.0  # one FP32 model: that one


def test_tf2onnx_counters_in_node_and_tensor_names_are_renumbered_in_graph_order():
    import onnx
    from onnx import helper

    from ptq_cli.transforms.graph import canonical_names

    def converted(counter: int):
        """What tf2onnx writes for one layer, its process-wide counter at `counter`."""
        node = helper.make_node("Relu", ["input"], [f"model_1/conv2d_1/BiasAdd__{counter}:0"], name=f"model_1/conv2d_1/BiasAdd__{counter + 3}")
        out = helper.make_node("Identity", [f"model_1/conv2d_1/BiasAdd__{counter}:0"], ["scores"], name="Identity")
        graph = helper.make_graph([node, out], "g", [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 3])],
                                  [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, [1, 3])])
        return canonical_names(helper.make_model(graph))

    first, later = converted(6), converted(153)
    assert first.SerializeToString() == later.SerializeToString()
    assert first.graph.node[0].output[0].endswith(":0") and first.graph.node[1].input[0] == first.graph.node[0].output[0]


def test_average_pools_left_in_float_make_one_note_however_many():
    from ptq_cli.quantize.policy import pools_in_float_note

    assert pools_in_float_note([], "onnxruntime") == []
    one = pools_in_float_note(["head/Mean"], "onnxruntime")
    assert one == ["average pool head/Mean: left in float, so the layer reading it quantizes the pooled features on their own range "
                   "(onnxruntime would give them the scale of the whole maps)"]
    many = pools_in_float_note([f"se{index}/Mean" for index in range(10)], "torch.ao")
    assert len(many) == 1 and many[0].startswith("10 average pools (se0/Mean, se1/Mean, se2/Mean and 7 more): left in float, so the layers reading them quantize ")


def test_image_sqnr_is_the_mean_of_each_image_s_own_sqnr_and_ranks_by_the_typical_image():
    from ptq_cli.metrics import image_sqnr_db, sqnr_db

    rng = np.random.default_rng(0)
    reference = rng.normal(size=(8, 10))
    reference[0] *= 100  # one image whose scores are far larger than the others'
    noisy = reference + rng.normal(scale=0.05, size=reference.shape) * np.abs(reference).max(axis=1, keepdims=True)  # alike per image
    assert image_sqnr_db(reference, noisy) == pytest.approx(np.mean([sqnr_db(ref, got) for ref, got in zip(reference, noisy, strict=True)]))
    # Close on the large image, poor on the rest: pooled SQNR prefers it, the mean over images does not.
    serves_the_large = reference + rng.normal(scale=1.0, size=reference.shape)
    serves_the_large[0] = reference[0] + rng.normal(scale=0.01, size=10)
    assert sqnr_db(reference, serves_the_large) > sqnr_db(reference, noisy)
    assert image_sqnr_db(reference, serves_the_large) < image_sqnr_db(reference, noisy)
    assert image_sqnr_db(reference, reference.copy()) == float("inf")
    serves_the_large[0] = reference[0]
    assert np.isfinite(image_sqnr_db(reference, serves_the_large))  # one exact image among others: bounded, not inf
    assert np.isfinite(image_sqnr_db(np.zeros((2, 3)), np.ones((2, 3))))  # all-zero scores: bounded, not -inf


def test_a_proven_saturating_figure_shows_as_equal_only_where_it_is():
    """PyTorch's proof is measured on fbgemm, which can round an image otherwise than the exact path's oneDNN: the
    report shows its own figure then, and "=" only where the two are the same."""
    from ptq_cli.render_report import no_vnni
    from ptq_cli.services.measure.report import ReportRow

    row = ReportRow("m.pt", "pytorch", "int8", "", 75.97, None, None, 1, None, 1.0, "evaluate", None, None,
                    saturating_accuracy=75.97, saturating_basis="proof (the pair rule on every layer): fbgemm's kernels run here")
    assert no_vnni(row, short=True) == "=" and no_vnni(row).startswith("= (proof")
    differs = replace(row, saturating_accuracy=75.98)
    assert no_vnni(differs, short=True) == "75.98" and no_vnni(differs).startswith("75.98% (proof")


def test_the_fastest_is_not_passed_over_for_a_loss_the_images_cannot_tell_from_chance():
    """500 images: a model 0.4 points below FP32 on 2 images (McNemar p 0.5) is within the budget, and said to be
    indistinguishable; one 4 points below on 20 (p < 0.001) is not."""
    from ptq_cli.render_report import report_markdown

    fp32 = replace(_record("f.onnx", "onnxruntime", "fp32", 87.0, 400, 1000.0, [85.0, 89.0]), images=500)

    def measured(name, accuracy, speed, only_fp32, p_value):
        fidelity = {"top1_agreement": 99.0, "top5_containment": 100.0, "sqnr_db": 20.0, "fp32_only_right": only_fp32, "model_only_right": 0,
                    "accuracy_delta_p_value": p_value, "images": 500}
        return replace(_record(name, "onnxruntime", "int8", accuracy, 100, speed, [85.0, 89.0]), images=500, fidelity=fidelity)

    slow, noisy, worse = measured("slow.onnx", 87.0, 1410.0, 0, 1.0), measured("fast.onnx", 86.6, 5190.0, 2, 0.5), measured("bad.onnx", 83.0, 9000.0, 20, 0.0001)
    report = build_report([fp32, slow, noisy, worse])
    assert report.groups[0].recommendation.fastest.model == "fast.onnx"
    assert "indistinguishable from FP32 on 500 images (McNemar p 0.50)" in report_markdown(report)
    strict = build_report([fp32, slow, replace(noisy, fidelity={**noisy.fidelity, "accuracy_delta_p_value": 0.01}), worse])
    assert strict.groups[0].recommendation.fastest.model == "slow.onnx"


def test_best_is_said_to_be_no_better_than_a_runner_up_the_images_cannot_tell_apart():
    """500 images: best and runner-up differ on 1 image against 0 (p 1.0): "no better than"; on 20 against 0: best alone."""
    from ptq_cli.metrics import packed_hits
    from ptq_cli.render_report import report_markdown

    rng = np.random.default_rng(0)
    fp32_hits = rng.random(500) < 0.87

    def measured(name, hits, speed):
        record = _record(name, "onnxruntime", "fp32" if name == "f.onnx" else "int8", round(100.0 * hits.mean(), 4), 100, speed, [85.0, 89.0])
        return replace(record, images=500, correct=int(hits.sum()), right_images=packed_hits(hits))

    def flipped(count):
        hits = fp32_hits.copy()
        hits[np.flatnonzero(hits)[:count]] = False
        return hits

    close = build_report([measured("f.onnx", fp32_hits, 1000.0), measured("a.onnx", flipped(0), 2000.0), measured("b.onnx", flipped(1), 3000.0)])
    advice = close.groups[0].recommendation
    assert (advice.best_accuracy.model, advice.best_rival.model, advice.best_rival_p_value) == ("a.onnx", "b.onnx", 1.0)
    assert "no better than b.onnx" in report_markdown(close) and "(McNemar p 1.00)" in report_markdown(close)
    apart = build_report([measured("f.onnx", fp32_hits, 1000.0), measured("a.onnx", flipped(0), 2000.0), measured("b.onnx", flipped(20), 3000.0)])
    assert apart.groups[0].recommendation.best_rival is None and "no better than" not in report_markdown(apart)


def test_images_right_round_trip_and_a_record_whose_bits_disagree_is_refused(tmp_path):
    from ptq_cli.errors import PtqError
    from ptq_cli.metrics import packed_hits, unpacked_hits
    from ptq_cli.services.measure.evaluation_records import read_record, save_record

    hits = np.arange(13) % 3 == 0
    assert (unpacked_hits(packed_hits(hits), 13) == hits).all()
    for text, images in ((packed_hits(hits), 20), ("not base64!", 13), (packed_hits(np.ones(16, dtype=bool)), 13)):
        with pytest.raises(ValueError, match="images right"):
            unpacked_hits(text, images)
    record = replace(_record("q.onnx", "onnxruntime", "int8", 50.0, 100, 1.0, [100.0, 0.0]), images=2, correct=1,
                     confusion_matrix=[[1, 0], [1, 0]], right_images=packed_hits(np.array([True, False])))
    assert read_record(save_record(record, tmp_path)).right_images == record.right_images
    with pytest.raises(PtqError, match="images right are not its 1 correct"):
        read_record(save_record(replace(record, right_images=packed_hits(np.array([True, True]))), tmp_path))
