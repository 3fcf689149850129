"""ImageNet-size classifiers on images whose classes are not the model's: calibration without labels, fidelity
to FP32, unlabelled folders, memory-bounded calibration, depthwise defaults, the 80-column report.

Synthetic 224x224 stand-ins (tests/synthetic.py) in the fast lane; the real EfficientNet-Lite0 (packages on
the registry, tests/imagenet_size.py) in the real-asset lane."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from synthetic import channel_mean_classifier, colour_images, depthwise_classifier, image_folder, invoke, one_line_error, photo_folder

from ptq_cli.datasets import open_dataset
from ptq_cli.metrics import mcnemar_p_value, wilson_interval
from ptq_cli.quantize import overflow
from ptq_cli.services.make.calibration import build_calibration_set, sized_indices
from ptq_cli.services.measure.evaluation_records import read_record
from ptq_cli.services.measure.fidelity import compare
from ptq_cli.transforms.graph import clamped_activations


@pytest.fixture(scope="module")
def mobile(tmp_path_factory) -> Path:
    """A working folder: dw.onnx (1000 classes, 224x224, depthwise), cal/ and photos/ (unlabelled JPEGs)."""
    root = tmp_path_factory.mktemp("mobile")
    depthwise_classifier(root / "dw.onnx")
    photo_folder(root / "cal", 24, seed=1)
    photo_folder(root / "photos", 18, seed=2)
    return root


def _quantize(root: Path, output: str, *extra: str):
    result = invoke("quantize", "--model", "dw.onnx", "--data", "photos", "--calibration-data", "cal", "--output", output, "--json", *extra, cwd=root)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_fidelity_figures_follow_their_definitions():
    reference = np.array([[3.0, 1.0, 0.0, -1.0, -2.0, -3.0], [0.0, 2.0, 1.0, 0.0, 0.0, 0.0]], np.float32)
    same = compare(reference, reference.copy(), "fp32.onnx", "0" * 64)
    assert (same.top1_agreement, same.top5_containment, same.sqnr_db, same.kl_divergence) == (100.0, 100.0, None, 0.0)
    # Image 1: FP32's class 0 falls to 6th place (out of the top 5); image 2: top-1 moves from 1 to 2, class 1 stays in the top 5.
    swapped = np.array([[-4.0, 1.0, 0.0, -1.0, -2.0, -3.0], [0.0, 2.0, 3.0, 0.0, 0.0, 0.0]], np.float32)
    figures = compare(reference, swapped, "fp32.onnx", "0" * 64)
    assert figures.top1_agreement == 0.0 and figures.top5_containment == 50.0
    noise = float(np.sum((reference - swapped) ** 2))
    assert figures.sqnr_db == round(10 * np.log10(float(np.sum(reference**2)) / noise), 3)
    p = np.exp(reference) / np.exp(reference).sum(axis=1, keepdims=True)
    q = np.exp(swapped) / np.exp(swapped).sum(axis=1, keepdims=True)
    assert figures.kl_divergence == pytest.approx(float(np.mean(np.sum(p * np.log(p / q), axis=1))), abs=1e-6)


@pytest.mark.parametrize(("successes", "trials"), [(0, 1), (0, 109), (1, 109), (102, 109), (109, 109), (9_874, 10_000), (5, 7)])
def test_the_agreement_interval_is_scipy_s_wilson_interval(successes, trials):
    stats = pytest.importorskip("scipy.stats")
    expected = stats.binomtest(successes, trials).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(successes, trials) == pytest.approx((expected.low, expected.high), abs=1e-9)


@pytest.mark.parametrize(("only_first", "only_second"), [(0, 0), (0, 1), (3, 0), (52, 46), (5, 20), (400, 310), (1, 1)])
def test_the_delta_s_p_value_is_an_exact_binomial_test_on_the_images_one_model_alone_gets_right(only_first, only_second):
    stats = pytest.importorskip("scipy.stats")
    expected = 1.0 if only_first + only_second == 0 else stats.binomtest(only_first, only_first + only_second, 0.5).pvalue
    assert mcnemar_p_value(only_first, only_second) == pytest.approx(expected, rel=1e-9)


def test_fidelity_counts_the_images_each_model_alone_classifies_right():
    reference = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1]]  # FP32's classes: 0 1 2 3 0 1
    scores = np.eye(4, dtype=np.float32)[[0, 2, 2, 1, 1, 1]]  # the model's: 0 2 2 1 1 1
    labels = np.array([0, 1, 3, 1, 1, 2])  # FP32 right on images 0, 1; the model on 0, 3, 4
    figures = compare(reference, scores, "fp32.onnx", "0" * 64, labels)
    assert (figures.fp32_only_right, figures.model_only_right) == (1, 2)
    assert figures.accuracy_delta_p_value == 1.0  # a 1-2 split is the likeliest there is
    assert figures.top1_agreement == pytest.approx(100 * 3 / 6, abs=1e-4)
    assert figures.top1_agreement_low < figures.top1_agreement < figures.top1_agreement_high
    unlabelled = compare(reference, scores, "fp32.onnx", "0" * 64)
    assert (unlabelled.fp32_only_right, unlabelled.model_only_right, unlabelled.accuracy_delta_p_value) == (None, None, None)


def test_an_unlabelled_folder_is_a_dataset_drawn_uniformly(tmp_path):
    folder = photo_folder(tmp_path / "photos", 12)
    dataset = open_dataset(folder)
    images = dataset.load(dataset.evaluation_split())
    assert not images.labelled and images.images.shape == (12, 224, 224, 3) and set(images.labels) == {-1}
    drawn = build_calibration_set(dataset, None, seed=3, count=5)
    assert len(drawn.labels) == 5 and drawn.samples_per_class == 0 and drawn.per_class_counts == {}
    assert np.array_equal(drawn.indices, build_calibration_set(dataset, None, seed=3, count=5).indices)  # seeded
    assert len(set(drawn.indices)) == 5
    (folder / "notes.txt").write_text("not an image")
    with pytest.raises(Exception, match="notes.txt: not an image file"):
        open_dataset(folder).load("test")


def test_calibration_size_is_exact_and_even_over_labelled_classes():
    labels = np.repeat(np.arange(4), 10)
    chosen = sized_indices(labels, 10, seed=0, where="here")
    counts = np.bincount(labels[chosen], minlength=4)
    assert len(chosen) == 10 and len(set(chosen)) == 10 and sorted(counts) == [2, 2, 3, 3]
    with pytest.raises(Exception, match="--calibration-size: 41 is not in 1..40"):
        sized_indices(labels, 41, seed=0, where="here")


def test_a_mixed_folder_of_class_folders_and_loose_images_is_refused(tmp_path):
    image_folder(tmp_path / "mixed", splits=("train",))
    photo_folder(tmp_path / "mixed", 2)
    one_line_error(invoke("evaluate", "--model", "m.onnx", "--data", "mixed", cwd=tmp_path), "both class folders and images")


def test_quantize_and_evaluate_on_photos_whose_classes_are_not_the_model_s(mobile):
    """Calibration reads no labels; evaluation without labels of the model's classes measures fidelity to
    the FP32 source instead of top-1, and the record stays small for 1000 classes."""
    made = _quantize(mobile, "dw_int8.onnx")
    assert made["settings"]["per_channel"] is True  # depthwise convolutions: per-channel unless told
    assert made["settings"]["calibration_samples"] == 24  # every unlabelled image, under the default count
    result = invoke("evaluate", "--model", "dw_int8.onnx", "--data", "photos", "--int8-path", "exact", "--json", cwd=mobile)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["accuracy"] is None and record["correct"] is None and record["class_names"] == []
    fidelity = record["fidelity"]
    assert fidelity["images"] == 18 and fidelity["reference_path"].endswith("dw.onnx")
    assert 0 <= fidelity["top1_agreement"] <= fidelity["top5_containment"] <= 100
    files = list((mobile / "results").glob("dw_int8.onnx*~exact@*.json")) or list((mobile / "results").glob("dw_int8.onnx*@*.json"))
    assert files and files[0].stat().st_size < 200_000
    assert read_record(files[0]).agreement == fidelity["top1_agreement"]
    # The FP32 source, evaluated on the same images for the delta, is the reference row: it agrees with itself.
    source = read_record(next((mobile / "results").glob("dw.onnx-*@*.json")))
    assert source.accuracy is None and source.agreement == 100.0


def test_the_fp32_model_on_photos_is_the_reference_and_against_itself_agrees(mobile):
    """Without labels, the FP32 model evaluates as the reference (no fidelity to show); told to, it is measured against itself."""
    alone = invoke("evaluate", "--model", "dw.onnx", "--data", "photos", "--results-dir", "elsewhere", "--json", cwd=mobile)
    assert alone.exit_code == 0 and json.loads(alone.stdout)["fidelity"] is None and json.loads(alone.stdout)["accuracy"] is None
    result = invoke("evaluate", "--model", "dw.onnx", "--data", "photos", "--against-fp32", "dw.onnx", "--results-dir", "elsewhere", "--json", cwd=mobile)
    assert result.exit_code == 0 and json.loads(result.stdout)["fidelity"]["top1_agreement"] == 100.0


def test_a_model_without_depthwise_convolutions_keeps_the_per_tensor_default(tmp_path):
    channel_mean_classifier(tmp_path / "m.onnx", size=16)
    image_folder(tmp_path / "data", size=16)
    result = invoke("quantize", "--model", "m.onnx", "--data", "data", "--dtype", "int8", "--output", "m_int8.onnx", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"]["per_channel"] is False
    made = json.loads(result.stdout)["settings"]
    assert made["overflow_fix"] in ("first-layer", "all-layers") and len(made["overflow_fix_db"]) == 2  # no clamped activations: judged


@pytest.mark.parametrize("backend", ["onnxruntime", "pytorch", "openvino"])
def test_clamped_activations_make_every_layer_safe_by_default(mobile, backend):
    """ReLU6 outputs sit at the top code, where x86 kernels without VNNI saturate in every layer: the
    default fix covers all layers there, and a fix the user names is kept."""
    suffix = {"pytorch": ".pt", "openvino": ".xml"}.get(backend, ".onnx")
    made = _quantize(mobile, f"clamped{suffix}", "--backend", backend)
    assert made["settings"]["overflow_fix"] == "all-layers"
    assert _quantize(mobile, f"named{suffix}", "--backend", backend, "--overflow-fix", "first-layer")["settings"]["overflow_fix"] == "first-layer"
    if backend == "onnxruntime":
        proven, _ = overflow.saturation_proof(onnx.load(str(mobile / made["output"])))
        assert proven  # its depthwise convolution keeps full-range weights: that kernel cannot saturate


def _clip_node(opset: int, bound: float | None):
    from onnx import helper, numpy_helper

    if opset < 11:
        return helper.make_node("Clip", ["x"], ["y"], min=0.0, **({"max": bound} if bound is not None else {})), []
    constants = [numpy_helper.from_array(np.float32(0.0), "low")] + ([numpy_helper.from_array(np.float32(bound), "high")] if bound is not None else [])
    return helper.make_node("Clip", ["x", "low", "high" if bound is not None else ""], ["y"]), constants


@pytest.mark.parametrize(("opset", "bound", "clamped"), [(13, 6.0, True), (13, None, False), (9, 6.0, True), (9, None, False)])
def test_clamped_activations_are_clips_with_an_upper_bound(opset, bound, clamped):
    from onnx import helper

    node, constants = _clip_node(opset, bound)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    assert bool(clamped_activations(model)) == clamped


@pytest.mark.parametrize("reduce_range", [False, True])
def test_pytorch_quantizes_a_conv_before_relu6_over_relu6_s_range(reduce_range):
    """torch.ao would quantize the output over the convolution's own range (here -30..30 from its biases):
    a dozen codes for 0..6. Clamped, the output has 6/255 (6/127) a code and its input keeps its own range.
    The weights follow the pair rule (or the activations are 7-bit), so no CPU saturates."""
    import torch
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    from ptq_cli.backends import pytorch as torch_backend

    torch.backends.quantized.engine = torch_backend.ENGINE
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU6()).eval()
    with torch.no_grad():
        layers[0].bias.copy_(torch.tensor([-30.0, 30.0, 0, 0, 1, 2, 3, 4]))
    float_module = torch.fx.symbolic_trace(layers)
    images = torch.randn(16, 3, 12, 12)
    fix = overflow.ALL_LAYERS if reduce_range else overflow.FIRST_LAYER

    def quantized(clamp: bool):
        mapping = torch_backend.qconfig_mapping(True, "minmax", fix, tuple(torch_backend.first_layer_modules(float_module)))
        prepared = prepare_fx(copy.deepcopy(float_module), mapping, (images[:1],))
        if clamp:
            assert torch_backend.clamp_conv_outputs(prepared, reduce_range) == ["0"]
        with torch.no_grad():
            prepared(images)
            converted = convert_fx(prepared)
            return converted, float((converted(images) - float_module(images)).abs().mean())

    converted, clamped_error = quantized(clamp=True)
    assert converted.get_submodule("0").scale == pytest.approx(6 / (127 if reduce_range else 255)) and converted.get_submodule("0").zero_point == 0
    assert getattr(converted, "0_input_scale_0") < 0.1  # the input's own range (about -4..4), not ReLU6's
    assert quantized(clamp=False)[1] > 3 * clamped_error


def test_calibration_in_chunks_gives_the_same_model_and_an_impossible_budget_one_line(mobile, monkeypatch):
    """MinMax over chunks is the MinMax of the whole set: a budget that forces one image at a time gives
    the same file; a budget that cannot hold one image's activations is refused, naming the setting."""
    _quantize(mobile, "whole.onnx", "--calibration-size", "12", "--method", "minmax")
    from ptq_cli.quantize import calibration

    per_image = calibration.ACTIVATION_COPIES * calibration.activation_bytes(onnx.load(str(mobile / "dw.onnx")))
    chunks = []
    real_chunk = calibration.calibration_chunk
    monkeypatch.setattr(calibration, "calibration_chunk", lambda *args: chunks.append(real_chunk(*args)) or chunks[-1])
    images_bytes = 12 * 3 * 224 * 224 * 4  # the 12 calibration images as float32 model input
    monkeypatch.setenv("PTQ_CALIBRATION_MEMORY", str(calibration.BASE_PROCESS_BYTES + images_bytes + 3 * (mobile / "dw.onnx").stat().st_size
                                                     + int(1.5 * per_image)))
    _quantize(mobile, "chunked.onnx", "--calibration-size", "12", "--method", "minmax")
    assert chunks == [1]
    assert (mobile / "whole.onnx").read_bytes() == (mobile / "chunked.onnx").read_bytes()
    monkeypatch.setenv("PTQ_CALIBRATION_MEMORY", "1000")
    one_line_error(invoke("quantize", "--model", "dw.onnx", "--data", "photos", "--calibration-data", "cal", "--output", "no.onnx", cwd=mobile),
                   "PTQ_CALIBRATION_MEMORY")
    assert not (mobile / "no.onnx").exists()


