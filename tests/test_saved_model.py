"""`ptq convert --keras` on TensorFlow SavedModel folders: a classifier converts and matches TensorFlow; a folder whose
graph reads or writes files, or that holds a link, is refused before TensorFlow loads it, and nothing it names runs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from synthetic import image_folder, invoke, one_line_error

pytest.importorskip("tensorflow")


def _tensorflow():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    return tf


def keras_export(folder: Path) -> Path:
    """A small Keras CNN on 8x8 RGB, exported as a SavedModel (Keras 3's model.export)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(3)])
    model.export(str(folder), verbose=False)
    return folder


def module_with(folder: Path, touch_files) -> Path:
    """A tf.Module SavedModel whose serving function also calls `touch_files()` (a file op) before classifying."""
    tf = _tensorflow()

    class Classifier(tf.Module):
        def __init__(self):
            super().__init__()
            self.weights = tf.Variable(np.ones((3, 3), np.float32))

        @tf.function(input_signature=[tf.TensorSpec((None, 8, 8, 3), tf.float32)])
        def __call__(self, images):
            with tf.control_dependencies([touch_files()]):
                return tf.matmul(tf.reduce_mean(images, axis=[1, 2]), self.weights)

    classifier = Classifier()
    tf.saved_model.save(classifier, str(folder), signatures=classifier.__call__)
    return folder


def test_a_keras_saved_model_converts_and_matches_tensorflow(tmp_path):
    image_folder(tmp_path / "images")
    keras_export(tmp_path / "saved")
    result = invoke("convert", "--keras", "saved", "--output", "m.onnx", "--data", "images", "--preprocess", "unit", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m.onnx").is_file() and "100.00%" in result.stdout  # top-1 agreement with TensorFlow on the check images
    evaluated = invoke("evaluate", "--model", "m.onnx", "--data", "images", cwd=tmp_path)
    assert evaluated.exit_code == 0, evaluated.output
    one_line_error(invoke("quantize", "--model", "m.onnx", "--data", "images", "--backend", "litert", "--output", "q.tflite", cwd=tmp_path),
                   "is a SavedModel folder; --backend litert quantizes from a .keras or .h5 file")


@pytest.mark.parametrize(("op", "touch"), [
    ("WriteFile", lambda target: lambda: _tensorflow().io.write_file(str(target), "written by the model")),
    ("ReadFile", lambda target: lambda: _tensorflow().io.read_file(str(target))),
])
def test_a_saved_model_that_touches_files_is_refused_before_tensorflow_loads_it(tmp_path, op, touch):
    image_folder(tmp_path / "images")
    target = tmp_path / "written.txt"
    module_with(tmp_path / "saved", touch(target))
    assert not target.exists()  # saving traced the function; it did not run it
    result = invoke("convert", "--keras", "saved", "--output", "m.onnx", "--data", "images", cwd=tmp_path)
    one_line_error(result, f"saved: a SavedModel using TensorFlow ops ptq does not run from a SavedModel ({op}")
    assert not target.exists() and not (tmp_path / "m.onnx").exists()


def test_a_saved_model_folder_holding_a_link_or_no_graph_is_one_line(tmp_path):
    image_folder(tmp_path / "images")
    keras_export(tmp_path / "saved")
    (tmp_path / "saved" / "assets" / "passwd").symlink_to("/etc/passwd")
    one_line_error(invoke("convert", "--keras", "saved", "--output", "m.onnx", "--data", "images", cwd=tmp_path), "saved: a SavedModel folder holding a link")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "saved_model.pb").write_bytes(b"")
    one_line_error(invoke("convert", "--keras", "empty", "--output", "m.onnx", "--data", "images", cwd=tmp_path),
                   "empty: a SavedModel with 0 graphs tagged 'serve'")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "saved_model.pb").write_bytes(b"\xff" * 64)
    one_line_error(invoke("convert", "--keras", "junk", "--output", "m.onnx", "--data", "images", cwd=tmp_path),
                   "junk/saved_model.pb: not a SavedModel graph")
    assert not (tmp_path / "m.onnx").exists()


def test_run_points_a_saved_model_folder_to_convert(tmp_path):
    image_folder(tmp_path / "images")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "saved_model.pb").write_bytes(b"")
    one_line_error(invoke("run", "--keras", "saved", "--data", "images", cwd=tmp_path), "--keras: saved is a folder; convert a SavedModel with ptq convert --keras")


def test_a_saver_def_naming_another_node_does_not_exempt_it(tmp_path):
    """The saver's nodes are left out of the op check only as what TensorFlow writes (calls of its checkpoint
    functions): a saved_model.pb edited so that `restore_op_name` names a WriteFile node is refused by that op."""
    from tensorflow.core.framework import attr_value_pb2, node_def_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    image_folder(tmp_path / "images")
    folder = keras_export(tmp_path / "saved")
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((folder / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0]
    writer = node_def_pb2.NodeDef(name="restore_all", op="WriteFile", input=["saver_filename", "saver_filename"])
    writer.attr["T"].CopyFrom(attr_value_pb2.AttrValue(type=7))
    graph.graph_def.node.append(writer)
    graph.saver_def.restore_op_name = "restore_all"
    (folder / "saved_model.pb").write_bytes(saved.SerializeToString())
    refused = invoke("convert", "--keras", "saved", "--output", "m.onnx", "--data", "images", cwd=tmp_path)
    one_line_error(refused, "saved: a SavedModel using TensorFlow ops ptq does not run from a SavedModel (")
    assert "WriteFile" in refused.stderr and not (tmp_path / "m.onnx").exists()
