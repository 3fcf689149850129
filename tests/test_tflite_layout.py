"""A .tflite laid out for a microcontroller (transforms/tflite_layout.py): the same outputs bit for bit on
TFLite Micro and LiteRT, in no more flash and arena; and the int4 layers chosen so that unpacking their filters
does not enlarge TFLite Micro's arena (quantize/int4.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CIFAR
from synthetic import full_integer_tflite

from ptq_cli.quantize import int4
from ptq_cli.transforms import tflite_graph
from ptq_cli.transforms.tflite_layout import microcontroller_layout

pytest.importorskip("ai_edge_litert", reason="the litert extra is not installed")
pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
tf = pytest.importorskip("tensorflow", reason="the keras extra is not installed")
from ptq_cli.backends import tflm_interpreter as tflm  # noqa: E402  (after the skips: it needs the litert extra)

ASSETS = CIFAR.parent / "mlperf-tiny-resnet8"


def _outputs(data: bytes, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(TFLite Micro's outputs, LiteRT's default outputs) for int8 images, one invoke each."""
    from ai_edge_litert.interpreter import Interpreter
    from tflite_micro.python.tflite_micro import runtime

    micro = runtime.Interpreter.from_bytes(data, arena_size=1 << 20)
    lite = Interpreter(model_content=data)
    lite.allocate_tensors()
    on_micro, on_lite = [], []
    for image in images:
        micro.set_input(image[None], 0)
        micro.invoke()
        on_micro.append(np.array(micro.get_output(0)))
        lite.set_tensor(lite.get_input_details()[0]["index"], image[None])
        lite.invoke()
        on_lite.append(lite.get_tensor(lite.get_output_details()[0]["index"]).copy())
    return np.stack(on_micro), np.stack(on_lite)


def _residual_int8() -> bytes:
    """A full-integer .tflite of: stem conv -> identity block (two convs) -> strided block whose 1x1 shortcut
    convolution is written last -> Flatten -> Dense, as the TFLite converter writes it."""
    keras = tf.keras
    keras.backend.clear_session()  # layer names (and with them the converter's op order) as in a fresh process, whatever ran before
    rng = np.random.default_rng(5)
    image = keras.Input((16, 16, 3))
    stem = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(image)
    body = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(stem)
    body = keras.layers.Conv2D(8, 3, padding="same")(body)
    merged = keras.layers.ReLU()(keras.layers.Add()([stem, body]))
    down = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu")(merged)
    down = keras.layers.Conv2D(16, 3, padding="same")(down)
    shortcut = keras.layers.Conv2D(16, 1, strides=2)(merged)
    pooled = keras.layers.AveragePooling2D(8)(keras.layers.ReLU()(keras.layers.Add()([shortcut, down])))
    model = keras.Model(image, keras.layers.Dense(4)(keras.layers.Flatten()(pooled)))
    return full_integer_tflite(model, rng, 0.3, 20)


def test_the_layout_keeps_every_output_bit_for_bit_in_less_flash_and_arena():
    """On the 4-bit model, where running the shortcut first keeps its input from living across the unpacking of
    the widest filter."""
    images = np.random.default_rng(6).integers(-128, 128, (8, 16, 16, 3), dtype=np.int8)
    data = int4.to_int4(_residual_int8(), images).data
    laid_out = microcontroller_layout(data, tflm.arena_of)
    for before, after in zip(_outputs(data, images), _outputs(laid_out.data, images), strict=True):
        assert np.array_equal(before, after)
    assert len(laid_out.data) < len(data) and tflm.arena_of(laid_out.data) < tflm.arena_of(data)
    schema = tflite_graph.schema_module()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(laid_out.data, 0))
    kinds = [tflite_graph.op_kind(model, operator) for operator in model.subgraphs[0].operators]
    # The Flatten's run-time shape ops are gone, and the strided block's shortcut runs before its widest convolution.
    assert not {"SHAPE", "STRIDED_SLICE", "PACK"} & set(kinds)
    convolutions = [operator for operator, kind in zip(model.subgraphs[0].operators, kinds, strict=True) if kind == "CONV_2D"]
    shortcut = next(position for position, operator in enumerate(convolutions)
                    if list(model.subgraphs[0].tensors[int(operator.inputs[1])].shape)[1:3] == [1, 1])
    assert shortcut == 3 and any("reordered" in change for change in laid_out.changes)


