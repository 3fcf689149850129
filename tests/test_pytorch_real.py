"""The PyTorch path on the real model: onnx2torch conversion, FX int8 quantization, TorchScript evaluation."""

from __future__ import annotations

import json

from conftest import assert_clean_failure, ptq, ptq_ok, record_of

from ptq_cli.backends import pytorch, tflm


def test_pytorch_fp32_scores_exactly_the_onnx_accuracy(pipeline):
    onnx_record = record_of(pipeline / "results", "resnet8.onnx")
    torch_record = record_of(pipeline / "results", "resnet8.pt")
    assert (torch_record["runtime"], torch_record["dtype"]) == ("pytorch", "fp32")
    assert torch_record["accuracy"] == onnx_record["accuracy"] == 87.19
    assert torch_record["confusion_matrix"] == onnx_record["confusion_matrix"]


def test_onnx_to_torch_conversion_is_checked(pipeline):
    run = ptq_ok("convert", "--onnx", "models/resnet8.onnx", "--torch", "models/again.pt", "--check-images", "300", "--json", cwd=pipeline)
    result = json.loads(run.stdout)
    assert result["source"] == "models/resnet8.onnx" and result["output"] == "models/again.pt"
    assert result["check"]["images"] == 300 and result["check"]["max_abs_diff"] <= 1e-4
    assert result["check"]["top1_agreement"] == 1.0
    (pipeline / "models" / "again.pt").unlink()


def test_pytorch_int8_is_close_to_fp32_and_half_the_size(pipeline):
    fp32 = record_of(pipeline / "results", "resnet8.pt")
    int8 = record_of(pipeline / "results", "resnet8_pytorch_int8.pt")
    assert (int8["runtime"], int8["dtype"]) == ("pytorch", "int8")
    assert fp32["accuracy"] - int8["accuracy"] <= 0.3, int8["accuracy"]
    assert int8["model_size_bytes"] <= 0.5 * fp32["model_size_bytes"]
    settings = int8["quantization"]
    assert settings["format"] == "FX" and settings["per_channel"] is True
    assert settings["method"] in ("histogram", "minmax", "per-image") and len(settings["method_sqnr_db"]) == len(pytorch.METHOD_CANDIDATES)  # auto: measured
    assert settings["calibration_samples"] == 1000 and settings["calibration_seed"] == 42


def test_torchscript_models_load_without_the_project(pipeline):
    # TorchScript: plain torch loads and runs it, no ptq_cli or onnx2torch import needed.
    import subprocess
    import sys

    code = (
        "import sys, torch; m = torch.jit.load(sys.argv[1]); "
        "print(tuple(m(torch.zeros(3, 32, 32, 3)).shape)); "
        "print(any(k.startswith(('ptq_cli', 'onnx2torch')) for k in sys.modules))"
    )
    for name in ("resnet8.pt", "resnet8_pytorch_int8.pt"):
        done = subprocess.run([sys.executable, "-c", code, str(pipeline / "models" / name)], capture_output=True, text=True)
        assert done.stdout.split() == ["(3,", "10)", "False"], done.stderr


def test_pytorch_uint8_is_refused_before_any_work(resnet8_onnx, tmp_path):
    for args in (["--dtype", "uint8"], ["--dtype", "int8", "--weight-dtype", "uint8"]):
        run = ptq("quantize", "--model", resnet8_onnx, "--backend", "pytorch", *args, "--output", "q.pt", cwd=tmp_path)
        assert_clean_failure(run, 2, "uint8")
        assert "signed int8 weights" in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_onnxruntime_method_is_refused_for_pytorch(resnet8_onnx, tmp_path):
    run = ptq("quantize", "--model", resnet8_onnx, "--backend", "pytorch", "--method", "entropy", cwd=tmp_path)
    assert_clean_failure(run, 2, "--method")
    assert list(tmp_path.iterdir()) == []


def test_corrupt_torchscript_file(pipeline, tmp_path):
    data = (pipeline / "models" / "resnet8_pytorch_int8.pt").read_bytes()
    (tmp_path / "broken.pt").write_bytes(data[: len(data) // 2])
    run = ptq("evaluate", "--model", "broken.pt", "--results-dir", "res", cwd=tmp_path)
    assert_clean_failure(run, 2, "broken.pt")
    assert "TorchScript" in run.stderr
    assert not (tmp_path / "res").exists()


def test_report_shows_both_frameworks_side_by_side(pipeline):
    report = json.loads(ptq_ok("report", "--json", cwd=pipeline).stdout)
    (study,) = report["groups"]
    rows = [(row["runtime"], row["dtype"], row["model"]) for row in study["rows"]]
    assert rows == [
        ("onnxruntime", "fp32", "resnet8.onnx"),
        ("onnxruntime", "int8", "resnet8_int8.onnx"),
        ("onnxruntime", "uint8", "resnet8_uint8.onnx"),
        ("onnxruntime", "uint8", "resnet8_uint8_speed.onnx"),
        ("pytorch", "fp32", "resnet8.pt"),
        ("pytorch", "int8", "resnet8_pytorch_int8.pt"),
        ("openvino", "fp32", "resnet8.onnx"),  # the same ONNX file, run on OpenVINO at f32
        ("openvino", "int8", "resnet8_openvino_int8.xml"),
        ("litert", "int8", "pretrainedResnet_quant.tflite"),  # the MLPerf Tiny reference
        ("litert", "int8", "resnet8_int8.tflite"),
        ("litert", "int8", "resnet8_int8_ranges.tflite"),
        ("litert", "int8", "resnet8_int8_w4.tflite"),
        # Every .tflite again on TFLite Micro's kernels (what a microcontroller runs), with the tflite-micro package.
        *[("tflm", "int8", name) for name in ("pretrainedResnet_quant.tflite", "resnet8_int8.tflite", "resnet8_int8_ranges.tflite", "resnet8_int8_w4.tflite")
          if tflm.available()],
    ]
    by_model = {row["model"]: row for row in study["rows"] if row["runtime"] not in ("openvino", "tflm")}
    torch_int8 = record_of(pipeline / "results", "resnet8_pytorch_int8.pt")
    torch_fp32 = record_of(pipeline / "results", "resnet8.pt")
    assert by_model["resnet8_pytorch_int8.pt"]["size_bytes"] == torch_int8["model_size_bytes"]
    assert by_model["resnet8_pytorch_int8.pt"]["size_reduction"] == round(1 - torch_int8["model_size_bytes"] / torch_fp32["model_size_bytes"], 4)


def test_convert_source_options_are_checked_before_any_work(resnet8_onnx, tmp_path):
    onnx_model = resnet8_onnx
    run = ptq("convert", "--onnx", onnx_model, cwd=tmp_path)
    assert_clean_failure(run, 2, "--torch")
    run = ptq("convert", "--onnx", onnx_model, "--keras", "model.h5", "--torch", "m.pt", cwd=tmp_path)
    assert_clean_failure(run, 2, "--keras and --onnx")
    assert list(tmp_path.iterdir()) == []
