"""`--method auto` (onnxruntime, OpenVINO's QDQ route): the activation ranges chosen by the output they give on
held-out calibration images, then calibrated on every image; and onnxruntime's histogram calibration on
calibration batches of unequal sizes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from synthetic import invoke, png_images, scores_before_softmax, smooth_photos, two_conv_classifier

from ptq_cli.backends.base import describe_settings
from ptq_cli.quantize import reuse
from ptq_cli.quantize.policy import chosen_method
from ptq_cli.quantize.ranges import FACTORS
from ptq_cli.quantize.settings import AUTO_METHOD, METHOD_CANDIDATES, METHOD_MARGIN_DB, PER_IMAGE, PER_IMAGE_PERCENTILE, PER_IMAGE_TIGHT_PERCENTILE
from ptq_cli.services.quant_settings import describe_method, make_settings


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ranges")
    two_conv_classifier(root / "m.onnx")
    smooth_photos(root / "cal", 120, seed=1)
    smooth_photos(root / "test", 16, seed=2)
    return root


def _quantize(root: Path, output: str, *extra: str, calibration: str = "cal") -> dict:
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", calibration, "--preprocess", "unit",
                    "--rounding", "nearest", "--output", output, "--json", *extra, cwd=root)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _quantization_parameters(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    names = {name for node in model.graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear") for name in node.input[1:]}
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.name in names}


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_auto_keeps_the_best_measured_ranges_and_calibrates_them_on_every_image(project, dtype):
    """Every candidate is measured, the highest output SQNR is kept (MinMax unless beaten by a margin), and the file is that method's, calibrated on
    all the calibration images: the same scales and zero points as asking for the method by name."""
    auto = _quantize(project, f"auto_{dtype}.onnx", "--dtype", dtype)["settings"]
    measured = [tuple(score) for score in auto["method_sqnr_db"]]
    assert [(method, percentile) for method, percentile, _ in measured] == list(METHOD_CANDIDATES)
    assert all(db is not None for _, _, db in measured) and len({db for _, _, db in measured}) > 1  # measured, not assumed
    best = chosen_method(tuple(measured))
    assert (auto["method"], auto["percentile"]) == best
    named = ["--method", best[0], *(["--percentile", str(best[1])] if best[1] is not None else [])]
    explicit = _quantize(project, f"named_{dtype}.onnx", "--dtype", dtype, *named)["settings"]
    assert explicit["method_sqnr_db"] == [] and (explicit["method"], explicit["percentile"]) == best
    chosen, named_model = _quantization_parameters(project / f"auto_{dtype}.onnx"), _quantization_parameters(project / f"named_{dtype}.onnx")
    assert chosen.keys() == named_model.keys() and all(np.array_equal(chosen[key], named_model[key]) for key in chosen if "zero_point" in key)
    # Scales: the named method's, or (the range search kept) moved from them by one of the search's factors (one sweep).
    steps = {1.0, *FACTORS} if auto["ranges"] == "searched" else {1.0}
    ratios = [float((chosen[key] / named_model[key]).reshape(-1)[0]) for key in chosen if "zero_point" not in key and chosen[key].size == 1]
    assert all(any(abs(ratio - step) < 1e-4 for step in steps) for ratio in ratios)
    stored = json.loads({prop.key: prop.value for prop in onnx.load(str(project / f"auto_{dtype}.onnx")).metadata_props}["ptq.quantization"])
    assert stored["method"] == best[0] and len(stored["method_sqnr_db"]) == len(METHOD_CANDIDATES)


def test_the_quantize_table_names_the_ranges_kept_and_what_each_measured(project):
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                    "--rounding", "nearest", "--output", "shown.onnx", cwd=project)
    assert result.exit_code == 0, result.output
    made = _quantize(project, "shown_json.onnx")["settings"]
    row = next(line for line in result.stdout.splitlines() if "calibration method" in line)
    assert describe_method(made["method"], made["percentile"], [tuple(score) for score in made["method_sqnr_db"]]) in row
    assert row.count(" dB") == 1 and all(f"{db:.1f}" in row for _, _, db in made["method_sqnr_db"])


def test_histogram_calibration_takes_batches_of_unequal_sizes(project):
    """350 images are 3 batches of 117, 117 and 116: onnxruntime's histogram collector stacks a tensor's batches
    with np.asarray, which fails on unequal ones; ptq's collector hands it one flat array."""
    smooth_photos(project / "cal350", 350, seed=3, size=16)
    made = _quantize(project, "p350.onnx", "--method", "percentile", calibration="cal350")["settings"]
    assert made["method"] == "percentile" and made["calibration_samples"] == 350


def test_a_percentile_alone_asks_for_percentile_calibration():
    assert (make_settings("int8", percentile=99.9).method, make_settings("int8", percentile=99.9).percentile) == ("percentile", 99.9)
    assert make_settings("int8").method == AUTO_METHOD
    assert make_settings("int8", target="speed").method == AUTO_METHOD


