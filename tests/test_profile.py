"""`ptq benchmark --profile`: where a model's time goes on its runtime, kept in the benchmark record, summed up by the report."""

from __future__ import annotations

import json

import pytest
from synthetic import depthwise_classifier, invoke, ok, one_line_error, photo_folder

from ptq_cli.backends.base import CONVERT, FLOAT_KERNEL, INT8_KERNEL, OP_KINDS, RuntimeProfile
from ptq_cli.backends.onnxruntime import op_kind
from ptq_cli.backends.openvino import layer_kind
from ptq_cli.x86 import cpu as cpu_info


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A depthwise classifier (convolutions, a float Clip, a Gemm) on a folder of photos, and its default 8-bit model."""
    root = tmp_path_factory.mktemp("profile")
    depthwise_classifier(root / "dw.onnx", size=32, classes=3)
    photo_folder(root / "photos", count=12, size=40)
    ok("quantize", "--model", "dw.onnx", "--data", "photos", "--output", "dw_int8.onnx", cwd=root)
    return root


def test_the_profile_says_which_kernels_ran_and_where_the_time_went(study):
    timed = ok("benchmark", "--model", "dw.onnx", "--model", "dw_int8.onnx", "--runs", "3", "--batch-size", "8", "--profile", "--json", cwd=study)
    records = {record["model_path"]: record for record in json.loads(timed.stdout)}
    fp32, int8 = (RuntimeProfile.from_stored(records[name]["profile"]) for name in ("dw.onnx", "dw_int8.onnx"))
    for profile in (fp32, int8):
        assert profile.batch_size == 8 and profile.runs > 0 and profile.convolutions >= 3
        assert all(op.kind in OP_KINDS and op.nodes >= 1 and op.milliseconds >= 0 for op in profile.ops)
        assert sum(profile.share(kind) for kind in OP_KINDS) == pytest.approx(1.0)
        assert [op.milliseconds for op in profile.ops] == sorted((op.milliseconds for op in profile.ops), reverse=True)
    assert fp32.int8_convolutions == 0 and fp32.share(INT8_KERNEL) == 0 and fp32.share(CONVERT) == 0
    assert int8.int8_convolutions >= 1 and int8.share(INT8_KERNEL) > 0
    # The record keeps it; the report sums it up, in the terminal and in Markdown.
    ok("evaluate", "--model", "dw.onnx", "--model", "dw_int8.onnx", "--data", "photos", "--against-fp32", "dw.onnx", cwd=study)
    rows = {row["model"]: row for group in json.loads(ok("report", "--json", cwd=study).stdout)["groups"] for row in group["rows"]}
    latencies = {name: records[name]["latency_ms_p50"] for name in ("dw.onnx", "dw_int8.onnx")}
    assert rows["dw_int8.onnx"]["speedup_batch1"] == pytest.approx(latencies["dw.onnx"] / latencies["dw_int8.onnx"], abs=1e-3)
    lines = ok("report", cwd=study).stdout.splitlines()
    assert any(line.startswith("* At batch 1") and "dw_int8.onnx" in line for line in lines), lines
    said = f"{int8.int8_convolutions} of {int8.convolutions} convolutions and matrix products run int8"
    assert any(said in line for line in lines), lines
    ok("report", "--markdown", "report.md", cwd=study)
    assert "## Where the time goes" in (study / "report.md").read_text() and said in (study / "report.md").read_text()
    shown = ok("benchmark", "--model", "dw_int8.onnx", "--runs", "2", "--batch-size", "8", "--profile", cwd=study).stdout
    assert "where the time goes" in shown and "QLinear" in shown and said in shown


def test_openvino_profiles_the_layers_it_ran(study):
    """The same ONNX file on OpenVINO (`--also MODEL@openvino`): its performance counters, by layer type and precision."""
    timed = ok("benchmark", "--model", "dw_int8.onnx", "--also", "dw_int8.onnx@openvino", "--runs", "2", "--batch-size", "8", "--profile", "--json",
               cwd=study)
    records = {record["runtime"]: record for record in json.loads(timed.stdout)}
    profile = RuntimeProfile.from_stored(records["openvino"]["profile"])
    assert "OpenVINO" in profile.source and profile.batch_size == 8 and profile.convolutions >= 3
    assert {op.op for op in profile.ops} & {"Convolution", "GroupConvolution"} and sum(profile.share(kind) for kind in OP_KINDS) == pytest.approx(1.0)


def test_openvino_layers_are_sorted_by_the_precision_they_ran_in():
    assert [layer_kind(*layer) for layer in (("Convolution", "brgconv_avx512_I8"), ("Convolution", "brgconv_avx512_f32"), ("FakeQuantize", "jit_avx512_f32"),
                                             ("Reorder", "jit_uni_f32"), ("AvgPool", "jit_avx2_u8"))] == [
        INT8_KERNEL, FLOAT_KERNEL, CONVERT, "layout", INT8_KERNEL]


def test_onnxruntime_ops_are_sorted_into_what_they_compute_in():
    assert [op_kind(op) for op in ("QLinearConv", "QGemm", "MatMulInteger", "QuantizeLinear", "DequantizeLinear", "Transpose", "Conv", "HardSigmoid")] == [
        INT8_KERNEL, INT8_KERNEL, INT8_KERNEL, CONVERT, CONVERT, "layout", FLOAT_KERNEL, FLOAT_KERNEL]


def test_a_profile_of_the_other_cpus_kernels_is_refused_in_one_line(study, monkeypatch):
    vnni = cpu_info.Cpu("a VNNI CPU", "x86_64", ("avx2", "avx512_vnni"))
    monkeypatch.setattr(cpu_info, "current", lambda: vnni)
    one_line_error(invoke("benchmark", "--model", "dw_int8.onnx", "--runs", "2", "--profile", "--int8-path", "saturating", cwd=study), "--profile")
