"""`--backend executorch`: torchao's PT2E flow with ExecuTorch's XNNPACKQuantizer, lowered to the XNNPACK delegate and
written as an ExecuTorch program (.pte) that ExecuTorch's runtime runs; the lowering judged against the program before
it; what XNNPACK runs and what it leaves to the portable kernels kept in the model and its records; and a .pte ptq did
not make, or a damaged one, met with its runtime's checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from synthetic import conv_project, depthwise_classifier, invoke, ok, one_line_error, small_torch_classifier

from ptq_cli import backends
from ptq_cli.backends import executorch as executorch_backend
from ptq_cli.errors import PtqError
from ptq_cli.quantize import pt2e
from ptq_cli.services import models as model_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import emulate


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return conv_project(tmp_path_factory.mktemp("executorch"))


@pytest.fixture(scope="module")
def quantized(project) -> Path:
    result = ok("quantize", "--model", "m.onnx", "--data", "images", "--backend", "executorch", "--output", "m.pte", "--json", cwd=project)
    assert "threadpool" not in result.output and "cpuinfo" not in result.output  # the runtime's own log stays out of ptq's output
    made = json.loads(result.stdout)
    assert made["settings"]["backend"] == "executorch" and made["settings"]["overflow_fix"] == "none"
    assert any("XNNPACK runs" in note for note in made["notes"])
    # By default the weights are those ptq's onnxruntime model chose (learned rounding), made first from the same images.
    assert made["settings"]["weights_from"] == "onnxruntime" and any(note.startswith("weights of 2 layers from ptq's onnxruntime model") for note in made["notes"])
    return project / "m.pte"


def test_an_executorch_program_evaluates_like_its_source_and_its_record_says_what_xnnpack_runs(project, quantized):
    assert backends.for_file(quantized).name == "executorch"
    shown = json.loads(ok("evaluate", "--model", "m.pte", "--model", "m.onnx", "--data", "images", "--json", cwd=project).stdout)
    records = {Path(record["model_path"]).name: record for record in shown}
    record = records["m.pte"]
    assert (record["runtime"], record["dtype"]) == ("executorch", "int8")
    assert record["fidelity"]["top1_agreement"] >= 90.0
    assert "batch 1" in record["model_input"]
    delegation = record["quantization"]["delegation"]
    assert delegation["aten_convolution_default"]["xnnpack"] >= 1 and delegation["aten_convolution_default"]["portable"] == 0


def test_xnnpack_computes_the_same_bytes_on_both_x86_int8_paths(quantized):
    """XNNPACK widens its int8 products before adding them: its AVX2 kernels (a CPU without VNNI) give what this CPU's
    give, byte for byte, so the backend has no overflow fix and no second int8 path to measure."""
    if cpu_info.current().int8_path == cpu_info.SATURATING:
        pytest.skip("this CPU has no VNNI: its kernels are the AVX2 ones, and no other path is reached here")
    if not emulate.runs_natively():
        pytest.skip("a VNNI CPU that cannot mask CPUID: the AVX2 kernels are not reached natively here")
    loaded = model_service.load_model(quantized, 1)
    batch = np.random.default_rng(0).uniform(0, 255, loaded.input.shape(8)).astype(np.float32)
    here = loaded.predict(batch)
    assert model_service.scores_under_emulation(quantized, batch, 1).tobytes() == here.tobytes()


def test_a_lowering_that_changes_the_outputs_is_refused_and_nothing_is_written(project, monkeypatch):
    # A program whose scores come out negated: the gate compares what the runtime computes with the program it came from.
    call = executorch_backend._Program.call
    monkeypatch.setattr(executorch_backend._Program, "call", lambda self, batch: -call(self, batch))
    result = invoke("quantize", "--model", "m.onnx", "--data", "images", "--backend", "executorch", "--output", "bad.pte", cwd=project)
    assert result.exit_code == 2 and "Traceback" not in result.output
    said = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("Calibrating")]  # the progress bar's lines aside
    assert len(said) == 1 and "XNNPACK lowering changes what the quantized model computes" in said[0]
    assert not (project / "bad.pte").exists()


def test_a_program_ptq_did_not_make_evaluates_and_a_damaged_one_is_one_line(project, quantized):
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(small_torch_classifier(), (torch.rand(4, 3, 16, 16),))
    (project / "user.pte").write_bytes(to_edge_transform_and_lower(program).to_executorch().buffer)
    shown = json.loads(ok("evaluate", "--model", "user.pte", "--data", "images", "--json", cwd=project).stdout)
    assert (shown["runtime"], shown["dtype"], shown["images"]) == ("executorch", "fp32", 36)
    assert "NCHW 3x16x16, batch 4" in shown["model_input"]
    data = quantized.read_bytes()
    (project / "cut.pte").write_bytes(data[: len(data) // 2])
    one_line_error(invoke("evaluate", "--model", "cut.pte", "--data", "images", cwd=project), "cut.pte")
    scrambled = bytearray(data)
    scrambled[64:4096] = np.random.default_rng(1).integers(0, 256, 4032, dtype=np.uint8).tobytes()
    (project / "scrambled.pte").write_bytes(bytes(scrambled))
    one_line_error(invoke("evaluate", "--model", "scrambled.pte", "--data", "images", cwd=project), "scrambled.pte")


def test_a_clamp_after_a_convolution_gets_its_own_range_as_a_fused_relu_does(tmp_path):
    """XNNPACKQuantizer alone quantizes a convolution's output on its whole range and hands a ReLU6 after it that scale;
    the clamp fused as a ReLU is, its output is observed on 0..6 and nothing is quantized between the two."""
    model = onnx.load(str(depthwise_classifier(tmp_path / "dw.onnx", size=32, classes=10)))
    model.graph.name = "dw.onnx"
    images = np.random.default_rng(0).uniform(0, 255, (40, 3, 32, 32)).astype(np.float32)
    source = pt2e.torch_source(model, images, fold=True)
    converted = pt2e.calibrated(pt2e.export(source.module, source.example), pt2e.Recipe(target=pt2e.XNNPACK, pair_safe=False), source.batches)
    quantized = {node.args[0]: node for node in converted.graph.nodes if node.op == "call_function" and "quantize_per_tensor" in str(node.target)
                 and "dequantize" not in str(node.target)}
    clamps = [node for node in converted.graph.nodes if node.op == "call_function" and "hardtanh" in str(node.target)]
    assert len(clamps) == 2
    for clamp in clamps:
        assert clamp.args[0] not in quantized  # the convolution's output goes to the clamp unquantized
        scale = float(quantized[clamp].args[1])
        assert scale <= 6.0 / 255 * 1.01, scale  # 0..6 over the 256 codes, not the convolution's range


def test_weights_from_none_keeps_the_flows_own_rounding(project):
    made = json.loads(ok("quantize", "--model", "m.onnx", "--data", "images", "--backend", "executorch", "--weights-from", "none", "--output", "own.pte",
                         "--json", cwd=project).stdout)
    assert made["settings"]["weights_from"] == "none" and not any(note.startswith("weights") for note in made["notes"])


def test_a_model_onnxruntimes_flow_cannot_take_keeps_the_flows_own_rounding_and_says_why(project, monkeypatch):
    def cannot(_path, _pair_safe):
        raise PtqError("m.onnx: onnxruntime cannot quantize it (an op it lacks)")

    monkeypatch.setattr(quantize_service, "_weights_maker", lambda *_args: cannot)
    made = json.loads(ok("quantize", "--model", "m.onnx", "--data", "images", "--backend", "executorch", "--output", "fallback.pte", "--json",
                         cwd=project).stdout)
    assert any(note.startswith("weights: PT2E's own rounding (ptq's onnxruntime model could not be made: m.onnx: onnxruntime cannot")
               for note in made["notes"]), made["notes"]
    assert (project / "fallback.pte").is_file()


def test_weights_from_a_qdq_model_with_a_float_stem_leave_the_stem_float_on_xnnpack(project):
    """--weights-from on ExecuTorch: the layers the onnxruntime model quantized carry its weights, and the stem it keeps
    in float is left unannotated (XNNPACKQuantizer takes no per-layer None), so it stays float; the lowering still judged."""
    ok("quantize", "--model", "m.onnx", "--data", "images", "--stem", "float", "--no-space-to-depth", "--output", "stem_float.onnx", cwd=project)
    made = json.loads(ok("quantize", "--model", "m.onnx", "--data", "images", "--backend", "executorch", "--weights-from", "stem_float.onnx",
                         "--output", "carried.pte", "--json", cwd=project).stdout)
    assert any(note.startswith("weights of 1 layers from stem_float.onnx") and "kept float as there: node_0" in note for note in made["notes"]), made["notes"]
    shown = json.loads(ok("evaluate", "--model", "carried.pte", "--model", "m.onnx", "--data", "images", "--json", cwd=project).stdout)
    assert next(record for record in shown if record["model_path"].endswith("carried.pte"))["fidelity"]["top1_agreement"] >= 90.0
