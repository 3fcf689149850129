"""ptq's numpy copy of TensorFlow Lite Micro's int8 reference kernels (transforms/tflm_kernels.py) against the
tflite-micro interpreter itself: the same output bytes, image by image, on models of every op it covers; and
`--runtime tflm` going back to the interpreter where the copy disagrees or lacks an op."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CIFAR
from synthetic import full_integer_tflite

pytest.importorskip("ai_edge_litert", reason="the litert extra is not installed")
pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
tf = pytest.importorskip("tensorflow", reason="the keras extra is not installed")

from ptq_cli.backends import tflm  # noqa: E402  (after the skips: they need the litert extra)
from ptq_cli.quantize import int4  # noqa: E402
from ptq_cli.services.models import load_model  # noqa: E402
from ptq_cli.transforms import tflm_kernels  # noqa: E402

ASSETS = CIFAR.parent / "mlperf-tiny-resnet8"


def _interpreter_outputs(data: bytes, codes: np.ndarray) -> np.ndarray:
    from tflite_micro.python.tflite_micro import runtime

    interpreter = runtime.Interpreter.from_bytes(data, arena_size=1 << 20)
    found = []
    for image in codes:
        interpreter.set_input(image[None], 0)
        interpreter.invoke()
        found.append(np.array(interpreter.get_output(0)).reshape(-1))
    return np.stack(found)


def _every_op_int8(relu=tf.nn.relu6) -> bytes:
    """A full-integer .tflite (batch 1, as a microcontroller's) with each op the copy covers: strided and dilated
    convolutions with ReLU/ReLU6, a depthwise convolution with depth multiplier 2, max and average pooling, a
    residual ADD, RESHAPE, FULLY_CONNECTED and SOFTMAX."""
    keras = tf.keras
    rng = np.random.default_rng(11)
    image = keras.Input((12, 12, 3), batch_size=1)
    stem = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation=relu)(image)
    body = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", activation="relu")(stem)
    body = keras.layers.Conv2D(8, 3, dilation_rate=2, padding="same")(body)
    merged = keras.layers.Add()([stem, body])
    pooled = keras.layers.AveragePooling2D(2)(keras.layers.MaxPooling2D(2, strides=1, padding="same")(merged))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(pooled))
    model = keras.Model(image, keras.layers.Softmax()(keras.layers.Dense(5)(hidden)))
    return full_integer_tflite(model, rng, 0.4, 30)


def _flatten_free_batch() -> bytes:
    """A full-integer .tflite with the batch left free, as LiteRT quantization's models: the converter computes its
    Flatten's RESHAPE target at run time (SHAPE, STRIDED_SLICE, PACK)."""
    keras = tf.keras
    image = keras.Input((12, 12, 3))
    features = keras.layers.Flatten()(keras.layers.Conv2D(8, 3, strides=2, activation="relu")(image))
    model = keras.Model(image, keras.layers.Softmax()(keras.layers.Dense(5)(features)))
    return full_integer_tflite(model, np.random.default_rng(17), 0.4, 30)


def test_the_copy_gives_the_interpreter_s_bytes_on_every_op_it_covers():
    data = _every_op_int8()
    codes = np.random.default_rng(12).integers(-128, 128, (64, 12, 12, 3), dtype=np.int8)
    kernels = tflm_kernels.covers(data)
    assert callable(kernels), kernels
    expected = _interpreter_outputs(data, codes)
    assert np.array_equal(kernels(codes).reshape(len(codes), -1), expected)
    assert len(np.unique(expected.argmax(axis=1))) > 1  # the outputs say something
    # 4-bit filters (unpacked as TFLite Micro unpacks them): the same again.
    four_bit = int4.to_int4(data, codes[:20]).data
    assert np.array_equal(tflm_kernels.covers(four_bit)(codes).reshape(len(codes), -1), _interpreter_outputs(four_bit, codes))


def test_depthwise_and_pointwise_convolutions_give_the_interpreter_s_bytes():
    """The copy sums a depthwise convolution tap by tap over strided slices, and multiplies a 1 x 1 convolution's
    batch itself: every stride, dilation and depth multiplier must read the input positions TFLM's kernel reads
    (valid and same padding)."""
    keras = tf.keras
    image = keras.Input((13, 13, 4), batch_size=1)
    body = keras.layers.DepthwiseConv2D(3, strides=2, padding="same")(image)
    body = keras.layers.Conv2D(4, 1, activation="relu")(body)
    body = keras.layers.DepthwiseConv2D(3, dilation_rate=2, depth_multiplier=3, padding="same", activation="relu")(body)
    body = keras.layers.Conv2D(12, 1, strides=(1, 1))(body)
    body = keras.layers.DepthwiseConv2D((2, 3), strides=(1, 2), padding="valid")(body)
    model = keras.Model(image, keras.layers.Flatten()(body))
    data = full_integer_tflite(model, np.random.default_rng(21), 0.4, 30)
    codes = np.random.default_rng(22).integers(-128, 128, (40, 13, 13, 4), dtype=np.int8)
    kernels = tflm_kernels.covers(data)
    assert callable(kernels), kernels
    expected = _interpreter_outputs(data, codes)
    assert np.array_equal(kernels(codes).reshape(len(codes), -1), expected)
    assert expected.shape[1] == 6 * 3 * 12 and len(np.unique(expected)) > 50  # the outputs say something


def test_reference_codes_are_tflm_s_inside_the_model_and_litert_s_where_the_copy_lacks_an_op():
    """What LiteRT quantization reads of a model (its judged scores, learned rounding's and 4-bit's layer inputs):
    every op's output as TFLM computes it (the interpreter's bytes on the model cut there), over more images than a
    call takes; on a model with an op the copy lacks, LiteRT's reference kernels' values."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    data = _every_op_int8()
    codes = np.random.default_rng(16).integers(-128, 128, (tflm_kernels.REFERENCE_BATCH + 30, 12, 12, 3), dtype=np.int8)
    schema = int4.schema_module()
    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph = model_object.subgraphs[0]
    made = [int(operator.outputs[0]) for operator in graph.operators]
    found = tflm_kernels.reference_codes(data, {int(graph.inputs[0]): codes}, made)
    for tensor in made:
        assert np.array_equal(found[tensor].reshape(len(codes), -1), _interpreter_outputs(int4.up_to(model_object, tensor), codes)), tensor
    free_batch = _flatten_free_batch()
    free_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(free_batch, 0))
    free_graph = free_object.subgraphs[0]
    assert {"SHAPE", "STRIDED_SLICE", "PACK"} <= {int4.op_kind(free_object, operator) for operator in free_graph.operators}
    assert not isinstance(tflm_kernels.runner(free_batch), str), tflm_kernels.runner(free_batch)
    output = int(free_graph.outputs[0])
    found = tflm_kernels.reference_codes(free_batch, {int(free_graph.inputs[0]): codes}, [output])[output]
    assert np.array_equal(found.reshape(len(codes), -1), _interpreter_outputs(free_batch, codes))

    lacking, one = _every_op_int8(relu=tf.nn.sigmoid), codes[:1]  # its RESHAPE is to batch 1, as the interpreter runs it
    interpreter = Interpreter(model_content=lacking, experimental_preserve_all_tensors=True, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    image = interpreter.get_input_details()[0]["index"]
    interpreter.allocate_tensors()
    interpreter.set_tensor(image, one)
    interpreter.invoke()
    made = [int(operator.outputs[0]) for operator in schema.ModelT.InitFromObj(schema.Model.GetRootAs(lacking, 0)).subgraphs[0].operators]
    found = tflm_kernels.reference_codes(lacking, {image: one}, made)
    assert all(np.array_equal(found[tensor], interpreter.get_tensor(tensor)) for tensor in made)


def test_an_op_the_copy_lacks_is_named_and_the_interpreter_runs_the_model(tmp_path):
    data = _every_op_int8(relu=tf.nn.sigmoid)  # LOGISTIC, which the copy does not have
    assert tflm_kernels.covers(data) == "LOGISTIC"
    (tmp_path / "logistic.tflite").write_bytes(data)
    model = load_model(tmp_path / "logistic.tflite", 1, runtime="tflm")
    prepared = model.prepare(np.random.default_rng(13).integers(0, 256, (70, 12, 12, 3), dtype=np.uint8))
    assert np.array_equal(model.predict(prepared), _interpreter_scores(tmp_path / "logistic.tflite", prepared))


def test_where_the_copy_disagrees_the_interpreter_scores_the_call_and_every_later_one(tmp_path, monkeypatch):
    (tmp_path / "model.tflite").write_bytes(_every_op_int8())
    calls = []

    def wrong(_data):
        def run(codes):
            calls.append(len(codes))
            return np.zeros((len(codes), 5), np.int8)

        return run

    monkeypatch.setattr(tflm_kernels, "covers", wrong)
    model = load_model(tmp_path / "model.tflite", 1, runtime="tflm")
    prepared = model.prepare(np.random.default_rng(14).integers(0, 256, (2 * tflm.PARALLEL_FROM, 12, 12, 3), dtype=np.uint8))
    expected = _interpreter_scores(tmp_path / "model.tflite", prepared)
    assert len(np.unique(expected.argmax(axis=1))) > 1
    for start in (0, tflm.PARALLEL_FROM):
        part = slice(start, start + tflm.PARALLEL_FROM)
        assert np.array_equal(model.predict(prepared[part]), expected[part])
    assert calls == [tflm.PARALLEL_FROM]  # tried once, then left


def test_two_threads_share_a_call_on_the_copy_and_give_the_interpreter_s_scores(tmp_path, monkeypatch):
    """With two threads, a call the copy runs goes to two threads, half the images each (numpy's array work lets go
    of the GIL), and gives the interpreter's scores."""
    import threading

    (tmp_path / "model.tflite").write_bytes(_every_op_int8())
    ran_on: list[tuple[str, int]] = []
    covers = tflm_kernels.covers

    def recording(data: bytes):
        runner = covers(data)
        assert callable(runner), runner

        def run(codes: np.ndarray) -> np.ndarray:
            ran_on.append((threading.current_thread().name, len(codes)))
            return runner(codes)

        return run

    monkeypatch.setattr(tflm_kernels, "covers", recording)
    model = load_model(tmp_path / "model.tflite", 2, runtime="tflm")
    prepared = model.prepare(np.random.default_rng(15).integers(0, 256, (2 * tflm.PARALLEL_FROM, 12, 12, 3), dtype=np.uint8))
    assert np.array_equal(model.predict(prepared), _interpreter_scores(tmp_path / "model.tflite", prepared))
    assert sorted(count for _, count in ran_on) == [tflm.PARALLEL_FROM, tflm.PARALLEL_FROM]
    assert all(name.startswith("tflm-kernels") for name, _ in ran_on)
    # More threads than images: one image a part, never an empty one (the copy keeps the model).
    ran_on.clear()
    crowded = load_model(tmp_path / "model.tflite", 3 * tflm.PARALLEL_FROM, runtime="tflm")
    part = prepared[: tflm.PARALLEL_FROM]
    assert np.array_equal(crowded.predict(part), _interpreter_scores(tmp_path / "model.tflite", part))
    assert sorted(count for _, count in ran_on) == [1] * tflm.PARALLEL_FROM


def _interpreter_scores(path, prepared: np.ndarray) -> np.ndarray:
    """The tflite-micro interpreter's scores, through the runtime's own input and output conversion."""
    return tflm._Scorer(path.read_bytes(), path).run(prepared)


@pytest.mark.real_assets
def test_the_copy_gives_the_interpreter_s_bytes_on_the_mlperf_reference_and_its_4_bit_version():
    from conftest import cifar_split

    data = (ASSETS / "pretrainedResnet_quant.tflite").read_bytes()
    codes = (cifar_split("test").images[:200].astype(np.int16) - 128).astype(np.int8)  # its input: scale 1, zero point -128
    assert np.array_equal(tflm_kernels.covers(data)(codes).reshape(len(codes), -1), _interpreter_outputs(data, codes))
    four_bit = int4.to_int4(data, codes[:100]).data
    assert np.array_equal(tflm_kernels.covers(four_bit)(codes).reshape(len(codes), -1), _interpreter_outputs(four_bit, codes))


def _gemmlowp_high_mul(a: int, b: int) -> int:
    """SaturatingRoundingDoublingHighMul as gemmlowp writes it in C, on Python integers."""
    if a == b == tflm_kernels.INT32_MIN:
        return tflm_kernels.INT32_MAX
    product = a * b
    nudge = (1 << 30) if product >= 0 else 1 - (1 << 30)
    total = product + nudge
    return -((-total) >> 31) if total < 0 else total >> 31  # C's division by 2^31, toward zero


def _gemmlowp_divide_by_pot(x: int, exponent: int) -> int:
    """RoundingDivideByPOT as gemmlowp writes it in C, on Python integers."""
    mask = (1 << exponent) - 1
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if (x & mask) > threshold else 0)


