"""PyTorch models for every x86 CPU: fbgemm without VNNI adds pairs of u8 x s8 products into a saturating int16, in its
depthwise kernel too. `--overflow-fix all-layers` keeps 8-bit activations with every layer's weights under the pair
rule, or torch.ao's 7-bit activations, whichever the held-out calibration images measure closer to FP32; a model that
cannot saturate has its saturating path scored on a VNNI CPU in fbgemm, the kernels CPUs without VNNI run."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from synthetic import depthwise_classifier, invoke, one_line_error, smooth_photos, two_conv_classifier

from ptq_cli.backends import pytorch
from ptq_cli.quantize import overflow, torch_ao
from ptq_cli.quantize.settings import METHOD_MARGIN_DB
from ptq_cli.services import models as model_service
from ptq_cli.x86 import cpu as cpu_info


def _wide_classifier(path: Path) -> Path:
    """NCHW 3 x 32 x 32 -> Conv 3->96 (3x3, stride 2) -> ReLU6 -> Conv 96->576 (1x1) -> ReLU6 -> mean -> Gemm -> 10 scores:
    layers as wide as a mobile network's, where oneDNN and fbgemm can round a few outputs in a million differently."""
    rng = np.random.default_rng(7)
    weights = {"w1": rng.normal(0, 0.4, (96, 3, 3, 3)), "b1": rng.normal(0.5, 0.5, 96), "w2": rng.normal(0, 0.06, (576, 96, 1, 1)),
               "b2": rng.normal(0, 0.5, 576), "w3": rng.normal(0, 0.2, (576, 10)), "zero": np.float32(0), "six": np.float32(6)}
    nodes = [helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Clip", ["c1", "zero", "six"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
             helper.make_node("Clip", ["c2", "zero", "six"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w3"], ["scores"])]
    graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 32, 32])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 10])],
                              [numpy_helper.from_array(np.asarray(value, np.float32), name) for name, value in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pytorch_portable")
    depthwise_classifier(root / "dw.onnx", size=32, classes=10)  # ReLU6 (Clip 0..6) after the stem and the depthwise convolution
    _wide_classifier(root / "wide.onnx")
    two_conv_classifier(root / "relu.onnx", size=32)  # ReLU, not clamped
    smooth_photos(root / "cal", 120, seed=1, size=32)
    smooth_photos(root / "test", 16, seed=2, size=32)
    return root


def _quantize(root: Path, output: str, *extra: str, model: str = "dw.onnx"):
    return invoke("quantize", "--model", model, "--data", "test", "--calibration-data", "cal", "--preprocess", "unit",
                  "--backend", "pytorch", "--output", output, "--json", *extra, cwd=root)


def _made(root: Path, output: str, *extra: str, model: str = "dw.onnx") -> dict:
    result = _quantize(root, output, *extra, model=model)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("bits", [torch_ao.EIGHT_BIT, torch_ao.SEVEN_BIT])
def test_all_layers_bounds_every_weighted_layer_by_the_pair_rule_or_keeps_7_bit_activations(bits):
    import torch
    from torch.ao.quantization.observer import ObserverBase
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = pytorch.ENGINE
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU6(), torch.nn.Conv2d(16, 16, 3, groups=16), torch.nn.ReLU6(),
                                 torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10)).eval()
    float_module = torch.fx.symbolic_trace(layers)
    images = torch.randn(16, 3, 12, 12)
    mapping = torch_ao.qconfig_mapping(True, "minmax", overflow.ALL_LAYERS, tuple(pytorch.first_layer_modules(float_module)),
                                      activation_bits=bits)
    prepared = prepare_fx(copy.deepcopy(float_module), mapping, (images[:1],))
    observers = [module for module in prepared.modules() if isinstance(module, ObserverBase) and module.dtype == torch.quint8]
    assert observers and {module.quant_max for module in observers} == {255 if bits == torch_ao.EIGHT_BIT else 127}
    with torch.no_grad():
        prepared(images)
    converted = convert_fx(prepared)
    weighted = [module for module in converted.modules() if isinstance(module, (torch.ao.nn.quantized.Conv2d, torch.ao.nn.quantized.Linear))]
    assert len(weighted) == 3  # the stem, the depthwise convolution (fbgemm's kernel saturates too) and the classifier
    worst = []
    for module in weighted:
        codes = module.weight().int_repr().numpy().astype(np.int64)
        positive, negative = overflow.pair_sums(codes.reshape(len(codes), -1))
        worst.append(int(max(positive.max(), negative.max())))
    if bits == torch_ao.EIGHT_BIT:
        assert max(worst) <= overflow.PAIR_LIMIT  # 255 x 128 <= 32,767
    else:
        assert max(worst) > overflow.PAIR_LIMIT  # full-range weights: the 7-bit activations keep 2 x 127 x 128 in range


