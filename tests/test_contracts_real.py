"""The real ResNet8 behind other input contracts (NCHW, normalised, fixed batch, opset 9, 64x64) and the
real test batch as image folders: known answers through the flags, the stored contract and the loader."""

from __future__ import annotations

import pytest
from conftest import STUDY_EMULATION, cifar_split, ptq_ok, read_json, record_of
from contracts import contract_variant
from PIL import Image

pytestmark = pytest.mark.real_assets
NORMALIZED = ("--preprocess", "cifar10-normalized")


@pytest.fixture(scope="module")
def test_folders(tmp_path_factory, assets):
    """The 10,000 test images as ROOT/test/<class>/<n>.png and as JPEG (quality 95), with a train split
    of 20 images per class for calibration."""
    root = tmp_path_factory.mktemp("folders")
    test, train = cifar_split("test"), cifar_split("train")
    for kind, options in (("png", {}), ("jpeg", {"quality": 95})):
        suffix = ".png" if kind == "png" else ".jpg"
        for split, images, labels in (("test", test.images, test.labels), ("train", train.images[:2000], train.labels[:2000])):
            for name in test.class_names:
                (root / kind / split / name).mkdir(parents=True)
            for index, (image, label) in enumerate(zip(images, labels, strict=True)):
                Image.fromarray(image).save(root / kind / split / test.class_names[label] / f"{index:05d}{suffix}", **options)
        (root / kind / "classes.txt").write_text("\n".join(test.class_names) + "\n")
    return root


def test_third_party_contract_scores_the_known_answer_and_quantizes(tmp_path, resnet8_onnx):
    contract_variant(resnet8_onnx, tmp_path / "third.onnx")  # NCHW, 0-1 CIFAR mean/std, batch 1, opset 9
    ptq_ok("evaluate", "--model", "third.onnx", *NORMALIZED, "--results-dir", "res", cwd=tmp_path)
    fp32 = record_of(tmp_path / "res", "third.onnx")
    assert abs(fp32["accuracy"] - 87.19) <= 0.02
    assert fp32["model_input"].startswith("NCHW 3x32x32, batch 1 (fixed batch 1 made symbolic")
    run = ptq_ok("quantize", "--model", "third.onnx", "--target", "speed", *NORMALIZED, "--output", "third_speed.onnx", cwd=tmp_path)
    assert "opset 9 upgraded to 13" in run.stdout
    # No flags: the stored contract. A VNNI CPU emulates the saturating path on 100 images (10 a class; the default
    # 1,000 would cost about 35 s more under qemu).
    run = ptq_ok("evaluate", "--model", "third_speed.onnx", "--results-dir", "res", "--int8-path", "both", "--emulated-images", "100", cwd=tmp_path)
    quantized = record_of(tmp_path / "res", "third_speed.onnx")
    assert quantized["source_sha256"] == fp32["model_sha256"] and quantized["preprocessing"] == "cifar10-normalized"
    # Issue 22's bar for a third-party classifier: within 0.5 points of FP32 on both x86 int8 paths. The emulated path's
    # images are too few for half a point: there the bar is that the saturating path loses nothing against the exact one
    # on the same images.
    paths = {record["int8_path"]: record for record in (read_json(path) for path in (tmp_path / "res").glob("third_speed.onnx-*.json"))}
    assert sorted(paths) == ["exact", "saturating"]
    for record in paths.values():
        if record["images"] == fp32["images"]:
            assert record["accuracy"] >= fp32["accuracy"] - 0.5, (record["int8_path"], record["accuracy"])
        else:
            assert record["accuracy"] >= record["exact_accuracy_same_images"] - 0.2, record["int8_basis"]
    assert "delta vs FP32 third.onnx" in run.stdout
    # PyTorch takes the NCHW model too.
    ptq_ok("quantize", "--model", "third.onnx", "--backend", "pytorch", *NORMALIZED, "--output", "third_pt.pt", cwd=tmp_path)
    ptq_ok("evaluate", "--model", "third_pt.pt", "--results-dir", "res", cwd=tmp_path)
    assert record_of(tmp_path / "res", "third_pt.pt")["accuracy"] >= fp32["accuracy"] - 0.5


def test_fixed_batch_that_cannot_be_freed_runs_image_by_image(tmp_path, resnet8_onnx):
    contract_variant(resnet8_onnx, tmp_path / "tied.onnx", opset=None, fixed_reshape=True)
    ptq_ok("evaluate", "--model", "tied.onnx", *NORMALIZED, "--results-dir", "res", cwd=tmp_path)
    tied = record_of(tmp_path / "res", "tied.onnx")
    assert tied["correct"] == 8719 and "run 1 image at a time" in tied["model_input"]


def test_a_64x64_model_is_fed_by_the_loaders_resize(tmp_path, resnet8_onnx):
    contract_variant(resnet8_onnx, tmp_path / "big.onnx", size=64, batch=None, opset=None)
    ptq_ok("evaluate", "--model", "big.onnx", *NORMALIZED, "--results-dir", "res", cwd=tmp_path)
    # Bilinear 32 -> 64 in the loader, 2x2 average pooling back to 32 in the graph: measured once, 88.17%.
    assert abs(record_of(tmp_path / "res", "big.onnx")["accuracy"] - 88.17) <= 0.02


def test_the_test_batch_as_an_image_folder_scores_what_the_pickles_score(tmp_path, pipeline, test_folders):
    models = pipeline / "models"
    for name in ("resnet8.onnx", "resnet8_uint8_speed.onnx"):
        ptq_ok("evaluate", "--model", models / name, "--data", test_folders / "png", "--results-dir", "res", cwd=tmp_path)
        assert record_of(tmp_path / "res", name)["correct"] == record_of(pipeline / "results", name)["correct"]
    ptq_ok("evaluate", "--model", models / "resnet8.onnx", "--data", test_folders / "jpeg", "--results-dir", "res", cwd=tmp_path)
    report = read_json_report(tmp_path)
    assert sorted(group["label"] for group in report["groups"]) == ["jpeg (test)", "png (test)"]


def read_json_report(cwd):
    import json

    return json.loads(ptq_ok("report", "--results-dir", "res", "--json", cwd=cwd).stdout)


def test_run_on_a_users_model_and_image_folder(tmp_path, resnet8_onnx, test_folders):
    contract_variant(resnet8_onnx, tmp_path / "third.onnx")
    # On a VNNI CPU the saturating path is emulated (about 100x slower under qemu) on a few images, as in the study's run.
    # 30 calibration images a class (the default 100 is the study's): what is tested is the run over a user's contract and folder.
    ptq_ok("run", "--model", "third.onnx", "--data", test_folders / "png", *NORMALIZED, "--samples-per-class", "30", "--no-benchmark", "--no-pytorch", "--no-openvino",
           *STUDY_EMULATION, cwd=tmp_path)
    fp32, speed = record_of(tmp_path / "results", "third.onnx"), record_of(tmp_path / "results", "third_uint8_speed.onnx")
    # Issue 22's bar (within 0.5 points), and the speed model follows FP32 on all but a few images.
    assert abs(fp32["accuracy"] - 87.19) <= 0.02 and speed["accuracy"] >= fp32["accuracy"] - 0.5 and speed["fidelity"]["top1_agreement"] >= 97.5
    assert (tmp_path / "models" / "third_int8.onnx").is_file() and read_json(tmp_path / "results" / "manifest.json")["stages"]
