"""Right on every CPU: the pair rule against a vpmaddubsw reference, `--cpus`, both int8 paths in evaluate
and the report, and the warning outside a model's target. In-process, synthetic models and data; every
assertion holds on a CPU with VNNI and on one without."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CIFAR, cifar_split
from synthetic import conv_classifier, image_folder, invoke, one_line_error

from ptq_cli import settings
from ptq_cli.errors import PtqError
from ptq_cli.guards import cache
from ptq_cli.quantize import overflow
from ptq_cli.quantize.judges import SATURATING_FIRST_LAYER
from ptq_cli.quantize.settings import METHOD_MARGIN_DB
from ptq_cli.services import models as model_service
from ptq_cli.services.make import portability
from ptq_cli.services.models import load_model
from ptq_cli.x86 import cpu as cpu_info
from ptq_cli.x86 import emulate

AVX2_ONLY = cpu_info.Cpu("Test AVX2 CPU", "x86_64", ("avx2",))
WITH_VNNI = cpu_info.Cpu("Test VNNI CPU", "x86_64", ("avx2", "avx512_vnni"))


def saturating_dot(activations: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Reference of x86's u8 x s8 dot product without VNNI: vpmaddubsw adds adjacent products into a
    saturating int16, vpmaddwd sums those exactly. activations (N, K) u8, codes (K,) s8."""
    products = activations.astype(np.int64) * codes.astype(np.int64)
    if products.shape[1] % 2:
        products = np.pad(products, ((0, 0), (0, 1)))
    pairs = np.clip(products[:, 0::2] + products[:, 1::2], -32768, 32767)
    return pairs.sum(axis=1)


def test_pair_rule_rows_never_saturate_and_full_range_rows_do():
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 1, (64, 72)).astype(np.float32)
    scales = overflow.pair_safe_scales(rows)
    codes = overflow.quantize_rows(rows, scales).astype(np.int64)
    assert overflow.is_pair_safe(codes)
    assert np.all(scales >= np.abs(rows).max(axis=1) / 127 - 1e-9)
    # Any pairing, any activations: worst cases (255 under positive codes, 0 under negative, and the
    # reverse) plus random ones give the exact dot product.
    for row in codes:
        order = rng.permutation(len(row))  # whichever inputs the kernel pairs
        shuffled = row[order]
        worst = np.stack([np.where(shuffled > 0, 255, 0), np.where(shuffled < 0, 255, 0), rng.integers(0, 256, len(row))])
        assert np.array_equal(saturating_dot(worst, shuffled), worst.astype(np.int64) @ shuffled)
    full_range = overflow.quantize_rows(rows, np.abs(rows).max(axis=1) / 127).astype(np.int64)
    assert not overflow.is_pair_safe(full_range)
    row = full_range[0]
    worst = np.where(row > 0, 255, 0)[None, :]
    assert not np.array_equal(saturating_dot(worst, row), worst.astype(np.int64) @ row)


def test_pair_rule_keeps_a_row_that_is_already_safe_at_full_precision():
    row = np.zeros((1, 16), np.float32)
    row[0, 0], row[0, 1], row[0, 2] = 1.0, -1.0, 0.001  # one large code per sign: safe at 127
    assert np.isclose(overflow.pair_safe_scales(row)[0], 1.0 / 127)


def test_cpuinfo_decides_the_int8_path():
    avx2 = cpu_info.parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n\n", "x86_64")
    vnni = cpu_info.parse_cpuinfo("model name : Xeon\nflags : avx2 avx512f avx512_vnni amx_int8\n", "x86_64")
    arm = cpu_info.parse_cpuinfo("Features : fp asimd\n", "aarch64")
    assert (avx2.int8_path, avx2.flags, avx2.model) == (cpu_info.SATURATING, ("avx2",), "AMD EPYC")
    assert (vnni.int8_path, vnni.flags) == (cpu_info.EXACT, ("avx2", "avx512_vnni", "amx_int8"))
    assert arm.int8_path == cpu_info.EXACT
    assert cpu_info.covers(cpu_info.ALL, avx2) and not cpu_info.covers(cpu_info.VNNI, avx2) and cpu_info.covers(cpu_info.VNNI, vnni)


@pytest.fixture
def study(tmp_path):
    conv_classifier(tmp_path / "conv.onnx")
    image_folder(tmp_path / "imgs", per_class=12)
    return tmp_path


def _quantize(study, output: str, *options: str) -> onnx.ModelProto:
    result = invoke("quantize", "--model", "conv.onnx", "--data", "imgs", "--target", "speed", "--no-space-to-depth", "--output", output, *options,
                    cwd=study)
    assert result.exit_code == 0, result.output
    return onnx.load(str(study / output))


def _settings(model: onnx.ModelProto) -> dict:
    return json.loads({prop.key: prop.value for prop in model.metadata_props}["ptq.quantization"])