@pytest.mark.parametrize("method,symmetric", [("percentile", True), ("percentile", False), ("entropy", False)])
def test_the_threaded_histogram_collector_builds_onnxruntime_s_own_histograms(method, symmetric):
    """Histograms built one tensor per thread are onnxruntime's, bin for bin and in the same tensor order,
    over several chunks (the later ones extending the bins)."""
    from onnxruntime.quantization import calibrate

    from ptq_cli.quantize import calibration

    calibrator = type("Calibrator", (), {"method": method, "symmetric": symmetric, "num_bins": 64, "num_quantized_bins": 16,
                                         "percentile": 99.9, "scenario": "same"})()
    threaded = calibration._threaded_collector(calibrator, calibrate)
    own = calibrate.HistogramCollector(method, symmetric, 64, 16, 99.9, "same")
    rng = np.random.default_rng(0)
    for chunk in range(3):
        arrays = {f"t{index}": [rng.normal(0, 1 + chunk + index, (2, 8, 5, 5)).astype(np.float32)] for index in (3, 1, 2, 0)}
        threaded.collect(arrays)
        own.collect(arrays)
    assert list(threaded.histogram_dict) == list(own.histogram_dict) == ["t3", "t1", "t2", "t0"]
    for name, histogram in own.histogram_dict.items():
        assert all(np.array_equal(ours, theirs) for ours, theirs in zip(threaded.histogram_dict[name], histogram, strict=True))