def test_the_default_measures_both_on_held_out_images_and_keeps_the_closer(project):
    made = _made(project, "dw_auto.pt")
    assert made["settings"]["overflow_fix"] == overflow.ALL_LAYERS  # ReLU6
    note = next(note for note in made["notes"] if "7-bit activations" in note)
    eight, seven = (float(figure) for figure in re.findall(r"(-?\d+\.\d) dB", note))
    kept = torch_ao.SEVEN_BIT if seven >= eight + METHOD_MARGIN_DB else torch_ao.EIGHT_BIT
    assert made["settings"]["activation_bits"] == kept and note.startswith(f"activations {kept}-bit")
    named = _made(project, "dw_7.pt", "--activation-bits", "7", "--method", "minmax")
    assert named["settings"]["activation_bits"] == "7" and not any("7-bit activations (" in note for note in named["notes"])
    one_line_error(_quantize(project, "dw_vnni.pt", "--activation-bits", "8", "--cpus", "vnni"), "--activation-bits")
    assert not (project / "dw_vnni.pt").exists()


def test_a_proven_model_s_saturating_path_is_what_fbgemm_computes_without_vnni(project):
    """On a VNNI CPU torch's x86 engine runs most convolutions in oneDNN, which rounds some outputs otherwise than
    fbgemm (a Keras MobileNetV3-Small's scores 50 dB apart); a model that cannot saturate is scored for CPUs without VNNI
    in fbgemm, and the emulated CPU without VNNI computes the same."""
    from ptq_cli.services.models import load_model

    _made(project, "wide_8.pt", "--activation-bits", "8", "--method", "minmax", model="wide.onnx")
    model = load_model(project / "wide_8.pt", saturating_int8=True)
    images = np.random.default_rng(0).uniform(0, 1, (16, 3, 32, 32)).astype(np.float32)  # as --preprocess unit feeds
    emulated = model_service.scores_under_emulation(project / "wide_8.pt", images)
    np.testing.assert_allclose(model.predict(images), emulated, rtol=1e-6, atol=1e-6 * float(np.abs(emulated).max()))
    result = invoke("evaluate", "--model", "wide_8.pt", "--data", "test", "--against-fp32", "wide.onnx", "--int8-path", "saturating", "--json",
                    cwd=project)
    assert result.exit_code == 0, result.output
    basis = json.loads(result.stdout)["int8_basis"]
    if cpu_info.current().int8_path == cpu_info.EXACT:
        assert basis.startswith("proof (the pair rule on every layer") and "fbgemm's kernels run here" in basis
    else:
        assert basis == "native"


def test_without_clamped_activations_all_layers_is_judged_against_first_layer(project):
    """A model without ReLU6 saturates on CPUs without VNNI only where large codes meet large weights: first-layer bounds
    the stem and is measured; all-layers is proven. Both judged on held-out images, all-layers kept unless first-layer
    is METHOD_MARGIN_DB closer; a fix the user names is not judged."""
    made = _made(project, "relu.pt", "--method", "minmax", model="relu.onnx")["settings"]
    judged = dict(made["overflow_fix_db"])
    assert set(judged) == {overflow.ALL_LAYERS, overflow.FIRST_LAYER} and None not in judged.values()
    kept = overflow.FIRST_LAYER if judged[overflow.FIRST_LAYER] >= judged[overflow.ALL_LAYERS] + METHOD_MARGIN_DB else overflow.ALL_LAYERS
    assert made["overflow_fix"] == kept and made["activation_bits"] == (torch_ao.EIGHT_BIT if kept == overflow.ALL_LAYERS else None)
    named = _made(project, "relu_first.pt", "--method", "minmax", "--overflow-fix", "first-layer", model="relu.onnx")["settings"]
    assert (named["overflow_fix"], named["overflow_fix_db"]) == (overflow.FIRST_LAYER, [])
    asked = _made(project, "relu_7.pt", "--method", "minmax", "--activation-bits", "7", model="relu.onnx")["settings"]
    assert (asked["overflow_fix"], asked["activation_bits"], asked["overflow_fix_db"]) == (overflow.ALL_LAYERS, "7", [])
