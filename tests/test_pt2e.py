"""`--backend pt2e`: torchao's PT2E quantization written as a torch.export program (.pt2), run after Inductor's x86
lowering; the lowering judged against the program before it; and a .pt2 from anyone loaded without running anything
written in it (a crafted archive for each way torch.export.load would run code)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from synthetic import conv_project, depthwise_classifier, image_folder, invoke, ok, one_line_error, small_torch_classifier

from ptq_cli.errors import PtqError
from ptq_cli.guards import pt2_archive
from ptq_cli.metrics import sqnr_db
from ptq_cli.quantize import overflow, pt2e
from ptq_cli.services import models as model_service
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import emulate


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return conv_project(tmp_path_factory.mktemp("pt2e"))


@pytest.fixture(scope="module")
def quantized(project) -> Path:
    made = json.loads(ok("quantize", "--model", "m.onnx", "--data", "images", "--backend", "pt2e", "--output", "m.pt2", "--json", cwd=project).stdout)
    assert made["settings"]["backend"] == "pt2e" and made["settings"]["overflow_fix"] == "all-layers"
    return project / "m.pt2"


def test_a_pt2e_model_is_a_torch_export_program_that_evaluates_like_its_source(project, quantized):
    program, extra = pt2_archive.load(quantized, quantized.read_bytes())
    assert any("quantized_decomposed" in str(node.target) for node in program.graph.nodes)
    assert json.loads(extra["ptq.json"])["ptq.model_input"]
    shown = json.loads(ok("evaluate", "--model", "m.pt2", "--model", "m.onnx", "--data", "images", "--json", cwd=project).stdout)
    records = {Path(record["model_path"]).name: record for record in shown}
    assert records["m.pt2"]["runtime"] == "pt2e" and records["m.pt2"]["dtype"] == "int8"
    assert records["m.pt2"]["fidelity"]["top1_agreement"] >= 90.0
    assert "compiled for x86" in records["m.pt2"]["model_input"]
    # Right on every x86 CPU by proof: the pair rule on every layer, so its saturating path is its exact path.
    both = json.loads(ok("evaluate", "--model", "m.pt2", "--data", "images", "--int8-path", "both", "--json", cwd=project).stdout)
    assert {record["int8_path"] for record in both} == {"exact", "saturating"}
    assert len({record["correct"] for record in both}) == 1 and all("proof" in record["int8_basis"] or record["int8_basis"] == "native" for record in both)


def test_a_program_compiles_once_a_shape_with_inductor_s_cpp_wrapper_and_runs_as_its_source(quantized, monkeypatch):
    """Inductor's settings (freezing, the C++ wrapper) are in force while a batch shape compiles, and not entered again
    for a shape compiled already; the compiled scores are the quantize/dequantize program's, as the lowering judge asks."""
    import torch._inductor.config as inductor

    real_compile, seen = torch.compile, []

    def spied(module, **options):
        program = real_compile(module, **options)

        def call(batch):
            seen.append((inductor.freezing, inductor.cpp_wrapper))
            return program(batch)

        return call

    monkeypatch.setattr(torch, "compile", spied)
    program, _ = pt2_archive.load(quantized, quantized.read_bytes())
    run = pt2e.compiled(program.module())
    batch = torch.from_numpy(np.random.default_rng(0).uniform(0, 255, (2, 3, 16, 16)).astype(np.float32))
    first, again = run(batch), run(batch)
    assert seen == [(True, True), (False, False)]
    assert torch.equal(first, again)
    with torch.inference_mode():  # as evaluate calls it: guarded apart, so compiled within the settings too
        inferred = run(batch)
    assert seen[2:] == [(True, True)] and torch.equal(inferred, first)
    with torch.no_grad():
        assert sqnr_db(program.module()(batch).numpy(), first.numpy()) > pt2e.LOWERING_SQNR_DB


def test_convert_writes_a_float_torch_export_program_that_computes_what_the_onnx_model_does(project):
    made = json.loads(ok("convert", "--onnx", "m.onnx", "--torch", "m_fp32.pt2", "--data", "images", "--json", cwd=project).stdout)
    assert made["check"]["top1_agreement"] == 1.0
    program, _ = pt2_archive.load(project / "m_fp32.pt2", (project / "m_fp32.pt2").read_bytes())
    assert not any("quantized_decomposed" in str(node.target) for node in program.graph.nodes)
    shown = json.loads(ok("evaluate", "--model", "m_fp32.pt2", "--data", "images", "--json", cwd=project).stdout)
    assert (shown["runtime"], shown["dtype"]) == ("pt2e", "fp32")