def test_a_percentile_replaces_minmax_only_when_it_measures_better_by_the_margin():
    assert chosen_method((("minmax", None, 20.0), ("percentile", 99.999, 20.0 + METHOD_MARGIN_DB), ("percentile", 99.99, 19.0))) == ("percentile", 99.999)
    assert chosen_method((("minmax", None, 20.0), ("percentile", 99.999, 20.0 + METHOD_MARGIN_DB / 2), ("percentile", 99.99, 19.0))) == ("minmax", None)
    assert chosen_method((("minmax", None, None), ("percentile", 99.999, 3.0), ("percentile", 99.99, 4.0))) == ("percentile", 99.99)


def test_describe_method_names_the_kept_ranges_then_the_measured_ones():
    assert describe_method("minmax", None) == "minmax"
    assert describe_method("percentile", 99.99, (("minmax", None, 23.14), ("percentile", 99.99, 25.0))) == (
        "percentile 99.99 (auto: image SQNR on held-out calibration images, minmax 23.1, percentile 99.99 25.0 dB)")


def test_a_percentile_onnxruntime_cannot_calibrate_leaves_minmax(project, monkeypatch):
    """A candidate that fails scores nothing, and the model is still made: MinMax, as before auto existed."""
    from ptq_cli.errors import PtqError
    from ptq_cli.quantize import judges

    real = judges.write_qdq

    def failing_percentiles(job, target, images, settings, *rest, **keywords):
        if settings.method == "percentile":
            raise PtqError("m.onnx: onnxruntime.quantization failed (a histogram it cannot build)")
        return real(job, target, images, settings, *rest, **keywords)

    monkeypatch.setattr(judges, "write_qdq", failing_percentiles)
    made = _quantize(project, "minmax_kept.onnx")["settings"]
    assert made["method"] != "percentile"
    assert [db is None for _, _, db in made["method_sqnr_db"]] == [method == "percentile" for method, _ in METHOD_CANDIDATES]


def _candidate_parameters(project: Path, tmp_path: Path, method: str, percentile: float, histograms: dict | None) -> dict:
    """The quantization parameters of the `--method auto` candidate `method` at `percentile`, calibrated on 40 random images."""
    from ptq_cli.quantize import judges
    from ptq_cli.quantize.job import Job

    images = np.random.default_rng(0).uniform(0, 1, (40, 3, 16, 16)).astype(np.float32)
    settings = make_settings("uint8", method=method, percentile=percentile)
    job = Job(str(project / "m.onnx"), images, "image", [], lambda quantized: 0, tmp_path, tmp_path / "out.onnx", "m.onnx")
    model = judges.calibrated_model(job, images, settings, None, histograms=histograms)
    path = tmp_path / f"{method}-{percentile}-{histograms is not None}.onnx"
    onnx.save(model, str(path))
    return _quantization_parameters(path)


def test_the_percentile_candidates_read_one_collection_of_histograms(project, tmp_path, monkeypatch):
    """`--method auto`'s percentiles share the histograms the first one collected: the second runs nothing, and its model
    is the one a calibration of its own makes."""
    from onnxruntime.quantization import calibrate


    collected = []
    real = calibrate.HistogramCalibrater.collect_data
    monkeypatch.setattr(calibrate.HistogramCalibrater, "collect_data", lambda self, reader: (collected.append(self.percentile), real(self, reader))[1])

    def calibrated(percentile: float, histograms: dict | None):
        return _candidate_parameters(project, tmp_path, "percentile", percentile, histograms)

    shared: dict = {}
    first, second, alone = calibrated(99.0, shared), calibrated(99.99, shared), calibrated(99.99, None)
    assert collected == [99.0, 99.99]  # the first and the one alone collected; the second read the first's histograms
    assert second.keys() == alone.keys() and all(np.array_equal(second[key], alone[key]) for key in second)
    assert any(not np.array_equal(first[key], second[key]) for key in first)  # its own percentile, not the first's ranges


def test_the_per_image_candidates_read_one_pass_of_image_extremes(project, tmp_path, monkeypatch):
    """`--method auto`'s per-image percentiles (99 and the tighter 90) share the extremes the first one found: the second
    runs nothing, and its model is the one a calibration of its own makes."""
    from ptq_cli.quantize import calibration

    assert (PER_IMAGE, PER_IMAGE_TIGHT_PERCENTILE) in METHOD_CANDIDATES and PER_IMAGE_TIGHT_PERCENTILE < PER_IMAGE_PERCENTILE
    passes = []
    real = calibration.image_extremes
    monkeypatch.setattr(calibration, "image_extremes", lambda *args: (passes.append(1), real(*args))[1])

    def calibrated(percentile: float, histograms: dict | None):
        return _candidate_parameters(project, tmp_path, PER_IMAGE, percentile, histograms)

    shared: dict = {}
    first, second, alone = calibrated(PER_IMAGE_PERCENTILE, shared), calibrated(PER_IMAGE_TIGHT_PERCENTILE, shared), calibrated(PER_IMAGE_TIGHT_PERCENTILE, None)
    assert len(passes) == 2  # the first and the one alone ran the model; the second read the first's extremes
    assert second.keys() == alone.keys() and all(np.array_equal(second[key], alone[key]) for key in second)
    assert any(not np.array_equal(first[key], second[key]) for key in first)  # its own percentile, not the first's ranges


