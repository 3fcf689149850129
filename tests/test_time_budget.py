"""`ptq quantize --time-budget SECONDS` (quantize/budget.py): the optional steps that do not fit are left out and said,
learned rounding ends between layers, and a budget everything fits in makes the model made without one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from synthetic import invoke, one_line_error, quantized_json, two_conv_photos_project

from ptq_cli.model_file import QUANTIZATION_METADATA_KEY
from ptq_cli.quantize import budget, judges
from ptq_cli.quantize.settings import METHOD_CANDIDATES


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return two_conv_photos_project(tmp_path_factory.mktemp("time-budget"))


_quantize = quantized_json


def _codes(path: Path) -> dict[str, np.ndarray]:
    """Each weighted layer's 8-bit weight codes, by the layer's weight."""
    model = onnx.load(str(path))
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.data_type in (2, 3) and len(init.dims) > 1}


def _stored(path: Path) -> dict:
    return json.loads({prop.key: prop.value for prop in onnx.load(str(path)).metadata_props}[QUANTIZATION_METADATA_KEY])


def test_a_budget_spent_before_the_optional_steps_leaves_them_out_says_so_and_still_writes_a_model(project):
    made = _quantize(project, "spent.onnx", "--time-budget", "0.001")
    notes = "\n".join(made["notes"])
    others = [method if percentile is None else f"{method} {percentile:g}" for method, percentile in METHOD_CANDIDATES[1:]]
    assert f"method auto: {', '.join(others)} not judged (within the time budget of 0.001 s" in notes
    assert "learned rounding: not run (the time budget of 0.001 s was spent before it)" in notes
    assert "range search: not run (the time budget of 0.001 s was spent)" in notes
    assert made["settings"]["method"] == "minmax" and made["settings"]["rounding"] == "nearest"
    assert [method for method, _, _ in made["settings"]["method_sqnr_db"]] == ["minmax"]  # the one candidate judged
    assert _stored(project / "spent.onnx")["time_budget_s"] == 0.001  # the model says it was made within a budget
    evaluated = invoke("evaluate", "--model", "spent.onnx", "--data", "test", "--preprocess", "unit", "--results-dir", "res", cwd=project)
    assert evaluated.exit_code == 0, evaluated.output


def test_a_budget_everything_fits_in_makes_the_model_made_without_one(project):
    free = _quantize(project, "free.onnx")
    within = _quantize(project, "within.onnx", "--time-budget", "100000")
    assert not any("budget" in note for note in within["notes"]) and within["settings"] == free["settings"]
    assert len(free["settings"]["method_sqnr_db"]) == len(METHOD_CANDIDATES)
    graphs = [onnx.load(str(project / name)).graph.SerializeToString() for name in ("free.onnx", "within.onnx")]
    assert graphs[0] == graphs[1]  # only the stored budget differs
    assert "time_budget_s" not in _stored(project / "free.onnx")


def test_learned_rounding_ended_by_the_budget_leaves_the_later_layers_their_nearest_codes(project, monkeypatch):
    learned = ("--method", "minmax", "--rounding", "learned")
    _quantize(project, "all_learned.onnx", *learned)
    _quantize(project, "nearest.onnx", "--method", "minmax", "--rounding", "nearest")

    class OneLayer(budget.StepClock):
        """A clock whose budget ends after the first layer, whatever this machine's speed."""

        def another(self) -> bool:
            if self.steps >= 1:
                self.stopped = True
                return False
            self.steps += 1
            return True

    monkeypatch.setattr(judges, "StepClock", OneLayer)
    made = _quantize(project, "one_layer.onnx", *learned, "--time-budget", "100000")
    assert any("ended it after 1 layers; the layers after them keep their nearest codes" in note for note in made["notes"])
    partly, learned_codes, nearest_codes = (_codes(project / name) for name in ("one_layer.onnx", "all_learned.onnx", "nearest.onnx"))
    first, *later = list(partly)  # graph order: the first layer refined, the others left as rounded
    assert later and all(np.array_equal(partly[name], nearest_codes[name]) for name in later)
    assert any(not np.array_equal(learned_codes[name], nearest_codes[name]) for name in later)  # which the whole rounding moves
    assert np.array_equal(partly[first], learned_codes[first]) and not np.array_equal(learned_codes[first], nearest_codes[first])


@pytest.mark.parametrize("given", ["0", "-3", "nan", "inf"])
def test_a_budget_that_is_not_a_positive_number_of_seconds_is_one_line(project, given):
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--preprocess", "unit", "--output", "refused.onnx",
                    "--time-budget", given, cwd=project)
    one_line_error(result, "--time-budget: must be a number of seconds above 0")
    assert not (project / "refused.onnx").exists()


def test_a_backend_that_does_not_keep_to_a_budget_refuses_it_in_one_line(project):
    result = invoke("quantize", "--model", "m.onnx", "--data", "test", "--preprocess", "unit", "--backend", "litert", "--output", "refused.tflite",
                    "--time-budget", "60", cwd=project)
    one_line_error(result, "--time-budget: --backend litert does not keep to a time budget (onnxruntime and openvino do)")
    assert not (project / "refused.tflite").exists()
