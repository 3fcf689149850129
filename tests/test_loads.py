"""Each command loads each model it reads once (a session built and probed once), whatever checks it makes first."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest
from synthetic import colours_project, invoke

from ptq_cli import backends, settings
from ptq_cli.x86 import cpu as cpu_info


@pytest.fixture
def loads(monkeypatch, tmp_path) -> collections.Counter:
    """Every load of a file of the project (not ptq's own temporary files) through the backend table, counted by name."""
    counted: collections.Counter = collections.Counter()
    monkeypatch.setattr(backends, "TABLE", {**backends.TABLE})
    for name, row in list(backends.TABLE.items()):
        def load(path, options, original=row.runtime.load):
            if Path(path).resolve().is_relative_to(tmp_path.resolve()):
                counted[Path(path).name] += 1
            return original(path, options)
        backends.TABLE[name] = dataclasses.replace(row, runtime=dataclasses.replace(row.runtime, load=load))
    return counted


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return colours_project(tmp_path)


def test_quantize_evaluate_and_benchmark_load_each_model_once(loads, project):
    made = invoke("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--dtype", "int8", "--output", "models/q.onnx",
                  "--no-portability-cost", "--json", cwd=project)
    assert made.exit_code == 0, made.output
    assert loads == {"m.onnx": 1}, loads
    loads.clear()
    evaluated = invoke("evaluate", "--model", "models/m.onnx", "--model", "models/q.onnx", "--data", "colours.npz", "--json", cwd=project)
    assert evaluated.exit_code == 0, evaluated.output
    assert loads == {"m.onnx": 1, "q.onnx": 1}, loads
    loads.clear()
    both = invoke("evaluate", "--model", "models/q.onnx", "--data", "colours.npz", "--int8-path", "both", "--emulated-images", 10, "--json", cwd=project)
    assert both.exit_code == 0, both.output
    # A second session only where the exact path needs onnxruntime's switch (a CPU without VNNI).
    assert loads == {"q.onnx": 1 + (cpu_info.current().int8_path == cpu_info.SATURATING)}, loads
    assert {record["int8_path"] for record in json.loads(both.stdout)} == set(cpu_info.INT8_PATHS)
    loads.clear()
    (project / "results").rename(project / "earlier")  # no record of the FP32 source: it is evaluated too, from the session fidelity loaded
    alone = invoke("evaluate", "--model", "models/q.onnx", "--data", "colours.npz", cwd=project)
    assert alone.exit_code == 0, alone.output
    assert "Evaluated its FP32 source" in alone.output and loads == {"q.onnx": 1, "m.onnx": 1}, loads
    loads.clear()
    timed = invoke("benchmark", "--model", "models/m.onnx", "--model", "models/q.onnx", "--data", "colours.npz", "--runs", 2, "--json", cwd=project)
    assert timed.exit_code == 0, timed.output
    assert loads == {"m.onnx": 1, "q.onnx": 1}, loads
    assert len(json.loads(timed.stdout)) == 2