def test_percentile_calibration_on_threads_gives_the_same_file(mobile, monkeypatch):
    """On 4 histogram threads and calibration session threads, or on the one CPU a Ray task is given."""
    from ptq_cli import settings

    monkeypatch.setenv(settings.TASK_CPUS_ENV, "4")
    _quantize(mobile, "threads4.onnx", "--calibration-size", "12", "--method", "percentile")
    monkeypatch.setenv(settings.TASK_CPUS_ENV, "1")
    _quantize(mobile, "threads1.onnx", "--calibration-size", "12", "--method", "percentile")
    assert (mobile / "threads4.onnx").read_bytes() == (mobile / "threads1.onnx").read_bytes()


@pytest.mark.parametrize("task_cpus", [None, "1"])
def test_the_calibration_session_keeps_to_the_cpus_a_task_is_given(mobile, monkeypatch, task_cpus):
    """A Ray task is given one CPU (PTQ_TASK_CPUS): onnxruntime's calibration session, which takes every core
    by itself, is then made on one thread."""
    from ptq_cli import settings
    from ptq_cli.quantize import calibration

    if task_cpus:
        monkeypatch.setenv(settings.TASK_CPUS_ENV, task_cpus)
    else:
        monkeypatch.delenv(settings.TASK_CPUS_ENV, raising=False)
    threads = []
    real = calibration._within_task_cpus

    def spy(calibrator):
        real(calibrator)
        threads.append(calibrator.infer_session.get_session_options().intra_op_num_threads)

    monkeypatch.setattr(calibration, "_within_task_cpus", spy)
    _quantize(mobile, f"cpus_{task_cpus}.onnx", "--calibration-size", "12", "--method", "minmax")
    assert threads and all(count == (1 if task_cpus else 0) for count in threads)  # 0: onnxruntime's default, every core