def test_per_image_extremes_reach_activations_whose_batch_axis_shape_inference_lost(tmp_path):
    """A squeeze-excitation gate squeezed then reshaped to [-1, C, 1, 1] (tf2onnx writes such Reshapes; without its value_info, shape
    inference names no batch there, nor in what the gate multiplies) still gets per-image extremes: a run on one image
    and on two tells which first axes are the batch. A tensor whose first axis is a channel count gets none."""
    from onnx import TensorProto, helper

    from ptq_cli.quantize import calibration

    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, 4, 1, 1], np.int64), "gate_shape")
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "spatial")
    nodes = [helper.make_node("Conv", ["image", "w"], ["features"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["features"], ["pooled"]),
             helper.make_node("Squeeze", ["pooled", "spatial"], ["squeezed"]),
             helper.make_node("Reshape", ["squeezed", "gate_shape"], ["gate_in"]),
             helper.make_node("Sigmoid", ["gate_in"], ["gate"]),
             helper.make_node("Mul", ["features", "gate"], ["gated"]),
             helper.make_node("Transpose", ["gated"], ["channels_first"], perm=[1, 0, 2, 3]),
             helper.make_node("Transpose", ["channels_first"], ["scores_map"], perm=[1, 0, 2, 3]),
             helper.make_node("ReduceMean", ["scores_map"], ["scores"], axes=[2, 3], keepdims=0)]
    graph = helper.make_graph(nodes, "gated", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 4])], [weights, shape, axes])
    path = tmp_path / "gated.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    images = rng.uniform(0, 1, (5, 3, 8, 8)).astype(np.float32)
    activations, found = calibration.image_extremes(str(path), images, "image", None)
    assert {"features", "gate_in", "gate", "gated", "scores_map"} <= set(activations) and "channels_first" not in activations
    assert all(len(values) == len(images) for values in found)
    gate = activations.index("gate")
    expected = 1 / (1 + np.exp(-images_gate(rng_images=images, weights=numpy_helper.to_array(weights))))
    assert np.allclose(found[2 * gate + 1], expected.max(axis=1), atol=1e-5)


def images_gate(rng_images: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The gate's input per image: the mean of each channel of the padded 3x3 convolution."""
    padded = np.pad(rng_images, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # N, C, H, W, 3, 3
    return np.einsum("nchwij,ocij->nohw", windows, weights).mean(axis=(2, 3))


def test_within_one_run_a_calibration_is_loaded_not_collected_again(project, tmp_path, monkeypatch):
    """Within one run (`ptq quantize` with its model for VNNI CPUs, `ptq run`), onnxruntime's calibration cache hands a
    later calibration of the same float model, images and options the ranges the first collected (per-image ranges start
    from MinMax's): it runs nothing, and its model is the one a calibration of its own makes."""
    from onnxruntime.quantization import calibrate


    collected = []
    real = calibrate.MinMaxCalibrater.collect_data
    monkeypatch.setattr(calibrate.MinMaxCalibrater, "collect_data", lambda self, reader: (collected.append(1), real(self, reader))[1])
    alone, per_image_alone = _candidate_parameters(project, tmp_path, "minmax", None, None), _candidate_parameters(project, tmp_path, PER_IMAGE, 99.0, None)
    assert len(collected) == 2
    with reuse.reusing_made_files():
        first, again = _candidate_parameters(project, tmp_path, "minmax", None, None), _candidate_parameters(project, tmp_path, "minmax", None, None)
        per_image = _candidate_parameters(project, tmp_path, PER_IMAGE, 99.0, None)
    assert len(collected) == 3  # the first in the run collected; the second and the per-image ranges loaded its cache
    for made, reference in ((first, alone), (again, alone), (per_image, per_image_alone)):
        assert made.keys() == reference.keys() and all(np.array_equal(made[key], reference[key]) for key in made)
    assert any(not np.array_equal(per_image[key], alone[key]) for key in alone)  # its own ranges, not MinMax's


def _weight_codes(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    weights = {node.input[1] for node in model.graph.node if node.op_type in ("Conv", "Gemm", "MatMul")}
    codes = {node.input[0] for node in model.graph.node if node.op_type == "DequantizeLinear" and node.output[0] in weights}
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.name in codes}


def test_a_percentile_preferred_before_rounding_is_judged_again_after_it(project, monkeypatch):
    """Where the nearest-rounded models prefer a percentile, it and MinMax are both rounded (learned rounding kept or not,
    as each measures) and judged again on the held-out images: the file is the one that measures better there (the
    percentile only by the margin), with the weight codes of that method asked for by name."""
    from ptq_cli.quantize import judges

    monkeypatch.setattr(judges, "chosen_method", lambda measured: ("percentile", 99.99))
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                    "--output", "rounded_auto.onnx", "--json", cwd=project)
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)["settings"]
    (first, first_percentile, first_db), (second, second_percentile, second_db) = made["method_rounded_db"]
    assert (first, first_percentile, second, second_percentile) == ("percentile", 99.99, "minmax", None)
    assert first_db is not None and second_db is not None
    kept = ("percentile", 99.99) if first_db >= second_db + METHOD_MARGIN_DB else ("minmax", None)
    assert (made["method"], made["percentile"]) == kept
    monkeypatch.undo()
    named = ["--method", kept[0], *(["--percentile", str(kept[1])] if kept[1] is not None else [])]
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                    "--output", "rounded_named.onnx", *named, cwd=project)
    assert result.exit_code == 0, result.output
    auto_codes, named_codes = _weight_codes(project / "rounded_auto.onnx"), _weight_codes(project / "rounded_named.onnx")
    assert auto_codes and auto_codes.keys() == named_codes.keys() and all(np.array_equal(auto_codes[key], named_codes[key]) for key in auto_codes)


