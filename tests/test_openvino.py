"""The OpenVINO backend: quantization to IR (ptq's QDQ model converted, or NNCF's), OpenVINO as a runtime
for ONNX files, the precision hint in every record. In-process on tests/synthetic.py's classifier; one real-asset test against a plain
openvino script."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from synthetic import CLASSES, channel_mean_classifier, colour_images, invoke, ok, one_line_error

from ptq_cli import settings
from ptq_cli.quantize.reuse import REUSED_NOTE, reusing_made_files
from ptq_cli.quantize.settings import METHOD_CANDIDATES

pytest.importorskip("openvino", reason="the openvino extra is not installed")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    channel_mean_classifier(tmp_path / "m.onnx", batch=1)  # a fixed batch, as exporters write it
    train_images, train_labels = colour_images(6, seed=1)
    test_images, test_labels = colour_images(6, seed=2)
    np.savez(tmp_path / "colours.npz", train_images=train_images, train_labels=train_labels, test_images=test_images,
             test_labels=test_labels, class_names=np.array(CLASSES))
    return tmp_path



def records(results: Path) -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in results.glob("*.json")}


def test_nncf_quantizes_to_ir_that_evaluates_on_openvino_with_its_precision_recorded(project):
    result = ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--bias-correction", "full", "--json",
                cwd=project)
    summary = json.loads(result.stdout)  # NNCF's progress bars stay off stdout
    assert "Statistics collection" not in result.stderr  # and off a stderr that is not a terminal (a log, a pipe)
    assert summary["settings"]["backend"] == "openvino" and summary["settings"]["bias_correction"] == "full"
    assert summary["settings"]["method"] == "nncf"  # an NNCF option names the quantizer
    assert (project / "m_openvino_int8.xml").is_file() and (project / "m_openvino_int8.bin").is_file()
    assert not [path.name for path in project.iterdir() if path.name.startswith(".")]
    ok("evaluate", "--model", "m_openvino_int8.xml", "--data", "colours.npz", "--results-dir", "res", cwd=project)
    (record,) = [record for record in records(project / "res").values() if record["model_path"].endswith(".xml")]
    assert record["runtime"] == "openvino" and record["precision"] == "f32" and record["dtype"] == "int8"
    assert record["accuracy"] == 100.0 and record["quantization"]["nncf_preset"] == "performance"
    # The source was evaluated for the delta (on onnxruntime, its own runtime).
    assert any(r["runtime"] == "onnxruntime" and r["dtype"] == "fp32" for r in records(project / "res").values())


def _weight_codes_of_ir(path: Path) -> list[tuple[int, bytes]]:
    import openvino as ov

    model = ov.Core().read_model(str(path))
    return sorted((op.get_data().size, op.get_data().tobytes()) for op in model.get_ops()
                  if op.get_type_name() == "Constant" and op.get_element_type() == ov.Type.i8)


def test_the_default_ir_is_ptq_s_own_quantization_with_quantizers_only_where_the_cpu_plugin_fuses_them(project):
    """By default the IR is ptq's QDQ engine's model (calibration, pair rule, learned rounding) converted, its pairs
    placed for OpenVINO: a FakeQuantize on an activation only at the input of a convolution, matrix product or residual
    join (whose output stays float, for the plugin's post-op fusions); and the IR says how it was made."""
    import openvino as ov

    made = json.loads(ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--rounding", "learned", "--json",
                         cwd=project).stdout)["settings"]
    assert (made["rounding"], made["nncf_preset"], made["format"]) == ("learned", None, "IR")
    assert (made["method"], made["percentile"]) in METHOD_CANDIDATES and len(made["method_sqnr_db"]) == len(METHOD_CANDIDATES)  # --method auto
    assert _weight_codes_of_ir(project / "m_openvino_int8.xml")
    graph = ov.Core().read_model(str(project / "m_openvino_int8.xml"))
    activations = [op for op in graph.get_ordered_ops() if op.get_type_name() == "FakeQuantize"
                   and op.input_value(0).get_node().get_type_name() not in ("Constant", "Convert")]
    assert activations
    for quantizer in activations:  # never before an activation or an elementwise product: those fuse into the convolution
        readers = {target.get_node().get_type_name() for target in quantizer.output(0).get_target_inputs()}
        assert readers <= {"Convolution", "GroupConvolution", "MatMul", "Add"}, readers
    ok("evaluate", "--model", "m_openvino_int8.xml", "--data", "colours.npz", "--results-dir", "res", cwd=project)
    (record,) = [record for record in records(project / "res").values() if record["model_path"].endswith(".xml")]
    assert record["runtime"] == "openvino" and record["quantization"]["rounding"] == "learned"
    assert "IR from QDQ" in ok("report", "--results-dir", "res", cwd=project).stdout


