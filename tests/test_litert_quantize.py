"""`ptq quantize --backend litert`: a full-integer .tflite from the Keras model an ONNX model was converted
from, calibrated on ptq's calibration set; tiny Keras classifiers of coloured images, in-process."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from synthetic import CLASSES, channel_mean_classifier, colour_images, invoke, one_line_error

from ptq_cli import settings
from ptq_cli.backends import litert
from ptq_cli.errors import PtqError
from ptq_cli.quantize import reuse, tflite
from ptq_cli.quantize.policy import chosen_method, held_out_mask
from ptq_cli.quantize.settings import METHOD_CANDIDATES
from ptq_cli.services import quant_settings
from ptq_cli.services.models import load_model

pytest.importorskip("ai_edge_litert", reason="the litert extra is not installed")
keras = pytest.importorskip("keras", reason="the keras extra is not installed")

SCALE = 1 / 255


def _keras_colour_classifier(path, scale: float = 1.0):
    """Conv 1x1 (the identity, ReLU) -> mean over the image -> Dense (the identity x 10): the class is the
    brightest channel. `scale`: the input is pixels x scale."""
    image = keras.Input((8, 8, 3))
    features = keras.layers.Conv2D(3, 1, activation="relu", name="conv")(image)
    pooled = keras.layers.GlobalAveragePooling2D()(features)
    scores = keras.layers.Dense(3, activation="softmax", name="dense")(pooled)
    model = keras.Model(image, scores)
    model.get_layer("conv").set_weights([np.eye(3, dtype=np.float32).reshape(1, 1, 3, 3), np.zeros(3, np.float32)])
    model.get_layer("dense").set_weights([np.eye(3, dtype=np.float32) * 10 / (255 * scale), np.zeros(3, np.float32)])
    model.save(path)
    return path


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A Keras model, its ONNX conversion by ptq (which records the Keras file), and images in an .npz."""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    train, train_labels = colour_images(20, seed=1)
    test, test_labels = colour_images(20, seed=2)
    np.savez(tmp_path / "colours.npz", train_images=train, train_labels=train_labels, test_images=test, test_labels=test_labels,
             class_names=np.array(CLASSES))
    _keras_colour_classifier(tmp_path / "tiny.h5", SCALE)
    converted = invoke("convert", "--keras", "tiny.h5", "--output", "tiny.onnx", "--data", "colours.npz", "--check-images", "30",
                       "--scale", str(SCALE), cwd=tmp_path)
    assert converted.exit_code == 0, converted.output
    return tmp_path


def _quantize(study, *args):
    result = invoke("quantize", "--model", "tiny.onnx", "--backend", "litert", "--data", "colours.npz", "--json", *args, cwd=study)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _top1(model, images):
    return model.predict(model.prepare(images)).argmax(axis=1)


def test_a_full_integer_tflite_with_int8_io_predicts_what_the_float_model_does(study):
    made = _quantize(study)
    assert made["output"] == "tiny_int8.tflite" and made["settings"]["io"] == "int8" and made["settings"]["per_channel"] is True
    data = (study / "tiny_int8.tflite").read_bytes()
    assert litert.sniff(data[:8]) and made["output_size_bytes"] == len(data)
    quantized, source = load_model(study / "tiny_int8.tflite"), load_model(study / "tiny.onnx")
    assert quantized.info.dtype == "int8" and quantized.info.quantization["input"].startswith("int8 (")
    assert quantized.info.quantization["output"].startswith("int8 (")
    # Stored in the flatbuffer: the preprocessing (no flags needed), the settings, the FP32 source.
    assert quantized.preprocessing == source.preprocessing and quantized.preprocessing.scale == pytest.approx(SCALE)
    assert quantized.info.source_sha256 == source.info.sha256
    assert quantized.info.quantization["calibration_samples"] == 60 and quantized.info.quantization["keras_source"] == "tiny.h5"
    images, labels = colour_images(20, seed=2)
    assert np.array_equal(_top1(quantized, images), _top1(source, images)) and np.mean(_top1(quantized, images) == labels) == 1.0


@pytest.mark.parametrize("io, kind", [("uint8", "uint8 ("), ("float", "float32")])
def test_io_sets_the_input_and_output_tensor_types(study, io, kind):
    _quantize(study, "--io", io, "--output", f"{io}.tflite")
    quantized = load_model(study / f"{io}.tflite")
    assert quantized.info.quantization["input"].startswith(kind) and quantized.info.quantization["output"].startswith(kind)
    images, _ = colour_images(20, seed=2)
    assert np.array_equal(_top1(quantized, images), _top1(load_model(study / "tiny.onnx"), images))


