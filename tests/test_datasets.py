"""Bring your own model and images, in-process (typer's CliRunner) on tiny synthetic models and data.

The classifier and images are tests/synthetic.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image
from synthetic import CLASSES, channel_mean_classifier, colour_images, colours_npz, image_folder, invoke, one_line_error

from ptq_cli.datasets import open_dataset
from ptq_cli.errors import PtqError


def evaluate_record(results: Path, model: str) -> dict:
    found = sorted(results.glob(f"{model}-??????@*.json"))
    assert len(found) == 1, [p.name for p in results.iterdir()]
    return json.loads(found[0].read_text())


def test_image_folder_is_read_by_layout_and_fed_as_the_model_wants(tmp_path):
    image_folder(tmp_path / "colours")
    channel_mean_classifier(tmp_path / "m.onnx")
    result = invoke("evaluate", "--model", "m.onnx", "--data", "colours", "--results-dir", "res", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    record = evaluate_record(tmp_path / "res", "m.onnx")
    assert record["accuracy"] == 100.0 and record["class_names"] == list(CLASSES) and record["dataset_format"] == "folder"
    assert record["model_input"].startswith("NCHW 3x8x8")
    # Fed BGR, red and blue swap: only green stays right.
    result = invoke("evaluate", "--model", "m.onnx", "--data", "colours", "--bgr", "--results-dir", "bgr", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert abs(evaluate_record(tmp_path / "bgr", "m.onnx")["accuracy"] - 100 / 3) < 0.01


def test_classes_txt_orders_the_labels(tmp_path):
    image_folder(tmp_path / "colours")
    dataset = open_dataset(tmp_path / "colours")
    assert dataset.class_names() == CLASSES  # not the sorted folder names (blue, green, red)
    (tmp_path / "colours" / "classes.txt").unlink()
    assert open_dataset(tmp_path / "colours").class_names() == ("blue", "green", "red")
    test = dataset.load("test")
    assert test.images.shape == (18, 8, 8, 3) and test.labels.tolist() == [0] * 6 + [1] * 6 + [2] * 6


def test_grey_and_rgba_images_take_the_models_channel_count(tmp_path):
    root = image_folder(tmp_path / "colours")
    red = root / "test" / "red"
    Image.fromarray(np.full((8, 8), 90, np.uint8)).save(red / "grey.png")
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 255
    Image.fromarray(rgba).save(red / "rgba.png")
    test = open_dataset(root).load("test", (8, 8), 3)
    reds = test.images[test.labels == 0]  # files sorted by name: 0000..0005.png, grey.png, rgba.png
    assert test.images.shape == (20, 8, 8, 3)
    assert reds[6][0, 0].tolist() == [90, 90, 90] and reds[7][0, 0].tolist() == [200, 0, 0]
    grey = open_dataset(root).load("test", (8, 8), 1)
    assert grey.images.shape == (20, 8, 8, 1) and grey.images[test.labels == 0][6][0, 0, 0] == 90


def test_images_are_resized_to_the_model_input(tmp_path):
    image_folder(tmp_path / "colours", size=16)
    channel_mean_classifier(tmp_path / "m.onnx", size=8)
    result = invoke("evaluate", "--model", "m.onnx", "--data", "colours", "--results-dir", "res", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert evaluate_record(tmp_path / "res", "m.onnx")["accuracy"] == 100.0


def test_photos_of_many_sizes_with_a_train_split_calibrate_at_the_model_s_size(tmp_path):
    """People's photos differ in size: a labelled folder with splits calibrates and quantizes (its labels come
    from the class folders, not from decoding every photo at its own size)."""
    for split, seed in (("train", 1), ("test", 2)):
        images, labels = colour_images(4, size=40, seed=seed)
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = tmp_path / "photos" / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            height, width = 9 + 3 * index, 31 - 2 * index
            Image.fromarray(image[:height, :width]).save(folder / f"{index:02d}.png")
    channel_mean_classifier(tmp_path / "m.onnx")
    result = invoke("quantize", "--model", "m.onnx", "--data", "photos", "--output", "q.onnx", "--rounding", "nearest", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert open_dataset(tmp_path / "photos").labels("train").tolist() == [0] * 4 + [1] * 4 + [2] * 4
    with pytest.raises(PtqError, match="no 'val' split"):
        open_dataset(tmp_path / "photos").labels("val")


def test_images_drawn_from_an_array_set_are_resized_alone_and_as_they_would_be_all_together(tmp_path, monkeypatch):
    from ptq_cli.datasets import base
    from ptq_cli.services.make.calibration import build_calibration_set

    colours_npz(tmp_path / "c.npz", per_class=40)
    everything = base.resize(open_dataset(tmp_path / "c.npz").load("train").images, (20, 12))
    resized: list[int] = []
    monkeypatch.setattr(base, "resize", lambda images, size, resize=base.resize: resized.append(len(images)) or resize(images, size))
    drawn = build_calibration_set(open_dataset(tmp_path / "c.npz"), 5, 7, (20, 12))
    assert resized == [15] and drawn.images.shape == (15, 20, 12, 3)
    assert np.array_equal(drawn.images, everything[drawn.indices])


def test_photos_drawn_for_calibration_are_decoded_alone_unless_the_whole_split_is_cached(tmp_path, monkeypatch):
    from ptq_cli import settings
    from ptq_cli.datasets import folder
    from ptq_cli.services.make.calibration import build_calibration_set

    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    image_folder(tmp_path / "photos", per_class=20, size=16)
    decoded: list[int] = []
    original = folder.ImageFolder._decode
    monkeypatch.setattr(folder.ImageFolder, "_decode", lambda self, split, size, indices=None:
                        decoded.append(60 if indices is None else len(indices)) or original(self, split, size, indices))
    drawn = build_calibration_set(open_dataset(tmp_path / "photos"), 2, 7, (12, 12))
    assert decoded == [6] and drawn.images.shape == (6, 12, 12, 3)
    everything = open_dataset(tmp_path / "photos").load("train", (12, 12))  # the whole split, decoded and cached
    again = build_calibration_set(open_dataset(tmp_path / "photos"), 2, 7, (12, 12))
    assert decoded == [6, 60] and np.array_equal(again.images, everything.images[drawn.indices])
    assert np.array_equal(drawn.images, again.images) and np.array_equal(drawn.labels, everything.labels[drawn.indices])


def test_a_split_over_the_images_memory_is_scored_a_part_at_a_time_into_the_same_record(tmp_path, monkeypatch):
    from ptq_cli import settings
    from ptq_cli.datasets.base import Dataset

    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    image_folder(tmp_path / "photos", per_class=10, size=16)
    channel_mean_classifier(tmp_path / "m.onnx", size=12)
    channel_mean_classifier(tmp_path / "fp32.onnx", size=12, opset=14)  # the same scores from other bytes: fidelity has a second model to run
    evaluate = ("evaluate", "--model", "m.onnx", "--data", "photos", "--against-fp32", "fp32.onnx", "--batch-size", "4")
    assert invoke(*evaluate, "--results-dir", "whole", cwd=tmp_path).exit_code == 0  # the split held whole (and cached so)
    held: list[int] = []
    original = Dataset._decoded
    monkeypatch.setattr(Dataset, "_decoded", lambda *args: (lambda arrays: held.append(len(arrays[0])) or arrays)(original(*args)))
    monkeypatch.setenv("PTQ_IMAGES_MEMORY", str(12 * 12 * 3 * 8))  # two calls of 4 images
    result = invoke(*evaluate, "--results-dir", "parts", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    # One pass: each part is decoded once, for the model and its FP32 model, and not sliced from the whole split's cache.
    assert held == [8, 8, 8, 6]
    whole, parts = evaluate_record(tmp_path / "whole", "m.onnx"), evaluate_record(tmp_path / "parts", "m.onnx")
    assert parts["fidelity"]["images"] == 30 and parts["fidelity"]["top1_agreement"] == 100.0
    assert {key: value for key, value in parts.items() if key not in ("timestamp", "images_per_second")} == \
           {key: value for key, value in whole.items() if key not in ("timestamp", "images_per_second")}


def test_validation_is_drawn_apart_from_the_calibration_set_and_only_from_its_own_images(tmp_path):
    from ptq_cli.services.make.calibration import build_calibration_set
    from ptq_cli.services.study.validation import build_validation_set

    dataset = open_dataset(colours_npz(tmp_path / "c.npz", per_class=10))
    calibration = build_calibration_set(dataset, 4, 7, (12, 12))
    validation = build_validation_set(calibration, dataset, samples_per_class=3)
    assert not set(validation.indices) & set(calibration.indices) and validation.images.shape == (9, 12, 12, 3)
    assert np.array_equal(validation.images, dataset.load("train", (12, 12)).images[validation.indices])
    other = open_dataset(colours_npz(tmp_path / "other.npz", per_class=10, train_images=colour_images(10, seed=5)[0]))
    with pytest.raises(PtqError, match="drawn from other images than the train split"):
        build_validation_set(calibration, other, samples_per_class=3)


def test_npz_dataset_and_its_bad_forms(tmp_path):
    images, labels = colour_images(5)
    np.savez(tmp_path / "set.npz", images=images, labels=labels, class_names=np.array(CLASSES))
    channel_mean_classifier(tmp_path / "m.onnx", layout="NHWC")
    result = invoke("evaluate", "--model", "m.onnx", "--data", "set.npz", "--results-dir", "res", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert evaluate_record(tmp_path / "res", "m.onnx")["accuracy"] == 100.0
    np.savez(tmp_path / "keys.npz", x=images, y=labels)
    one_line_error(invoke("evaluate", "--model", "m.onnx", "--data", "keys.npz", "--results-dir", "r2", cwd=tmp_path), "keys.npz")
    np.savez(tmp_path / "shape.npz", images=images.astype(np.float32), labels=labels)
    one_line_error(invoke("evaluate", "--model", "m.onnx", "--data", "shape.npz", "--results-dir", "r3", cwd=tmp_path), "shape.npz")
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


@pytest.mark.parametrize("damage, mentions", [
    ("empty class", "green"),
    ("corrupt image", "0000.png"),
    ("not an image", "notes.txt"),
    ("classes differ", "differ"),
])
def test_bad_image_folders_fail_in_one_line(tmp_path, damage, mentions):
    root = image_folder(tmp_path / "colours")
    channel_mean_classifier(tmp_path / "m.onnx")
    if damage == "empty class":
        for path in (root / "test" / "green").iterdir():
            path.unlink()
    elif damage == "corrupt image":
        (root / "test" / "red" / "0000.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    elif damage == "not an image":
        (root / "test" / "red" / "notes.txt").write_text("hello")
    else:
        (root / "test" / "purple").mkdir()
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "test" / "purple" / "a.png")
    one_line_error(invoke("evaluate", "--model", "m.onnx", "--data", "colours", "--results-dir", "res", cwd=tmp_path), mentions)
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("options, mentions", [
    (["--mean", "0.5,0.5"], "--mean"),
    (["--std", "0"], "--std"),
    (["--std", "1,x,1"], "--std"),
    (["--scale", "-1"], "--scale"),
])
def test_bad_preprocessing_options_fail_before_work(tmp_path, options, mentions):
    image_folder(tmp_path / "colours")
    channel_mean_classifier(tmp_path / "m.onnx")
    for command in (["evaluate", "--results-dir", "res"], ["quantize", "--output", "q.onnx"]):
        one_line_error(invoke(*command, "--model", "m.onnx", "--data", "colours", *options, cwd=tmp_path), mentions)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["colours", "m.onnx"]


def test_models_that_do_not_fit_the_data_are_refused(tmp_path):
    image_folder(tmp_path / "colours")
    channel_mean_classifier(tmp_path / "four.onnx", classes=4)
    channel_mean_classifier(tmp_path / "two.onnx", two_inputs=True)
    one_line_error(invoke("evaluate", "--results-dir", "res", "--model", "four.onnx", "--data", "colours", cwd=tmp_path), "4 class scores")
    for command in (["evaluate", "--results-dir", "res"], ["quantize", "--output", "q.onnx"]):
        one_line_error(invoke(*command, "--model", "two.onnx", "--data", "colours", cwd=tmp_path), "2 inputs")
    assert not (tmp_path / "res").exists() and not (tmp_path / "q.onnx").exists()


def test_calibrating_and_timing_need_no_labels_of_the_model_s_classes(tmp_path):
    """Images of 3 classes calibrate and time a model of 4 (as a folder of photos does an ImageNet classifier)."""
    image_folder(tmp_path / "colours")
    channel_mean_classifier(tmp_path / "four.onnx", classes=4)
    quantized = invoke("quantize", "--model", "four.onnx", "--data", "colours", "--output", "q.onnx", "--json", cwd=tmp_path)
    assert quantized.exit_code == 0, quantized.output
    assert json.loads(quantized.stdout)["settings"]["calibration_samples"] > 0 and (tmp_path / "q.onnx").is_file()
    timed = invoke("benchmark", "--model", "four.onnx", "--model", "q.onnx", "--data", "colours", "--runs", 2, "--results-dir", "res", "--json",
                   cwd=tmp_path)
    assert timed.exit_code == 0, timed.output
    assert [record["model_path"] for record in json.loads(timed.stdout)] == ["four.onnx", "q.onnx"]


def test_a_single_set_calibrates_on_itself_and_says_so_but_never_tunes_on_itself(tmp_path):
    image_folder(tmp_path / "only", splits=("test",))
    flat = tmp_path / "flat"  # ROOT/<class>/<image>: one set
    (tmp_path / "only" / "test").rename(flat)
    image_folder(tmp_path / "calib", splits=("train",))
    channel_mean_classifier(tmp_path / "m.onnx")
    itself = invoke("quantize", "--model", "m.onnx", "--data", "flat", "--output", "q.onnx", "--json", cwd=tmp_path)
    assert itself.exit_code == 0, itself.output
    made = json.loads(itself.stdout)
    assert any("the set it is judged on" in note for note in made["notes"]) and "judged on" in made["settings"]["calibration_source"]
    one_line_error(invoke("tune", "--model", "m.onnx", "--data", "flat", cwd=tmp_path), "--calibration-data")
    result = invoke("quantize", "--model", "m.onnx", "--data", "flat", "--calibration-data", "calib", "--output", "q.onnx",
                    "--dtype", "uint8", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert not any("judged on" in note for note in json.loads(result.stdout)["notes"])


def test_quantized_model_keeps_its_preprocessing_and_fixed_batch_is_freed(tmp_path):
    image_folder(tmp_path / "colours", per_class=12)
    channel_mean_classifier(tmp_path / "m.onnx", batch=1, opset=9)
    result = invoke("quantize", "--model", "m.onnx", "--data", "colours", "--preprocess", "unit", "--output", "q.onnx",
                    "--dtype", "uint8", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert any("opset 9 upgraded to 13" in note for note in notes) and any("fixed batch 1 made symbolic" in note for note in notes)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    metadata = {prop.key: prop.value for prop in quantized.metadata_props}
    assert json.loads(metadata["ptq.input"])["preset"] == "unit"
    assert quantized.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    # Evaluated without flags: the stored contract; the FP32 source evaluated too, fed the same way.
    result = invoke("evaluate", "--model", "q.onnx", "--data", "colours", "--results-dir", "res", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    quantized_record, source_record = evaluate_record(tmp_path / "res", "q.onnx"), evaluate_record(tmp_path / "res", "m.onnx")
    assert quantized_record["preprocessing"] == "unit" == source_record["preprocessing"]
    assert quantized_record["source_sha256"] == source_record["model_sha256"]
    assert "delta vs FP32 m.onnx" in result.stdout
    assert source_record["model_input"] == "NCHW 3x8x8, batch 1 (fixed batch 1 made symbolic (same outputs))"


def _pooled_flatten_classifier(path: Path, target: list[int], constant_node: bool, tied: bool = False, ir_version: int = 7) -> Path:
    """A fixed-batch-1 NCHW classifier: global mean, a Reshape to the constant `target` (an initializer or a Constant
    node, as tf2onnx writes a Keras Flatten), scores; `tied`: the features reshaped to [3, 1] and transposed instead.
    Below IR version 4 (opset 8), every initializer is a graph input too."""
    from onnx import helper, numpy_helper

    shape = numpy_helper.from_array(np.array([3, 1] if tied else target, np.int64), "target")
    nodes = [helper.make_node("GlobalAveragePool", ["image"], ["pooled"]),
             *([helper.make_node("Constant", [], ["target"], value=shape)] if constant_node else []),
             helper.make_node("Reshape", ["pooled", "target"], ["columns" if tied else "flat"]),
             *([helper.make_node("Transpose", ["columns"], ["flat"], perm=[1, 0])] if tied else []),
             helper.make_node("MatMul", ["flat", "weights"], ["scores"])]
    weights = numpy_helper.from_array(np.array([[1, 0, 0], [0, 2, 0], [0, 0, 3]], np.float32), "weights")
    initializers = [weights, *([] if constant_node else [shape])]
    inputs = [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, [1, 3, 8, 8])]
    if ir_version < 4:
        inputs += [helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)) for init in initializers]
    graph = helper.make_graph(nodes, "flatten", inputs, [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, [1, 3])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13 if ir_version >= 4 else 8)], ir_version=ir_version)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(("target", "constant_node", "ir_version"), [([1, 3], False, 7), ([1, -1], True, 7), ([1, 3], True, 7), ([1, 3], False, 3)])
def test_a_flatten_written_for_the_fixed_batch_is_freed_and_computes_the_same(tmp_path, target, constant_node, ir_version):
    """tf2onnx writes a Keras Flatten of a batch-1 export as a Reshape to [1, 1000]: the batch is freed anyway (learned
    rounding and --method auto need it), and the freed model scores a batch as the fixed one scores each image; the
    same for an opset-8 model, whose initializers are graph inputs."""
    import onnxruntime as ort

    from ptq_cli.model_file import describe_input, free_batch

    path = _pooled_flatten_classifier(tmp_path / "m.onnx", target, constant_node, ir_version=ir_version)
    model = onnx.load(str(path))
    freed = free_batch(path, model, describe_input(path, model)[0])
    assert freed is not None
    onnx.checker.check_model(freed)
    # The target the fixed batch was written into is gone (no node reads it any more).
    assert "target" not in {init.name for init in freed.graph.initializer} | {out for node in freed.graph.node for out in node.output}
    images = np.random.default_rng(0).uniform(0, 1, (5, 3, 8, 8)).astype(np.float32)
    fixed = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = np.concatenate([fixed.run(None, {"image": images[i : i + 1]})[0] for i in range(5)])
    got = ort.InferenceSession(freed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert [init.name for init in model.graph.initializer] == [init.name for init in onnx.load(str(path)).graph.initializer]  # the input untouched
    image_folder(tmp_path / "colours", per_class=12)
    notes = json.loads(invoke("quantize", "--model", "m.onnx", "--data", "colours", "--preprocess", "unit", "--output", "q.onnx", "--json",
                              cwd=tmp_path).stdout)["notes"]
    assert any("fixed batch 1 made symbolic" in note for note in notes) and not any("tied to its fixed batch" in note for note in notes)
    # IR version 3 (opset 8) lists its initializers among the inputs: upgraded, it takes the IR version opset 13 needs.
    assert ir_version >= 4 or any("opset 8 upgraded to 13" in note for note in notes)


def test_a_graph_that_mixes_the_batch_into_its_features_keeps_its_fixed_batch(tmp_path):
    from ptq_cli.model_file import describe_input, free_batch

    path = _pooled_flatten_classifier(tmp_path / "m.onnx", [1, 3], constant_node=False, tied=True)
    model = onnx.load(str(path))
    assert free_batch(path, model, describe_input(path, model)[0]) is None


def test_records_are_kept_per_dataset_and_the_report_groups_them(tmp_path):
    image_folder(tmp_path / "png")
    image_folder(tmp_path / "jpeg", suffix=".jpg")
    channel_mean_classifier(tmp_path / "m.onnx")
    for data in ("png", "jpeg"):
        assert invoke("evaluate", "--model", "m.onnx", "--data", data, "--results-dir", "res", cwd=tmp_path).exit_code == 0
    assert len(list((tmp_path / "res").glob("m.onnx-??????@*.json"))) == 2
    result = invoke("report", "--results-dir", "res", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    groups = json.loads(result.stdout)["groups"]
    assert sorted(group["label"] for group in groups) == ["jpeg (test)", "png (test)"]


def test_each_command_has_its_own_help_with_the_data_options(tmp_path):
    for command in ("calibrate", "quantize", "evaluate", "benchmark", "sensitivity", "tune", "prune", "sweep", "run", "convert"):
        result = invoke(command, "--help", cwd=tmp_path)
        assert result.exit_code == 0, (command, result.output)
        assert "--data" in result.stdout and f"ptq {command}" in result.stdout
    for command in ("quantize", "evaluate", "benchmark", "sensitivity", "tune", "prune", "sweep", "run"):
        assert "--preprocess" in invoke(command, "--help", cwd=tmp_path).stdout


def test_sixteen_bit_grey_is_scaled_to_eight_bits_not_clipped(tmp_path):
    """A 16-bit PNG's 0-65535 become 0-255 (divided by 257), as its 8-bit original would read, never 255 everywhere."""
    wide = (np.random.default_rng(0).random((8, 8)) * 65535).astype(np.uint16)
    for split in ("train", "test"):
        for name in CLASSES:
            (tmp_path / "grey" / split / name).mkdir(parents=True)
            Image.fromarray(wide).save(tmp_path / "grey" / split / name / "0.png")
    assert Image.open(tmp_path / "grey" / "test" / "red" / "0.png").mode.startswith("I")
    images = open_dataset(tmp_path / "grey").load("test").images
    assert np.abs(images[0, ..., 0].astype(float) - wide / 257.0).max() <= 0.5


def test_a_set_of_one_image_evaluates_and_quantizes(tmp_path):
    """Classes the images do not show are not drawn from: one labelled image calibrates."""
    channel_mean_classifier(tmp_path / "m.onnx")
    np.savez(tmp_path / "one.npz", images=colour_images(1)[0][:1], labels=np.array([0]), class_names=np.array(CLASSES))
    assert invoke("evaluate", "--model", "m.onnx", "--data", "one.npz", "--results-dir", "res", cwd=tmp_path).exit_code == 0
    made = invoke("quantize", "--model", "m.onnx", "--data", "one.npz", "--output", "q.onnx", "--json", cwd=tmp_path)
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["settings"]["calibration_samples"] == 1
