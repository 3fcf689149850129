"""One direct test for each module the command tests reach only through the CLI: what each promises, on
its own, in process (the process itself only where ending it is the point)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from synthetic import CLASSES, colours_npz, conv_classifier, image_folder

from ptq_cli import settings
from ptq_cli.datasets.base import convert_channels, resize
from ptq_cli.datasets.folder import ImageFolder
from ptq_cli.datasets.npz import NpzDataset
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded, cache, hardstop, library_noise, trust
from ptq_cli.services import quant_settings, records
from ptq_cli.services.make import calibration as calibration_service
from ptq_cli.services.make.export import c_symbol, export_c_array
from ptq_cli.services.progress import Steps
from ptq_cli.services.study import sensitivity, sweep, validation


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def colours(tmp_path) -> Path:
    return colours_npz(tmp_path / "colours.npz", per_class=8)


def test_a_limit_is_read_from_its_variable_and_refuses_in_its_own_words(tmp_path, monkeypatch):
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 100)
    monkeypatch.setenv(bounded.MODEL_BYTES.env, "99")
    with pytest.raises(PtqError, match=r"over the limit of 99 bytes for one model file \(raise it with PTQ_MAX_MODEL_BYTES\)"):
        bounded.read_bytes(big, bounded.MODEL_BYTES, "model file")
    monkeypatch.setenv(bounded.MODEL_BYTES.env, "100")
    assert bounded.read_bytes(big, bounded.MODEL_BYTES, "model file") == b"x" * 100
    monkeypatch.setenv(bounded.MODEL_BYTES.env, "lots")
    with pytest.raises(PtqError, match="PTQ_MAX_MODEL_BYTES: 'lots' is not a whole number"):
        bounded.MODEL_BYTES.value()


def test_npz_members_are_read_without_pickles(tmp_path):
    np.savez(tmp_path / "ok.npz", images=np.zeros((2, 4, 4, 3), np.uint8))
    assert bounded.npz_arrays(tmp_path / "ok.npz")["images"].shape == (2, 4, 4, 3)
    np.savez(tmp_path / "objects.npz", labels=np.array([{"a": 1}], dtype=object))
    with pytest.raises(PtqError):
        bounded.npz_arrays(tmp_path / "objects.npz")


def test_the_cache_is_private_and_its_seals_tell_an_edit(private_cache):
    root = cache.directory()
    assert root == private_cache and stat.S_IMODE(root.stat().st_mode) == 0o700
    seal = cache.seal("entry", b"bytes")
    assert cache.sealed(seal, "entry", b"bytes") and not cache.sealed(seal, "entry", b"bytez")
    os.chmod(root, 0o777)
    with pytest.raises(PtqError, match="writable by everyone"):
        cache.directory()


def test_ptq_trusts_the_torchscript_it_wrote_and_nothing_else(private_cache):
    trust.remember(b"written by ptq")
    assert trust.written_by_ptq(b"written by ptq") and not trust.written_by_ptq(b"found on the internet")
    trust.require(Path("own.pt"), b"written by ptq", "TorchScript")
    with pytest.raises(PtqError, match="--trust-remote-code"):
        trust.require(Path("other.pt"), b"found on the internet", "TorchScript")
    with trust.scope():
        trust.trust_remote_code(True)
        trust.require(Path("other.pt"), b"found on the internet", "TorchScript")


def test_a_deadline_ends_the_process_with_its_message():
    code = "import time\nfrom ptq_cli.guards import hardstop\nwith hardstop.deadline(0.5, 'one call did not return'):\n    time.sleep(30)\n"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "one call did not return" in done.stderr and time.monotonic() - began < 20
    with hardstop.deadline(30, "never"):  # a block that finishes in time: nothing happens
        pass


def test_native_output_on_stderr_is_hidden_inside_the_block_only(capfd):
    with library_noise.native_stderr_silenced():
        os.write(2, b"absl: noise\n")
    os.write(2, b"ptq: message\n")
    assert capfd.readouterr().err == "ptq: message\n"


def test_images_are_resized_and_given_the_model_s_channels():
    images = np.random.default_rng(0).integers(0, 255, (2, 8, 8, 3), dtype=np.uint8)
    assert resize(images, (4, 6)).shape == (2, 4, 6, 3)
    grey = convert_channels(images, 1, "m.onnx")
    assert grey.shape == (2, 8, 8, 1) and grey.dtype == np.uint8
    assert np.array_equal(convert_channels(grey, 3, "m.onnx")[..., 0], grey[..., 0])


def test_an_npz_and_an_image_folder_give_the_same_labelled_images(tmp_path, colours, private_cache):
    npz = NpzDataset(colours)
    assert set(npz.splits()) == {"train", "test"} and npz.evaluation_split() == "test"
    test = npz.load("test")
    assert test.images.shape == (24, 8, 8, 3) and tuple(test.class_names) == CLASSES  # 8 per class
    folder = ImageFolder(image_folder(tmp_path / "folder", per_class=4))
    from_folder = folder.load("test")
    assert tuple(from_folder.class_names) == CLASSES  # classes.txt's order, not the folders' sorted one
    assert np.bincount(from_folder.labels).tolist() == [4, 4, 4]
    assert folder.content_key("test") == ImageFolder(tmp_path / "folder").content_key("test")


def test_steps_report_progress_and_never_pass_the_total():
    seen = []
    step = Steps(2, lambda done, total: seen.append((done, total)))
    for _ in range(3):
        step()
    assert seen == [(1, 2), (2, 2), (2, 2)]


def test_a_tflite_file_becomes_a_c_array_with_its_exact_bytes(tmp_path):
    model = tmp_path / "model-int8.tflite"
    data = b"\x1c\x00\x00\x00TFL3" + bytes(range(30))
    model.write_bytes(data)
    exported = export_c_array(model, arena=False)  # fake bytes: nothing TFLite Micro could run
    source = exported.source.read_text()
    values = [int(token, 16) for token in source.split("{", 1)[1].split("}", 1)[0].replace(",", " ").split()]
    assert bytes(values) == data and exported.symbol == c_symbol(model.name) and exported.size_bytes == len(data)
    assert f"{exported.symbol}_len = {len(data)};" in source and f"extern const unsigned char {exported.symbol}[];" in exported.header.read_text()
    with pytest.raises(PtqError, match="not a TFLite flatbuffer"):
        export_c_array(conv_classifier(tmp_path / "m.onnx"))


@dataclass(frozen=True)
class Sample:
    name: str
    value: float | None
    tags: list[str]


def test_records_keep_json_finite_and_read_back_what_they_know(tmp_path):
    assert json.loads(records.to_json(Sample("a", float("nan"), ["x"]))) == {"name": "a", "value": None, "tags": ["x"]}
    assert records.from_dict(Sample, {"name": "a", "value": 1.5, "tags": [], "newer_field": 1}) == Sample("a", 1.5, [])
    with pytest.raises(TypeError, match="field 'value'"):
        records.from_dict(Sample, {"name": "a", "value": "high", "tags": []})
    renamed = records.from_dict(records_with_runtime(), {"framework": "onnxruntime"})  # an older record's word
    assert renamed.runtime == "onnxruntime"
    (tmp_path / "models").mkdir()
    assert records.model_key(tmp_path / "models" / "m.onnx") != records.model_key(tmp_path / "m.onnx")  # one name, two folders


def records_with_runtime():
    @dataclass(frozen=True)
    class Measured:
        runtime: str

    return Measured


def test_sweep_sparsities_are_parsed_sorted_and_checked():
    assert sweep.parse_sparsities("0.5,0,0.3,0.5") == (0.0, 0.3, 0.5)
    with pytest.raises(PtqError, match="--sparsity"):
        sweep.parse_sparsities("half")
    with pytest.raises(PtqError):
        sweep.parse_sparsities("1.0")


def test_layer_sensitivity_ranks_each_quantizable_layer_of_the_graph(tmp_path, colours, private_cache):
    model = conv_classifier(tmp_path / "conv.onnx")
    dataset = NpzDataset(colours)
    calibration = calibration_service.build_calibration_set(dataset, 4, 0)
    validation_set = validation.build_validation_set(calibration, dataset, 4)
    result = sensitivity.layer_sensitivity(model, quant_settings.make_settings("int8"), calibration, validation_set)
    assert {layer.op_type for layer in result.layers} >= {"Conv", "Gemm"}
    assert [layer.output_sqnr_db for layer in result.layers] == sorted(layer.output_sqnr_db for layer in result.layers)  # worst first
    saved = sensitivity.save_result(result, tmp_path / "results")
    assert json.loads(saved.read_text())["layers"][0]["node"] == result.layers[0].node


def test_sweep_records_read_back_and_a_damaged_one_is_named(tmp_path):
    from ptq_cli.services.measure import sweep_records

    point = sweep_records.SweepPoint(0.5, 0.49, "m_pruned.onnx", 86.0, 400, 300, "m_pruned_int8.onnx", 85.5, -1.7, 100, 60)
    result = sweep_records.SweepResult("m.onnx", "int8", "global", False, False, True, "QDQ a:int8 w:int8", [point], "r.json", 87.2)
    folder = tmp_path / sweep_records.SWEEP_DIR
    records.write_record(folder / "m_int8_global.json", result)
    (folder / "broken.json").write_text('{"points": "none"}')
    sweeps, skipped = sweep_records.load_sweeps(tmp_path)
    assert sweeps == [result] and len(skipped) == 1 and "broken.json: not a ptq sweep record" in skipped[0]
