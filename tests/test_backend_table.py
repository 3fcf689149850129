"""The backend table is the one place a backend is named: a backend defined here, in a test module, and
registered in the table goes through quantize, evaluate, benchmark and report with services/ untouched."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from synthetic import channel_mean_classifier, colours_project, invoke, one_line_error

from ptq_cli import backends, settings
from ptq_cli.backends.base import QUANTIZATION_METADATA_KEY, Backend, Quantizer, RunOptions, Runtime, finish_load
from ptq_cli.errors import PtqError
from ptq_cli.model_file import read_bytes
from ptq_cli.quantize.settings import BackendOptions, QuantizeCall, QuantizedFile, option
from ptq_cli.services import quant_settings
from ptq_cli.services.make import calibration as calibration_service
from ptq_cli.services.make import quantize as quantize_service
from ptq_cli.services.measure import evaluation_records

MAGIC = b"TOYQ"


def _toy_file(model: onnx.ModelProto, stored: dict[str, str]) -> bytes:
    """MAGIC, the JSON metadata's length (4 bytes), the metadata, then the ONNX graph."""
    header = json.dumps(stored).encode()
    return MAGIC + len(header).to_bytes(4, "little") + header + model.SerializeToString()


@dataclass(frozen=True)
class ToyOptions(BackendOptions):
    """The toy quantizer's two options of its own: all a new backend declares for them to reach make_settings,
    the command line's --help and its checks, and the model's stored settings."""

    panel: ClassVar[str] = "Toy (--backend toy)"
    word: ClassVar[str] = "a toy option"

    grid_bits: int | None = option(None, minimum=2, cli=int, help="Bits of the toy's weight grid. (default: 8)")
    rounding_mode: str | None = option(None, "--rounding-mode", choices=("nearest", "down"), help="How the toy rounds onto its grid.")

    def settle(self, common):
        if self.rounding_mode == "down" and common.per_channel:
            raise PtqError("--rounding-mode down: the toy rounds down per tensor only")
        return ToyOptions(self.grid_bits or 8, self.rounding_mode or "nearest"), common

    def describe(self) -> str:
        return f"{self.grid_bits}-bit grid, rounded {self.rounding_mode}"


def _quantize(call: QuantizeCall) -> QuantizedFile:
    """Weights on a symmetric grid of the options' bits, one scale per tensor (simulated: the graph stays float)."""
    model, output, settings, stored = call.model, call.output, call.settings, call.stored
    options = settings.options
    assert isinstance(options, ToyOptions) and options.grid_bits is not None
    quantized = onnx.ModelProto.FromString(model.SerializeToString())
    for initializer in quantized.graph.initializer:
        weights = numpy_helper.to_array(initializer).astype(np.float32)
        scale = float(np.abs(weights).max()) / (2 ** (options.grid_bits - 1) - 1) or 1.0
        codes = np.floor(weights / scale) if options.rounding_mode == "down" else np.round(weights / scale)
        initializer.CopyFrom(numpy_helper.from_array((codes * scale).astype(np.float32), initializer.name))
    made = {**json.loads(stored.get(QUANTIZATION_METADATA_KEY, "{}")), **settings.as_dict()}
    data = _toy_file(quantized, {**stored, QUANTIZATION_METADATA_KEY: json.dumps(made)})
    output.write_bytes(data)
    return QuantizedFile(len(data))


def _load(path: Path, options: RunOptions):
    import hashlib

    import onnxruntime as ort

    from ptq_cli.model_file import describe_input

    data = read_bytes(path)
    length = int.from_bytes(data[4:8], "little")
    stored = json.loads(data[8 : 8 + length])
    model = onnx.load_from_string(data[8 + length :])
    described, classes = describe_input(path, model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def predict(batch: np.ndarray) -> np.ndarray:
        return session.run(None, {described.name: batch})[0]

    return finish_load(path, TOY, options, described=described, predict=predict, dtype="int8", size_bytes=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), stored=stored, declared_classes=classes)


TOY = Backend(name="toy", suffixes=(".toy",), sniff=lambda head: head.startswith(MAGIC), format="TOY",
              quantizer=Quantizer(_quantize, methods=("minmax",), per_channel=False, options=ToyOptions),
              runtime=Runtime(_load, settings="onnxruntime session, simulated int8 weights"))


@pytest.fixture
def toy_table(monkeypatch):
    """The table with the toy backend as one more row, for this test only (the command line built from it too)."""
    import typer.testing

    monkeypatch.setattr(backends, "TABLE", {**backends.TABLE})
    backends.register(TOY)
    typer.testing._get_command.cache_clear()  # synthetic.py caches the click command; it is built from the table
    yield TOY
    typer.testing._get_command.cache_clear()


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """models/m.onnx and colours.npz, with a private decoded-data cache."""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return colours_project(tmp_path)


def _quantized_toy(project: Path) -> Path:
    from ptq_cli.datasets import open_dataset

    dataset = open_dataset(project / "colours.npz")
    calibration = calibration_service.build_calibration_set(dataset, 2, 0, None)
    made = quant_settings.make_settings(backend="toy")
    output = quantize_service.default_output(project / "models" / "m.onnx", made)
    result = quantize_service.quantize(project / "models" / "m.onnx", output, made, calibration)
    assert output.name == "m_toy_int8.toy" and result.output_size_bytes == output.stat().st_size
    return output


