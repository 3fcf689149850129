"""Space-to-depth of narrow convolutions: the rewritten float graph computes what the original did,
convolutions it cannot or need not rewrite stay as they were, and on the real ResNet8 the quantized
stem gets 12 input channels (a shape onnxruntime's fast x86 int8 kernel takes) and the Pads run on 8 bits."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import assert_clean_failure, cifar_split, ptq, ptq_ok
from onnx import TensorProto, helper, numpy_helper

from ptq_cli.services.models import load_model as load_onnx
from ptq_cli.transforms.space_to_depth import space_to_depth_convs


def conv_model(in_channels=3, kernel=(3, 3), pads=(1, 1, 1, 1), strides=(1, 1), group=1, width=16, relu=True, nhwc_input=False, bias=True,
               out_channels=32):
    """A one-Conv model (optionally behind tf2onnx's NHWC -> NCHW Transpose, optionally followed by Relu)."""
    rng = np.random.default_rng(in_channels * 100 + kernel[1])
    weights = rng.standard_normal((out_channels, in_channels // group, *kernel)).astype(np.float32)
    initializers = [numpy_helper.from_array(weights, "w")]
    conv_inputs = ["x_nchw" if nhwc_input else "x", "w"]
    if bias:
        initializers.append(numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "b"))
        conv_inputs.append("b")
    nodes = []
    if nhwc_input:
        nodes.append(helper.make_node("Transpose", ["x"], ["x_nchw"], perm=[0, 3, 1, 2]))
    nodes.append(helper.make_node("Conv", conv_inputs, ["y_conv"], name="stem", kernel_shape=list(kernel), pads=list(pads), strides=list(strides), group=group))
    nodes.append(helper.make_node("Relu" if relu else "Identity", ["y_conv"], ["y"]))
    shape = ["N", 8, width, in_channels] if nhwc_input else ["N", in_channels, 8, width]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", None, None, None])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def outputs(model, images: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": images})[0]


def conv_input_channels(model) -> dict[str, int]:
    weights = {init.name: init for init in model.graph.initializer}
    return {node.name: numpy_helper.to_array(weights[node.input[1]]).shape[1] for node in model.graph.node if node.op_type == "Conv"}


@pytest.mark.parametrize(
    ("case", "in_channels", "kernel", "pads", "block", "options"),
    [
        ("RGB 3x3 same", 3, (3, 3), (1, 1, 1, 1), 4, {}),
        ("behind tf2onnx's NHWC transpose", 3, (3, 3), (1, 1, 1, 1), 4, {"nhwc_input": True}),
        ("grey 5x5", 1, (5, 5), (2, 2, 2, 2), 4, {"relu": False}),
        ("2 channels, 3x1 kernel", 2, (3, 1), (1, 0, 1, 0), 2, {}),
        ("6 channels", 6, (3, 3), (1, 1, 1, 1), 2, {"bias": False}),
        ("asymmetric width pads", 3, (3, 3), (1, 0, 1, 2), 4, {}),
        ("7 wide, 32 pixels", 3, (1, 7), (0, 3, 0, 3), 4, {"width": 32}),
        ("16 -> 16, as ResNet8's first stage", 16, (3, 3), (1, 1, 1, 1), 2, {"out_channels": 16}),
        ("4 -> 8: 32 outputs need 4 pixels", 4, (3, 3), (1, 1, 1, 1), 4, {"out_channels": 8}),
        ("8 -> 12: rounded up to a power of two", 8, (3, 3), (1, 1, 1, 1), 4, {"out_channels": 12}),
    ],
)
def test_rewrite_computes_the_same_outputs(case, in_channels, kernel, pads, block, options):
    original = conv_model(in_channels, kernel, pads, **options)
    rewritten, rewrites = space_to_depth_convs(conv_model(in_channels, kernel, pads, **options))
    out_channels = options.get("out_channels", 32)
    assert [(r.node, r.block, r.input_channels, r.output_channels) for r in rewrites] == [("stem", block, in_channels, out_channels)], case
    assert conv_input_channels(rewritten) == {"stem": block * in_channels}
    onnx.checker.check_model(rewritten)
    width = options.get("width", 16)
    shape = (5, 8, width, in_channels) if options.get("nhwc_input") else (5, in_channels, 8, width)
    images = np.random.default_rng(1).uniform(-3, 3, shape).astype(np.float32)
    expected = outputs(original, images)
    assert np.abs(outputs(rewritten, images) - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max()), case
    if options.get("nhwc_input"):
        # The input transpose is folded into the regrouping, not stacked on it.
        assert [node.op_type for node in rewritten.graph.node][:3] == ["Pad", "Reshape", "Transpose"]