def test_per_tensor_weights_have_one_scale_per_tensor(study):
    from tensorflow.lite.tools import flatbuffer_utils

    def weight_scales(name):
        graph = flatbuffer_utils.read_model(str(study / name)).subgraphs[0]
        convolution = next(tensor for tensor in graph.tensors if tensor.type == 9 and len(tensor.shape) == 4 and tensor.shape[-1] == 3
                           and tensor.quantization is not None and tensor.buffer and tensor.shape[0] == 3)
        return len(convolution.quantization.scale)

    _quantize(study, "--per-tensor", "--output", "tensor.tflite")
    _quantize(study, "--output", "channel.tflite")
    assert (weight_scales("tensor.tflite"), weight_scales("channel.tflite")) == (1, 3)


def test_ranges_from_an_onnxruntime_model_put_the_tflite_model_on_its_grid(study):
    made = invoke("quantize", "--model", "tiny.onnx", "--target", "speed", "--method", "percentile", "--data", "colours.npz", "--output", "speed.onnx", cwd=study)
    assert made.exit_code == 0, made.output
    result = _quantize(study, "--ranges-from", "speed.onnx")
    assert result["output"] == "tiny_int8_ranges.tflite" and "from speed.onnx" in result["notes"][0]
    qdq = onnx.load(str(study / "speed.onnx"))
    constants = {initializer.name: numpy_helper.to_array(initializer) for initializer in qdq.graph.initializer}
    # The first quantized activation is the image (here after tf2onnx's NHWC -> NCHW Transpose).
    first = next(node for node in qdq.graph.node if node.op_type == "QuantizeLinear" and node.input[0] not in constants)
    onnx_scale, onnx_zero_point = float(constants[first.input[1]]), int(constants[first.input[2]])
    details = tflite.interpreter_class()(model_path=str(study / "tiny_int8_ranges.tflite")).get_input_details()[0]
    scale, zero_point = details["quantization"]
    # The same grid: uint8 zero point z is int8 zero point z - 128.
    assert scale == pytest.approx(onnx_scale, rel=1e-6) and zero_point == onnx_zero_point - 128
    plain = tflite.interpreter_class()(model_path=str(study / _quantize(study)["output"])).get_input_details()[0]
    assert plain["quantization"][0] != pytest.approx(onnx_scale, rel=1e-6)  # the converter's own calibration differs


def test_an_onnx_model_without_a_keras_source_is_refused(study):
    channel_mean_classifier(study / "plain.onnx", layout="NHWC")
    result = invoke("quantize", "--model", "plain.onnx", "--backend", "litert", "--data", "colours.npz", cwd=study)
    one_line_error(result, "names none (ptq convert --keras records it)")
    assert not list(study.glob("plain_*"))


def test_a_changed_keras_source_is_refused(study):
    _keras_colour_classifier(study / "tiny.h5", 2 * SCALE)
    one_line_error(invoke("quantize", "--model", "tiny.onnx", "--backend", "litert", "--data", "colours.npz", cwd=study), "has changed")
    assert not (study / "tiny_int8.tflite").exists()


def test_ranges_from_a_model_of_another_source_are_refused(study):
    channel_mean_classifier(study / "other.onnx", layout="NHWC")
    made = invoke("quantize", "--model", "other.onnx", "--data", "colours.npz", "--scale", str(SCALE), "--output", "other_q.onnx", cwd=study)
    assert made.exit_code == 0, made.output
    one_line_error(invoke("quantize", "--model", "tiny.onnx", "--backend", "litert", "--data", "colours.npz", "--ranges-from", "other_q.onnx",
                          cwd=study), "was not quantized by ptq from this FP32 model")
    assert not (study / "tiny_int8_ranges.tflite").exists()


def test_a_missing_ranges_model_is_refused_before_any_work(study):
    one_line_error(invoke("quantize", "--model", "tiny.onnx", "--backend", "litert", "--data", "colours.npz", "--ranges-from", "gone.onnx",
                          cwd=study), "gone.onnx")
    assert not (study / "tiny_int8_ranges.tflite").exists()