def test_quantize_is_for_all_cpus_by_default_and_stores_its_target(study):
    default = _quantize(study, "all.onnx")
    judged = dict(_settings(default)["overflow_fix_db"])  # no clamped activations: all-layers judged against first-layer on held-out images
    # first-layer on both x86 paths where this machine runs the saturating one at native speed (its Gemm can saturate)
    both = cpu_info.current().int8_path == cpu_info.SATURATING or emulate.runs_natively()
    assert list(judged) == [overflow.ALL_LAYERS, overflow.FIRST_LAYER, *([SATURATING_FIRST_LAYER] if both else [])]
    assert None not in judged.values()
    worse_first = min(db for fix, db in judged.items() if fix != overflow.ALL_LAYERS)
    kept = overflow.FIRST_LAYER if worse_first >= judged[overflow.ALL_LAYERS] + METHOD_MARGIN_DB else overflow.ALL_LAYERS
    assert (_settings(default)["cpus"], _settings(default)["overflow_fix"]) == ("all", kept)
    first = _quantize(study, "first.onnx", "--overflow-fix", "first-layer")
    assert "overflow_fix_db" not in _settings(first) or _settings(first)["overflow_fix_db"] == []  # named: not judged
    proven, why = overflow.saturation_proof(first)
    assert not proven and why.startswith("Gemm")  # the conv (first layer) follows the pair rule; the Gemm keeps 8 bits
    vnni = _quantize(study, "vnni.onnx", "--cpus", "vnni")
    assert (_settings(vnni)["cpus"], _settings(vnni)["overflow_fix"]) == ("vnni", "none")
    proven, why = overflow.saturation_proof(vnni)
    assert not proven and "overflow" in why
    every = _quantize(study, "every.onnx", "--overflow-fix", "all-layers")
    assert overflow.saturation_proof(every)[0]
    one_line_error(invoke("quantize", "--model", "conv.onnx", "--data", "imgs", "--cpus", "vnni", "--overflow-fix", "all-layers", cwd=study),
                   "--cpus vnni")


@pytest.mark.parametrize("reached", [True, False, "failed"])
def test_first_layer_is_judged_by_its_worse_x86_path(study, monkeypatch, reached):
    """On a VNNI CPU the judge asks the service's way to the saturating path (services/models.py native_scores): here one that
    answers scores far from FP32's, so first-layer loses there whatever it measures on the exact path; where the
    path is not reached at native speed, or its run failed, the judge says it measured the exact path only, and why."""
    asked = []

    def saturating_scores(path, batch, _threads):
        asked.append(load_model(path).predict(batch).shape)  # the model handed over computes the judged scores
        if reached == "failed":
            raise PtqError(f"{path}: emulation (masked) failed (killed)")
        return np.full((len(batch), 3), 100.0, np.float32) if reached else None

    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    monkeypatch.setattr(model_service, "native_scores", saturating_scores)
    result = invoke("quantize", "--model", "conv.onnx", "--data", "imgs", "--target", "speed", "--no-space-to-depth", "--output", "m.onnx",
                    "--json", cwd=study)
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)
    judged = dict(made["settings"]["overflow_fix_db"])
    assert asked and asked[0][1:] == (3,)
    if reached is True:
        assert judged[SATURATING_FIRST_LAYER] < 0 < judged[overflow.FIRST_LAYER]
        assert made["settings"]["overflow_fix"] == overflow.ALL_LAYERS
    else:
        assert list(judged) == [overflow.ALL_LAYERS, overflow.FIRST_LAYER]
        why = "could not be run: " if reached == "failed" else "does not run the saturating path natively"
        assert any("judged on the exact int8 path only" in note and why in note for note in made["notes"])


def test_resnet8_speed_model_for_vnni_saturates_and_the_default_one_does_not(pipeline_snapshot):
    """Real weights: the saturating path as this CPU reaches it (natively, or emulated on a VNNI CPU) against
    the exact one, on 100 test images (under qemu each costs about 35 ms more, and the suite is to cost the same on every CPU)."""
    if cpu_info.current().int8_path == cpu_info.EXACT and not emulate.reachable():
        pytest.fail("a VNNI CPU that can neither mask CPUID nor run qemu-user: `make install` installs it (apt-get install qemu-user)")
    # The study's own calibration set, and the data named whole: PTQ_ASSETS may be relative to the repository.
    result = invoke("quantize", "--target", "speed", "--cpus", "vnni", "--data", CIFAR, "--calibration", "calibration/cifar10_calib.npz",
                    "--output", "models/speed_vnni.onnx", cwd=pipeline_snapshot)
    assert result.exit_code == 0, result.output
    images = cifar_split("test").images[:100]

    def agreement(name: str) -> float:
        path = pipeline_snapshot / "models" / name
        batch = load_model(path).prepare(images)
        if cpu_info.current().int8_path == cpu_info.SATURATING:
            exact, saturating = load_model(path, exact_int8=True).predict(batch), load_model(path).predict(batch)
        else:
            exact, saturating = load_model(path).predict(batch), model_service.scores_under_emulation(path, batch)
        return float(np.mean(exact.argmax(axis=1) == saturating.argmax(axis=1)))

    assert agreement("resnet8_uint8_speed.onnx") >= 0.99  # default: first-layer pair rule
    assert agreement("speed_vnni.onnx") < 0.9  # full 8-bit range: a third of the predictions change