def test_the_second_rounding_reads_the_float_model_s_inputs_from_the_first(project, monkeypatch):
    """The percentile model and the MinMax model are rounded from the same float model and images: the second rounding
    takes the float model's sums from the first instead of running the float model again, and the file is the same
    bytes as with every sum computed."""
    from ptq_cli.quantize import judges, runs

    monkeypatch.setattr(judges, "chosen_method", lambda measured: ("percentile", 99.99))
    real_batches = runs.collected_batches
    float_reads: list[str] = []

    def counting(input_name, images, threads, coming, chunk=16):
        batches = real_batches(input_name, images, threads, coming, chunk)

        def read(model, name):
            assert not any(node.op_type == "QuantizeLinear" for node in model.graph.node)  # the float model's source
            float_reads.append(name)
            return batches(model, name)

        return read

    monkeypatch.setattr(judges, "collected_batches", counting)

    def made(output: str) -> tuple[bytes, int, int]:
        float_reads.clear()
        result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                        "--output", output, "--json", "--no-portability-cost", cwd=project)
        assert result.exit_code == 0, result.output
        layers = int(next(note for note in json.loads(result.stdout)["notes"] if note.startswith("learned rounding:")).split()[2])
        return (project / output).read_bytes(), len(float_reads), layers

    shared, shared_reads, layers = made("memo_shared.onnx")
    monkeypatch.setattr(judges, "_float_memo", lambda float_model, images: None)
    computed, computed_reads, _ = made("memo_computed.onnx")
    assert layers > 0 and computed_reads - shared_reads == layers
    assert shared.replace(b"memo_shared", b"memo_computed") == computed


@pytest.mark.parametrize(("percentile_db", "minmax_db", "kept"), [(23.0, 22.0, "percentile"), (21.7, 23.6, "minmax"), (22.2, 22.0, "minmax"),
                                                                  (22.0, None, "percentile")])
def test_after_rounding_a_percentile_stays_only_where_it_still_wins_by_the_margin(percentile_db, minmax_db, kept):
    from dataclasses import replace

    from ptq_cli.quantize.judges import _rounded_method

    base = make_settings("uint8", percentile=99.99)
    percentile = ("percentile model", replace(base, rounding="learned").with_evidence(rounding_learned_db=percentile_db, method_sqnr_db=(("minmax", None, 15.4),)), [])
    minmax = ("minmax model", replace(base, method="minmax", percentile=None, rounding="learned").with_evidence(rounding_learned_db=minmax_db), [])
    model, settings, notes = _rounded_method(percentile, minmax)
    assert (model, settings.method) == (f"{kept} model", kept)
    assert settings.evidence.method_rounded_db == (("percentile", 99.99, percentile_db), ("minmax", None, minmax_db))
    assert settings.evidence.method_sqnr_db == (("minmax", None, 15.4),) and f"kept {kept}" in notes[-1]
    assert describe_method(settings.method, settings.percentile, settings.evidence.method_sqnr_db, settings.evidence.method_rounded_db).endswith(
        f"after weight rounding, percentile 99.99 {percentile_db:.1f}, minmax {'-' if minmax_db is None else f'{minmax_db:.1f}'} dB)")


def test_a_plain_onnxruntime_quantize_gets_the_speed_target_and_a_type_given_keeps_its_own():
    """Without --dtype, --weight-dtype or --target, onnxruntime quantizes as --target speed (uint8 activations,
    int8 per-channel weights, named so); a type given, or another backend, keeps the weights following the type."""
    from pathlib import Path

    from ptq_cli.services.make.quantize import default_output

    plain = make_settings()
    assert (plain.target, plain.dtype, plain.weight_dtype, plain.per_channel) == ("speed", "uint8", "int8", True)
    assert default_output(Path("m.onnx"), plain).name == "m_uint8_speed.onnx"
    for given in (make_settings("int8"), make_settings(weight_dtype="int8"), make_settings("uint8")):
        assert given.target is None and given.weight_dtype == given.dtype
    assert make_settings(backend="pytorch").target is None


def test_a_moved_input_scale_re_expresses_every_bias_it_scales(project):
    """An int32 bias's scale is its input's scale x its weights' scale: moving the input's scale rewrites that
    scale and the codes, so the bias the Conv adds is the same to within half a new step; weights and zero points stay."""
    from ptq_cli.quantize import ranges

    _quantize(project, "rescaled.onnx", "--method", "minmax")
    model = onnx.load(str(project / "rescaled.onnx"))
    links = ranges.bias_links(model)
    assert {link.input_scale for link in links} & set(ranges.activation_scales(model))  # conv2's input is an activation
    before = _quantization_parameters(project / "rescaled.onnx") | {
        init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.data_type == onnx.TensorProto.INT32}
    rescaler = ranges.Rescaler(model)
    moved = next(link for link in links if link.input_scale in ranges.activation_scales(model))
    rescaler.set(moved.input_scale, rescaler.get(moved.input_scale) * 1.25)
    after = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    new_scale = after[moved.input_scale] * after[moved.weight_scale]
    assert np.allclose(after[moved.scale], new_scale) and not np.allclose(before[moved.scale], new_scale)
    old_bias = before[moved.codes] * before[moved.scale].astype(np.float64)
    assert np.all(np.abs(after[moved.codes] * after[moved.scale].astype(np.float64) - old_bias) <= after[moved.scale] / 2 + 1e-12)
    untouched = [name for name in before if name not in (moved.input_scale, moved.scale, moved.codes)]
    assert all(np.array_equal(before[name], after[name]) for name in untouched)