@pytest.mark.parametrize("options, mentions", [
    ({"backend": "litert", "dtype": "uint8"}, "--io uint8"),
    ({"backend": "litert", "io": "int16"}, "--io"),
    ({"backend": "onnxruntime", "io": "int8"}, "a LiteRT option"),
    ({"backend": "openvino", "ranges_from": "m.onnx"}, "a LiteRT option"),
    ({"backend": "litert", "method": "percentile", "ranges_from": "m.onnx"}, "--ranges-from"),
    ({"backend": "litert", "method": "entropy"}, "not a litert calibration method"),
])
def test_litert_settings_are_checked_in_one_place(options, mentions):
    with pytest.raises(PtqError, match=mentions.replace("(", r"\(")):
        quant_settings.make_settings(**options)


def test_tune_says_it_does_not_search_tflite_settings(study):
    result = invoke("tune", "--model", "tiny.onnx", "--backend", "litert", "--data", "colours.npz", cwd=study)
    one_line_error(result, "ptq quantize --backend litert")


def _plain_tflm_scores(path, prepared: np.ndarray) -> tuple[np.ndarray, float]:
    """The tflite-micro interpreter as its own README uses it, one image per invoke: (int8 output codes x its
    output scale, that scale)."""
    from tflite_micro.python.tflite_micro import runtime

    interpreter = runtime.Interpreter.from_file(str(path))
    given = interpreter.get_input_details(0)["quantization_parameters"]
    scale, zero_point = float(given["scales"][0]), int(given["zero_points"][0])
    codes = np.clip(np.round(prepared / scale + zero_point), -128, 127).astype(np.int8)
    scores = []
    for image in codes:
        interpreter.set_input(image[None], 0)
        interpreter.invoke()
        scores.append(np.array(interpreter.get_output(0)).reshape(-1))
    returned = interpreter.get_output_details(0)["quantization_parameters"]
    out_scale, out_zero_point = float(returned["scales"][0]), int(returned["zero_points"][0])
    return (np.stack(scores).astype(np.float64) - out_zero_point) * out_scale, out_scale


def test_tflm_runs_a_tflite_on_the_microcontroller_kernels_in_worker_processes_with_the_same_scores(study):
    """`--runtime tflm`: TFLite Micro's interpreter scores the model as a device does (its own record, the arena
    it measured); a call split across worker processes gives the serial scores, and both are TFLM's own."""
    pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
    from ptq_cli.backends import tflm

    _quantize(study)
    path = study / "tiny_int8.tflite"
    images, _ = colour_images(40, seed=3)  # 120 images: split across workers from tflm.PARALLEL_FROM
    serial = load_model(path, 1, runtime="tflm")
    parallel = load_model(path, 2, runtime="tflm")
    assert serial.info.runtime == "tflm" and serial.info.arena_bytes > 0 and len(images) >= tflm.PARALLEL_FROM
    prepared = serial.prepare(images)
    scores = parallel.predict(prepared)
    assert np.array_equal(scores, serial.predict(prepared))
    plain, step = _plain_tflm_scores(path, prepared)
    np.testing.assert_allclose(scores, plain, rtol=0, atol=step / 4)  # the same output codes
    assert len(np.unique(plain.argmax(axis=1))) == 3
    result = invoke("evaluate", "--model", "tiny_int8.tflite", "--runtime", "tflm", "--data", "colours.npz", "--results-dir", "res", "--json", cwd=study)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["runtime"] == "tflm" and record["dtype"] == "int8" and record["accuracy"] == 100.0
    assert record["arena_bytes"] == serial.info.arena_bytes
    assert [path.name for path in (study / "res").glob("tiny_int8.tflite-*~tflm@*.json")]


def test_tflm_refuses_what_it_cannot_run_in_one_line(study):
    pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
    one_line_error(invoke("evaluate", "--model", "tiny.onnx", "--runtime", "tflm", "--data", "colours.npz", cwd=study), "runs .tflite files only")
    (study / "broken.tflite").write_bytes(b"\x1c\x00\x00\x00TFL3" + b"\x00" * 40)
    one_line_error(invoke("evaluate", "--model", "broken.tflite", "--runtime", "tflm", "--data", "colours.npz", cwd=study), "broken.tflite")


def test_tflm_names_the_op_it_lacks_in_one_line(study):
    """A model LiteRT loads but TFLite Micro has no kernel for (its Softmax's opcode made SKIP_GRAM, which TFLM lacks)."""
    pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    _quantize(study)
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs((study / "tiny_int8.tflite").read_bytes(), 0))
    (softmax,) = [code for code in model.operatorCodes if code.builtinCode == schema.BuiltinOperator.SOFTMAX]
    softmax.builtinCode = softmax.deprecatedBuiltinCode = schema.BuiltinOperator.SKIP_GRAM
    softmax.version = 1
    builder = flatbuffers.Builder(0)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    (study / "lacks.tflite").write_bytes(builder.Output())
    result = invoke("evaluate", "--model", "lacks.tflite", "--runtime", "tflm", "--data", "colours.npz", "--results-dir", "res", cwd=study)
    one_line_error(result, "lacks.tflite: TFLite Micro cannot run it (Didn't find op for builtin opcode 'SKIP_GRAM')")
    assert not list(study.glob("res/*.json"))  # no record of a model that did not run


