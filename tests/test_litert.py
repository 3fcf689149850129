"""LiteRT: .tflite models run with the LiteRT interpreter, their input and output quantization honoured.
The real-asset tests run MLCommons' own models; bad files fail in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import CIFAR
from synthetic import CLASSES, colour_images, invoke, one_line_error

from ptq_cli import settings
from ptq_cli.backends import litert, tflm

pytest.importorskip("ai_edge_litert", reason="the litert extra is not installed")
ASSETS = CIFAR.parent / "mlperf-tiny-resnet8"


@pytest.fixture
def colours(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    images, labels = colour_images(4, seed=2)
    np.savez(tmp_path / "colours.npz", test_images=images, test_labels=labels, class_names=np.array(CLASSES))
    return tmp_path


def test_a_tflite_file_is_told_by_its_flatbuffer_identifier_not_its_name():
    assert litert.sniff(b"\x1c\x00\x00\x00TFL3") and not litert.sniff(b"\x08\x01\x12\x00\x00\x00\x00\x00")


def test_a_broken_tflite_file_is_refused_in_one_line(colours):
    (colours / "broken.tflite").write_bytes(b"\x1c\x00\x00\x00TFL3" + b"\x00" * 40)
    one_line_error(invoke("evaluate", "--model", "broken.tflite", "--data", "colours.npz", cwd=colours), "broken.tflite")
    assert not (colours / "results").exists() or not list((colours / "results").glob("*.json"))


def test_label_names_exactly_one_model(colours):
    one_line_error(invoke("evaluate", "--model", "a.tflite", "--model", "b.tflite", "--data", "colours.npz", "--label", "x", cwd=colours),
                   "--label")


@pytest.mark.real_assets
@pytest.mark.parametrize("name, correct, dtype", [("pretrainedResnet_quant.tflite", 8697, "int8"), ("pretrainedResnet.tflite", 8719, "fp32")])
def test_mlperf_tiny_tflite_models_score_what_mlcommons_published(tmp_path, name, correct, dtype):
    """The int8 reference takes int8 input (scale 1, zero point -128): raw pixels are quantized as a device would."""
    result = invoke("evaluate", "--model", str(ASSETS / name), "--data", str(CIFAR), "--results-dir", "res", "--label", "ref", "--json",
                    cwd=tmp_path)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert (record["runtime"], record["dtype"], record["correct"], record["label"]) == ("litert", dtype, correct, "ref")
    if dtype == "int8":
        assert record["quantization"]["input"] == "int8 (scale 1, zero point -128)"


@pytest.mark.real_assets
def test_tflm_scores_the_mlperf_reference_as_a_plain_tflite_micro_script_does(tmp_path):
    """The first 500 test images, through `ptq evaluate --runtime tflm` (split across two worker processes) and
    through tflite-micro's interpreter alone: the same predictions, image by image."""
    pytest.importorskip("tflite_micro", reason="tflite-micro is not installed")
    from conftest import cifar_split
    from tflite_micro.python.tflite_micro import runtime

    test = cifar_split("test")
    images, labels = test.images[:500], test.labels[:500]
    np.savez(tmp_path / "first.npz", test_images=images, test_labels=labels, class_names=np.array(test.class_names))
    reference = ASSETS / "pretrainedResnet_quant.tflite"
    result = invoke("evaluate", "--model", str(reference), "--runtime", "tflm", "--data", "first.npz", "--threads", "2", "--results-dir", "res",
                    "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    interpreter = runtime.Interpreter.from_file(str(reference))
    plain = []
    for image in images:
        interpreter.set_input((image.astype(np.int16) - 128).astype(np.int8)[None], 0)  # scale 1, zero point -128
        interpreter.invoke()
        plain.append(int(np.argmax(interpreter.get_output(0))))
    assert record["runtime"] == "tflm" and record["correct"] == int(np.sum(np.array(plain) == labels))
    assert record["correct"] >= 400


C_MAIN = """
#include <stdint.h>
#include <stdio.h>
#include "{header}"
int main(int argc, char **argv) {{
    if ((uintptr_t){symbol} % 16 != 0) return 3;
    FILE *out = fopen(argv[1], "wb");
    if (!out || fwrite({symbol}, 1, {symbol}_len, out) != {symbol}_len) return 2;
    return fclose(out);
}}
"""


def _compile_and_dump(directory, source, header, symbol):
    import shutil
    import subprocess

    compiler = shutil.which("cc") or pytest.skip("no C compiler")
    (directory / "main.c").write_text(C_MAIN.format(header=header.name, symbol=symbol))
    subprocess.run([compiler, "-std=c11", "-Wall", "-Werror", "-I", str(header.parent), str(directory / "main.c"), str(source),
                    "-o", str(directory / "dump")], check=True)
    subprocess.run([str(directory / "dump"), str(directory / "dumped.bin")], check=True)
    return (directory / "dumped.bin").read_bytes()


def test_c_array_compiles_with_the_system_compiler_and_holds_the_exact_bytes(tmp_path):
    data = b"\x1c\x00\x00\x00TFL3" + bytes(range(256)) * 3 + b"\x07"  # every byte value, a length not a multiple of a row
    (tmp_path / "9-tiny model.tflite").write_bytes(data)
    result = invoke("export", "--model", "9-tiny model.tflite", "--c-array", "--no-arena", "--output-dir", "out", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    exported = json.loads(result.stdout)
    assert exported["symbol"] == "model_9_tiny_model_tflite" and exported["size_bytes"] == len(data)
    source, header = tmp_path / exported["source"], tmp_path / exported["header"]
    assert _compile_and_dump(tmp_path, source, header, exported["symbol"]) == data


def test_c_array_refuses_what_is_not_tflite(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07\x12\x04onnx")
    one_line_error(invoke("export", "--model", "m.onnx", "--c-array", cwd=tmp_path), "not a TFLite flatbuffer")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.real_assets
def test_c_array_of_the_mlperf_reference_round_trips(tmp_path):
    result = invoke("export", "--model", str(ASSETS / "pretrainedResnet_quant.tflite"), "--c-array", "--output-dir", str(tmp_path),
                    "--symbol", "g_model", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    exported = json.loads(result.stdout)
    dumped = _compile_and_dump(tmp_path, tmp_path / "pretrainedResnet_quant.c", tmp_path / "pretrainedResnet_quant.h", "g_model")
    assert dumped == (ASSETS / "pretrainedResnet_quant.tflite").read_bytes() and exported["size_bytes"] == 98_496
    if tflm.available():  # the arena TFLite Micro measured, as a define the firmware sizes its arena with
        assert f"#define G_MODEL_ARENA_BYTES {exported['arena_bytes']}" in (tmp_path / "pretrainedResnet_quant.h").read_text()
        assert 0 < exported["arena_bytes"] < 1 << 20


@pytest.mark.parametrize("args, mentions", [((), "--c-array"), (("--c-array", "--symbol", "1bad-name"), "--symbol")])
def test_export_refuses_a_missing_format_or_a_symbol_c_cannot_name(tmp_path, args, mentions):
    (tmp_path / "m.tflite").write_bytes(b"\x1c\x00\x00\x00TFL3" + b"\x00" * 8)
    one_line_error(invoke("export", "--model", "m.tflite", *args, cwd=tmp_path), mentions)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m.tflite"]


@pytest.mark.real_assets
def test_ptq_run_makes_an_int8_tflite_above_the_mlperf_reference_and_within_100kb(pipeline):
    """The converter's own calibration on ptq's 1,000 calibration images, per-channel weights, int8 I/O."""
    from conftest import record_of

    record = record_of(pipeline / "results", "resnet8_int8.tflite")
    reference = record_of(pipeline / "results", "pretrainedResnet_quant.tflite")
    assert record["runtime"] == "litert" and record["model_size_bytes"] <= 100_000
    assert record["quantization"]["input"].startswith("int8 (") and record["quantization"]["output"].startswith("int8 (")
    assert record["accuracy"] >= 87.10 and record["accuracy"] > reference["accuracy"] == 86.97


@pytest.mark.real_assets
def test_tflite_on_the_speed_models_ranges_agrees_with_it_more_than_on_the_converters_own(pipeline_snapshot):
    """The ranges model copies the speed model's activation grid. The default speed model also bounds its
    first layer's weights for CPUs without VNNI, which a TFLite model needs not: the same grid with the full
    8-bit weights is the speed model for VNNI CPUs (same calibration, so the same activation ranges), on the exact path.
    The two still differ at the pool: onnxruntime's averages the last maps in float, TFLite's int8 pool keeps its
    input's scale."""
    from conftest import cifar_split

    from ptq_cli.services.models import load_model
    from ptq_cli.x86 import cpu as cpu_info

    # The study's own calibration set, and the data named whole: PTQ_ASSETS may be relative to the repository.
    # Every model rounded to nearest, the ranges a percentile's (a grid the converter's MinMax does not give):
    # the grid is compared here, not the rounding or a search.
    common = ["--rounding", "nearest", "--data", CIFAR, "--calibration", "calibration/cifar10_calib.npz"]
    percentile = ["--method", "percentile", "--percentile", "99.99"]
    for arguments in (["--target", "speed", *percentile, "--output", "models/speed_calibrated.onnx"],
                      ["--target", "speed", "--cpus", "vnni", *percentile, "--output", "models/speed_vnni.onnx"],
                      ["--backend", "litert", "--ranges-from", "models/speed_calibrated.onnx", "--output", "models/ranges_nearest.tflite"],
                      ["--backend", "litert", "--method", "minmax", "--output", "models/minmax_nearest.tflite"]):
        result = invoke("quantize", *arguments, *common, cwd=pipeline_snapshot)
        assert result.exit_code == 0, result.output
    test = cifar_split("test")

    def top1(name, exact_int8=False):
        model = load_model(pipeline_snapshot / "models" / name, exact_int8=exact_int8)
        return np.concatenate([model.predict(model.prepare(test.images[start : start + 1000])).argmax(axis=1)
                               for start in range(0, len(test.labels), 1000)])

    speed = top1("speed_vnni.onnx", exact_int8=cpu_info.current().int8_path == cpu_info.SATURATING)
    agreement = {name: float(np.mean(top1(name) == speed)) for name in ("ranges_nearest.tflite", "minmax_nearest.tflite")}
    print(f"top-1 agreement with speed_vnni.onnx (exact path): {agreement}")
    # On the speed model's grid the two agree more than the converter's own calibration does.
    assert agreement["ranges_nearest.tflite"] >= max(0.98, agreement["minmax_nearest.tflite"] + 0.005)


@pytest.mark.real_assets
def test_report_sets_ptqs_tflite_models_against_the_reference(pipeline_snapshot):
    result = invoke("report", "--results-dir", "results", "--json", cwd=pipeline_snapshot)
    assert result.exit_code == 0, result.output
    group = json.loads(result.stdout)["groups"][0]
    assert group["reference"]["label"] == settings.MLPERF_REFERENCE_LABEL
    versus = {entry["model"]: entry for entry in group["versus_reference"]}
    assert set(versus) == {"resnet8_int8.tflite", "resnet8_int8_ranges.tflite", "resnet8_int8_w4.tflite"}
    assert versus["resnet8_int8.tflite"]["accuracy_delta"] == pytest.approx(versus["resnet8_int8.tflite"]["accuracy"] - group["reference"]["accuracy"])
    # With TFLite Micro installed, the comparison is the one a microcontroller makes: every model on its kernels.
    if tflm.available():
        assert group["reference"]["runtime"] == "tflm"
        runs = {(row["model"], row["runtime"]) for row in group["rows"]}
        assert {("resnet8_int8.tflite", "tflm"), ("resnet8_int8.tflite", "litert"), ("pretrainedResnet_quant.tflite", "tflm")} <= runs