def test_the_search_brings_unseen_images_back_from_a_poor_range(project):
    """Every activation range made 1.6x too wide (codes spent on values that never come): searched on the calibration
    images, the model comes closer to FP32 on test images it never saw, by moving only scales."""
    from ptq_cli.metrics import sqnr_db
    from ptq_cli.quantize import ranges

    _quantize(project, "poor.onnx", "--method", "minmax")
    model = onnx.load(str(project / "poor.onnx"))
    calibrated = onnx.ModelProto.FromString(model.SerializeToString())
    rescaler = ranges.Rescaler(model)
    names = ranges.activation_scales(model)
    for name in names:
        rescaler.set(name, rescaler.get(name) * 1.6)
    poor_zero_points = {key: value for key, value in _quantization_parameters(project / "poor.onnx").items() if "zero_point" in key}
    float_model = onnx.load(str(project / "m.onnx"))
    calibration, test = png_images(project / "cal"), png_images(project / "test")
    reference, test_reference = scores_before_softmax(float_model, calibration), scores_before_softmax(float_model, test)
    poor_db = sqnr_db(test_reference, scores_before_softmax(model, test))
    searched, result = ranges.search(model, lambda candidate, _moved: sqnr_db(reference, scores_before_softmax(candidate, calibration)), 1000)
    assert result.scales == len(names) == result.searched and result.moved >= 1
    calibrated_db, searched_db = (sqnr_db(test_reference, scores_before_softmax(made, test)) for made in (calibrated, searched))
    assert calibrated_db > poor_db + 1  # the widened ranges cost the model
    assert result.end_db > result.start_db + 0.5 and searched_db > poor_db + 0.5  # one sweep: a move of at most 0.8x per scale
    onnx.save(searched, str(project / "searched.onnx"))
    assert all(np.array_equal(value, _quantization_parameters(project / "searched.onnx")[key]) for key, value in poor_zero_points.items())


def test_the_search_stops_at_its_budget(project, tmp_path):
    from ptq_cli.quantize import ranges

    calls: list[int] = []
    model = onnx.load(str(two_conv_classifier(tmp_path / "float.onnx")))
    assert ranges.activation_scales(model) == []  # a float model has no activation scales: one call, nothing moved
    _, result = ranges.search(model, lambda _candidate, _moved: calls.append(1) or 0.0, 3)
    assert (result.evaluations, result.moved, len(calls)) == (1, 0, 1)
    _quantize(project, "budget.onnx", "--method", "minmax")
    quantized, calls = onnx.load(str(project / "budget.onnx")), []
    budget = 1 + 2 * len(FACTORS) + 3  # the first score, two scales, and not enough for a third
    _, result = ranges.search(quantized, lambda _candidate, _moved: calls.append(1) or float(len(calls)), budget)  # every move scores better
    assert len(ranges.activation_scales(quantized)) > 2 and result.searched == 2 and len(calls) == result.evaluations <= budget


def test_the_search_makes_one_sweep_however_large_its_budget(project):
    """A second sweep fit the searched images more tightly and took held-out images further from FP32 (README)."""
    from ptq_cli.quantize import ranges

    _quantize(project, "sweep.onnx", "--method", "minmax")
    model, calls = onnx.load(str(project / "sweep.onnx")), []
    _, result = ranges.search(model, lambda _candidate, moved: calls.append(moved) or float(len(calls)), 10_000)  # every move scores better
    scales = ranges.activation_scales(model)
    assert len(scales) > 2 and result.searched == result.moved == len(scales) and result.evaluations == len(calls) == 1 + len(scales) * len(FACTORS)
    assert calls == [None, *(name for name in scales for _ in FACTORS)]  # each score is told the scale that moved, in graph order