def _keras_two_conv_classifier(path, pooled: bool = False):
    """Conv 3x3 (3->8) -> Conv 3x3 (8->8) -> mean -> Dense: a stem and one more convolution, seeded weights.
    `pooled`: Conv 3x3 (3->16) -> MaxPool 2 -> Conv 3x3 (16->4), so that the body convolution runs where fewer
    activation bytes are alive than at the stem (its int4 filter, unpacked, does not enlarge TFLite Micro's arena)."""
    rng = np.random.default_rng(3)
    image = keras.Input((8, 8, 3))
    features = keras.layers.Conv2D(16 if pooled else 8, 3, padding="same", activation="relu", name="stem")(image)
    features = keras.layers.MaxPooling2D(2)(features) if pooled else features
    features = keras.layers.Conv2D(4 if pooled else 8, 3, padding="same", activation="relu", name="body")(features)
    scores = keras.layers.Dense(3, name="dense")(keras.layers.GlobalAveragePooling2D()(features))
    model = keras.Model(image, scores)
    for layer in ("stem", "body", "dense"):
        weights = model.get_layer(layer).get_weights()
        model.get_layer(layer).set_weights([rng.normal(0, 0.3, weights[0].shape).astype(np.float32), np.zeros_like(weights[1])])
    model.save(path)
    return path


