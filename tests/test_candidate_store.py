"""Candidates are measured once (issue 38): tune's and sensitivity's scores, and sweep's points and top-1s, are
kept in the results folder by what they measured, so a search run again, or cut short and run again, measures
only what it has not measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic import calibrated_colours_project, invoke

from ptq_cli import settings
from ptq_cli.services.measure import evaluate as evaluate_service
from ptq_cli.services.study import candidates, sweep
from ptq_cli.services.study.candidates import TUNING_DIR

TUNE = ("tune", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--validation-per-class", "20",
        "--max-float-layers", "1", "--json")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return calibrated_colours_project(tmp_path)


@pytest.fixture
def scored(monkeypatch) -> list:
    """Every candidate scored from now on (its settings), scored as before."""
    calls: list = []
    real = candidates.score_candidate

    def counting(job, inputs):
        calls.append(job)
        return real(job, inputs)

    monkeypatch.setattr(candidates, "score_candidate", counting)
    return calls


def tune(project: Path, *extra: str) -> tuple[int, str, dict | None]:
    result = invoke(*TUNE, *extra, cwd=project)
    return result.exit_code, result.output, json.loads(result.stdout) if result.exit_code == 0 else None


def figures(result: dict) -> list:
    return [result["chosen"]["settings"], [(c["settings"], c["validation_accuracy"], c["output_sqnr_db"], c["size_bytes"]) for c in result["candidates"]]]


def test_a_search_run_again_scores_nothing_again_and_decides_the_same(project, scored):
    code, output, first = tune(project, "--output", "models/a.onnx")
    assert code == 0, output
    assert first and len(scored) > len(first["candidates"]) >= 4  # and the layers of the float stage's sensitivity
    stored = list((project / settings.RESULTS_DIR / TUNING_DIR / candidates.CANDIDATES_DIR).glob("*.npz"))
    assert len(stored) == len(scored)
    scored.clear()
    code, output, again = tune(project, "--output", "models/b.onnx")
    assert code == 0, output
    assert scored == []
    assert again and figures(again) == figures(first)
    assert (project / "models" / "b.onnx").read_bytes() == (project / "models" / "a.onnx").read_bytes()


def test_other_calibration_images_are_other_candidates(project, scored):
    assert tune(project, "--output", "models/a.onnx")[0] == 0
    measured = len(scored)
    assert invoke("calibrate", "--data", "colours.npz", "--samples-per-class", "10", "--seed", "7", "--output", "other.npz", cwd=project).exit_code == 0
    scored.clear()
    code, output, _ = tune(project, "--output", "models/b.onnx", "--calibration", "other.npz")
    assert code == 0, output
    assert len(scored) == measured


def test_a_damaged_score_is_measured_again(project, scored):
    assert tune(project, "--output", "models/a.onnx")[0] == 0
    stored = sorted((project / settings.RESULTS_DIR / TUNING_DIR / candidates.CANDIDATES_DIR).glob("*.npz"))
    stored[0].write_bytes(b"PK\x03\x04 not an archive")
    stored[1].write_bytes(b"")
    scored.clear()
    code, output, _ = tune(project, "--output", "models/b.onnx")
    assert code == 0, output
    assert len(scored) == 2
    assert (project / "models" / "b.onnx").read_bytes() == (project / "models" / "a.onnx").read_bytes()


def test_a_search_cut_short_scores_only_what_is_left_when_run_again(project, scored, monkeypatch):
    assert tune(project, "--output", "models/whole.onnx", "--results-dir", "whole")[0] == 0
    total = len(scored)
    counting = candidates.score_candidate

    def failing_third(job, inputs):
        if len(scored) == 2:
            raise MemoryError("the machine ran out")
        return counting(job, inputs)

    monkeypatch.setattr(candidates, "score_candidate", failing_third)
    scored.clear()
    code, _, _ = tune(project, "--output", "models/cut.onnx")
    assert code != 0 and not (project / "models" / "cut.onnx").exists()
    monkeypatch.setattr(candidates, "score_candidate", counting)
    scored.clear()
    code, output, resumed = tune(project, "--output", "models/cut.onnx")
    assert code == 0, output
    assert len(scored) == total - 2
    assert (project / "models" / "cut.onnx").read_bytes() == (project / "models" / "whole.onnx").read_bytes()


SENSITIVITY = ("sensitivity", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--validation-per-class", "20", "--json")


def test_sensitivity_run_again_scores_no_layer_again_and_ranks_the_same(project, scored):
    first = json.loads(invoke(*SENSITIVITY, cwd=project).stdout)
    assert len(scored) == len(first["layers"]) >= 1
    scored.clear()
    again = json.loads(invoke(*SENSITIVITY, cwd=project).stdout)
    assert scored == [] and again["layers"] == first["layers"]
    scored.clear()
    other = json.loads(invoke(*SENSITIVITY, "--validation-per-class", "15", cwd=project).stdout)
    assert len(scored) == len(other["layers"])  # other validation images: other scores


SWEEP = ("sweep", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--sparsity", "0,0.3,0.6", "--json")


@pytest.fixture
def made(monkeypatch) -> list:
    """The sparsities of the sweep points made from now on, and the models evaluated (their paths)."""
    calls: list = []
    make_point, evaluate_model = sweep.make_point, evaluate_service.evaluate_model

    def making(sparsity, inputs):
        calls.append(sparsity)
        return make_point(sparsity, inputs)

    def evaluating(path, *args, **kwargs):
        calls.append(Path(path).name)
        return evaluate_model(path, *args, **kwargs)

    monkeypatch.setattr(sweep, "make_point", making)
    monkeypatch.setattr(evaluate_service, "evaluate_model", evaluating)
    return calls


def test_a_sweep_run_again_makes_and_measures_only_what_is_not_in_place(project, made):
    result = invoke(*SWEEP, cwd=project)
    assert result.exit_code == 0, result.output
    first = json.loads(result.stdout)
    assert sorted(map(str, made)) == sorted(["0.0", "0.3", "0.6", "m.onnx", *(Path(point[key]).name for point in first["points"]
                                                                                  for key in ("fp32_model", "model") if point[key] != "models/m.onnx")])
    files = {path: path.read_bytes() for path in (project / "models").glob("*.onnx")}
    made.clear()
    assert json.loads(invoke(*SWEEP, cwd=project).stdout) == first and made == []
    pruned = Path(first["points"][1]["fp32_model"])
    (project / pruned).unlink()  # a point whose files are gone is made again (its models' top-1s are read)
    (project / first["points"][2]["model"]).write_bytes(b"not the model")  # and one whose file changed
    again = json.loads(invoke(*SWEEP, cwd=project).stdout)
    assert again == first and made == [0.3, 0.6]
    assert {path: path.read_bytes() for path in (project / "models").glob("*.onnx")} == files