def test_an_onnx_file_runs_on_either_runtime_and_keeps_one_record_per_runtime_and_precision(project):
    for extra in ((), ("--runtime", "openvino"), ("--runtime", "openvino", "--precision", "bf16")):
        ok("evaluate", "--model", "m.onnx", "--data", "colours.npz", "--results-dir", "res", *extra, cwd=project)
    found = sorted((record["runtime"], record["precision"]) for record in records(project / "res").values())
    assert found == [("onnxruntime", None), ("openvino", "bf16"), ("openvino", "f32")]
    report = ok("report", "--results-dir", "res", cwd=project).stdout
    assert "OV bf16 fp32" in report and "OV fp32" in report  # a bf16 row is never shown as plain FP32 (OV: OpenVINO, as the 80-column table says it)


@pytest.mark.parametrize("args, mentions", [
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--preset", "mixed"), "--nncf-preset"),
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--method", "nncf", "--dtype", "uint8"), "--dtype"),
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--method", "minmax", "--bias-correction", "full"),
     "--method nncf"),
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--bias-correction", "full", "--rounding", "learned"),
     "--rounding"),
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--output", "q.onnx"), ".xml"),
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--ignored-scope", "no_such_layer",
      "--output", "q.xml"), "is not a layer"),
    (("evaluate", "--model", "m.onnx", "--data", "colours.npz", "--precision", "bf16"), "--precision"),
    (("quantize", "--model", "m.onnx", "--data", "colours.npz", "--ignored-scope", "scores"), "--ignored-scope"),
])
def test_what_nncf_or_openvino_cannot_do_is_refused_in_one_line(project, args, mentions):
    one_line_error(invoke(*args, cwd=project), mentions)
    assert not list(project.glob("*.xml")) and not list(project.glob("q.*"))


def test_an_ir_is_one_of_the_models_evaluate_finds_and_runs_only_on_openvino(project):
    (project / "models").mkdir()
    ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--output", "models/m_ov.xml", cwd=project)
    result = ok("evaluate", "--data", "colours.npz", "--json", cwd=project)  # no --model: every model in models/
    assert json.loads(result.stdout)["model_path"] == "models/m_ov.xml"
    one_line_error(invoke("evaluate", "--model", "models/m_ov.xml", "--data", "colours.npz", "--runtime", "onnxruntime", cwd=project),
                   "is a model of openvino; onnxruntime runs .onnx files only")


def test_an_ir_without_its_weights_is_refused(project):
    ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", cwd=project)
    (project / "m_openvino_int8.bin").unlink()
    one_line_error(invoke("evaluate", "--model", "m_openvino_int8.xml", "--data", "colours.npz", cwd=project), "m_openvino_int8.bin")