def test_evaluate_both_paths_writes_a_record_each_and_the_report_shows_them(study):
    _quantize(study, "every.onnx", "--overflow-fix", "all-layers")
    result = invoke("evaluate", "--model", "every.onnx", "--data", "imgs", "--int8-path", "both", "--json", cwd=study)
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert sorted(record["int8_path"] for record in records) == ["exact", "saturating"]
    assert [record["int8_basis"] for record in records].count("native") == 1
    other = next(record for record in records if record["int8_basis"] != "native")
    # The path this CPU does not take: onnxruntime's exact kernels, or the proof (all layers pair-safe).
    assert other["int8_basis"].startswith("onnxruntime session.x64quantprecision" if other["int8_path"] == "exact" else "proof")
    assert all(record["cpu"]["int8_path"] == cpu_info.current().int8_path for record in records)
    assert {path.name.split("@")[0].split("-", 1)[1][6:] for path in (study / "results").glob("every.onnx-*")} == {"", "~" + other["int8_path"]}
    report = json.loads(invoke("report", "--json", cwd=study).stdout)
    row = next(row for group in report["groups"] for row in group["rows"] if row["model"] == "every.onnx")
    assert row["int8_path"] == "exact" and row["saturating_accuracy"] is not None and row["cpus"] == "all"
    table = invoke("report", cwd=study, columns=80).stdout
    assert "noVNNI" in table and "Measured on:" in table


def test_saturating_path_on_a_vnni_cpu_is_proven_or_emulated(study, monkeypatch):
    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    _quantize(study, "every.onnx", "--overflow-fix", "all-layers")
    _quantize(study, "vnni.onnx", "--cpus", "vnni")
    proven = invoke("evaluate", "--model", "every.onnx", "--data", "imgs", "--int8-path", "saturating", "--json", cwd=study)
    assert proven.exit_code == 0, proven.output
    assert json.loads(proven.stdout)["int8_basis"].startswith("proof")
    emulated = invoke("evaluate", "--model", "vnni.onnx", "--data", "imgs", "--int8-path", "saturating", "--emulated-images", "12", "--json", cwd=study)
    if not emulate.reachable():
        one_line_error(emulated, "qemu-user")
        return
    assert emulated.exit_code == 0, emulated.output
    record = json.loads(emulated.stdout)
    assert record["int8_basis"].startswith("emulated") and record["images"] == 12 and record["exact_accuracy_same_images"] is not None
    # The report reads the subset's figure against the exact path on the same images.
    table = invoke("report", cwd=study).stdout
    assert f"* vnni.onnx: {record['accuracy']:.2f}% on the saturating path against {record['exact_accuracy_same_images']:.2f}% on the exact path, on the same 12 images" in table


def test_a_model_outside_its_target_warns_in_evaluate_and_benchmark(study, monkeypatch):
    _quantize(study, "vnni.onnx", "--cpus", "vnni")
    _quantize(study, "all.onnx")
    monkeypatch.setattr(cpu_info, "current", lambda: AVX2_ONLY)
    for command in (("evaluate",), ("benchmark", "--runs", "2")):
        outside = invoke(*command, "--model", "vnni.onnx", "--data", "imgs", cwd=study)
        assert outside.exit_code == 0, outside.output
        warnings = [line for line in outside.stderr.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "Test AVX2 CPU" in warnings[0], outside.stderr
        inside = invoke(*command, "--model", "all.onnx", "--data", "imgs", cwd=study)
        assert "warning:" not in inside.stderr
    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    assert "warning:" not in invoke("evaluate", "--model", "vnni.onnx", "--data", "imgs", cwd=study).stderr


def test_pytorch_pair_safe_observer_and_first_layer_walk():
    import torch

    from ptq_cli.backends import pytorch as torch_backend
    from ptq_cli.quantize import torch_ao

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 8, 3)
            self.body = torch.nn.Conv2d(8, 8, 3)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.body(torch.relu(self.stem(x.permute(0, 3, 1, 2)))).mean(dim=(2, 3)))

    module = torch.fx.symbolic_trace(Net())
    assert torch_backend.first_layer_modules(module) == ["stem"]
    weight = torch.randn(8, 3, 3, 3)
    for per_channel in (True, False):
        observer = torch_ao._pair_safe_observer(per_channel)()
        observer(weight)
        scales, zero_points = observer.calculate_qparams()
        rows = weight.reshape(8, -1).numpy()
        codes = overflow.quantize_rows(rows, np.broadcast_to(scales.numpy(), (8,)).astype(np.float32))
        assert overflow.is_pair_safe(codes) and not zero_points.any()


