"""`ptq run`: the whole study in one command, stages skipped by hash, a manifest, reproducible models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from conftest import KERAS_MODEL, PIPELINE_MODELS, STUDY_EMULATION, benchmark_of, ptq_ok, read_json, record_of

from ptq_cli.model_file import file_sha256


def _hashes(directory: Path) -> dict[str, str]:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.rglob("*")) if path.is_file()}


def test_run_makes_every_model_record_and_the_report(pipeline_snapshot):
    for name in PIPELINE_MODELS:
        assert (pipeline_snapshot / "models" / name).is_file()
        assert record_of(pipeline_snapshot / "results", name)["images"] == 10_000
    assert (pipeline_snapshot / "calibration" / "cifar10_calib.npz").is_file()
    assert "resnet8_uint8_speed.onnx" in (pipeline_snapshot / "reports" / "QUANTIZATION_ANALYSIS.md").read_text()


def test_manifest_has_versions_seed_and_the_hash_of_every_input_and_output(pipeline_snapshot):
    manifest = read_json(pipeline_snapshot / "results" / "manifest.json")
    assert manifest["seed"] == 42
    assert manifest["libraries"]["onnxruntime"] and manifest["libraries"]["torch"].startswith("2.13.0")
    assert manifest["last_run"]["command"] == ["ptq", "run", "--no-benchmark", *STUDY_EMULATION]
    stages = {stage["name"]: stage for stage in manifest["stages"]}
    assert manifest["last_run"]["ran"] == list(stages)
    assert {"convert keras -> onnx", "calibrate", "report"} <= set(stages)
    assert {f"evaluate {name}" for name in PIPELINE_MODELS} <= set(stages)
    # The other x86 int8 path of each 8-bit model: scored on --emulated-images where it is emulated (a VNNI CPU).
    other_path = [stage for name, stage in stages.items() if name.endswith("int8 path")]
    count = int(STUDY_EMULATION[1])
    assert other_path and all(stage["options"]["emulated_images"] == count and f"--emulated-images {count}" in stage["command"] for stage in other_path)
    emulated = [record for record in map(read_json, (pipeline_snapshot / "results").glob("*~saturating@*.json")) if record["int8_basis"].startswith("emulated")]
    assert all(record["images"] == count for record in emulated)
    assert stages["convert keras -> onnx"]["inputs"][str(KERAS_MODEL)] == hashlib.sha256(KERAS_MODEL.read_bytes()).hexdigest()
    for stage in stages.values():
        assert stage["seconds"] >= 0 and stage["outputs"]
        for path, digest in stage["outputs"].items():
            assert hashlib.sha256((pipeline_snapshot / path).read_bytes()).hexdigest() == digest, (stage["name"], path)


def test_second_run_skips_every_stage_and_changes_no_file(pipeline_snapshot):
    before = _hashes(pipeline_snapshot)
    result = json.loads(ptq_ok("run", "--no-benchmark", *STUDY_EMULATION, "--json", cwd=pipeline_snapshot).stdout)
    assert [stage["ran"] for stage in result["stages"]] == [False] * len(result["stages"])
    assert result["manifest_written"] is False
    assert _hashes(pipeline_snapshot) == before
    text = ptq_ok("run", "--no-benchmark", *STUDY_EMULATION, cwd=pipeline_snapshot).stdout
    assert f"All {len(result['stages'])} stages up to date" in text and "nothing written" in text
    assert _hashes(pipeline_snapshot) == before


def test_a_missing_output_reruns_only_its_stage_and_those_after_it_that_read_it(pipeline_snapshot):
    # The FP32 model's record: one int8 path or another, every row's delta reads it, so the report changes.
    fp32_record = next((pipeline_snapshot / "results").glob("resnet8.onnx-??????@*.json"))
    fp32_record.unlink()
    before = _hashes(pipeline_snapshot)
    result = json.loads(ptq_ok("run", "--no-benchmark", *STUDY_EMULATION, "--json", cwd=pipeline_snapshot).stdout)
    ran = [stage["name"] for stage in result["stages"] if stage["ran"]]
    assert ran == ["evaluate resnet8.onnx", "report"]
    after = _hashes(pipeline_snapshot)
    changed = {path for path in after if before.get(path) != after[path]}
    assert changed == {f"results/{fp32_record.name}", "reports/QUANTIZATION_ANALYSIS.md", "results/manifest.json"}
    assert read_json(pipeline_snapshot / "results" / "manifest.json")["last_run"]["up_to_date"][0] == "convert keras -> onnx"


# One model of each backend's quantizer (the OpenVINO IR converts the int8 QDQ model: deleted together, it is made
# once), the FP32 models and the calibration set; the other 8-bit models repeat these quantizers' code with other
# options, at about 100 s each on a CPU without VNNI.
REMADE = ("resnet8.onnx", "resnet8.pt", "resnet8_int8.onnx", "resnet8_pytorch_int8.pt", "resnet8_openvino_int8.xml", "resnet8_int8_ranges.tflite")


def test_a_second_run_with_the_same_seed_remakes_byte_identical_models_and_measures_none_again(pipeline_snapshot):
    """The FP32 models, a model of each backend and the calibration set, deleted and made again by `ptq run` in a new
    process, have the same bytes; so their measurements (keyed by those bytes) are up to date and not made again, and
    neither are the other models, whose inputs have the same bytes. (The study's evaluations, on the microcontroller
    kernels above all, would double this test's time and prove nothing more about the models.)"""
    before = _hashes(pipeline_snapshot)
    made = [*(f"models/{name}" for name in REMADE), "models/resnet8_openvino_int8.bin", "calibration/cifar10_calib.npz"]
    for path in made:
        (pipeline_snapshot / path).unlink()
    # Runs of the program, each in its own process, as a user makes them.
    result = json.loads(ptq_ok("run", "--no-benchmark", *STUDY_EMULATION, "--json", cwd=pipeline_snapshot, fresh_process=True).stdout)
    ran = {stage["name"] for stage in result["stages"] if stage["ran"]}
    assert ran == {"convert keras -> onnx", "convert onnx -> pytorch", "calibrate", *(f"quantize {name}" for name in REMADE[2:])}
    after = _hashes(pipeline_snapshot)
    assert {path: after.get(path) for path in made} == {path: before[path] for path in made}
    assert {path for path in after if after[path] != before.get(path)} == {"results/manifest.json"}  # its last run


def test_benchmark_stage_measures_every_model_once_and_the_report_uses_it(pipeline_snapshot):
    result = json.loads(ptq_ok("run", "--runs", "2", *STUDY_EMULATION, "--json", cwd=pipeline_snapshot).stdout)
    assert [stage["name"] for stage in result["stages"] if stage["ran"]] == ["benchmark", "report"]
    records = {name: benchmark_of(pipeline_snapshot / "results", name) for name in PIPELINE_MODELS}
    for name, record in records.items():
        model = pipeline_snapshot / "models" / name
        assert record["model_sha256"] == file_sha256(model) and record["runs"] == 2, name  # an IR: its .xml and .bin
    report = json.loads(ptq_ok("report", "--json", cwd=pipeline_snapshot).stdout)
    # TFLite Micro rows are the microcontroller's accuracy; their speed on this x86 CPU is not a device's, and is not benchmarked.
    rows = {(row["model"], row["runtime"]): row for row in report["groups"][0]["rows"] if row["runtime"] != "tflm"}
    # The benchmark stage measures each file on its own runtime, and the ONNX FP32 model on OpenVINO too, in the same process.
    assert sorted(rows) == sorted([(name, record["runtime"]) for name, record in records.items()]
                                  + [("resnet8.onnx", "openvino"), ("pretrainedResnet_quant.tflite", "litert")])
    assert {row["speed_source"] for row in rows.values()} == {"benchmark"}
    ov_fp32 = benchmark_of(pipeline_snapshot / "results", "resnet8.onnx", "~openvino-f32")
    assert ov_fp32["runtime"] == "openvino" and ov_fp32["precision"] == "f32" and ov_fp32["runs"] == 2
    nncf = rows["resnet8_openvino_int8.xml", "openvino"]
    # Against the FP32 model on OpenVINO f32, and against onnxruntime's FP32 run, both from that one benchmark.
    assert nncf["speedup"] == round(nncf["images_per_second"] / ov_fp32["images_per_second"], 3)
    assert nncf["speedup_vs_onnxruntime"] == round(nncf["images_per_second"] / records["resnet8.onnx"]["images_per_second"], 3)
    (benchmark,) = [stage for stage in result["stages"] if stage["name"] == "benchmark"]
    assert len(benchmark["outputs"]) == len(PIPELINE_MODELS) + 2  # and the ONNX model on OpenVINO, the MLPerf reference