@pytest.mark.real_assets
def test_ptq_evaluate_matches_a_plain_openvino_script(pipeline, tmp_path):
    import openvino as ov
    from conftest import CIFAR, cifar_split

    model = pipeline / "models" / "resnet8_openvino_int8.xml"  # the study's `ptq quantize --backend openvino`
    ok("evaluate", "--model", model, "--results-dir", tmp_path / "res", "--data", CIFAR, cwd=pipeline)
    (record,) = [r for r in records(tmp_path / "res").values() if r["model_path"].endswith(".xml")]
    test = cifar_split("test")
    compiled = ov.Core().compile_model(str(model), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    scores = np.concatenate([compiled(test.images[start : start + 500].astype(np.float32))[0] for start in range(0, 10000, 500)])
    assert record["correct"] == int((scores.argmax(axis=1) == test.labels).sum())
    assert abs(record["accuracy"] - 87.19) < 1.0


def two_layer_classifier(path: Path) -> Path:
    """A 1x1 convolution (identity) then channel means x an identity: two layers NNCF quantizes."""
    import onnx
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Conv", ["image", "kernel"], ["mixed"]),
             helper.make_node("ReduceMean", ["mixed"], ["means"], axes=[2, 3], keepdims=0),
             helper.make_node("MatMul", ["means", "weights"], ["scores"])]
    graph = helper.make_graph(nodes, "colours", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(np.eye(3, dtype=np.float32).reshape(3, 3, 1, 1), "kernel"),
                               numpy_helper.from_array(np.eye(3, dtype=np.float32), "weights")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def test_layer_names_are_stable_between_conversions_and_name_what_ignored_scope_takes(project):
    import onnx

    from ptq_cli.backends import openvino as backend

    model = onnx.load(str(two_layer_classifier(project / "two.onnx")))
    layers = backend.layers(model)
    assert len(layers) == 2 and backend.layers(model) == layers  # OpenVINO's own counters would differ the second time
    ok("quantize", "--model", "two.onnx", "--data", "colours.npz", "--backend", "openvino", "--ignored-scope", layers[0], cwd=project)
    refused = invoke("quantize", "--model", "two.onnx", "--data", "colours.npz", "--backend", "openvino",
                     "--ignored-scope", "conv9", "--output", "q.xml", cwd=project)
    one_line_error(refused, "is not a layer")
    assert all(layer in refused.stderr for layer in layers)  # the message lists the names it takes


def test_tune_openvino_searches_nncf_settings_then_float_layers_and_writes_the_chosen_ir(project):
    two_layer_classifier(project / "two.onnx")
    ok("calibrate", "--data", "colours.npz", "--samples-per-class", "3", "--output", "cal.npz", cwd=project)
    result = ok("tune", "--model", "two.onnx", "--backend", "openvino", "--data", "colours.npz", "--calibration", "cal.npz",
                "--validation-per-class", "2", "--max-drop", "100", "--json", cwd=project)
    tuned = json.loads(result.stdout)
    method = [c["settings"] for c in tuned["candidates"] if c["stage"] == "method"]
    assert sorted((s["nncf_preset"], s["bias_correction"]) for s in method) == sorted(
        (preset, correction) for preset in ("performance", "mixed") for correction in ("fast", "full", "none"))
    floats = [c["settings"]["float_nodes"] for c in tuned["candidates"] if c["stage"] == "float"]
    # Each layer alone, then the two together.
    assert sorted(map(len, floats)) == [1, 1, 2] and {f[0] for f in floats if len(f) == 1} == set(floats[-1])
    # Budget met by all: no float layer, then NNCF's performance preset, then the closest to FP32.
    chosen = tuned["chosen"]["settings"]
    assert tuned["met_budget"] and chosen["float_nodes"] == [] and chosen["nncf_preset"] == "performance"
    assert (project / "two_openvino_int8_tuned.xml").is_file() and (project / "two_openvino_int8_tuned.bin").is_file()
    evaluated = json.loads(ok("evaluate", "--model", "two_openvino_int8_tuned.xml", "--data", "colours.npz", "--json", cwd=project).stdout)
    assert evaluated["runtime"] == "openvino" and evaluated["quantization"]["validation"]["accuracy"] == tuned["chosen"]["validation_accuracy"]


def test_openvino_and_nncf_telemetry_is_declined_before_they_load():
    """Their usage events would leave the machine; offline, the sender hangs the process at exit."""
    from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker

    from ptq_cli.backends import openvino as openvino_backend

    openvino_backend._openvino()
    assert OptInChecker().check(enable_opt_in_dialog=False, disable_in_ci=False) == ConsentCheckResult.DECLINED


def test_each_new_batch_size_runs_on_its_own_static_compile_up_to_the_limit_with_the_same_scores(project, monkeypatch):
    import openvino as ov

    from ptq_cli.backends import openvino as backend
    from ptq_cli.backends.base import RunOptions
    from ptq_cli.inputs import PreprocessingFlags

    compiled_shapes = []
    compile_model = ov.Core.compile_model

    def recording(core, model, *args, **kwargs):
        compiled_shapes.append(str(model.inputs[0].get_partial_shape()))
        return compile_model(core, model, *args, **kwargs)

    monkeypatch.setattr(ov.Core, "compile_model", recording)
    loaded = backend.load(project / "m.onnx", RunOptions(1, PreprocessingFlags()))
    images = np.random.default_rng(0).standard_normal((9, 3, 8, 8)).astype(np.float32)
    one_by_one = np.concatenate([loaded.predict(image[None]) for image in images])
    sizes = list(range(2, 3 + backend.STATIC_SHAPES))  # one size more than are compiled statically
    for size in sizes + sizes:
        np.testing.assert_allclose(loaded.predict(images[:size]), one_by_one[:size], rtol=1e-5, atol=1e-6)
    static = [shape for shape in compiled_shapes if "?" not in shape]
    assert compiled_shapes[0] == "[?,3,8,8]"  # the fixed batch of 1 made dynamic, compiled at load
    assert static == [f"[{size},3,8,8]" for size in [1, *sizes[: backend.STATIC_SHAPES - 1]]]  # each once, the rest dynamic


def test_within_one_run_the_default_ir_is_made_for_openvino_not_taken_from_onnxruntime_s_model(project):
    """`ptq run` quantizes for onnxruntime int8 before OpenVINO; the IR's pairs are placed for OpenVINO, so it is not
    that QDQ model written again but made on its own, with the bytes of one made alone."""
    ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--output", "alone.xml", cwd=project)
    with reusing_made_files():
        ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--dtype", "int8", "--output", "q.onnx", cwd=project)
        again = json.loads(ok("quantize", "--model", "m.onnx", "--data", "colours.npz", "--backend", "openvino", "--output", "again.xml", "--json",
                              cwd=project).stdout)
    assert REUSED_NOTE not in again["notes"]
    assert (project / "again.bin").read_bytes() == (project / "alone.bin").read_bytes()
    numbered = re.compile(r'name="([A-Za-z]+)_\d+"')  # OpenVINO numbers unnamed nodes, counting up within a process
    assert numbered.sub(r'name="\1"', (project / "again.xml").read_text()) == numbered.sub(r'name="\1"', (project / "alone.xml").read_text())