def test_a_lowering_that_changes_the_outputs_is_refused_and_nothing_is_written(project, monkeypatch):
    # Lowering that returns a different module (the scores negated): the gate compares it with the program it came from.
    monkeypatch.setattr(pt2e, "compiled", lambda module: lambda batch: -module(batch))
    result = invoke("quantize", "--model", "m.onnx", "--data", "images", "--backend", "pt2e", "--output", "bad.pt2", cwd=project)
    one_line_error(result, "x86 lowering changes what the quantized model computes")
    assert not (project / "bad.pt2").exists()


def test_a_users_own_torch_export_program_evaluates_without_onnx(project):
    program = torch.export.export(small_torch_classifier(), (torch.rand(2, 3, 16, 16),), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    torch.export.save(program, project / "user.pt2")
    shown = json.loads(ok("evaluate", "--model", "user.pt2", "--data", "images", "--json", cwd=project).stdout)
    assert shown["runtime"] == "pt2e" and shown["dtype"] == "fp32" and shown["images"] == 36
    assert "NCHW 3x16x16" in shown["model_input"]


def _rewritten(source: Path, target: Path, edit_program=None, extra_member: tuple[str, bytes] | None = None) -> Path:
    """A copy of a .pt2 archive with its program's JSON edited, or a member added."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as written:
        for member in archive.infolist():
            data = archive.read(member)
            if member.filename.endswith("models/model.json") and edit_program is not None:
                program = json.loads(data)
                edit_program(program)
                data = json.dumps(program).encode()
            written.writestr(member, data)
        if extra_member is not None:
            written.writestr(extra_member[0], extra_member[1])
    return target


def _first_node(program: dict) -> dict:
    return program["graph_module"]["graph"]["nodes"][0]


def _poisoned_expression(program: dict) -> None:
    """The first symbolic size's expression made Python that sympify would run."""
    holder = next(holder for key, _value, holder in pt2_archive._walk(program) if key == "expr_str")
    holder["expr_str"] = "__import__('pathlib').Path('PWNED').touch()"


CRAFTED = {
    "guard code": (lambda program: program.__setitem__("guards_code", ["__import__('pathlib').Path('PWNED').touch() or True"]), None,
                   "guard code"),
    "a target outside torch.ops": (lambda program: _first_node(program).__setitem__("target", "torch.os.system"), None, "not a PyTorch operator"),
    "a shape expression": (_poisoned_expression, None, "shape expression"),
    "an AOTInductor library": (None, ("archive/data/aotinductor/model/model.so", b"\x7fELF"), "AOTInductor"),
}


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_a_crafted_archive_is_refused_before_anything_in_it_runs(project, quantized, kind, monkeypatch):
    edit, member, mentions = CRAFTED[kind]
    crafted = _rewritten(quantized, project / f"crafted_{kind.replace(' ', '_')}.pt2", edit, member)
    monkeypatch.chdir(project)
    with pytest.raises(PtqError, match=mentions):
        pt2_archive.load(crafted, crafted.read_bytes())
    result = invoke("evaluate", "--model", crafted.name, "--data", "images", cwd=project)
    one_line_error(result, crafted.name)
    assert not (project / "PWNED").exists()


def test_pickled_objects_other_than_tensors_are_refused(project, quantized):
    """A weight stored as a pickle (torch.export writes tensor subclasses so) is read weights-only: an object whose
    unpickling would run code is refused, not built."""
    class Payload:
        def __reduce__(self):
            return (Path("PWNED").touch, ())

    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    with zipfile.ZipFile(quantized) as archive:
        config_name = next(name for name in archive.namelist() if name.endswith("weights/model_weights_config.json"))
        config = json.loads(archive.read(config_name))
    name, entry = next(iter(config["config"].items()))
    entry["use_pickle"] = True
    crafted = project / "pickled.pt2"
    with zipfile.ZipFile(quantized) as archive, zipfile.ZipFile(crafted, "w") as written:
        for member in archive.infolist():
            data = archive.read(member)
            if member.filename == config_name:
                data = json.dumps(config).encode()
            elif member.filename.endswith("weights/" + entry["path_name"]):
                data = buffer.getvalue()
            written.writestr(member, data)
    with pytest.raises(PtqError):
        pt2_archive.load(crafted, crafted.read_bytes())
    assert not (project / "PWNED").exists() and not Path("PWNED").exists()


def test_the_vetting_accepts_what_export_writes_for_symbolic_sizes():
    assert pt2_archive._expression_ok("Symbol('s6', positive=True, integer=True)")
    assert pt2_archive._expression_ok("2*s6 + Max(1, s6)")
    assert not pt2_archive._expression_ok("__import__('os').system('x')")
    assert not pt2_archive._expression_ok("s6.__class__")
    assert pt2_archive._target_ok("torch.ops.aten.conv2d.default") and pt2_archive._target_ok("_operator.getitem")
    assert not pt2_archive._target_ok("torch.ops.my_lib.run.default") and not pt2_archive._target_ok("torch.load")
    assert np.isfinite(pt2e.LOWERING_SQNR_DB)


def test_depthwise_convolutions_leave_the_pair_rule_and_still_compute_the_same_on_both_x86_paths(tmp_path):
    """oneDNN widens a depthwise convolution's products before adding them: a model for every CPU keeps its depthwise
    filters at full range (pairs of codes beyond the rule), and its compiled scores on the AVX2 kernels (CPUID masked)
    are this CPU's within float rounding, where a dense layer's pairs would saturate (thousands apart)."""
    model = onnx.load(str(depthwise_classifier(tmp_path / "dw.onnx", size=32, classes=10)))
    model.graph.name = "dw.onnx"
    depthwise = pt2e.depthwise_modules(pt2e.torch_source(model, np.zeros((2, 3, 32, 32), np.float32), fold=True).module)
    assert len(depthwise) == 1
    image_folder(tmp_path / "images", per_class=12, size=32)
    ok("quantize", "--model", "dw.onnx", "--data", "images", "--backend", "pt2e", "--output", "dw.pt2", cwd=tmp_path)
    program, _ = pt2_archive.load(tmp_path / "dw.pt2", (tmp_path / "dw.pt2").read_bytes())
    weights = {tuple(value.shape): value.int().numpy() for value in program.state_dict.values() if value.dtype == torch.int8}
    sums = {shape: max(overflow.pair_sums(codes.reshape(len(codes), -1))[0].max(), overflow.pair_sums(codes.reshape(len(codes), -1))[1].max())
            for shape, codes in weights.items()}
    assert sums[(8, 1, 3, 3)] > overflow.PAIR_LIMIT  # the depthwise filters at full range
    assert all(total <= overflow.PAIR_LIMIT for shape, total in sums.items() if shape != (8, 1, 3, 3))  # every other layer under the rule
    if cpu_info.current().int8_path == cpu_info.SATURATING or not emulate.runs_natively():
        pytest.skip("the other x86 path is not reached natively here")
    loaded = model_service.load_model(tmp_path / "dw.pt2", 1)
    batch = np.full(loaded.input.shape(8), 255.0, np.float32)
    batch[::2, :, ::2] = np.random.default_rng(0).uniform(0, 255, batch[::2, :, ::2].shape)
    here, avx2 = loaded.predict(batch), model_service.scores_under_emulation(tmp_path / "dw.pt2", batch, 1)
    assert sqnr_db(here, avx2) > 60.0


def test_weights_from_a_qdq_model_carry_its_codes_and_float_layers_into_the_program(project):
    """--weights-from: the onnxruntime model's 8-bit weights (learned rounding chose each code) are the program's, code
    for code, in the granularity it has; a model ptq did not make from this FP32 model, or a granularity asked against
    its, is one line."""
    from onnx import numpy_helper

    made = json.loads(ok("quantize", "--model", "m.onnx", "--data", "images", "--cpus", "vnni", "--no-space-to-depth", "--output", "m_int8.onnx", "--json",
                         cwd=project).stdout)
    qdq = onnx.load(str(project / "m_int8.onnx"))
    codes = [array for array in (numpy_helper.to_array(item) for item in qdq.graph.initializer) if array.dtype == np.int8 and array.ndim >= 2]
    carried = json.loads(ok("quantize", "--model", "m.onnx", "--data", "images", "--backend", "pt2e", "--cpus", "vnni", "--weights-from", "m_int8.onnx",
                            "--output", "carried.pt2", "--json", cwd=project).stdout)
    assert carried["settings"]["per_channel"] == made["settings"]["per_channel"]
    assert any(note.startswith(f"weights of {len(codes)} layers from m_int8.onnx") for note in carried["notes"]), (len(codes), "|".join(carried["notes"]))
    program, _ = pt2_archive.load(project / "carried.pt2", (project / "carried.pt2").read_bytes())
    ours = [value.numpy() for value in program.state_dict.values() if value.dtype == torch.int8]  # a layer lowering kept float has none
    assert ours
    for mine in ours:
        assert any(theirs.shape == mine.shape and np.array_equal(theirs, mine) for theirs in codes)
    one_line_error(invoke("quantize", "--model", "m.onnx", "--data", "images", "--backend", "pt2e", "--weights-from", "m.onnx", "--output", "x.pt2",
                          cwd=project), "was not quantized by ptq from this FP32 model")
    other = "--per-tensor" if made["settings"]["per_channel"] else "--per-channel"
    one_line_error(invoke("quantize", "--model", "m.onnx", "--data", "images", "--backend", "pt2e", other, "--weights-from", "m_int8.onnx",
                          "--output", "x.pt2", cwd=project), "leave the granularity to them")
    assert not (project / "x.pt2").exists()


def test_weights_from_a_qdq_model_carry_the_biases_it_adds_bias_correction_included(tmp_path):
    """Learned rounding corrects each layer's bias for its rounding (quantize/rounding.py): the program adds the bias the
    QDQ model adds, not the float model's."""
    from onnx import numpy_helper
    from synthetic import two_conv_classifier

    from ptq_cli.quantize import carried as carried_weights

    project = tmp_path
    two_conv_classifier(project / "m.onnx")
    image_folder(project / "images", per_class=12, size=16)
    ok("quantize", "--model", "m.onnx", "--data", "images", "--cpus", "vnni", "--no-space-to-depth", "--output", "m_int8_b.onnx", cwd=project)
    qdq = onnx.load(str(project / "m_int8_b.onnx"))
    constants = {item.name: numpy_helper.to_array(item) for item in qdq.graph.initializer}
    dequantized = [constants[node.input[0]].astype(np.float64) * constants[node.input[1]] for node in qdq.graph.node
                   if node.op_type == "DequantizeLinear" and constants.get(node.input[0], np.zeros(0, np.int8)).dtype == np.int32]
    module = pt2e.torch_source(onnx.load(str(project / "m.onnx")), np.zeros((2, 3, 16, 16), np.float32), fold=False).module
    float_biases = {name: layer.bias.detach().numpy().copy() for name, layer in module.named_modules() if getattr(layer, "bias", None) is not None}
    found = carried_weights.carried_weights(module, qdq, project / "m_int8_b.onnx")
    carried_weights.carry_into(module, found)
    assert found.biases and set(found.biases) <= set(found.weights)
    for name in found.biases:
        bias = module.get_submodule(name).bias.detach().numpy()
        assert any(there.shape == bias.shape and np.allclose(there, bias, rtol=1e-6, atol=1e-7) for there in dequantized)
    assert any(not np.array_equal(module.get_submodule(name).bias.detach().numpy(), float_biases[name]) for name in found.biases)


def _tf2onnx_shaped(path: Path) -> Path:
    """What tf2onnx writes for Keras: Pad's pads, Squeeze's and Unsqueeze's axes and Reshape's shape as constant inputs."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(5)
    constants = {"w": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
                 "hw": np.array([2, 3], np.int64), "last": np.array([2], np.int64), "flat": np.array([-1, 8], np.int64),
                 "zero": np.array(0.0, np.float32)}
    nodes = [helper.make_node("Pad", ["image", "pads", "zero"], ["padded"]),
             helper.make_node("Conv", ["padded", "w"], ["conv"], strides=[2, 2]),
             helper.make_node("Relu", ["conv"], ["relu"]),
             helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
             helper.make_node("Squeeze", ["pooled", "hw"], ["squeezed"]),
             helper.make_node("Unsqueeze", ["squeezed", "last"], ["again"]),
             helper.make_node("Reshape", ["again", "flat"], ["scores"])]
    graph = helper.make_graph(nodes, "tf2onnx_shaped", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 8])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def test_shapes_axes_and_pads_given_as_constant_inputs_export_as_the_onnx_model_computes(tmp_path):
    import onnxruntime

    path = _tf2onnx_shaped(tmp_path / "m.onnx")
    images = np.random.default_rng(0).uniform(0, 1, (4, 3, 16, 16)).astype(np.float32)
    source = pt2e.torch_source(onnx.load(str(path)), images, fold=False)
    # onnx2torch's layers read these at run time; each becomes a plain torch function of its constants.
    assert [node.target for node in source.module.graph.nodes if node.op == "call_module" and len(node.args) > 1] == []
    program = pt2e.export(source.module, images[:2])
    expected = onnxruntime.InferenceSession(str(path)).run(None, {"image": images})[0]
    np.testing.assert_allclose(program.module()(torch.from_numpy(images)).detach().numpy(), expected, rtol=1e-5, atol=1e-5)


TORCHAO_IMPORT = """
import logging
from ptq_cli.guards.library_noise import torchao_pt2e_imported
torchao_pt2e_imported()
torch_logger = logging.getLogger("torch")
print(len(torch_logger.handlers), torch_logger.propagate)
"""


def test_torchao_s_import_warnings_go_through_python_s_logging_not_torch_s_own_printer():
    """In a fresh interpreter (torchao logs its deprecation once, when first imported): the warning reaches stderr as
    Python's logging says it (which the CLI gathers and says once after its output), not in torch's own format in the
    middle of the output; torch's handler is back afterwards."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TORCHAO_IMPORT], capture_output=True, text=True, check=True)
    said = [line for line in done.stderr.splitlines() if "KernelPreference" in line]
    assert said and not any(line.startswith(("W1", "W0")) for line in said), done.stderr  # nothing silenced, none as torch prints
    assert done.stdout.split() == ["1", "False"], done.stdout