def _tensor_types(data: bytes) -> dict[str, tuple[int, int]]:
    """The filters of a .tflite's CONV_2D and FULLY_CONNECTED ops: name -> (tensor type, buffer bytes)."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph, found = model.subgraphs[0], {}
    for operator in graph.operators:
        code = model.operatorCodes[operator.opcodeIndex]
        if max(code.builtinCode, code.deprecatedBuiltinCode) in (schema.BuiltinOperator.CONV_2D, schema.BuiltinOperator.FULLY_CONNECTED):
            tensor = graph.tensors[operator.inputs[1]]
            found[tensor.name.decode() if isinstance(tensor.name, bytes) else tensor.name] = (tensor.type, len(model.buffers[tensor.buffer].data))
    return found


def test_int4_filters_are_int4_in_the_file_and_tflm_runs_them_as_their_codes(study, monkeypatch):
    """`--weight-dtype int4`: the body's convolution filter is an INT4 tensor (two codes a byte), the stem and the
    fully-connected layer stay int8 (TFLite Micro has no int4 FULLY_CONNECTED); TFLite Micro gives the scores of
    the same codes held in int8, and the model still predicts what the float model does."""
    pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    _keras_two_conv_classifier(study / "two.h5", pooled=True)
    assert invoke("convert", "--keras", "two.h5", "--output", "two.onnx", "--data", "colours.npz", "--check-images", "30", "--scale",
                  str(SCALE), cwd=study).exit_code == 0
    calls = []

    def spied(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    original = litert.to_int4
    monkeypatch.setattr(litert, "to_int4", spied)
    made = invoke("quantize", "--model", "two.onnx", "--backend", "litert", "--weight-dtype", "int4", "--data", "colours.npz", "--json", cwd=study)
    assert made.exit_code == 0, made.output
    settings = json.loads(made.stdout)["settings"]
    # The layers choose whether to compensate on the held-out calibration images: the quantize path passes them.
    held = calls[0]["held"]
    assert len(held) == settings["calibration_samples"] and np.array_equal(held, held_out_mask(len(held))) and held.any()
    assert (settings["weight_dtype"], settings["rounding"], json.loads(made.stdout)["output"]) == ("int4", "learned", "two_int8_w4.tflite")
    data = (study / "two_int8_w4.tflite").read_bytes()
    filters = sorted(_tensor_types(data).values(), key=lambda kind: kind[1])
    int4 = [(kind, size) for kind, size in filters if kind == schema.TensorType.INT4]
    assert int4 == [(schema.TensorType.INT4, 4 * 3 * 3 * 16 // 2)]  # the body: 576 codes in 288 bytes
    assert sum(kind == schema.TensorType.INT8 for kind, _ in filters) == 2  # the stem and the dense layer
    # The same codes held in int8 (unpacked, low nibble first), run by TFLite Micro: the same scores.
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    for tensor in model.subgraphs[0].tensors:
        if tensor.type == schema.TensorType.INT4:
            packed = np.asarray(model.buffers[tensor.buffer].data, np.uint8)
            nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[: int(np.prod(tensor.shape))].astype(np.int8)
            model.buffers[tensor.buffer].data = np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.int8).view(np.uint8)
            tensor.type = schema.TensorType.INT8
    builder = flatbuffers.Builder(0)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    (study / "as_int8.tflite").write_bytes(bytes(builder.Output()))
    images, labels = colour_images(10, seed=4)
    four_bit, held_in_int8 = (load_model(study / name, 1, runtime="tflm") for name in ("two_int8_w4.tflite", "as_int8.tflite"))
    scores = four_bit.predict(four_bit.prepare(images))
    assert np.array_equal(scores, held_in_int8.predict(held_in_int8.prepare(images)))
    fp32 = load_model(study / "two.onnx")
    assert np.mean(scores.argmax(axis=1) == fp32.predict(fp32.prepare(images)).argmax(axis=1)) >= 0.9


def test_a_flash_budget_puts_back_in_8_bits_the_4_bit_layers_that_fit_and_gain(study):
    """`--max-flash-kb`: the file stays within it and the settings record it; the layers put back in 8 bits are
    those the judge scores higher that fit (here a judge that prefers 8-bit filters, so that the choice and not
    the tiny model's noise is tested); refused without int4."""
    from ai_edge_litert import schema_py_generated as schema

    from ptq_cli.quantize import int4

    _keras_two_conv_classifier(study / "two.h5", pooled=True)
    assert invoke("convert", "--keras", "two.h5", "--output", "two.onnx", "--data", "colours.npz", "--check-images", "30", "--scale",
                  str(SCALE), cwd=study).exit_code == 0
    budget = 32.0
    result = invoke("quantize", "--model", "two.onnx", "--backend", "litert", "--weight-dtype", "int4", "--data", "colours.npz",
                    "--output", "budget.tflite", "--max-flash-kb", str(budget), "--json", cwd=study)
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)
    assert made["settings"]["max_flash_kb"] == budget and (study / "budget.tflite").stat().st_size <= budget * 1024
    assert "8 bits back where they gain most output SQNR" in " ".join(made["notes"])

    assert invoke("quantize", "--model", "two.onnx", "--backend", "litert", "--data", "colours.npz", "--output", "eight.tflite", cwd=study).exit_code == 0
    eight = (study / "eight.tflite").read_bytes()
    images = np.random.default_rng(8).integers(-128, 128, (20, 8, 8, 3), dtype=np.int8)
    all_four = int4.to_int4(eight, images).data

    def int8_filters(data: bytes) -> float:
        return float(sum(kind == schema.TensorType.INT8 for kind, _ in _tensor_types(data).values()))

    def body_type(cap: int) -> set[int]:
        mixed = int4.Mixed(fits=lambda data: len(data) <= cap, judge=int8_filters)
        data = int4.to_int4(eight, images, mixed=mixed).data
        assert len(data) <= cap
        return {kind for kind, _ in _tensor_types(data).values()}

    assert schema.TensorType.INT4 not in body_type(len(all_four) + 1000)
    assert schema.TensorType.INT4 in body_type(len(all_four) + 100)  # the body's int8 filter needs 288 more bytes
    asked = int4.to_int4(eight, images, eight_bit={1: "asked"})  # how a budget's choice is fitted again
    assert not asked.layers and any(kept.endswith("(asked)") for kept in asked.kept)
    one_line_error(invoke("quantize", "--model", "two.onnx", "--backend", "litert", "--max-flash-kb", "60", "--data", "colours.npz", cwd=study),
                   "--max-flash-kb")
    one_line_error(invoke("quantize", "--model", "two.onnx", "--max-flash-kb", "60", "--data", "colours.npz", cwd=study), "--max-flash-kb")


