"""The PyTorch backend's activation ranges: `--method auto` judges torch.ao's observers and ptq's per-image one on
held-out calibration images, and the output Softmax stays float (torch.ao's fixed Softmax ranges clipped the scores a
Reshape hands it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from synthetic import png_images, quantized_json, smooth_photos, two_conv_classifier

from ptq_cli.backends import pytorch
from ptq_cli.metrics import sqnr_db
from ptq_cli.quantize import torch_ao
from ptq_cli.quantize.policy import chosen_method, per_image_range
from ptq_cli.quantize.settings import PER_IMAGE


def _conv_head_classifier(path: Path) -> Path:
    """two_conv_classifier with Keras MobileNetV3's head: the pooled map -> a 1x1 Conv to the 10 scores -> Reshape -> Softmax,
    the scores well outside 0..1."""
    model = onnx.load(str(two_conv_classifier(path)))
    kept = [node for node in model.graph.node if node.op_type not in ("Flatten", "Gemm", "Softmax")]
    rng = np.random.default_rng(5)
    model.graph.initializer.extend([numpy_helper.from_array(rng.normal(0, 4.0, (10, 24, 1, 1)).astype(np.float32), "head"),
                                    numpy_helper.from_array(np.array([-1, 10], np.int64), "flat_shape")])
    del model.graph.node[:]
    model.graph.node.extend([*kept, helper.make_node("Conv", ["pooled", "head"], ["logits_map"], name="logits"),
                             helper.make_node("Reshape", ["logits_map", "flat_shape"], ["logits"]),
                             helper.make_node("Softmax", ["logits"], ["scores"], axis=1)])
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pytorch_ranges")
    _conv_head_classifier(root / "head.onnx")
    smooth_photos(root / "cal", 120, seed=1)
    smooth_photos(root / "test", 16, seed=2)
    return root


def _quantize(root: Path, output: str, *extra: str) -> dict:
    return quantized_json(root, output, "--backend", "pytorch", *extra, model="head.onnx")


def test_the_output_softmax_stays_float_where_a_reshape_hands_it_the_scores(project):
    import onnxruntime as ort

    from ptq_cli.services.models import load_model

    _quantize(project, "head_minmax.pt", "--method", "minmax")
    images = png_images(project / "cal")
    session = ort.InferenceSession(str(project / "head.onnx"), providers=["CPUExecutionProvider"])
    logits_model = onnx.load(str(project / "head.onnx"))
    logits_model.graph.output[0].name = "logits"
    logits = ort.InferenceSession(logits_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
    assert np.abs(logits).max() > 2  # the scores reach well outside the Softmax's 0..1
    fp32, ours = session.run(None, {"image": images})[0], load_model(project / "head_minmax.pt").predict(images)
    assert sqnr_db(fp32, ours) > 15 and np.mean(fp32.argmax(1) == ours.argmax(1)) > 0.9


def test_auto_keeps_the_observer_the_held_out_images_prefer(project):
    import gc

    made = _quantize(project, "head_auto.pt")["settings"]
    assert gc.get_freeze_count() == 0  # the judging's frozen objects are scanned again after it
    gc.freeze()  # a caller's own frozen objects stay frozen
    try:
        frozen = gc.get_freeze_count()
        _quantize(project, "head_auto_frozen.pt")
        assert 0 < gc.get_freeze_count() <= frozen  # none unfrozen, none added (some freed as their last reference went)
    finally:
        gc.unfreeze()
    measured = [tuple(score) for score in made["method_sqnr_db"]]
    assert [(method, percentile) for method, percentile, _ in measured] == list(pytorch.METHOD_CANDIDATES)
    assert all(db is not None for _, _, db in measured)
    assert (made["method"], made["percentile"]) == chosen_method(tuple(measured))
    named = _quantize(project, "head_per_image.pt", "--method", PER_IMAGE)["settings"]
    assert (named["method"], named["percentile"], named["method_sqnr_db"]) == (PER_IMAGE, 99.0, [])


def test_the_per_image_observer_takes_percentiles_of_each_image_s_own_extremes():
    import torch

    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(20, 4, 5, 5)).astype(np.float32) for _ in range(3)]
    batches[1][7] *= 40  # one image far out of range
    observer = torch_ao._per_image_observer(95.0, reduce_range=False)()
    for batch in batches:
        observer(torch.from_numpy(batch))
    images = np.concatenate(batches).reshape(60, -1)
    low, high = per_image_range(images.min(axis=1), images.max(axis=1), 95.0)
    assert (observer.min_val.item(), observer.max_val.item()) == pytest.approx((low, high), rel=1e-6)
    assert high < images.max() / 10  # the bright image does not set the range
    scale, _ = observer.calculate_qparams()
    assert scale.item() == pytest.approx((high - min(low, 0.0)) / 255, rel=1e-5)


@pytest.mark.parametrize("opset", [13, 11])  # before 13, onnx2torch's own Softmax module
def test_the_judged_scores_are_those_the_output_softmax_reads(project, opset):
    import torch

    model = onnx.load(str(project / "head.onnx"))
    model.opset_import[0].version = opset
    module = pytorch.onnx_to_graph_module(model)
    images = torch.from_numpy(png_images(project / "cal")[:8])
    assert pytorch.output_softmax_modules(module)
    scores = pytorch._scores_module(module)
    with torch.no_grad():
        assert torch.allclose(torch.softmax(scores(images), dim=1), module(images), atol=1e-6)
    assert not pytorch.output_softmax_modules(scores)
