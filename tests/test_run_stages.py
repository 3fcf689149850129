"""`ptq run`'s stages are ptq commands, written once: the manifest's command lines are what ran, and the
records each wrote are named by the command from what it measured. In-process, on tests/synthetic.py's project."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from synthetic import colours_project, invoke, ok, one_line_error

from ptq_cli import settings
from ptq_cli.services.measure import benchmark as benchmark_service
from ptq_cli.services.measure import evaluation_records
from ptq_cli.services.records import from_dict, record_files

STUDY = ("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-openvino", "--runs", "2")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "study").mkdir()
    return colours_project(tmp_path / "study")



def _measured(results: Path) -> dict[tuple, tuple]:
    """(model file, runtime, precision, int8 path) -> (model sha256, top-1, images) of each evaluation record."""
    records = [evaluation_records.read_record(path) for path in record_files(results)]
    return {(record.name, record.runtime, record.precision, record.int8_path): (record.model_sha256, record.accuracy, record.images) for record in records}


def test_replaying_the_manifest_command_by_command_makes_the_same_files(project, tmp_path):
    ok(*STUDY, cwd=project)
    manifest = json.loads((project / "results" / "manifest.json").read_text())
    replay = tmp_path / "replay"
    (replay / "models").mkdir(parents=True)
    for name in ("models/m.onnx", "colours.npz"):
        shutil.copy(project / name, replay / name)
    for stage in manifest["stages"]:
        program, command, *arguments = shlex.split(stage["command"])
        assert program == "ptq" and command in stage["name"].split()[0]
        ok(command, *arguments, cwd=replay)
        for path in stage["outputs"]:
            if Path(path).suffix in (".onnx", ".npz", ".md"):  # models, the calibration set and the report, by the names given
                assert (replay / path).is_file(), (stage["name"], path)
            if Path(path).suffix in (".onnx", ".npz"):  # byte for byte
                assert (replay / path).read_bytes() == (project / path).read_bytes(), path
    # The same measurements, with the same figures (not the times; record names hold the images' folder, which differs).
    ran, replayed = _measured(project / "results"), _measured(replay / "results")
    assert ran == replayed and len(ran) >= 4
    benchmarks = sorted(path.name.split("-")[0] for path in (project / "results" / "benchmarks").glob("*.json"))
    assert benchmarks and benchmarks == sorted(path.name.split("-")[0] for path in (replay / "results" / "benchmarks").glob("*.json"))


def test_each_record_is_named_from_what_it_measured_and_the_report_reads_every_one(project, monkeypatch):
    result = json.loads(ok(*STUDY, "--json", cwd=project).stdout)
    monkeypatch.chdir(project)  # names hold the model's and the images' folders, relative to where ptq ran
    results = Path("results")
    for path in record_files(results):
        assert path == evaluation_records.record_file(results, evaluation_records.read_record(path))
    for path in sorted((results / "benchmarks").glob("*.json")):
        record = from_dict(benchmark_service.BenchmarkRecord, json.loads(path.read_text()))
        assert path == evaluation_records.record_file(results / "benchmarks", record)
    stages = {stage["name"]: stage for stage in result["stages"]}
    written = {path for name, stage in stages.items() if name.startswith(("evaluate", "benchmark")) for path in stage["outputs"]}
    assert written == set(stages["report"]["inputs"]) and written
    # A record that goes missing is written again by the stage that wrote it; the report reads it again.
    missing = next(path for path in written if "m_int8.onnx" in path and "benchmarks" not in path)
    Path(missing).unlink()
    again = json.loads(ok(*STUDY, "--json", cwd=project).stdout)
    assert [stage["name"] for stage in again["stages"] if stage["ran"]] == [next(name for name, stage in stages.items() if missing in stage["outputs"]),
                                                                           "report"]
    assert Path(missing).is_file()


def test_force_runs_every_stage_again_and_makes_the_same_models(project):
    first = json.loads(ok(*STUDY, "--json", cwd=project).stdout)
    models = {path.name: path.read_bytes() for path in (project / "models").iterdir()}
    forced = json.loads(ok(*STUDY, "--force", "--json", cwd=project).stdout)
    assert [stage["name"] for stage in forced["stages"] if stage["ran"]] == [stage["name"] for stage in first["stages"]]
    assert {path.name: path.read_bytes() for path in (project / "models").iterdir()} == models
    again = json.loads(ok(*STUDY, "--json", cwd=project).stdout)
    assert not [stage["name"] for stage in again["stages"] if stage["ran"]]


def test_benchmark_times_a_file_on_a_second_runtime_in_the_same_turns(project):
    pytest.importorskip("openvino")
    ok("benchmark", "--model", "models/m.onnx", "--also", "models/m.onnx@openvino:f32", "--runs", "2", "--data", "colours.npz", cwd=project)
    names = sorted(path.name for path in (project / "results" / "benchmarks").glob("*.json"))
    assert len(names) == 2 and any("~openvino-f32" in name for name in names)
    one_line_error(invoke("benchmark", "--model", "models/m.onnx", "--also", "models/m.onnx", cwd=project), "--also: 'models/m.onnx' is not MODEL@RUNTIME")


def test_each_qdq_model_of_a_run_is_quantized_once_the_openvino_one_with_its_own_placement(project, monkeypatch):
    """Within one run each QDQ model is quantized once: onnxruntime's int8, uint8 and speed models, and OpenVINO's,
    whose pairs are placed for OpenVINO (not onnxruntime's int8 model converted)."""
    pytest.importorskip("openvino")
    from ptq_cli.quantize import qdq

    made: list[str] = []
    quantize = qdq.quantize_qdq

    def counted(call, placement):
        made.append(f"{call.settings.dtype}/{call.settings.target}/{type(placement).__name__}")
        return quantize(call, placement)

    monkeypatch.setattr(qdq, "quantize_qdq", counted)
    ok("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-benchmark", cwd=project)
    assert (project / "models" / "m_openvino_int8.xml").is_file() and (project / "models" / "m_openvino_int8.bin").is_file()
    assert sorted(made) == sorted(set(made)) and len(made) == 4, made  # int8, uint8, the speed model, and the IR's
    assert sum(entry.endswith("/OpenVinoCpu") for entry in made) == 1, made


def test_a_backend_that_cannot_take_the_model_is_left_out_and_the_study_goes_on(project, monkeypatch):
    """onnx2torch lacks an op of the user's model (as it does for a torch.onnx ViT export): the PyTorch stages are
    left out, said in one line, and every other model is made, measured and reported."""
    pytest.importorskip("torch")
    from ptq_cli.transforms.torch_compat import import_onnx2torch

    onnx2torch = import_onnx2torch()

    def lacks_an_op(model):
        raise KeyError("blocks/layers/1/Add_2")

    monkeypatch.setattr(onnx2torch, "convert", lacks_an_op)
    study = [argument for argument in STUDY if argument != "--no-pytorch"]
    result = invoke(*study, "--json", cwd=project)
    assert result.exit_code == 0, result.output
    ran = json.loads(result.stdout)
    assert list(ran["left_out"]) == ["pytorch"] and ran["left_out"]["pytorch"].startswith("models/m.onnx: onnx2torch cannot convert it (KeyError")
    failed = [stage for stage in ran["stages"] if stage["left_out"]]
    assert [stage["name"] for stage in failed] == ["convert onnx -> pytorch"] and not failed[0]["outputs"]
    assert not list((project / "models").glob("*.pt"))
    assert len(list((project / "models").glob("m_*.onnx"))) == 3 and len(_measured(project / "results")) >= 4
    manifest = json.loads((project / "results" / "manifest.json").read_text())
    assert not any("pytorch" in stage["name"] or ".pt" in stage["command"] for stage in manifest["stages"])
    assert manifest["last_run"]["left_out"] == ran["left_out"]
    table = invoke(*study, cwd=project, columns=200).stdout  # tried again (the user did not say --no-pytorch), left out again
    assert "Left out of the study: pytorch (models/m.onnx: onnx2torch cannot convert it" in table


def test_a_stage_task_that_may_fail_returns_its_error_and_one_that_may_not_raises_it(project, monkeypatch):
    from ptq_cli.cli import run_stage_command
    from ptq_cli.errors import PtqError
    from ptq_cli.services.study.stage_task import StageTask, run_stage_task

    monkeypatch.chdir(project)
    arguments = ("--model", "models/absent.onnx", "--data", "colours.npz")
    failed = run_stage_task(StageTask("evaluate", arguments, str(project), (), "results", may_fail=True), run_stage_command)
    assert failed.failed is not None and failed.failed.startswith("models/absent.onnx") and not failed.files
    with pytest.raises(PtqError, match="models/absent.onnx"):
        run_stage_task(StageTask("evaluate", arguments, str(project), (), "results"), run_stage_command)


def test_the_study_emulates_the_whole_split_at_native_speed_and_500_images_under_qemu(monkeypatch):
    """On a VNNI CPU a model's saturating-path stage scores evaluate's default (the whole test split) where its AVX2
    kernels run natively (CPUID masked), RUN_EMULATED_IMAGES under qemu
    (about 100x slower), and always the count the user names."""
    from ptq_cli.services.study import pipeline
    from ptq_cli.x86 import emulate
    from ptq_cli.x86 import plan as int8_plan

    options = pipeline.StudyOptions(keras_model=None, data_dir=Path("colours.npz"))
    monkeypatch.setattr(emulate, "masking_shim", lambda: Path("avx2-cpuid.so"))
    assert int8_plan.emulated_images(options.emulated_images) is None
    assert int8_plan.emulated_images(20) == 20
    monkeypatch.setattr(emulate, "masking_shim", lambda: None)
    assert int8_plan.emulated_images(options.emulated_images) == int8_plan.RUN_EMULATED_IMAGES
    assert int8_plan.emulated_images(20) == 20


def test_an_interrupted_run_goes_on_from_the_stage_it_stopped_at(project, monkeypatch):
    """The manifest is written after every stage that ran: stopped in its fourth stage (as SIGTERM stops it), the
    next `ptq run` runs only that stage and those after it."""
    from ptq_cli.services.study import pipeline

    real, calls = pipeline._run_stage, []

    def stopping(stage, *args):
        calls.append(stage.name)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(stage, *args)

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "_run_stage", stopping)
        stopped = invoke(*STUDY, cwd=project)
    assert stopped.exit_code == 130, stopped.output
    kept = json.loads((project / "results" / "manifest.json").read_text())
    assert [entry["name"] for entry in kept["stages"]] == calls[:3] and kept["last_run"]["unfinished"]
    ok(*STUDY, cwd=project)
    last_run = json.loads((project / "results" / "manifest.json").read_text())["last_run"]
    assert last_run["up_to_date"] == calls[:3] and last_run["ran"][0] == calls[3]
