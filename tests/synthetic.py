"""A tiny synthetic classifier and datasets for in-process CLI tests (typer's CliRunner).

The classifier: mean of each colour channel -> 3 scores (red, green, blue); the images: solid colours with
noise, so a correctly fed model scores 100% and a wrongly fed one (BGR, another size) measurably less.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import onnx
import typer.main
from onnx import helper, numpy_helper
from PIL import Image
from typer.testing import CliRunner

from ptq_cli.cli import app

CLASSES = ("red", "green", "blue")
runner = CliRunner()


# typer's CliRunner rebuilds the click command from the app on every call (a third of a short call's
# time); the app does not change during the tests, so build it once.
typer.testing._get_command = functools.cache(typer.testing._get_command)


def invoke(*args, cwd: Path, columns: int = 200, env: dict[str, str] | None = None):
    """`ptq ARGS` in-process, in `cwd`, on a terminal `columns` wide: the one in-process runner of the tests."""
    before = Path.cwd()
    os.chdir(cwd)
    try:
        return runner.invoke(app, [str(arg) for arg in args], env={"COLUMNS": str(columns), **(env or {})}, prog_name="ptq")
    finally:
        os.chdir(before)


def ok(*args, cwd: Path, columns: int = 200):
    """`invoke`, which must succeed."""
    result = invoke(*args, cwd=cwd, columns=columns)
    assert result.exit_code == 0, (args, result.exit_code, result.output)
    return result


def one_line_error(result, mentions: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:") and mentions in lines[0], result.stderr
    assert "Traceback" not in result.output


def colour_images(count_per_class: int, size: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label in range(3):
        for _ in range(count_per_class):
            image = rng.integers(0, 60, (size, size, 3))
            image[..., label] += 150
            images.append(image.astype(np.uint8))
            labels.append(label)
    return np.stack(images), np.array(labels, np.int64)


def colours_npz(path: Path, per_class: int = 6, **overrides) -> Path:
    """An .npz of colour images: train (seed 1) and test (seed 2) splits, `per_class` each, class names; `overrides` replace arrays."""
    train_images, train_labels = colour_images(per_class, seed=1)
    test_images, test_labels = colour_images(per_class, seed=2)
    arrays = {"train_images": train_images, "train_labels": train_labels, "test_images": test_images, "test_labels": test_labels,
              "class_names": np.array(CLASSES)}
    arrays.update(overrides)
    np.savez(path, **arrays)
    return path


def channel_mean_classifier(path: Path, layout: str = "NCHW", batch: int | str = "N", size: int = 8, classes: int = 3,
                            opset: int = 13, two_inputs: bool = False) -> Path:
    """Scores = per-channel mean (x W, an identity for 3 classes); NCHW or NHWC, float input."""
    shape = [batch, 3, size, size] if layout == "NCHW" else [batch, size, size, 3]
    axes = [2, 3] if layout == "NCHW" else [1, 2]
    weights = np.eye(3, classes, dtype=np.float32)
    nodes = [helper.make_node("ReduceMean", ["image"], ["means"], axes=axes, keepdims=0),
             helper.make_node("MatMul", ["means", "weights"], ["scores"])]
    inputs = [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, shape)]
    if two_inputs:
        inputs.append(helper.make_tensor_value_info("mask", onnx.TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, "colours", inputs, [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, [batch, classes])],
                              [numpy_helper.from_array(weights, "weights")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)
    onnx.save(model, str(path))
    return path


def image_folder(root: Path, splits=("train", "test"), per_class: int = 6, suffix: str = ".png", size: int = 8) -> Path:
    for offset, split in enumerate(splits):
        images, labels = colour_images(per_class, size, seed=offset)
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = root / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{index:04d}{suffix}")
    (root / "classes.txt").write_text("\n".join(CLASSES) + "\n")  # the model's order, not the sorted folder names
    return root


def conv_classifier(path: Path, size: int = 8) -> Path:
    """NCHW 3 x size x size -> Conv 3->6 (3x3) -> Relu -> global mean -> Gemm -> 3 colour scores. At the full
    8-bit range a filter's largest same-sign weight codes sum to far more than 128, so the pair rule
    changes its scales (onnxruntime's kernel for this small conv was not seen to overflow on it: the
    real-asset ResNet8 test shows the overflow itself)."""
    rng = np.random.default_rng(1)
    # Every weight large and positive (no pairing of its codes is pair-safe), the filter's own colour twice
    # as heavy; the Gemm takes each colour's filters against the others'.
    conv = (0.03 + rng.uniform(0.0, 0.005, (6, 3, 3, 3))).astype(np.float32)
    for filter_index in range(6):
        conv[filter_index, filter_index % 3] += 0.03
    gemm = np.full((6, 3), -0.5, np.float32)
    for filter_index in range(6):
        gemm[filter_index, filter_index % 3] = 1.0
    nodes = [helper.make_node("Conv", ["image", "conv_w"], ["conv"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["conv"], ["relu"]),
             helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "gemm_w"], ["scores"])]
    graph = helper.make_graph(nodes, "conv_colours", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(conv, "conv_w"), numpy_helper.from_array(gemm, "gemm_w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def colours_project(root: Path) -> Path:
    """A working directory with models/m.onnx (the channel-mean classifier) and colours.npz."""
    (root / "models").mkdir()
    channel_mean_classifier(root / "models" / "m.onnx")
    colours_npz(root / "colours.npz")
    return root


def calibrated_colours_project(root: Path) -> Path:
    """colours_project in root/study, with 40 images a class in colours.npz and cal.npz drawn from them by
    `ptq calibrate` (10 a class): what tune, sensitivity and sweep read."""
    (root / "study").mkdir()
    project = colours_project(root / "study")
    colours_npz(project / "colours.npz", per_class=40)
    result = invoke("calibrate", "--data", "colours.npz", "--samples-per-class", "10", "--output", "cal.npz", cwd=project)
    assert result.exit_code == 0, result.output
    return project


def depthwise_classifier(path: Path, size: int = 224, classes: int = 1000, seed: int = 0) -> Path:
    """A 224x224 stand-in for a mobile ImageNet classifier: stem Conv 3->8 (stride 4) -> Clip(0, 6) ->
    depthwise 3x3 Conv (one group per channel) -> Clip(0, 6) -> pointwise Conv 8->16 -> global mean ->
    Gemm -> `classes` scores. The depthwise filters differ in scale by 1000x across channels, as batch-norm
    folding leaves them: one scale for the whole tensor leaves the small ones a code or two."""
    rng = np.random.default_rng(seed)
    stem = rng.normal(0, 0.3, (8, 3, 4, 4)).astype(np.float32)
    depthwise = rng.normal(0, 1.0, (8, 1, 3, 3)).astype(np.float32) * np.logspace(-3, 0, 8, dtype=np.float32)[:, None, None, None]
    pointwise = rng.normal(0, 1.0, (16, 8, 1, 1)).astype(np.float32) / np.logspace(-3, 0, 8, dtype=np.float32)[None, :, None, None] * 0.05
    gemm = rng.normal(0, 1.0, (16, classes)).astype(np.float32)
    six, zero = numpy_helper.from_array(np.float32(6.0), "six"), numpy_helper.from_array(np.float32(0.0), "zero")
    nodes = [helper.make_node("Conv", ["image", "stem_w"], ["stem"], strides=[4, 4]),
             helper.make_node("Clip", ["stem", "zero", "six"], ["stem6"]),
             helper.make_node("Conv", ["stem6", "dw_w"], ["dw"], group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["dw", "zero", "six"], ["dw6"]),
             helper.make_node("Conv", ["dw6", "pw_w"], ["pw"]),
             helper.make_node("GlobalAveragePool", ["pw"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "gemm_w"], ["scores"])]
    graph = helper.make_graph(nodes, "depthwise", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", classes])],
                              [numpy_helper.from_array(stem, "stem_w"), numpy_helper.from_array(depthwise, "dw_w"),
                               numpy_helper.from_array(pointwise, "pw_w"), numpy_helper.from_array(gemm, "gemm_w"), six, zero])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def photo_folder(root: Path, count: int = 30, size: int = 224, seed: int = 0) -> Path:
    """ROOT/*.jpg: `count` unlabelled colour images (no class folders)."""
    images, _ = colour_images(-(-count // 3), size, seed)
    root.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(images[:count]):
        Image.fromarray(image).save(root / f"photo_{index:03d}.jpg", quality=90)
    return root


def smooth_photos(root: Path, count: int, seed: int, size: int = 16, suffix: str = ".png") -> Path:
    """ROOT/*.png: unlabelled smooth colour fields (a 4x4 random image upsampled: neighbouring pixels move together, as in photographs)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (4, 4, 3)).astype(np.uint8)).resize((size, size), Image.BILINEAR).save(root / f"{index:03d}{suffix}")
    return root


def cancelling_stem_classifier(path: Path, size: int = 16, cancelling: bool = True) -> Path:
    """NCHW 3 x size x size -> Mul by 1/255 (normalisation in the graph, which onnxruntime quantizes) -> stem
    Conv 3->4 (3x3) -> global mean -> Gemm -> 3 scores, whose stem is ruined by 8-bit weights: each filter has
    +1 on red and -1 on green at its centre, which cancel on grey images, and carries the image in weights of
    about 0.004, half a code of the scale the +-1 set. Without `cancelling` the stem is the small weights
    alone (8-bit weights then cost it little)."""
    rng = np.random.default_rng(5)
    stem = rng.uniform(0.002, 0.006, (4, 3, 3, 3)).astype(np.float32) * rng.choice([-1.0, 1.0], (4, 3, 3, 3)).astype(np.float32)
    if cancelling:
        stem[:, 0, 1, 1], stem[:, 1, 1, 1] = 1.0, -1.0
    gemm = rng.normal(0, 1.0, (4, 3)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["image", "unit"], ["scaled"]),
             helper.make_node("Conv", ["scaled", "stem_w"], ["stem"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["stem"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "gemm_w"], ["scores"])]
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(stem, "stem_w"), numpy_helper.from_array(gemm, "gemm_w"),
                               numpy_helper.from_array(np.float32(1 / 255), "unit")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def grey_folder(root: Path, count: int = 24, size: int = 16, seed: int = 0) -> Path:
    """ROOT/*.png: `count` unlabelled grey images (red = green = blue, exactly: PNG is lossless)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        grey = rng.integers(0, 256, (size, size), dtype=np.uint8)
        Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2)).save(root / f"grey_{index:03d}.png")
    return root


def two_conv_photos_project(root: Path) -> Path:
    """root/m.onnx (two_conv_classifier), 96 smooth photos in root/cal to calibrate on and 64 in root/test: what the
    learned rounding and time budget tests quantize (`quantized_json`)."""
    two_conv_classifier(root / "m.onnx")
    smooth_photos(root / "cal", 96, seed=1)
    smooth_photos(root / "test", 64, seed=2)
    return root


def quantized_json(root: Path, output: str, *extra: str, model: str = "m.onnx") -> dict:
    """`ptq quantize` of a model calibrated on root/cal and judged on root/test (a two_conv_photos_project's, unit
    preprocessing), which must succeed: its --json."""
    result = invoke("quantize", "--model", model, "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                    "--output", output, "--json", *extra, cwd=root)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def two_conv_classifier(path: Path, size: int = 16, pool: str = "GlobalAveragePool") -> Path:
    """NCHW 3 x 16 x 16 -> Conv 3->16 (3x3) -> Relu -> Conv 16->24 (3x3, stride 2) -> Relu -> mean -> Gemm -> 10 scores -> Softmax.
    The mean is a GlobalAveragePool, or with `pool="AveragePool"` the same mean as an AveragePool over the whole map."""
    rng = np.random.default_rng(3)
    initializers = [numpy_helper.from_array(rng.normal(0, 0.3, (16, 3, 3, 3)).astype(np.float32), "w1"),
                    numpy_helper.from_array(rng.normal(0, 0.05, 16).astype(np.float32), "b1"),
                    numpy_helper.from_array(rng.normal(0, 0.15, (24, 16, 3, 3)).astype(np.float32), "w2"),
                    numpy_helper.from_array(rng.normal(0, 0.05, 24).astype(np.float32), "b2"),
                    numpy_helper.from_array(rng.normal(0, 0.5, (24, 10)).astype(np.float32), "w3")]
    nodes = [helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node(pool, ["r2"], ["pooled"], **({"kernel_shape": [size // 2, size // 2]} if pool == "AveragePool" else {})),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w3"], ["logits"], name="classifier"),
             helper.make_node("Softmax", ["logits"], ["scores"], axis=1)]
    graph = helper.make_graph(nodes, "two_conv", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 10])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def full_integer_tflite(model, rng: np.random.Generator, weight_std: float, samples: int) -> bytes:
    """A Keras model with seeded normal weights (std `weight_std`), converted by the TFLite converter to a
    full-integer .tflite with int8 input and output, calibrated on `samples` uniform [0, 1) images."""
    import tensorflow as tf

    for layer in model.layers:
        if layer.get_weights():
            layer.set_weights([rng.normal(0, weight_std, weight.shape).astype(np.float32) for weight in layer.get_weights()])
    shape = (1, *model.input_shape[1:])
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([rng.uniform(0, 1, shape).astype(np.float32)] for _ in range(samples))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    return converter.convert()


def png_images(folder: Path) -> np.ndarray:
    """The folder's PNG images in name order, as NCHW float32 in [0, 1] (what `--preprocess unit` feeds)."""
    return np.stack([np.asarray(Image.open(path), np.float32).transpose(2, 0, 1) / 255 for path in sorted(folder.glob("*.png"))])


def scores_before_softmax(model, images: np.ndarray) -> np.ndarray:
    """The float scores a model's output Softmax reads (what quantize's measurements judge), as onnxruntime computes
    them on its exact int8 path (the same on CPUs with and without VNNI); `model` is an onnx.ModelProto."""
    import onnxruntime as ort

    from ptq_cli.model_file import EXACT_PATH_CONFIG

    model = onnx.ModelProto.FromString(model.SerializeToString())
    name = next(node.input[0] for node in model.graph.node if node.op_type == "Softmax")
    model.graph.output.append(helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.add_session_config_entry(EXACT_PATH_CONFIG, "1")
    first = model.graph.input[0].name
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run([name], {first: images})[0]


def squeeze_excite_classifier(path: Path, size: int = 16) -> Path:
    """A MobileNetV3-like block, NCHW 3 x size x size, opset 14: Conv 3->16 -> HardSwish (the op) -> squeeze-excitation
    (ReduceMean over the map, Conv 16->4, Relu, Conv 4->16, HardSigmoid, Mul) -> Conv 16->24 -> HardSwish spelled out
    as Keras exports it (x * Clip(x + 3, 0, 6) / 6) -> ReduceMean over the map -> Flatten -> Gemm -> 3 scores -> Softmax."""
    rng = np.random.default_rng(5)

    def weight(name: str, *shape: int, std: float) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, std, shape).astype(np.float32), name)

    constants = [numpy_helper.from_array(np.array(value, np.float32), name) for name, value in (("three", 3.0), ("zero", 0.0), ("six", 6.0))]
    initializers = [weight("w1", 16, 3, 3, 3, std=0.03), weight("b1", 16, std=0.1), weight("w_squeeze", 4, 16, 1, 1, std=0.3),
                    weight("w_excite", 16, 4, 1, 1, std=0.3), weight("w2", 24, 16, 3, 3, std=0.1), weight("b2", 24, std=0.1),
                    weight("w3", 24, 3, std=0.5), *constants]
    nodes = [helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("HardSwish", ["c1"], ["h1"], name="hardswish1"),
             helper.make_node("ReduceMean", ["h1"], ["squeezed"], axes=[2, 3], keepdims=1, name="se_mean"),
             helper.make_node("Conv", ["squeezed", "w_squeeze"], ["s1"], name="se_squeeze"),
             helper.make_node("Relu", ["s1"], ["s2"]),
             helper.make_node("Conv", ["s2", "w_excite"], ["s3"], name="se_excite"),
             helper.make_node("HardSigmoid", ["s3"], ["gate"], alpha=1.0 / 6, beta=0.5, name="se_gate"),
             helper.make_node("Mul", ["h1", "gate"], ["excited"], name="se_mul"),
             helper.make_node("Conv", ["excited", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
             helper.make_node("Add", ["c2", "three"], ["shifted"], name="hs2_add"),
             helper.make_node("Clip", ["shifted", "zero", "six"], ["clipped"], name="hs2_clip"),
             helper.make_node("Div", ["clipped", "six"], ["sixths"], name="hs2_div"),
             helper.make_node("Mul", ["c2", "sixths"], ["h2"], name="hs2_mul"),
             helper.make_node("ReduceMean", ["h2"], ["pooled"], axes=[2, 3], keepdims=1, name="pool"),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w3"], ["logits"], name="classifier"),
             helper.make_node("Softmax", ["logits"], ["scores"], axis=1)]
    graph = helper.make_graph(nodes, "squeeze_excite", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8), str(path))
    return path


def conv_project(root: Path, size: int = 16) -> Path:
    """ROOT/m.onnx (conv_classifier) and ROOT/images (12 images a class, train and test): a model and its images."""
    conv_classifier(root / "m.onnx", size=size)
    image_folder(root / "images", per_class=12, size=size)
    return root


def small_torch_classifier():
    """A user's own nn.Module, seeded: Conv 3->4 (3x3) -> ReLU -> spatial mean -> Linear 4->3, for NCHW images."""
    import torch

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)))

    torch.manual_seed(0)
    return Small().eval()