def test_within_one_run_the_tflite_models_share_the_converters_calibration_and_the_method_comparison(study, monkeypatch):
    """`ptq run` makes its .tflite models from one Keras model and calibration set: within the run the converter
    calibrates each image set once and `--method auto` compares once, and the files are those made one by one."""

    calibrated: list[int] = []
    calibrate = tflite.calibrate

    def counted(keras_path, calibration, progress=None):
        calibrated.append(len(calibration))
        return calibrate(keras_path, calibration, progress)

    monkeypatch.setattr(tflite, "calibrate", counted)
    made = {"int8.tflite": (), "int4.tflite": ("--weight-dtype", "int4")}
    alone = {name: _quantize(study, "--output", name, *options) for name, options in made.items()}
    one_by_one, calibrated[:] = list(calibrated), []
    with reuse.reusing_made_files():
        within = {name: _quantize(study, "--output", f"run_{name}", *options) for name, options in made.items()}
    assert len(one_by_one) == 4 and sorted(calibrated) == sorted(set(one_by_one)) and len(calibrated) == 2  # the held-out split's and the whole set's
    for name in made:
        assert (study / f"run_{name}").read_bytes() == (study / name).read_bytes(), name
        assert within[name]["settings"]["method_sqnr_db"] == alone[name]["settings"]["method_sqnr_db"]


def _two_conv_int8(study) -> bytes:
    """The two-convolution classifier, converted and quantized by ptq to a full-integer .tflite: its bytes."""
    _keras_two_conv_classifier(study / "two.h5")
    assert invoke("convert", "--keras", "two.h5", "--output", "two.onnx", "--data", "colours.npz", "--check-images", "30", "--scale",
                  str(SCALE), cwd=study).exit_code == 0
    assert invoke("quantize", "--model", "two.onnx", "--backend", "litert", "--data", "colours.npz", "--output", "eight.tflite", cwd=study).exit_code == 0
    data = (study / "eight.tflite").read_bytes()
    return data


def test_the_int8_models_layer_inputs_collected_several_a_pass_are_those_of_one_pass_a_layer(study, monkeypatch):
    """What 4-bit fitting reads of the unchanged int8 model: every layer's input, from one interpreter pass while they fit
    in ORIGINAL_BYTES, one pass each when only one does; the same values as a pass for each layer alone."""
    from ptq_cli.quantize import int4

    data = _two_conv_int8(study)
    schema = int4.schema_module()
    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    tensors = [int(operator.inputs[0]) for _, operator in int4.weighted_ops(model_object)]
    images = np.random.default_rng(3).integers(-128, 128, (130, 8, 8, 3), dtype=np.int8)  # more than one interpreter batch
    alone = {tensor: int4.layer_inputs(data, tensor, images) for tensor in tensors}
    passes: list[list[int]] = []
    collect = int4.tensor_codes
    monkeypatch.setattr(int4, "tensor_codes", lambda model, wanted, batch: passes.append(list(wanted)) or collect(model, wanted, batch))
    for budget, expected in ((int4.ORIGINAL_BYTES, [tensors]), (1, [[tensor] for tensor in tensors])):
        monkeypatch.setattr(int4, "ORIGINAL_BYTES", budget)
        passes.clear()
        original = int4.OriginalInputs(data, model_object.subgraphs[0], tensors, images)
        for tensor in tensors:
            np.testing.assert_array_equal(original(tensor), alone[tensor])
        assert passes == expected
    # The model cut at a layer's input reads it as the whole model does, in fewer operators, and the model stays whole.
    monkeypatch.setattr(int4, "tensor_codes", collect)
    graph, before = model_object.subgraphs[0], int4.pack_model(model_object)
    for tensor in tensors:
        cut = int4.up_to(model_object, tensor)
        np.testing.assert_array_equal(int4.layer_inputs(cut, tensor, images), alone[tensor])
        operators = schema.Model.GetRootAs(cut, 0).Subgraphs(0).OperatorsLength()
        assert operators < len(graph.operators) or tensor in list(graph.inputs), tensor
    assert int4.pack_model(model_object) == before