def _residual_classifier(path: Path) -> Path:
    """NCHW 3 x 16 x 16 -> Conv 3->8 -> Relu -> (Conv 8->8 -> Relu) + the Relu before -> Relu -> mean -> Gemm -> Softmax."""
    from onnx import helper

    rng = np.random.default_rng(5)
    initializers = [numpy_helper.from_array(rng.normal(0, scale, shape).astype(np.float32), name) for name, shape, scale in
                    (("w1", (8, 3, 3, 3), 0.3), ("b1", (8,), 0.05), ("w2", (8, 8, 3, 3), 0.15), ("b2", (8,), 0.05), ("w3", (8, 10), 0.5))]
    nodes = [helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"), helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Add", ["r1", "r2"], ["sum"]), helper.make_node("Relu", ["sum"], ["r3"]),
             helper.make_node("GlobalAveragePool", ["r3"], ["pooled"]), helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w3"], ["logits"], name="classifier"), helper.make_node("Softmax", ["logits"], ["scores"], axis=1)]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 10])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def test_the_part_after_a_moved_scale_scores_what_the_whole_model_scores(project):
    """The search runs only what depends on the moved scale, fed the tensors the rest computes (the skip connection's
    among them): the same output SQNR as the whole model to within the search's noise floor, for every scale and factor."""
    from ptq_cli.metrics import image_sqnr_db
    from ptq_cli.quantize import judges, ranges, runs
    from ptq_cli.transforms.graph import part_after

    _residual_classifier(project / "residual.onnx")
    made = invoke("quantize", "--model", "residual.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit", "--rounding", "nearest",
                  "--method", "minmax", "--output", "residual_int8.onnx", cwd=project)
    assert made.exit_code == 0, made.output
    model = onnx.load(str(project / "residual_int8.onnx"))
    images, judged = png_images(project / "cal"), runs.judged_in(model, "logits")
    reference = scores_before_softmax(onnx.load(str(project / "residual.onnx")), images)
    scores = judges.PartScores(judged, "image", images, 1, 32, reference)
    scales, producers = ranges.activation_scales(model), {output: node for node in model.graph.node for output in node.output}
    parts = {name: part_after(model, name, judged) for name in scales}
    assert parts[scales[0]] is None  # the input's scale: the whole model depends on it
    assert any(part is not None and len(part[1]) == 2 for part in parts.values())  # conv2's output: it reads the skip connection too
    assert all(producers[read].op_type == "QuantizeLinear" for part in parts.values() if part is not None for read in part[1] if read != "image")
    assert part_after(model, scales[1], "no such tensor") is None
    rescaler = ranges.Rescaler(model)
    for name in scales:
        start = rescaler.get(name)
        for factor in (FACTORS[0], FACTORS[-1]):
            rescaler.set(name, start * factor)
            whole = image_sqnr_db(reference, runs.tensor_outputs(model, judged, "image", images, 1))
            assert abs(scores(model, name) - whole) < ranges.MIN_GAIN_DB, name
        rescaler.set(name, start)


def test_auto_searches_the_ranges_and_keeps_the_search_only_where_held_out_images_measure_it_better(project):
    made = _quantize(project, "auto_searched.onnx")["settings"]
    calibrated_db, searched_db = made["ranges_calibrated_db"], made["ranges_searched_db"]
    assert calibrated_db is not None and searched_db is not None
    assert made["ranges"] == ("searched" if searched_db >= calibrated_db + METHOD_MARGIN_DB else "calibrated")
    assert ("searched ranges" in describe_settings(made)) == (made["ranges"] == "searched")
    shown = invoke("quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                   "--rounding", "nearest", "--output", "auto_searched_shown.onnx", cwd=project, columns=200)
    assert shown.exit_code == 0 and f"{calibrated_db:.1f} dB calibrated, {searched_db:.1f} dB searched" in shown.stdout
    named = _quantize(project, "named_no_search.onnx", "--method", "minmax")["settings"]
    assert named["ranges"] is None and "activation ranges" not in invoke(
        "quantize", "--model", "m.onnx", "--data", "test", "--calibration-data", "cal", "--preprocess", "unit", "--rounding", "nearest",
        "--method", "minmax", "--output", "named_shown.onnx", cwd=project, columns=200).stdout


def test_describe_ranges_names_the_kept_ranges_and_both_figures():
    from ptq_cli.quantize.ranges import describe_ranges

    assert describe_ranges(None) is None
    assert describe_ranges("searched", 30.64, 31.55) == (
        "searched (image SQNR on held-out calibration images: 30.6 dB calibrated, 31.6 dB searched)")


def test_a_search_whose_one_sweep_exceeds_the_budget_is_not_run_and_says_so(project, monkeypatch):
    from ptq_cli.quantize import judges

    monkeypatch.setattr(judges, "RANGE_SEARCH_PIXELS", 16 * 16 * 90 * 10)  # 10 runs of the 90 images not held out: under one sweep
    made = _quantize(project, "over_budget.onnx")
    assert made["settings"]["ranges"] is None and made["settings"]["ranges_searched_db"] is None
    assert any(note.startswith("range search: not run") and "budget of 10" in note for note in made["notes"])


def test_a_part_onnxruntime_cannot_run_alone_leaves_the_candidates_of_that_scale_to_the_whole_model(project, monkeypatch):
    from onnx import helper

    from ptq_cli.metrics import image_sqnr_db
    from ptq_cli.quantize import judges, ranges, runs
    from ptq_cli.transforms.graph import part_after

    _quantize(project, "unrunnable.onnx", "--method", "minmax")
    model = onnx.load(str(project / "unrunnable.onnx"))
    images, judged = png_images(project / "cal"), runs.judged_in(model, "logits")
    reference = scores_before_softmax(onnx.load(str(project / "m.onnx")), images)

    def unrunnable(whole, scale, output):
        part = part_after(whole, scale, output)
        if part is not None:
            part[0].graph.node.append(helper.make_node("NoSuchOp", [output], ["nothing"]))  # onnxruntime refuses to load it
        return part

    monkeypatch.setattr(judges, "part_after", unrunnable)
    scores, moved = judges.PartScores(judged, "image", images, 1, 32, reference), ranges.activation_scales(model)[-1]
    assert part_after(model, moved, judged) is not None
    whole = image_sqnr_db(reference, runs.tensor_outputs(model, judged, "image", images, 1))
    assert scores(model, moved) == pytest.approx(whole) and scores(model, moved) == pytest.approx(whole)


def _activations(path: Path, names: list[str], images: np.ndarray) -> list[np.ndarray]:
    """The float model's tensors `names` on `images`, from a plain onnxruntime run (the reference)."""
    import onnxruntime as ort

    model = onnx.load(str(path))
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, {"image": images})