def test_the_fixed_point_helpers_compute_gemmlowp_s_own_arithmetic():
    rng = np.random.default_rng(3)
    low, high = tflm_kernels.INT32_MIN, tflm_kernels.INT32_MAX
    edges = [0, 1, -1, low, high, low + 1, 1 << 30, -(1 << 30), (1 << 30) + 1, -(1 << 30) - 1]
    a = np.array(edges * len(edges) + rng.integers(low, high, 3000, endpoint=True).tolist(), np.int64)
    b = np.array([edge for edge in edges for _ in edges] + rng.integers(low, high, 3000, endpoint=True).tolist(), np.int64)
    assert tflm_kernels.doubling_high_mul(a, b).tolist() == [_gemmlowp_high_mul(int(x), int(y)) for x, y in zip(a, b, strict=True)]
    exponents = rng.integers(0, 32, len(a))
    assert tflm_kernels.divide_by_pot(a, exponents).tolist() == [_gemmlowp_divide_by_pot(int(x), int(e)) for x, e in zip(a, exponents, strict=True)]
    # The requantization, its two roundings in one (ties everywhere with a multiplier of 2^30 and odd inputs).
    values = np.concatenate([np.arange(-3000, 3000), rng.integers(-(2**31), 2**31, 3000)]).astype(np.int64)
    for multiplier, shift in ((1 << 30, -1), (1 << 30, -7), (int(rng.integers(1 << 30, 1 << 31)), -20), ((1 << 31) - 1, -31), (1 << 30, 2)):
        expected = [_gemmlowp_divide_by_pot(_gemmlowp_high_mul(int(x) << max(shift, 0), multiplier), max(-shift, 0)) for x in values]
        assert tflm_kernels.multiply_by_quantized_multiplier(values, multiplier, shift).tolist() == expected, (multiplier, shift)