def test_onnxruntime_s_clipped_biases_are_a_note_not_log_lines(tmp_path):
    """A bias far beyond int32 at its scale (input scale x tiny uint8 weights' scale): onnxruntime logs a
    warning per bias tensor on the root logger; ptq says it once, in the result."""
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Conv", ["image", "w", "b"], ["conv"]), helper.make_node("GlobalAveragePool", ["conv"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["scores"])]
    weights = np.full((3, 3, 1, 1), 1e-7, np.float32)
    graph = helper.make_graph(nodes, "biased", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(np.array([1e6, -1e6, 0.0], np.float32), "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(tmp_path / "biased.onnx"))
    photo_folder(tmp_path / "cal", 6, size=8)
    result = invoke("quantize", "--model", "biased.onnx", "--data", "cal", "--calibration-data", "cal", "--output", "q.onnx", "--stem", "int8", "--dtype", "uint8", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert "WARNING" not in result.stderr and "exceeds the range" not in result.stderr
    assert "onnxruntime clipped the int32 biases of 1 layer:" in " ".join(json.loads(result.stdout)["notes"])


def test_run_refuses_to_write_its_calibration_set_into_the_user_s_calibration_folder(tmp_path):
    """`ptq run` keeps its calibration sets in ./calibration/: a folder of photos of that name is left alone."""
    depthwise_classifier(tmp_path / "dw.onnx")
    photo_folder(tmp_path / "calibration", 6, seed=1)
    photo_folder(tmp_path / "photos", 6, seed=2)
    before = sorted(path.name for path in (tmp_path / "calibration").iterdir())
    result = invoke("run", "--model", "dw.onnx", "--data", "photos", "--calibration-data", "calibration", cwd=tmp_path)
    assert result.exit_code == 2
    one_line_error(result, "a folder it reads images from")
    assert sorted(path.name for path in (tmp_path / "calibration").iterdir()) == before


def test_the_report_without_labels_ranks_by_agreement_and_fits_80_columns(mobile):
    _quantize(mobile, "dw_int8.onnx")
    assert invoke("evaluate", "--model", "dw_int8.onnx", "--data", "photos", cwd=mobile).exit_code == 0
    result = invoke("report", cwd=mobile, columns=80)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    header = next(line for line in lines if "Agree" in line)
    assert "Top-5" in header and "Top-1" not in header
    assert any(line.startswith("dw_int8.onnx ") for line in lines)  # the whole name on one line (the shared stem "dw" is too short to cut)
    assert any(line.startswith("Most faithful: ") for line in lines)


def test_labelled_images_of_the_model_s_classes_give_accuracy_and_fidelity(tmp_path):
    channel_mean_classifier(tmp_path / "m.onnx", size=8)
    images, labels = colour_images(6, 8, seed=1)
    test_images, test_labels = colour_images(6, 8, seed=2)
    np.savez(tmp_path / "d.npz", train_images=images, train_labels=labels, test_images=test_images, test_labels=test_labels)
    assert invoke("quantize", "--model", "m.onnx", "--data", "d.npz", "--output", "m_int8.onnx", cwd=tmp_path).exit_code == 0
    result = invoke("evaluate", "--model", "m_int8.onnx", "--data", "d.npz", "--json", cwd=tmp_path)
    record = json.loads(result.stdout)
    assert record["accuracy"] is not None and record["fidelity"]["images"] == 18
    fidelity = record["fidelity"]
    assert fidelity["top1_agreement_low"] <= fidelity["top1_agreement"] <= fidelity["top1_agreement_high"]
    # Agreement and accuracy are the same measurement where FP32 is right on every image.
    fp32 = json.loads(invoke("evaluate", "--model", "m.onnx", "--data", "d.npz", "--json", cwd=tmp_path).stdout)
    if fp32["accuracy"] == 100.0:
        assert record["fidelity"]["top1_agreement"] == record["accuracy"]
    # The delta in points is what the images each model alone gets right make of it; the text says both counts.
    assert record["accuracy"] - fp32["accuracy"] == pytest.approx(100 * (fidelity["model_only_right"] - fidelity["fp32_only_right"]) / 18, abs=1e-3)
    text = invoke("evaluate", "--model", "m_int8.onnx", "--data", "d.npz", cwd=tmp_path).stdout
    assert f"FP32 alone right on {fidelity['fp32_only_right']} images, this model alone on {fidelity['model_only_right']}" in " ".join(text.split())
    # The report reads both from the record: the delta with its p-value, the agreement with its interval.
    assert invoke("report", "--markdown", "report.md", cwd=tmp_path).exit_code == 0
    row = next(line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("| m_int8.onnx |"))
    assert f"(p = {fidelity['accuracy_delta_p_value']:.2f})" in row
    assert f"{fidelity['top1_agreement']:.2f}% ({fidelity['top1_agreement_low']:.1f}-{fidelity['top1_agreement_high']:.1f})" in row


def test_a_record_without_accuracy_must_carry_its_fidelity(mobile, tmp_path):
    _quantize(mobile, "dw_int8.onnx")
    assert invoke("evaluate", "--model", "dw_int8.onnx", "--data", "photos", cwd=mobile).exit_code == 0
    path = next((mobile / "results").glob("dw_int8.onnx-*.json"))
    data = json.loads(path.read_text())
    data["fidelity"] = None
    tampered = tmp_path / path.name
    tampered.write_text(json.dumps(data))
    with pytest.raises(Exception, match="no fidelity"):
        read_record(tampered)
    data = json.loads(path.read_text())
    data["fidelity"]["top5_containment"] = data["fidelity"]["top1_agreement"] - 1
    tampered.write_text(json.dumps(data))
    with pytest.raises(Exception, match="top-5 containment below top-1 agreement"):
        read_record(tampered)
    data = json.loads(path.read_text())
    data["fidelity"]["top1_agreement_high"] = data["fidelity"]["top1_agreement"] - 1
    tampered.write_text(json.dumps(data))
    with pytest.raises(Exception, match="top-1 agreement interval out of range"):
        read_record(tampered)
    data = json.loads(path.read_text())
    del data["fidelity"]["top1_agreement_low"], data["fidelity"]["top1_agreement_high"]  # a record from before the interval
    tampered.write_text(json.dumps(data))
    assert read_record(tampered).agreement == data["fidelity"]["top1_agreement"]


def test_tuning_without_labels_scores_agreement_with_fp32(tmp_path):
    """Validation images without labels take the FP32 model's top-1 classes: FP32 scores 100% and any other
    model its top-1 agreement with FP32."""
    from ptq_cli.services.study.validation import ValidationScore, ValidationSet, build_validation_set, labels_from_fp32

    dataset = open_dataset(photo_folder(tmp_path / "photos", 15, size=16))
    calibration = build_calibration_set(dataset, None, seed=0, count=5)
    validation = build_validation_set(calibration, dataset, samples_per_class=1)
    assert len(validation.labels) == 10 and not set(validation.indices) & set(calibration.indices)
    outputs = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
    labelled, fp32 = labels_from_fp32(validation, ValidationScore(37.0, 1.0, outputs))
    assert fp32.accuracy == 100.0 and list(labelled.labels) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    kept = ValidationSet(validation.images, np.zeros(10, np.int64), validation.indices, 0, 1, "d", "train", ("a",))
    assert labels_from_fp32(kept, fp32)[0] is kept  # labels of the model's classes stay


def test_the_study_runs_on_photos_whose_classes_are_not_the_model_s(tmp_path):
    """`ptq run --model` on a folder of photos with other classes (CIFAR-like names, a 1000-class model):
    every model measured against the FP32 model, and the report ranks by agreement."""
    depthwise_classifier(tmp_path / "dw.onnx")
    photo_folder(tmp_path / "cal", 12, seed=1)
    image_folder(tmp_path / "photos", splits=("test",), per_class=3, suffix=".jpg", size=32)
    result = invoke("run", "--model", "dw.onnx", "--data", "photos", "--calibration-data", "cal", "--no-pytorch", "--no-openvino", "--no-litert",
                    "--no-benchmark", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    records = [read_record(path) for path in (tmp_path / "results").glob("*.json") if path.name != "manifest.json"]
    assert records and all(record.accuracy is None and record.fidelity is not None for record in records)
    assert {Path(record.fidelity["reference_path"]).name for record in records} == {"dw.onnx"}
    markdown = (tmp_path / "reports" / "QUANTIZATION_ANALYSIS.md").read_text()
    assert "Agreement with the FP32 model (dw.onnx)" in markdown
    assert "Agree" in result.stdout and "Top-5" in result.stdout