def test_int4_leaves_in_8_bits_the_layer_whose_unpacked_filter_would_enlarge_the_arena():
    """In the identity block, the second convolution runs while three full-size activations are alive (the
    int8 model's peak): its unpacked int4 filter would add to it. Every other body convolution fits."""
    schema = tflite_graph.schema_module()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(_residual_int8(), 0))
    convolutions = [operator for kind, operator in int4.weighted_ops(model) if kind == "CONV_2D"]
    body = convolutions[1:]  # the stem stays int8 anyway
    fits = int4.arena_neutral(model, body)
    second = next(operator for operator in body if int(operator.outputs[0]) in {int(index) for other in model.subgraphs[0].operators
                  if tflite_graph.op_kind(model, other) == "ADD" for index in other.inputs}
                  and list(model.subgraphs[0].tensors[int(operator.inputs[0])].shape)[1] == 16)
    assert fits == {id(operator) for operator in body} - {id(second)}


@pytest.mark.real_assets
@pytest.mark.parametrize("name", ["pretrainedResnet_quant.tflite", "pretrainedResnet.tflite"])
def test_mlcommons_models_laid_out_score_the_same_on_both_runtimes(name):
    from conftest import cifar_split

    data = (ASSETS / name).read_bytes()
    laid_out = microcontroller_layout(data, tflm.arena_of)
    images = cifar_split("test").images[:20]
    images = (images.astype(np.int16) - 128).astype(np.int8) if "quant" in name else images.astype(np.float32)
    for before, after in zip(_outputs(data, images), _outputs(laid_out.data, images), strict=True):
        assert np.array_equal(before, after)
    assert len(laid_out.data) <= len(data) and tflm.arena_of(laid_out.data) <= tflm.arena_of(data)


def _dilated_int8(size: int, rate, depthwise: bool, padding: str) -> bytes:
    """A full-integer .tflite with its batch left free around a dilated convolution, which the converter then writes as
    SPACE_TO_BATCH_ND, a plain convolution and BATCH_TO_SPACE_ND."""
    keras = tf.keras
    image = keras.Input((size, size, 3))
    layer = (keras.layers.DepthwiseConv2D(3, dilation_rate=rate, padding=padding, activation="relu") if depthwise
             else keras.layers.Conv2D(8, 3, dilation_rate=rate, padding=padding, activation="relu"))
    model = keras.Model(image, keras.layers.Dense(5)(keras.layers.Flatten()(layer(image))))
    return full_integer_tflite(model, np.random.default_rng(3), 0.4, 30)


def _reference_outputs(data: bytes, codes: np.ndarray) -> np.ndarray:
    """LiteRT's reference kernels on a batch, the shapes computed at run time."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interpreter = Interpreter(model_content=data, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    image, scores = interpreter.get_input_details()[0]["index"], interpreter.get_output_details()[0]["index"]
    interpreter.resize_tensor_input(image, list(codes.shape))
    interpreter.allocate_tensors()
    interpreter.set_tensor(image, codes)
    interpreter.invoke()
    return interpreter.get_tensor(scores).astype(int)


@pytest.mark.parametrize(("size", "rate", "depthwise", "padding"), [(13, 2, False, "same"), (12, (2, 3), True, "same"), (13, 3, False, "valid")])
def test_a_dilated_convolution_runs_on_tflite_micro_as_litert_runs_the_converter_s_file(size, rate, depthwise, padding):
    """TFLite Micro sizes SPACE_TO_BATCH_ND from the file's batch-1 shapes (1 where the blocks make 4) and pads with 0,
    not the zero point: on the converter's file it computes another function than LiteRT. Laid out, the convolution is
    one dilated op, which TFLite Micro computes as LiteRT computes the converter's file, bit for bit."""
    data = _dilated_int8(size, rate, depthwise, padding)
    codes = np.random.default_rng(5).integers(-128, 128, (8, size, size, 3), dtype=np.int8)
    expected = _reference_outputs(data, codes)
    micro = lambda model: _outputs(model, codes)[0].reshape(len(codes), -1).astype(int)  # noqa: E731
    assert not np.array_equal(micro(data), expected)
    laid = microcontroller_layout(data)
    model_object = tflite_graph.schema_module().ModelT.InitFromObj(tflite_graph.schema_module().Model.GetRootAs(laid.data, 0))
    kinds = [tflite_graph.op_kind(model_object, operator) for operator in model_object.subgraphs[0].operators]
    assert "SPACE_TO_BATCH_ND" not in kinds and "BATCH_TO_SPACE_ND" not in kinds and laid.changes[0].startswith("1 dilated convolution")
    assert np.array_equal(micro(laid.data), expected)
    assert np.array_equal(_reference_outputs(laid.data, codes), expected)