@pytest.mark.parametrize("opset", [13, 18])  # ReduceMin/ReduceMax take their axes as an input from opset 18
def test_per_image_ranges_are_percentiles_of_each_image_s_own_extremes(project, tmp_path, opset):
    """Against numpy on the activations themselves: each range is the 99th percentile over the images of their maxima (and the
    1st of their minima), so that one image far out of range (here, 40 times brighter) does not set the scale, as MinMax lets it."""
    from ptq_cli.quantize.calibration import per_image_ranges

    images = png_images(project / "cal")[:100]
    images[7] *= 40.0
    source = tmp_path / "m.onnx"
    onnx.save(onnx.version_converter.convert_version(onnx.load(str(project / "m.onnx")), opset), str(source))
    found = per_image_ranges(str(source), images, "image", 99.0)
    assert {"image", "c1", "r1", "c2", "r2", "logits"} <= found.keys() and "scores" in found
    names = sorted(found)
    for name, values in zip(names, _activations(project / "m.onnx", names, images), strict=True):
        per_image = values.reshape(len(values), -1)
        assert found[name] == [{"rmin": pytest.approx(np.percentile(per_image.min(1), 1.0), rel=1e-6, abs=1e-7),
                                "rmax": pytest.approx(np.percentile(per_image.max(1), 99.0), rel=1e-6, abs=1e-7)}], name
    r1 = _activations(project / "m.onnx", ["r1"], images)[0]
    assert found["r1"][0]["rmax"] < r1.max() / 10  # the bright image alone reaches MinMax's bound


def test_per_image_method_is_kept_in_the_model_and_bounds_the_scales_below_minmax(project, tmp_path):
    bright = smooth_photos(tmp_path / "cal", 60, seed=4)
    from PIL import Image

    Image.fromarray(np.full((16, 16, 3), 255, np.uint8)).save(bright / "999.png")  # one image far brighter than the others
    (project / "cal_bright").symlink_to(bright)
    per_image = _quantize(project, "per_image.onnx", "--method", "per-image", calibration="cal_bright")
    _quantize(project, "minmax_bright.onnx", "--method", "minmax", calibration="cal_bright")
    assert (per_image["settings"]["method"], per_image["settings"]["percentile"]) == ("per-image", 99.0)
    assert describe_method("per-image", 99.0) == "per-image 99"
    narrowed, full = _quantization_parameters(project / "per_image.onnx"), _quantization_parameters(project / "minmax_bright.onnx")
    activation_scales = [key for key in narrowed if key.endswith("_scale") and narrowed[key].size == 1 and not key.startswith("w")]
    assert activation_scales and all(narrowed[key] <= full[key] * (1 + 1e-6) for key in activation_scales)
    assert any(narrowed[key] < full[key] * 0.99 for key in activation_scales)  # the extreme image no longer sets them


def _minmax_images(monkeypatch) -> list[int]:
    """The images onnxruntime's MinMax calibrators are fed, batch by batch, from now on."""
    from onnxruntime.quantization import calibrate

    seen: list[int] = []
    real = calibrate.MinMaxCalibrater.collect_data

    def collect(self, reader):
        get_next = reader.get_next

        def counted():
            batch = get_next()
            if batch:
                seen.append(len(next(iter(batch.values()))))
            return batch

        reader.get_next = counted
        try:
            return real(self, reader)
        finally:
            del reader.get_next

    monkeypatch.setattr(calibrate.MinMaxCalibrater, "collect_data", collect)
    return seen


def test_the_minmax_model_of_every_image_calibrates_only_the_held_out_ones_and_is_what_a_whole_pass_makes(project, monkeypatch):
    """`--method auto` has MinMax's ranges over the 3/4 its candidates calibrate on: the model of every image runs only the
    held-out quarter through onnxruntime's MinMax calibrator and merges the two, and the file is byte for byte the one
    a MinMax pass over every image makes."""
    from ptq_cli.quantize import calibration
    from ptq_cli.quantize.policy import held_out_split

    images = _minmax_images(monkeypatch)
    _quantize(project, "merged.onnx", "--method", "auto")
    merged = sum(images)
    images.clear()
    monkeypatch.setattr(calibration, "_minmax_of_all", lambda *_: None)
    _quantize(project, "whole.onnx", "--method", "auto")
    held_out, rest = held_out_split(np.arange(len(png_images(project / "cal"))))
    assert sum(images) - merged == len(rest) and len(held_out) > 0
    assert (project / "merged.onnx").read_bytes() == (project / "whole.onnx").read_bytes()


