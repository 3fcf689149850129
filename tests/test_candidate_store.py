"""Tune's candidates are scored once (issue 38): their scores are kept in the results folder by what they
measured, so a search run again, or cut short and run again, scores only what it has not scored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic import colours_npz, colours_project, invoke

from ptq_cli import settings
from ptq_cli.services.study import candidates
from ptq_cli.services.study.tune import TUNING_DIR

TUNE = ("tune", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--validation-per-class", "20",
        "--max-float-layers", "1", "--json")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "study").mkdir()
    project = colours_project(tmp_path / "study")
    colours_npz(project / "colours.npz", per_class=40)
    assert invoke("calibrate", "--data", "colours.npz", "--samples-per-class", "10", "--output", "cal.npz", cwd=project).exit_code == 0
    return project


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
    assert first and len(scored) == len(first["candidates"]) >= 4
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