def test_the_changed_models_layer_inputs_read_stretch_by_stretch_are_those_of_the_model_cut_at_each_layer(study, monkeypatch):
    """What fitting reads of the model it changes layer by layer (CurrentInputs): each layer's input as the model
    cut there computes it with the earlier layers' new filters, running each operator once in all; past
    CURRENT_BYTES, the cut model each time."""
    from ptq_cli.quantize import int4

    data = _two_conv_int8(study)
    schema = int4.schema_module()
    images = np.random.default_rng(4).integers(-128, 128, (130, 8, 8, 3), dtype=np.int8)  # more than one interpreter batch
    segments: list[int] = []  # the operators of each model CurrentInputs runs (a stretch, or the model cut at the layer)
    reading, run_model = [False], int4.reference_codes

    def counted(model: bytes, *rest):
        if reading[0]:
            segments.append(schema.Model.GetRootAs(model, 0).Subgraphs(0).OperatorsLength())
        return run_model(model, *rest)

    monkeypatch.setattr(int4, "reference_codes", counted)
    for budget in (int4.CURRENT_BYTES, 0):
        monkeypatch.setattr(int4, "CURRENT_BYTES", budget)
        segments.clear()
        model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
        graph, current = model_object.subgraphs[0], int4.CurrentInputs(model_object, images)
        moved = []
        for _, operator in int4.weighted_ops(model_object):
            tensor = int(operator.inputs[0])
            reading[0] = True
            read = current(operator)
            reading[0] = False
            np.testing.assert_array_equal(read, int4.layer_inputs(int4.up_to(model_object, tensor), tensor, images))
            moved.append(not np.array_equal(read, int4.layer_inputs(data, tensor, images)))
            # The layer changes after its input is read, as fitting changes it: the next layers' inputs change with it.
            filters = model_object.buffers[graph.tensors[int(operator.inputs[1])].buffer]
            filters.data = np.frombuffer((-np.frombuffer(bytes(filters.data), np.int8).clip(-127, 127)).astype(np.int8).tobytes(), np.uint8)
        # Within the budget, each operator runs once in all; past it, each read runs the model cut at the layer.
        assert 0 < sum(segments) <= len(graph.operators) if budget else sum(segments) > len(graph.operators), segments
        assert moved[0] is False and any(moved), moved  # the first layer reads the image; a later one the changed layers' output


def test_int4_codes_leave_less_output_error_than_plain_rounding():
    """Per output channel, the chosen clipping and GPTQ codes cost the layer's output no more than nearest 4-bit
    codes at the full range, weighted by the inputs' second moments, on correlated inputs; stored two codes a byte."""
    from ptq_cli.quantize import int4
    from ptq_cli.transforms import tflite_graph

    rng = np.random.default_rng(0)
    mixing = rng.normal(0, 1, (24, 24))
    inputs = rng.normal(0, 1, (4000, 24)) @ mixing
    second = inputs.T @ inputs / len(inputs)
    weights = rng.normal(0, 1, (16, 24))
    codes, scales = int4._codes(weights, second, per_tensor=False)
    assert codes.min() >= int4.QMIN and codes.max() <= int4.QMAX
    plain_scales = np.abs(weights).max(axis=1) / int4.QMAX
    plain = np.clip(np.rint(weights / plain_scales[:, None]), int4.QMIN, int4.QMAX)

    def cost(quantized, scale):
        error = weights - quantized * scale[:, None]
        return np.einsum("ok,kl,ol->o", error, second, error)

    assert np.all(cost(codes, scales) <= cost(plain, plain_scales) + 1e-9) and cost(codes, scales).sum() < 0.8 * cost(plain, plain_scales).sum()
    packed = tflite_graph.pack_int4(np.array([1, -1, 7, -8, 3], np.int8))
    assert np.array_equal(packed, np.array([0xF1, 0x87, 0x03], np.uint8))
    assert tflite_graph.unpack_int4(packed, [5]).tolist() == [1, -1, 7, -8, 3]


def _moments(original: np.ndarray, current: np.ndarray) -> tuple[np.ndarray, int]:
    rows = np.concatenate([original, current, np.ones((len(original), 1))], axis=1)
    return rows.T @ rows, len(rows)


def test_int4_layers_take_up_the_earlier_layers_error_where_held_out_rows_show_it_helps():
    """GPTAQ's asymmetric calibration: where the inputs a layer now gets (x') are a distortion of the int8
    model's (x), aiming at W x takes it up, on rows the fit never saw; where rows are too few to fit it, the
    held-out rows choose the plain fit."""
    from ptq_cli.quantize import int4

    rng = np.random.default_rng(1)
    weights, bias = rng.normal(0, 1, (8, 24)), rng.normal(0, 0.1, 8)
    distortion = np.eye(24) + rng.normal(0, 0.08, (24, 24))

    def rows(count: int, systematic: bool) -> tuple[np.ndarray, np.ndarray]:
        original = rng.normal(0.5, 1, (count, 24))
        return original, (original @ distortion if systematic else original) + rng.normal(0, 0.05, (count, 24))

    def error(fitted, count: int = 20_000) -> float:
        return int4._output_error(weights, bias, fitted, _moments(*rows(count, systematic=True))[0] / count)

    plentiful = (_moments(*rows(3000, True)), _moments(*rows(1000, True)))
    compensate, fitted = int4._chosen_fit(weights, bias, plentiful, per_tensor=False)
    plain = int4._fit(weights, bias, (plentiful[0][0] + plentiful[1][0]) / 4000, per_tensor=False, compensate=False)
    assert compensate and error(fitted) < 0.8 * error(plain)
    assert not int4._chosen_fit(weights, bias, (_moments(*rows(30, False)), _moments(*rows(10, False))), per_tensor=False)[0]
    assert not int4._chosen_fit(weights, bias, (_moments(*rows(300, True)), (np.zeros((49, 49)), 0)), per_tensor=False)[0]