def test_ptq_cpuinfo_names_another_cpuinfo_file(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text("model name : Rehearsal Xeon\nflags : avx2 amx_int8\n")
    monkeypatch.setenv(cpu_info.CPUINFO_ENV, str(tmp_path / "cpuinfo"))
    cpu_info.current.cache_clear()
    try:
        found = cpu_info.current()
        assert (found.model, found.flags) == ("Rehearsal Xeon", ("avx2", "amx_int8"))
        assert found.int8_path == cpu_info.EXACT  # AMX (and any ARM CPU) takes the exact path
    finally:
        monkeypatch.delenv(cpu_info.CPUINFO_ENV)
        cpu_info.current.cache_clear()


def _grouped_qdq_classifier(path: Path, in_per_group: int, channels: int = 64, unsigned_weights: bool = False, output_scale: float = 10.0) -> Path:
    """A QDQ model whose int8 Conv has `in_per_group` input channels per group (1: depthwise), every int8
    weight at +127 (no pair rule), after a float 1x1 Conv that spreads an RGB image of ones over `channels`
    activations of code 255: the worst case for pairs."""
    from onnx import helper, numpy_helper

    groups = channels // in_per_group
    weights = np.full((channels, in_per_group, 3, 3), 255 if unsigned_weights else 127, np.uint8 if unsigned_weights else np.int8)
    constants = {"spread": np.full((channels, 3, 1, 1), 1 / 3, np.float32), "x_scale": np.float32(1 / 255), "x_zero": np.uint8(0), "w": weights, "w_scale": np.float32(1.0),
                 "w_zero": np.uint8(0) if unsigned_weights else np.int8(0),
                 "y_scale": np.float32(output_scale), "y_zero": np.uint8(0)}
    nodes = [helper.make_node("Conv", ["image", "spread"], ["spread_out"]),
             helper.make_node("QuantizeLinear", ["spread_out", "x_scale", "x_zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["x"]),
             helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wf"]),
             helper.make_node("Conv", ["x", "wf"], ["y"], group=groups, pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("QuantizeLinear", ["y", "y_scale", "y_zero"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "y_scale", "y_zero"], ["yd"]),
             helper.make_node("GlobalAveragePool", ["yd"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["scores"])]
    graph = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", channels])],
                              [numpy_helper.from_array(np.asarray(value), name) for name, value in constants.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


@pytest.mark.parametrize("in_per_group", [1, 2])
def test_depthwise_convolutions_cannot_saturate_and_need_no_pair_rule(tmp_path, in_per_group):
    """onnxruntime's depthwise kernel gives the exact sums with full-range weights, so the proof and the
    all-layers fix exempt depthwise convolutions; two input channels per group already saturate."""
    if cpu_info.current().int8_path == cpu_info.EXACT and not emulate.reachable():
        pytest.fail("a VNNI CPU that can neither mask CPUID nor run qemu-user: `make install` installs it (apt-get install qemu-user)")
    path = _grouped_qdq_classifier(tmp_path / "grouped.onnx", in_per_group)
    batch = np.ones((1, 3, 8, 8), np.float32)
    if cpu_info.current().int8_path == cpu_info.SATURATING:
        exact, saturating = load_model(path, exact_int8=True).predict(batch), load_model(path).predict(batch)
    else:
        exact, saturating = load_model(path).predict(batch), model_service.scores_under_emulation(path, batch)
    proven, _ = overflow.saturation_proof(onnx.load(str(path)))
    assert proven == (in_per_group == 1)
    assert np.array_equal(exact, saturating) == (in_per_group == 1)


def test_uint8_weights_under_uint8_activations_cannot_saturate_and_are_proven(tmp_path):
    """u8 x u8: every weight at code 255 under activations of code 255, the worst case for int16 pairs, gives the
    exact sums on both paths (onnxruntime's kernel widens first), so the proof takes uint8 weights under uint8 activations."""
    if cpu_info.current().int8_path == cpu_info.EXACT and not emulate.reachable():
        pytest.fail("a VNNI CPU that can neither mask CPUID nor run qemu-user: `make install` installs it (apt-get install qemu-user)")
    batch = np.ones((1, 3, 8, 8), np.float32)

    def both_paths(path: Path) -> tuple[np.ndarray, np.ndarray]:
        if cpu_info.current().int8_path == cpu_info.SATURATING:
            return load_model(path, exact_int8=True).predict(batch), load_model(path).predict(batch)
        return load_model(path).predict(batch), model_service.scores_under_emulation(path, batch)

    # An output scale wide enough for the exact sums (64 x 9 x 255): a saturated sum would land on another code.
    unsigned = _grouped_qdq_classifier(tmp_path / "u8u8.onnx", 64, unsigned_weights=True, output_scale=1000.0)
    exact, saturating = both_paths(unsigned)
    assert np.array_equal(exact, saturating)
    assert overflow.saturation_proof(onnx.load(str(unsigned)))[0]
    signed = _grouped_qdq_classifier(tmp_path / "s8.onnx", 64, output_scale=1000.0)  # the same worst case with int8 weights
    exact, saturating = both_paths(signed)
    assert not np.array_equal(exact, saturating)  # saturates: the measurement sees saturation where there is some
    assert not overflow.saturation_proof(onnx.load(str(signed)))[0]



def test_masked_cpuid_runs_the_avx2_kernels_qemu_emulates_byte_for_byte(tmp_path, monkeypatch):
    """The two ways to the saturating path on a VNNI CPU, the AVX2 kernels run natively with CPUID masked and the same
    kernels under qemu as a Haswell, give the same bytes on a model that saturates; and neither gives the exact sums."""
    if emulate.masking_shim() is None or emulate.qemu() is None:
        pytest.skip("this machine cannot mask CPUID (no CPUID faulting or no C compiler) or has no qemu-user: nothing to compare")
    batch = np.ones((2, 3, 8, 8), np.float32)
    signed = _grouped_qdq_classifier(tmp_path / "s8.onnx", 64, output_scale=1000.0)  # int8 weights at their worst case: saturates
    masked = model_service.scores_under_emulation(signed, batch)
    monkeypatch.setattr(emulate, "masking_shim", lambda: None)
    assert emulate.describe().startswith("qemu")
    emulated = model_service.scores_under_emulation(signed, batch)
    assert masked.tobytes() == emulated.tobytes()
    exact = load_model(signed, exact_int8=cpu_info.current().int8_path == cpu_info.SATURATING).predict(batch)
    assert not np.array_equal(masked, exact)


def test_benchmark_times_the_kernels_of_cpus_without_vnni_in_records_of_their_own(study, monkeypatch):
    """`--int8-path saturating` on a VNNI CPU: every model, the FP32 one too, timed in a child on the AVX2 kernels
    (natively, never under qemu), its records apart from the native ones, the speed-up against the FP32 model timed
    there; on a CPU without VNNI, its own kernels; where no native route exists, one line."""
    _quantize(study, "all.onnx")
    models = ("--model", "conv.onnx", "--model", "all.onnx", "--runs", "2", "--batch-size", "4")
    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    timed = invoke("benchmark", *models, "--int8-path", "saturating", "--json", cwd=study)
    if not emulate.runs_natively():
        one_line_error(timed, "conv.onnx")
        return
    assert timed.exit_code == 0, timed.output
    records = json.loads(timed.stdout)
    assert [(record["int8_path"], record["int8_basis"]) for record in records] == [("saturating", emulate.describe())] * 2
    assert records[1]["speedup_vs_fp32"] is not None
    native = json.loads(invoke("benchmark", *models, "--json", cwd=study).stdout)
    assert [record["int8_path"] for record in native] == [None, None]
    files = sorted(path.name for path in (study / "results" / "benchmarks").iterdir())
    assert len(files) == 4 and sum("~saturating" in name for name in files) == 2
    for model in ("conv.onnx", "all.onnx"):  # the report's rows: evaluations, each joined with its speed on either kernels
        assert invoke("evaluate", "--model", model, "--data", "imgs", cwd=study).exit_code == 0
    rows = [row for group in json.loads(invoke("report", "--json", cwd=study).stdout)["groups"] for row in group["rows"]]
    row = next(row for row in rows if row["model"] == "all.onnx")
    assert row["saturating_speedup"] == pytest.approx(records[1]["images_per_second"] / records[0]["images_per_second"], abs=1e-3)
    assert row["speedup"] == pytest.approx(native[1]["images_per_second"] / native[0]["images_per_second"], abs=1e-3)
    lines = invoke("report", cwd=study).stdout.splitlines()
    assert any(line.startswith(f"* all.onnx: {row['saturating_speedup']:.2f}x") and "without VNNI" in line for line in lines)
    assert invoke("report", "--markdown", "report.md", cwd=study).exit_code == 0
    assert f"## Speed on x86 CPUs without VNNI\n\n- all.onnx: {row['saturating_speedup']:.2f}x" in (study / "report.md").read_text()
    monkeypatch.setattr(emulate, "masking_shim", lambda: None)
    one_line_error(invoke("benchmark", *models, "--int8-path", "saturating", cwd=study), "conv.onnx")
    monkeypatch.setattr(cpu_info, "current", lambda: AVX2_ONLY)  # the CPU's own kernels saturate: timed here
    own = json.loads(invoke("benchmark", *models, "--int8-path", "saturating", "--json", cwd=study).stdout)
    assert [record["int8_path"] for record in own] == [None, None]



def test_by_default_cpuid_masked_scores_whole_splits_and_qemu_a_thousand_images(study, monkeypatch):
    monkeypatch.setattr(emulate, "masking_shim", lambda: None)
    assert emulate.default_subset(4 * 3 * 32 * 32) == emulate.DEFAULT_SUBSET
    monkeypatch.setattr(emulate, "masking_shim", lambda: Path("avx2-cpuid.so"))
    assert emulate.default_subset(4 * 3 * 32 * 32) >= 10_000  # CIFAR-10's whole test set
    assert emulate.default_subset(4 * 3 * 1024 * 1024) == emulate.DEFAULT_SUBSET  # 12 MB an image: a thousand, not 42
    monkeypatch.undo()
    if not emulate.runs_natively():
        return
    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    _quantize(study, "vnni.onnx", "--cpus", "vnni")
    result = invoke("evaluate", "--model", "vnni.onnx", "--data", "imgs", "--int8-path", "saturating", "--json", cwd=study)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert f"on all {record['images']} images" in record["int8_basis"] and record["exact_accuracy_same_images"] is not None


def test_code_ptq_did_not_write_is_made_again_before_a_child_loads_it(tmp_path, monkeypatch):
    """The shim runs in every emulated child: a file at its name that ptq did not write (edited, or put there) is
    replaced by a fresh one, as a TorchScript file ptq did not write is refused. (In a cache of its own: the shared one's
    shim is loaded by the emulated children of tests running beside it.)"""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    path = emulate.masking_shim()
    if path is None:
        pytest.skip("this machine cannot mask CPUID (no CPUID faulting or no C compiler)")
    path.write_bytes(b"\x7fELF not ptq's")
    assert emulate.masking_shim() == path
    assert path.read_bytes() != b"\x7fELF not ptq's" and cache.was_written(hashlib.sha256(path.read_bytes()).hexdigest())


def test_a_child_whose_cpuid_is_not_masked_refuses_to_score(tmp_path, monkeypatch):
    """Started to run the AVX2 kernels with CPUID masked, a child that finds it is not (the shim not loaded, its handler
    replaced) says so and scores nothing: its figures would be this CPU's own path's."""
    monkeypatch.setenv(emulate.MASKED_ENV, "1")
    assert not emulate.masked_here()
    with pytest.raises(SystemExit, match="CPUID is not masked"):
        model_service._child(str(tmp_path / "m.onnx"), str(tmp_path / "in.npy"), str(tmp_path / "out.npy"), "1")
    assert not (tmp_path / "out.npy").exists()

def test_the_all_layers_fix_leaves_depthwise_weights_at_full_precision(tmp_path):
    from synthetic import depthwise_classifier

    model = onnx.load(str(depthwise_classifier(tmp_path / "dw.onnx", size=32, classes=10)))
    assert set(overflow.weight_overrides(model, overflow.ALL_LAYERS, per_channel=True)) == {"stem_w", "pw_w", "gemm_w"}
    assert set(overflow.weight_overrides(model, overflow.FIRST_LAYER, per_channel=True)) == {"stem_w"}


def _sqnr_on(model_path: Path, reference: np.ndarray, images: np.ndarray) -> float:
    from ptq_cli.metrics import sqnr_db

    return round(sqnr_db(reference, load_model(model_path).predict(images)), 2)


def test_quantize_says_what_portability_costs_against_the_model_for_vnni_cpus_alone(tmp_path, monkeypatch):
    """On a CPU with VNNI, a model made for all CPUs (the pair rule bounds its int8 stem) is measured against the
    one `--cpus vnni` makes, both against FP32 on the calibration images: the figures are those two files'. (The CPU
    is the test's: on a CPU without VNNI both models run on its kernels alike, and the figures still are theirs.)"""
    conv_classifier(tmp_path / "m.onnx")
    image_folder(tmp_path / "data", per_class=8)
    assert invoke("calibrate", "--data", "data", "--output", "cal.npz", cwd=tmp_path).exit_code == 0
    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    common = ("--model", "m.onnx", "--data", "data", "--calibration", "cal.npz", "--stem", "int8", "--rounding", "nearest", "--portability-cost", "--json")
    made = invoke("quantize", *common, "--output", "all.onnx", cwd=tmp_path)
    assert made.exit_code == 0, made.output
    cost = json.loads(made.stdout)["portability"]
    alone = invoke("quantize", *common, "--cpus", "vnni", "--output", "vnni.onnx", cwd=tmp_path)
    assert alone.exit_code == 0 and json.loads(alone.stdout)["portability"] is None  # nothing to compare: no fix
    fp32 = load_model(tmp_path / "m.onnx")
    images = fp32.prepare(np.load(tmp_path / "cal.npz")["images"])
    reference = fp32.predict(images)
    assert cost["images"] == len(images)
    assert cost["portable_sqnr_db"] == _sqnr_on(tmp_path / "all.onnx", reference, images)
    assert cost["vnni_sqnr_db"] == _sqnr_on(tmp_path / "vnni.onnx", reference, images) != cost["portable_sqnr_db"]
    assert "--cpus vnni" in invoke("quantize", *common[:-1], "--output", "again.onnx", cwd=tmp_path).stdout
    # The measurement is a record of the portable file: the report's recommendation names it once that file is evaluated.
    assert invoke("evaluate", "--model", "all.onnx", "--data", "data", cwd=tmp_path).exit_code == 0
    report = json.loads(invoke("report", "--json", cwd=tmp_path).stdout)
    assert [saved["portable_sqnr_db"] for saved in report["groups"][0]["portability"]] == [cost["portable_sqnr_db"]]
    assert "Right on every x86 CPU: all.onnx" in " ".join(invoke("report", cwd=tmp_path).stdout.split())
    skipped = invoke("quantize", *common, "--no-portability-cost", "--output", "quick.onnx", cwd=tmp_path)
    assert json.loads(skipped.stdout)["portability"] is None
    monkeypatch.setattr(cpu_info, "current", lambda: AVX2_ONLY)
    here = json.loads(invoke("quantize", *common, "--output", "avx2.onnx", cwd=tmp_path).stdout)["portability"]
    assert "has no VNNI" in here["not_measured"] and here["portable_sqnr_db"] is None
    # On by default; PTQ_PORTABILITY_COST=0 (the test suite's setting) turns the default off.
    by_default = [argument for argument in common if argument != "--portability-cost"]
    assert json.loads(invoke("quantize", *by_default, "--output", "default.onnx", cwd=tmp_path).stdout)["portability"] is None
    monkeypatch.delenv("PTQ_PORTABILITY_COST")
    assert json.loads(invoke("quantize", *by_default, "--output", "default.onnx", cwd=tmp_path).stdout)["portability"]["not_measured"]
    # By default, measured only where the model was quick to make (it takes a second quantization); asked, always.
    monkeypatch.setattr(cpu_info, "current", lambda: WITH_VNNI)
    quick = json.loads(invoke("quantize", *by_default, "--output", "quick_default.onnx", cwd=tmp_path).stdout)["portability"]
    assert quick["portable_sqnr_db"] == cost["portable_sqnr_db"] and not quick["not_measured"]
    monkeypatch.setattr(portability, "QUICK_SECONDS", 0.0)
    slow = json.loads(invoke("quantize", *by_default, "--output", "slow.onnx", cwd=tmp_path).stdout)["portability"]
    assert "--portability-cost measures it" in slow["not_measured"] and slow["portable_sqnr_db"] is None
    asked = json.loads(invoke("quantize", *common, "--output", "asked.onnx", cwd=tmp_path).stdout)["portability"]
    assert asked["portable_sqnr_db"] == cost["portable_sqnr_db"] and not asked["not_measured"]


def _two_layers_sharing_one_int8_weight() -> onnx.ModelProto:
    """x -> QDQ -> MatMul(DQ(w)) twice, one weight, scale and zero point for both: as torch's exporter shares equal
    weights. The codes span the full int8 range, so onnxruntime's exact kernels convert them to uint8."""
    from onnx import TensorProto, helper, numpy_helper

    codes = np.random.default_rng(0).integers(-127, 128, (12, 5)).astype(np.int8)
    initializers = [numpy_helper.from_array(codes, "w"), numpy_helper.from_array(np.array(0.01, np.float32), "w_scale"),
                    numpy_helper.from_array(np.array(0, np.int8), "w_zero"), numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
                    numpy_helper.from_array(np.array(128, np.uint8), "x_zero")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]), helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wd"]), helper.make_node("MatMul", ["xd", "wd"], ["a"]),
             helper.make_node("Relu", ["xd"], ["r"]), helper.make_node("MatMul", ["r", "wd"], ["b"]), helper.make_node("Add", ["a", "b"], ["scores"])]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 5])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_exact_path_loads_layers_that_share_one_int8_weight(tmp_path):
    from ptq_cli.model_file import ort_session
    from ptq_cli.transforms.qdq_edits import private_weight_dequantizers

    model = _two_layers_sharing_one_int8_weight()
    private = private_weight_dequantizers(model)
    dequantizers = [node for node in private.graph.node if node.op_type == "DequantizeLinear" and node.input[0] != "xq"]
    consumers = [name for node in private.graph.node for name in node.input]
    # Each layer its own weight, scale and zero point; the model given is left as it was.
    assert len(dequantizers) == 2 and all(consumers.count(name) == 1 for node in dequantizers for name in (*node.input, node.output[0]))
    assert [node.op_type for node in model.graph.node].count("DequantizeLinear") == 2 and len(model.graph.initializer) == 5
    x = np.random.default_rng(1).uniform(-6, 6, (64, 12)).astype(np.float32)
    default = ort_session(tmp_path / "m.onnx", model.SerializeToString())
    same = ort_session(tmp_path / "m.onnx", private.SerializeToString())
    assert np.array_equal(default.run(None, {"x": x})[0], same.run(None, {"x": x})[0])
    # The exact kernels (onnxruntime 1.32 refuses the shared weight there) compute the dequantized arithmetic.
    exact = ort_session(tmp_path / "m.onnx", model.SerializeToString(), exact_int8=True).run(None, {"x": x})[0]
    xd = (np.clip(np.round(x / 0.05) + 128, 0, 255) - 128) * np.float32(0.05)
    weights = onnx.numpy_helper.to_array(model.graph.initializer[0]).astype(np.float32) * np.float32(0.01)
    np.testing.assert_allclose(exact, xd @ weights + np.maximum(xd, 0) @ weights, rtol=1e-4, atol=1e-3)
    assert private_weight_dequantizers(private) is private
    # A graph whose copies would grow past the bound is left as it is (a crafted one could feed one weight to thousands of nodes).
    assert private_weight_dequantizers(model, max_added_bytes=0) is model


def _residual_classifier(path: Path) -> Path:
    """NCHW 3 x 8 x 8 -> Conv 3->8 -> Relu, read by two layers (Conv 8->8 -> Relu -> Conv 8->8, and a 1x1 Conv 8->8
    shortcut) -> Add -> Relu -> mean -> Gemm -> 3 scores: ResNet's block, where one activation has two readers."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(5)
    shapes = {"w1": (8, 3, 3, 3), "w2": (8, 8, 3, 3), "w3": (8, 8, 3, 3), "ws": (8, 8, 1, 1), "wg": (8, 3)}
    nodes = [helper.make_node("Conv", ["image", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1]), helper.make_node("Conv", ["r1", "ws"], ["cs"]),
             helper.make_node("Add", ["c3", "cs"], ["sum"]), helper.make_node("Relu", ["sum"], ["r3"]),
             helper.make_node("GlobalAveragePool", ["r3"], ["pooled"]), helper.make_node("Flatten", ["pooled"], ["flat"]),
             helper.make_node("Gemm", ["flat", "wg"], ["scores"])]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("image", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name) for name, shape in shapes.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def _kernels(path: Path, optimized: Path) -> dict[str, int]:
    """The op types of the graph onnxruntime's CPU session runs for `path` (its QDQ fusions applied)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(node.op_type for node in onnx.load(str(optimized)).graph.node)


def test_int8_activations_read_by_two_layers_run_on_integer_kernels_in_onnxruntime(tmp_path, monkeypatch):
    """onnxruntime on x86 runs an int8 layer on integer kernels only where its input's QuantizeLinear has one reader:
    the quantized model gives each reader its own pair (the same arithmetic), so that its readers leave float."""
    import onnxruntime as ort

    from ptq_cli.quantize import placement

    _residual_classifier(tmp_path / "r.onnx")
    image_folder(tmp_path / "data", per_class=8)
    assert invoke("calibrate", "--data", "data", "--output", "cal.npz", cwd=tmp_path).exit_code == 0
    common = ("quantize", "--model", "r.onnx", "--calibration", "cal.npz", "--dtype", "int8", "--stem", "int8", "--rounding", "nearest", "--json")
    made = invoke(*common, "--output", "private.onnx", cwd=tmp_path)
    assert made.exit_code == 0, made.output
    assert any("pair(s) added" in note for note in json.loads(made.stdout)["notes"])
    monkeypatch.setattr(placement, "private_activation_quantizers", lambda model: 0)
    assert invoke(*common, "--output", "shared.onnx", cwd=tmp_path).exit_code == 0
    private, shared = _kernels(tmp_path / "private.onnx", tmp_path / "p.onnx"), _kernels(tmp_path / "shared.onnx", tmp_path / "s.onnx")
    # Both readers of the shared activation move to integer kernels; the layer writing it stays in float either way
    # (onnxruntime fuses a layer only into one QuantizeLinear; a shared int8 one it never shifts to uint8).
    assert (private["QLinearConv"], private["Conv"]) == (3, 1) and (shared["QLinearConv"], shared["Conv"]) == (1, 3), (private, shared)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graphs as written: their arithmetic
    images = np.random.default_rng(0).uniform(0, 1, (16, 3, 8, 8)).astype(np.float32)
    scores = [ort.InferenceSession(str(tmp_path / name), options, providers=["CPUExecutionProvider"]).run(None, {"image": images})[0]
              for name in ("private.onnx", "shared.onnx")]
    assert np.array_equal(*scores)


def test_a_mask_probe_that_did_not_finish_is_asked_again_not_taken_as_the_machine_s_answer(tmp_path, monkeypatch):
    """A judge's view of the saturating path hangs on the probe: one that timed out on a loaded machine must not leave
    the process without the AVX2 kernels for good (the judge would quietly judge on the exact path alone)."""
    import subprocess

    answers = iter([subprocess.TimeoutExpired("python", emulate.PROBE_SECONDS), subprocess.CompletedProcess([], -9), subprocess.CompletedProcess([], 0),
                    subprocess.CompletedProcess([], emulate.NOT_MASKED)])

    def probe(*_args, **_kwargs):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(emulate.subprocess, "run", probe)
    monkeypatch.setattr(emulate, "_MASKS", {})
    shim = tmp_path / "shim.so"
    assert emulate._masks(shim) is False  # timed out: no answer
    assert emulate._masks(shim) is False  # killed: no answer either
    assert emulate._masks(shim) is True  # asked again: the machine's answer...
    assert emulate._masks(shim) is True  # ...kept for the process