def test_the_judges_run_the_float_model_once_for_each_set_of_images_they_compare_on(project, monkeypatch):
    """The ranges, the overflow fix, the rounding and the range search each compare with FP32's output on the held-out
    images (the search on its own images too): the float model runs once for each set, not once a judge."""
    from ptq_cli.quantize import judges

    float_runs: list[tuple[int, ...]] = []
    real = judges.tensor_outputs

    def counted(model, name, input_name, images, *args, **kwargs):
        if not any(node.op_type == "QuantizeLinear" for node in model.graph.node):
            float_runs.append(images.shape)
        return real(model, name, input_name, images, *args, **kwargs)

    monkeypatch.setattr(judges, "tensor_outputs", counted)
    settings = _quantize(project, "judged.onnx", "--method", "auto", "--rounding", "auto")["settings"]
    assert settings["ranges"] == "searched" or settings["ranges"] == "calibrated"  # every judge ran
    assert settings["rounding_nearest_db"] is not None and len(float_runs) == len(set(float_runs)) == 2, float_runs


def test_each_weight_is_quantized_once_for_all_the_candidates_and_the_file_is_the_same(project, monkeypatch):
    """`--method auto` writes a QDQ model per candidate, most with the same weight codes: onnxruntime's writer computes
    the codes of a weight with the same scales once, and the model is byte for byte the one it writes computing them
    every time."""
    import importlib

    from ptq_cli.quantize import calibration

    writer = importlib.import_module("onnxruntime.quantization.qdq_quantizer")
    real, computed = writer.quantize_onnx_initializer, []

    def counted(weight, quant_type, zero_point, scale, *args, **kwargs):
        computed.append((weight.SerializeToString(), quant_type, np.asarray(zero_point).tobytes(), np.asarray(scale).tobytes(), args))
        return real(weight, quant_type, zero_point, scale, *args, **kwargs)

    monkeypatch.setattr(writer, "quantize_onnx_initializer", counted)
    _quantize(project, "codes_once.onnx", "--method", "auto")
    assert computed and len(computed) == len(set(computed))
    monkeypatch.setattr(calibration, "_weights_quantized_once", contextlib.nullcontext)
    computed.clear()
    _quantize(project, "codes_each_time.onnx", "--method", "auto")
    assert len(computed) > len(set(computed))
    assert (project / "codes_once.onnx").read_bytes() == (project / "codes_each_time.onnx").read_bytes()


def test_candidates_past_the_activation_budget_are_calibrated_on_an_even_draw_and_the_model_kept_on_every_image(project, monkeypatch):
    """Where the images not held out would read more than CANDIDATE_VALUES activation values, `--method auto`'s candidates
    are calibrated on an even draw of them within it (and says so); the model kept is calibrated on every image: its
    MinMax ranges merge the draw's with the other images', byte for byte the model a MinMax pass over every image makes."""
    from ptq_cli.quantize import calibration
    from ptq_cli.quantize.policy import held_out_split

    count = len(png_images(project / "cal"))
    held_out, rest = held_out_split(np.arange(count))
    per_image = calibration.activation_bytes(str(project / "m.onnx")) // 4
    monkeypatch.setattr(calibration, "CANDIDATE_VALUES", per_image * 40)  # a few dozen of the 90 not held out (the prepared graph has more)
    images = _minmax_images(monkeypatch)
    drawn = _quantize(project, "drawn.onnx", "--method", "auto")
    notes = " ".join(drawn["notes"])
    candidates = int(notes.split("candidates calibrated on ")[1].split()[0])
    assert 4 <= candidates < len(rest) and f"of the {len(rest)} images not held out" in notes and f"the model kept on all {count}" in notes
    assert images[0] == candidates and sum(images) == count  # the draw's MinMax, then every other image's, once
    images.clear()
    monkeypatch.setattr(calibration, "_minmax_of_all", lambda *_: None)
    _quantize(project, "drawn_whole.onnx", "--method", "auto")
    assert sum(images) == candidates + count and len(held_out) > 0
    assert (project / "drawn.onnx").read_bytes() == (project / "drawn_whole.onnx").read_bytes()


@pytest.mark.parametrize("count", [30, 1100])
def test_within_the_budget_the_candidates_read_every_image_not_held_out(project, count):
    """Under CANDIDATE_VALUES the candidates' images are policy.held_out_split's rest, in its order (the ranges, and the
    files, of a model that fits are those they always were); the others are every image besides, once: the held-out
    quarter, and past HELD_OUT_MAX held-out images the quarter's images beyond it too (MinMax over every image merges the two)."""
    from ptq_cli.quantize.calibration import judged_images
    from ptq_cli.quantize.job import Job
    from ptq_cli.quantize.policy import held_out_split

    images = np.arange(count * 4, dtype=np.float32).reshape(count, 1, 2, 2)
    job = Job(str(project / "m.onnx"), images, "input", [], lambda _model: 0, project, project / "unused.onnx", "m", None, ())
    split = judged_images(job)
    held_out, rest = held_out_split(images)
    assert np.array_equal(split.calibrating, rest) and np.array_equal(split.held_out, held_out)
    assert np.array_equal(np.sort(np.concatenate([split.calibrating, split.others]).reshape(-1)), images.reshape(-1))
    assert len(split.others) == count - len(rest) and len(split.others) >= len(held_out)
    assert not split.drawn and split.not_held_out == len(rest)  # nothing said of a draw that was not made