def test_int4_weights_are_refused_where_the_format_has_none(study):
    one_line_error(invoke("quantize", "--model", "tiny.onnx", "--data", "colours.npz", "--weight-dtype", "int4", cwd=study),
                   "--weight-dtype int4: 4-bit weights are written by --backend litert")


def _tensor_grids(path) -> list[tuple]:
    """Every tensor's (name, scales, zero points) of a .tflite: what its calibration decided."""
    from tensorflow.lite.tools import flatbuffer_utils

    graph = flatbuffer_utils.read_model(str(path)).subgraphs[0]
    return [(tensor.name, tuple(np.asarray(tensor.quantization.scale).tolist()), tuple(np.asarray(tensor.quantization.zeroPoint).tolist()))
            for tensor in graph.tensors if tensor.quantization is not None and tensor.quantization.scale is not None]


def test_auto_keeps_the_ranges_the_held_out_images_prefer_on_the_reference_kernels(study):
    """--method auto (the default): the converter's min/max and two percentiles are each measured, the best is
    kept, and the file has that method's grids, as when the method is named; --json stays one JSON document
    although onnxruntime's histogram collector prints as it works."""
    auto = _quantize(study, "--output", "auto.tflite")["settings"]
    measured = [tuple(score) for score in auto["method_sqnr_db"]]
    assert [score[:2] for score in measured] == list(METHOD_CANDIDATES) and all(score[2] is not None for score in measured)
    best = chosen_method(tuple(measured))
    assert (auto["method"], auto.get("percentile")) == best
    named = _quantize(study, "--method", best[0], *(["--percentile", str(best[1])] if best[1] is not None else []), "--output", "named.tflite")
    assert named["settings"].get("method_sqnr_db") in (None, [])
    assert _tensor_grids(study / "auto.tflite") == _tensor_grids(study / "named.tflite")


def test_learned_rounding_moves_int8_codes_on_the_converter_s_grid_and_brings_unseen_images_closer(study):
    """`--rounding learned` (LiteRT): GPTQ codes from the float weights and corrected biases, on the grids the converter
    chose (every scale and zero point the same as the nearest-rounded model's), and the scores of images calibration
    never saw closer to the float model's; auto keeps whichever the held-out calibration images prefer."""
    _keras_two_conv_classifier(study / "two.h5")
    assert invoke("convert", "--keras", "two.h5", "--output", "two.onnx", "--data", "colours.npz", "--check-images", "30", "--scale",
                  str(SCALE), cwd=study).exit_code == 0

    def made(name: str, *extra: str) -> dict:
        result = invoke("quantize", "--model", "two.onnx", "--backend", "litert", "--method", "minmax", "--data", "colours.npz",
                        "--output", name, "--json", *extra, cwd=study)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["settings"]

    assert made("nearest.tflite", "--rounding", "nearest")["rounding"] == "nearest"
    assert made("learned.tflite", "--rounding", "learned")["rounding"] == "learned"
    assert _tensor_grids(study / "nearest.tflite") == _tensor_grids(study / "learned.tflite")
    nearest, learned = ((study / name).read_bytes() for name in ("nearest.tflite", "learned.tflite"))
    assert _tensor_types(nearest) == _tensor_types(learned) and nearest != learned
    images = colour_images(40, seed=7)[0].astype(np.float32) * SCALE  # the model's input: pixels x scale
    reference = keras.models.load_model(study / "two.h5", compile=False).predict(images, verbose=0)

    def sqnr(data: bytes) -> float:
        scores = tflite.judged_scores(data, images)
        return float(10 * np.log10(np.sum(reference**2) / np.sum((reference - scores) ** 2)))

    assert sqnr(learned) > sqnr(nearest)
    auto = made("auto.tflite")
    assert auto["rounding"] == ("learned" if auto["rounding_learned_db"] > auto["rounding_nearest_db"] else "nearest")