@pytest.mark.parametrize(
    ("case", "options", "skip"),
    [
        ("4 in, 32 out: the kernel takes it as it is", {"in_channels": 4}, set()),
        ("stride 2", {"strides": (2, 2)}, set()),
        ("grouped", {"in_channels": 6, "group": 2}, set()),
        ("output narrower than input", {"pads": (0, 0, 0, 0)}, set()),
        ("width not a multiple of the block", {"width": 30}, set()),
        ("left in float", {}, {"stem"}),
        ("pointwise, 16 -> 16 (measured slower regrouped)", {"in_channels": 16, "out_channels": 16, "kernel": (1, 1), "pads": (0, 0, 0, 0)}, set()),
    ],
)
def test_convolutions_it_cannot_or_need_not_rewrite_stay_unchanged(case, options, skip):
    model = conv_model(**options)
    before = model.SerializeToString()
    rewritten, rewrites = space_to_depth_convs(model, skip=skip)
    assert rewrites == [], case
    assert rewritten.SerializeToString() == before, case


def test_resnet8_narrow_convolutions_are_regrouped_and_run_on_8_bits(pipeline):
    fp32_path = pipeline / "models" / "resnet8.onnx"
    rewritten, rewrites = space_to_depth_convs(onnx.load(str(fp32_path)))
    # The RGB stem (3 inputs), and the two 16 -> 16 convolutions (narrow outputs).
    assert [(r.block, r.input_channels, r.output_channels) for r in rewrites] == [(4, 3, 16), (2, 16, 16), (2, 16, 16)]
    images = cifar_split("test").images[:500].astype(np.float32)
    session = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    original = load_onnx(fp32_path).predict(images)
    regrouped = session.run(None, {session.get_inputs()[0].name: images})[0]
    assert np.abs(regrouped - original).max() < 1e-4
    assert np.array_equal(regrouped.argmax(axis=1), original.argmax(axis=1))

    # The speed preset regroups the stem by default and says so; --no-space-to-depth leaves it.
    # Nearest rounding and one activation ranges method: learned codes are fitted to each graph's own layout, and --method auto
    # judges each graph on its own; the rewrite is compared here, not the rounding or the ranges.
    result = json.loads(ptq_ok("quantize", "--target", "speed", "--rounding", "nearest", "--method", "percentile", "--output", "models/s2d.onnx", "--json",
                               cwd=pipeline).stdout)
    assert result["settings"]["space_to_depth"] is True
    assert [(r["node"], r["block"]) for r in result["space_to_depth"]] == [(r.node, r.block) for r in rewrites]
    plain = json.loads(ptq_ok("quantize", "--target", "speed", "--rounding", "nearest", "--method", "percentile", "--no-space-to-depth",
                              "--output", "models/plain.onnx", "--json", cwd=pipeline).stdout)
    assert plain["settings"]["space_to_depth"] is False and plain["space_to_depth"] == []

    def stem_channels(path) -> int:
        model = onnx.load(str(path))
        weights = {init.name: init for init in model.graph.initializer}
        stem = next(node for node in model.graph.node if node.name == rewrites[0].node)
        weight = next(node for node in model.graph.node if node.output[0] == stem.input[1])  # QDQ: Conv <- DequantizeLinear <- int8 weights
        return numpy_helper.to_array(weights[weight.input[0]]).shape[1]

    assert stem_channels(pipeline / "models" / "s2d.onnx") == 12
    assert stem_channels(pipeline / "models" / "plain.onnx") == 3
    # Every Pad the rewrite added pads the 8-bit tensor itself, not a dequantized float copy.
    quantized = onnx.load(str(pipeline / "models" / "s2d.onnx"))
    producers = {output: node.op_type for node in quantized.graph.node for output in node.output}
    pads = [node for node in quantized.graph.node if node.op_type == "Pad"]
    assert len(pads) == 3 and all(producers.get(pad.input[0]) != "DequantizeLinear" for pad in pads)
    # The two quantized models agree on nearly every image: the rewrite changes where the work runs, not the
    # arithmetic. (Float rounding in calibration can move a zero point by one code: 63 of 10,000 differed.)
    full = cifar_split("test").images.astype(np.float32)
    agree = np.mean(load_onnx(pipeline / "models" / "s2d.onnx").predict(full).argmax(axis=1) == load_onnx(pipeline / "models" / "plain.onnx").predict(full).argmax(axis=1))
    assert agree >= 0.99


def test_space_to_depth_is_refused_for_the_pytorch_backend(tmp_path):
    run = ptq("quantize", "--backend", "pytorch", "--space-to-depth", "--output", "q.pt", cwd=tmp_path)
    assert_clean_failure(run, 2, "--space-to-depth")
    assert list(tmp_path.iterdir()) == []