def test_a_backend_registered_in_a_test_goes_through_quantize_evaluate_benchmark_and_report(toy_table, project):
    toy = _quantized_toy(project)
    assert backends.for_file(toy) is TOY  # told by its content
    evaluated = invoke("evaluate", "--data", "colours.npz", "--json", cwd=project)  # models/ scanned with the table's suffixes
    assert evaluated.exit_code == 0, evaluated.output
    records = {Path(record["model_path"]).name: record for record in json.loads(evaluated.stdout)}
    assert set(records) == {"m.onnx", "m_toy_int8.toy"}
    assert records["m_toy_int8.toy"]["runtime"] == "toy" and records["m_toy_int8.toy"]["accuracy"] == 100.0
    assert records["m_toy_int8.toy"]["source_sha256"] == records["m.onnx"]["model_sha256"]
    benchmarked = invoke("benchmark", "--model", "models/m.onnx", "--model", toy, "--data", "colours.npz", "--runs", 2,
                         "--json", cwd=project)
    assert benchmarked.exit_code == 0, benchmarked.output
    runs = {record["runtime"]: record for record in json.loads(benchmarked.stdout)}
    assert runs["toy"]["runtime_settings"] == TOY.runtime.settings and runs["toy"]["speedup_vs_fp32"] is None  # no FP32 on its runtime
    reported = invoke("report", "--json", cwd=project)
    assert reported.exit_code == 0, reported.output
    rows = {row["model"]: row for row in json.loads(reported.stdout)["groups"][0]["rows"]}
    assert rows["m_toy_int8.toy"]["runtime"] == "toy" and rows["m_toy_int8.toy"]["reference"] == "m.onnx"
    assert rows["m_toy_int8.toy"]["delta"] == 0.0 and rows["m_toy_int8.toy"]["configuration"].startswith("TOY a:int8 w:int8")


def test_the_table_decides_options_outputs_and_runtimes(toy_table, project):
    with pytest.raises(PtqError, match="--io: a LiteRT option; applies to --backend litert"):
        quant_settings.make_settings(backend="toy", io="float")
    with pytest.raises(PtqError, match="'entropy' is not a toy calibration method"):
        quant_settings.make_settings(backend="toy", method="entropy")
    toy = _quantized_toy(project)
    one_line_error(invoke("evaluate", "--model", toy, "--data", "colours.npz", "--runtime", "openvino", cwd=project),
                   "is a model of toy; openvino runs .xml, .onnx files only")
    assert evaluation_records.runtime_tag(project / "models" / "m.onnx", "openvino", None) == "~openvino-f32"
    assert evaluation_records.runtime_tag(toy, "toy", None) == ""


def test_a_file_is_told_by_its_content_and_a_pt_file_by_its_name(tmp_path):
    onnx_file = channel_mean_classifier(tmp_path / "m.onnx")
    renamed = tmp_path / "m.tflite"
    renamed.write_bytes(onnx_file.read_bytes())
    assert backends.for_file(renamed).name == "onnxruntime"  # an ONNX graph named .tflite is still ONNX
    broken = tmp_path / "m.pt"
    broken.write_bytes(b"not a zip")
    assert backends.loads_code(broken) and backends.for_file(broken).name == "pytorch"  # so its error says TorchScript
    # What --runtime offers: ONNX files on onnxruntime or OpenVINO, TFLite files on LiteRT or TFLite Micro.
    assert backends.runtimes() == ("onnxruntime", "openvino", "litert", "tflm")


def test_a_backends_own_options_reach_the_command_line_its_checks_and_the_stored_settings(toy_table, project):
    shown = invoke("quantize", "--help-all", cwd=project)
    assert shown.exit_code == 0, shown.output
    panel = shown.output[shown.output.index("Toy (--backend toy)"):]
    assert "--grid-bits" in panel and "--rounding-mode" in panel and "nearest|down" in panel and "toy:" in shown.output  # --backend offers it
    made = invoke("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--backend", "toy", "--grid-bits", 3, "--rounding-mode", "down",
                  "--output", "m3.toy", "--json", cwd=project)
    assert made.exit_code == 0, made.output
    stored = json.loads(made.stdout)["settings"]
    assert (stored["grid_bits"], stored["rounding_mode"], stored["backend"]) == (3, "down", "toy")
    data = (project / "m3.toy").read_bytes()
    graph = onnx.load_from_string(data[8 + int.from_bytes(data[4:8], "little"):])
    weights = [numpy_helper.to_array(initializer) for initializer in graph.graph.initializer if initializer.dims]
    assert all(len(np.unique(np.round(w / (np.abs(w).max() / 3), 3))) <= 8 for w in weights if np.abs(w).max() > 0)  # on a 3-bit grid
    assert json.loads(data[8 : 8 + int.from_bytes(data[4:8], "little")])[QUANTIZATION_METADATA_KEY].count('"grid_bits": 3') == 1
    one_line_error(invoke("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--grid-bits", 4, cwd=project),
                   "--grid-bits: a toy option; applies to --backend toy")
    one_line_error(invoke("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--backend", "toy", "--grid-bits", 1, cwd=project),
                   "--grid-bits")
    one_line_error(invoke("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--backend", "toy", "--rounding-mode", "down",
                          "--per-channel", cwd=project), "--rounding-mode down: the toy rounds down per tensor only")
    assert quant_settings.make_settings(backend="toy").options == ToyOptions(8, "nearest")  # a Python caller gets the same defaults and checks
    with pytest.raises(PtqError, match="--rounding-mode: 'up' is not one of nearest, down"):
        quant_settings.make_settings(backend="toy", rounding_mode="up")
