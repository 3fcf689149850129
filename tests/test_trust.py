"""Trust boundaries: no code runs from a data or model file, no user file is lost, no input exhausts the
machine, and every bad input is one line naming the file (exit 2). One test (or parameter) per case of the
issue "Trust boundaries"; in-process on tests/synthetic.py's tiny classifier unless a signal is involved.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from PIL import Image
from synthetic import CLASSES, channel_mean_classifier, colour_images, image_folder, invoke, ok, one_line_error

from ptq_cli import settings
from ptq_cli.errors import PtqError
from ptq_cli.guards.atomic import atomic_output, remove_stale_temporaries


def snapshot(directory: Path) -> dict[str, bytes | tuple]:
    """Every regular file's bytes (size and mtime for a big one: the 20 GB sparse file is never read)."""
    def state(path: Path) -> bytes | tuple:
        info = path.stat()
        return (info.st_size, info.st_mtime_ns) if info.st_size > 2**20 else path.read_bytes()

    return {str(path.relative_to(directory)): state(path) for path in sorted(directory.rglob("*"))
            if path.is_file() and "cache" not in path.relative_to(directory).parts}


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv(settings.CACHE_ENV, str(cache))
    (tmp_path / "models").mkdir()
    channel_mean_classifier(tmp_path / "models" / "m.onnx")
    images, labels = colour_images(4)
    np.savez(tmp_path / "colours.npz", images=images, labels=labels, class_names=np.array(CLASSES))
    return tmp_path



def refused(*args, cwd: Path, mentions: str, unchanged: Path | None = None):
    """Exit 2, one line naming `mentions`, and nothing under `unchanged` (default: the project) changed."""
    where = unchanged or cwd
    before = snapshot(where)
    result = invoke(*args, cwd=cwd)
    one_line_error(result, mentions)
    assert snapshot(where) == before, args
    return result


# 1. No code from a dataset.

class Payload:
    """A pickle that, if unpickled by pickle.load, creates a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def cifar_dir(root: Path, payload_in: str | None = None, marker: Path | None = None) -> Path:
    root.mkdir(parents=True)
    images, labels = colour_images(2, size=32, seed=3)
    data = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    for name in [f"data_batch_{index}" for index in range(1, 6)] + ["test_batch"]:
        content = {b"data": data, b"labels": labels.tolist()}
        if name == payload_in:
            content[b"batch_label"] = Payload(marker)
        (root / name).write_bytes(pickle.dumps(content, protocol=2))
    meta = {b"label_names": [name.encode() for name in (*CLASSES, *(f"other{index}" for index in range(7)))]}
    if payload_in == "batches.meta":
        meta[b"num_cases_per_batch"] = Payload(marker)
    (root / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return root


@pytest.mark.parametrize(("victim", "command"), [
    ("batches.meta", "evaluate"), ("test_batch", "evaluate"), ("batches.meta", "calibrate"), ("data_batch_1", "calibrate"),
    ("batches.meta", "fetch --mirror"), ("test_batch", "fetch --mirror"), ("data_batch_3", "fetch --mirror"),
])
def test_a_pickle_payload_in_cifar_batches_never_runs(project, victim, command):
    marker = project / "pwned"
    cifar_dir(project / "mirror" / "cifar-10-batches-py", victim, marker)
    channel_mean_classifier(project / "big.onnx", size=32, classes=10)
    args = {"evaluate": ("evaluate", "--model", "big.onnx", "--data", "mirror/cifar-10-batches-py", "--results-dir", "res"),
            "calibrate": ("calibrate", "--data", "mirror/cifar-10-batches-py", "--samples-per-class", "1", "--output", "c.npz"),
            "fetch --mirror": ("fetch", "--mirror", "mirror", "--dest", "copy", "--asset", "cifar")}[command]
    result = invoke(*args, cwd=project)
    one_line_error(result, victim)
    assert "refused without running it" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
def test_a_keras_lambda_layer_s_stored_code_never_runs(project, monkeypatch, suffix):
    keras = pytest.importorskip("keras")
    build = project / "build"
    build.mkdir()
    monkeypatch.chdir(build)  # the function runs as the model is built: its marker lands here, not where ptq loads it
    inputs = keras.Input((32, 32, 3))
    touched = keras.layers.Lambda(lambda x: __import__("pathlib").Path("pwned").touch() or x)(inputs)
    keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(touched))).save(project / f"lambda{suffix}")
    assert (build / "pwned").exists()
    result = refused("convert", "--keras", f"lambda{suffix}", "--data", "colours.npz", "--output", "l.onnx", cwd=project, mentions=f"lambda{suffix}")
    assert not (project / "pwned").exists()
    # Keras 3 writes some models to .h5 it cannot read back (MobileNetV3's): the line says what loads.
    assert ("save it as .keras" in result.stderr) == (suffix == ".h5")


def test_a_keras_model_with_ops_tf2onnx_cannot_convert_is_one_line_naming_them(project):
    """Keras 3's exact GELU becomes TensorFlow's Erfc, which tf2onnx leaves in the graph as is: no runtime loads that,
    so convert says which ops, writes nothing, and leaves nothing in the working folder (shape inference of such a
    graph saves it there)."""
    keras = pytest.importorskip("keras")
    inputs = keras.Input((8, 8, 3))
    features = keras.layers.Activation("gelu")(keras.layers.Conv2D(4, 3)(inputs))
    keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(features))).save(project / "gelu.keras")
    result = refused("convert", "--keras", "gelu.keras", "--data", "colours.npz", "--output", "g.onnx", "--check-images", "4", cwd=project,
                     mentions="gelu.keras")
    assert "Erfc (1)" in result.stderr


def test_shape_inference_that_cannot_follow_a_graph_leaves_nothing_in_the_working_folder(tmp_path, monkeypatch):
    """onnxruntime's symbolic shape inference saves a graph it cannot finish as sym_shape_infer_temp.onnx in the working
    folder before it raises: ptq runs it elsewhere, and makes what targets it can static with onnx's own inference."""
    from ptq_cli.transforms.graph import preprocess, static_reshape_targets

    nodes = [helper.make_node("Relu", ["image"], ["positive"]), helper.make_node("Unknown", ["positive"], ["custom"], domain="example.ops"),
             helper.make_node("Reshape", ["positive", "target"], ["flat"])]
    graph = helper.make_graph(nodes, "unknown_op", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 2, 2])],
                              [helper.make_tensor_value_info("flat", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("custom", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array([-1, 12], np.int64), "target")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("example.ops", 1)])
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    static_reshape_targets(model)
    with contextlib.suppress(PtqError):  # onnxruntime's optimizer cannot load the unknown op either
        preprocess(model, tmp_path / "pre.onnx")
    assert list(folder.iterdir()) == [] and Path.cwd() == folder


def test_the_official_cifar_pickles_still_load(project):
    """Python 2's pickles (the official files) and Python 3's protocol 2 both use only what is allowed."""
    cifar_dir(project / "cifar")
    channel_mean_classifier(project / "big.onnx", size=32, classes=10)
    record = json.loads(ok("evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "res", "--json", cwd=project).stdout)
    assert record["images"] == 6 and record["accuracy"] == 100.0


# 2. No code from an untrusted TorchScript file.

class WritesAFile(torch.nn.Module):
    """A model whose forward overwrites a file through torch.from_file(shared=True), as the issue found."""

    def __init__(self, victim: str) -> None:
        super().__init__()
        self.victim = victim

    def forward(self, x):
        mapped = torch.from_file(self.victim, shared=True, size=4, dtype=torch.uint8)
        mapped.fill_(88)
        return x.mean(dim=(2, 3))


class ChannelMeans(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3))


@pytest.fixture
def hostile_torchscript(project) -> tuple[Path, Path]:
    victim = project / "victim.txt"
    victim.write_bytes(b"mine")
    torch.jit.save(torch.jit.script(WritesAFile(str(victim))), str(project / "models" / "evil.pt"))
    return project / "models" / "evil.pt", victim


@pytest.mark.parametrize("command", [("evaluate", "--data", "colours.npz", "--results-dir", "res"),
                                     ("benchmark", "--data", "colours.npz", "--runs", "1", "--results-dir", "res")])
def test_a_torchscript_file_ptq_did_not_write_is_not_loaded(project, hostile_torchscript, command):
    model, victim = hostile_torchscript
    refused(*command, "--model", "models/evil.pt", cwd=project, mentions="--trust-remote-code")
    assert victim.read_bytes() == b"mine"


def test_the_models_folder_scan_skips_untrusted_torchscript_with_a_line(project, hostile_torchscript):
    _, victim = hostile_torchscript
    result = ok("evaluate", "--data", "colours.npz", "--json", cwd=project)
    assert json.loads(result.stdout)["model_path"].endswith("m.onnx")
    assert "skipped models/evil.pt" in result.stderr and "--trust-remote-code" in result.stderr
    assert victim.read_bytes() == b"mine"


def test_report_refresh_does_not_load_an_untrusted_torchscript(project, hostile_torchscript):
    model, victim = hostile_torchscript
    torch.jit.save(torch.jit.trace(ChannelMeans(), torch.zeros(1, 3, 8, 8)), str(project / "harmless.pt"))
    ok("evaluate", "--model", "harmless.pt", "--data", "colours.npz", "--trust-remote-code", cwd=project)
    model.replace(project / "harmless.pt")  # the file changes after its record: --refresh would load it
    refused("report", "--refresh", cwd=project, mentions="--trust-remote-code", unchanged=project / "models")
    assert victim.read_bytes() == b"mine"


def test_trust_remote_code_loads_it_and_ptqs_own_torchscript_needs_no_option(project, tmp_path_factory, monkeypatch):
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration-data", "colours.npz", "--backend", "pytorch",
       "--output", "models/q.pt", cwd=project)
    assert json.loads(ok("evaluate", "--model", "models/q.pt", "--data", "colours.npz", "--json", cwd=project).stdout)["accuracy"] == 100.0
    # Another user's cache (or a copied one without its key) does not know the file: the option is needed.
    other = tmp_path_factory.mktemp("other-cache")
    monkeypatch.setenv(settings.CACHE_ENV, str(other))
    refused("evaluate", "--model", "models/q.pt", "--data", "colours.npz", cwd=project, mentions="ptq did not write")
    assert json.loads(ok("evaluate", "--model", "models/q.pt", "--data", "colours.npz", "--json", "--trust-remote-code",
                         cwd=project).stdout)["accuracy"] == 100.0


# 3. Nothing of the user's is lost.

def test_no_output_overwrites_an_input_or_another_output(project):
    models = project / "models"
    refused("calibrate", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/m.onnx", cwd=project, mentions="models/m.onnx")
    refused("convert", "--onnx", "models/m.onnx", "--torch", "models/m.onnx", cwd=project, mentions="models/m.onnx")
    refused("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration-data", "colours.npz", "--output", "models/m.onnx",
            cwd=project, mentions="models/m.onnx")
    os.link(models / "m.onnx", project / "alias.onnx")  # another name of the same file
    refused("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration-data", "colours.npz", "--output", "alias.onnx",
            cwd=project, mentions="alias.onnx")
    (models / "m.bin").write_bytes((models / "m.onnx").read_bytes())  # an ONNX file named .bin, as in the issue
    refused("quantize", "--backend", "openvino", "--model", "models/m.bin", "--data", "colours.npz", "--calibration-data", "colours.npz",
            "--output", "models/m.xml",
            cwd=project, mentions="models/m.bin")
    ok("evaluate", "--data", "colours.npz", cwd=project)
    record = next((project / "results").glob("*.json"))
    refused("report", "--markdown", str(record.relative_to(project)), cwd=project, mentions=".md")
    refused("report", "--markdown", "models/m.onnx", cwd=project, mentions=".md")


def test_two_reports_with_charts_in_one_folder_keep_their_own_charts(project):
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/m_int8.onnx", cwd=project)
    ok("evaluate", "--model", "models/m.onnx", "--model", "models/m_int8.onnx", "--data", "colours.npz", "--per-class", cwd=project)
    ok("report", "--plot", "--markdown", "out/first.md", cwd=project)
    ok("report", "--plot", "--markdown", "out/second.md", cwd=project)
    charts = ("accuracy_vs_speed_and_size.png", "per_class_delta.png")
    assert sorted(path.name for path in (project / "out").glob("*.png")) == sorted(f"{report}_{chart}" for report in ("first", "second") for chart in charts)
    assert all(f"first_{chart}" in (project / "out" / "first.md").read_text() for chart in charts)


def test_leftover_clean_up_deletes_only_files_ptq_named_and_owns(tmp_path):
    ours = tmp_path / ".q.onnx.4194303-abcd_123.partial.onnx"
    lookalikes = [tmp_path / ".q.onnx.partial", tmp_path / ".notes.partial.txt", tmp_path / ".q.onnx.4194303-ab.partial.onnx",
                  tmp_path / ".q.onnx.4194303-abcd_123.partial.txt"]
    for path in (ours, *lookalikes):
        path.write_bytes(b"x")
    link = tmp_path / ".r.onnx.4194303-abcd_124.partial.onnx"
    link.symlink_to(tmp_path / ".notes.partial.txt")
    remove_stale_temporaries(tmp_path / "q.onnx")
    assert not ours.exists()
    assert all(path.exists() for path in lookalikes) and link.is_symlink()


# 4. Inputs that would exhaust the machine.

def test_a_label_of_two_to_the_forty_is_refused_at_once(project):
    images, labels = colour_images(2)
    np.savez(project / "bomb.npz", images=images, labels=np.where(labels == 2, 2**40, labels))
    began = time.perf_counter()
    refused("evaluate", "--data", "bomb.npz", cwd=project, mentions="PTQ_MAX_CLASSES")
    assert time.perf_counter() - began < 30


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_an_image_that_is_a_device_or_a_fifo_is_refused_not_read(project, special):
    folder = image_folder(project / "folder", per_class=2)
    target = folder / "test" / "red" / "zz.png"
    if special == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(special)
    refused("evaluate", "--data", "folder", cwd=project, mentions="zz.png")


def test_a_fifo_as_dataset_or_model_is_refused(project):
    os.mkfifo(project / "data.npz")
    os.mkfifo(project / "fifo.onnx")
    refused("evaluate", "--data", "data.npz", cwd=project, mentions="data.npz")
    refused("evaluate", "--model", "fifo.onnx", "--data", "colours.npz", cwd=project, mentions="fifo.onnx")


def test_a_20_gb_sparse_onnx_file_is_refused_without_reading_it(project):
    with open(project / "sparse.onnx", "wb") as handle:
        handle.truncate(20 * 2**30)
    refused("evaluate", "--model", "sparse.onnx", "--data", "colours.npz", cwd=project, mentions="PTQ_MAX_MODEL_BYTES")


def test_a_16000_pixel_square_png_is_refused(project):
    folder = image_folder(project / "folder", per_class=2)
    Image.new("1", (16000, 16000)).save(folder / "test" / "red" / "zz.png")
    assert (folder / "test" / "red" / "zz.png").stat().st_size < 2**20
    refused("evaluate", "--data", "folder", cwd=project, mentions="PTQ_MAX_IMAGE_PIXELS")


def graph_model(path: Path, nodes, inputs_shape, output_shape, initializers=(), opset: int = 13) -> Path:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, inputs_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)], list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_a_declared_input_of_100000_squared_is_refused(project):
    graph_model(project / "huge.onnx", [helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3], keepdims=0)], ["N", 3, 100000, 100000], ["N", 3])
    refused("evaluate", "--model", "huge.onnx", "--data", "colours.npz", cwd=project, mentions="PTQ_MAX_INPUT_ELEMENTS")


def endless_loop(path: Path) -> Path:
    """An ONNX Loop with no trip count whose condition stays true: onnxruntime never returns."""
    boolean, real = TensorProto.BOOL, TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["v_in"], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", boolean, []),
         helper.make_tensor_value_info("v_in", real, None)],
        [helper.make_tensor_value_info("cond_out", boolean, []), helper.make_tensor_value_info("v_out", real, None)])
    nodes = [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("c", boolean, [], [True])),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("Loop", ["", "cond", "m"], ["y"], body=body)]
    return graph_model(path, nodes, ["N", 3, 8, 8], ["N", 3])


def start(project: Path, *args, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ptq_cli", *args], cwd=project, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_work(project: Path, seconds: float = 8.0) -> None:
    time.sleep(seconds)  # the interpreter starts, reads the data and enters the endless run


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_ends_a_run_that_never_returns(project, signals):
    endless_loop(project / "loop.onnx")
    process = start(project, "evaluate", "--model", "loop.onnx", "--data", "colours.npz")
    wait_for_work(project)
    process.send_signal(signal.SIGTERM)
    if signals == 2:
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
    began = time.perf_counter()
    _, stderr = process.communicate(timeout=60)
    waited = time.perf_counter() - began
    assert process.returncode == 143 and len(stderr.strip().splitlines()) == 1 and "interrupted" in stderr
    # A second signal ends it at once; a first one within the grace period (5 s) even if the runtime never returns.
    assert waited < (3 if signals == 2 else 15), waited
    assert not (project / "results").exists() or not any((project / "results").iterdir())


def test_an_inference_call_past_its_bound_is_reported(project):
    endless_loop(project / "loop.onnx")
    process = start(project, "evaluate", "--model", "loop.onnx", "--data", "colours.npz", PTQ_CALL_TIMEOUT="3")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2 and len(stderr.strip().splitlines()) == 1
    assert "loop.onnx" in stderr and "PTQ_CALL_TIMEOUT" in stderr


# 5. Tracebacks and wrong figures.

def test_an_output_that_is_not_the_declared_shape_is_refused_and_nothing_written(project):
    weights = numpy_helper.from_array(np.random.default_rng(0).random((10, 3), np.float32), "w")
    target = numpy_helper.from_array(np.array([-1, 2, 5], np.int64), "s")
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0), helper.make_node("Gemm", ["m", "w"], ["g"], transB=1),
             helper.make_node("Reshape", ["g", "s"], ["y"])]
    graph_model(project / "shape.onnx", nodes, ["N", 3, 8, 8], ["N", 10], [weights, target])
    images, labels = colour_images(2)
    np.savez(project / "ten.npz", images=images, labels=labels, class_names=np.array([f"c{index}" for index in range(10)]))
    refused("evaluate", "--model", "shape.onnx", "--data", "ten.npz", cwd=project, mentions="shape.onnx")
    refused("quantize", "--model", "shape.onnx", "--data", "ten.npz", "--calibration-data", "ten.npz", "--output", "q.onnx",
            cwd=project, mentions="shape.onnx")


def odd_npz(path: Path, kind: str) -> None:
    images, labels = colour_images(2)
    if kind == "object arrays":
        with zipfile.ZipFile(path, "w") as archive:
            with archive.open("images.npy", "w") as handle:
                np.lib.format.write_array(handle, np.array([object(), 1], dtype=object), allow_pickle=True)
            with archive.open("labels.npy", "w") as handle:
                np.lib.format.write_array(handle, labels)
    elif kind == "member not .npy":
        np.savez(path, images=images, labels=labels)
        with zipfile.ZipFile(path, "a") as archive:
            archive.writestr("readme.txt", b"hello")
    elif kind == ".npy renamed .npz":
        with open(path, "wb") as handle:
            np.save(handle, images)
    elif kind == "oversized header":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("images.npy", b"\x93NUMPY\x01\x00" + (60000).to_bytes(2, "little") + b"{" + b" " * 59998 + b"\n")
            archive.writestr("labels.npy", b"")
    elif kind == "declared larger than held":
        with zipfile.ZipFile(path, "w") as archive:
            header = "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776, 8, 8, 3), }"
            archive.writestr("images.npy", b"\x93NUMPY\x01\x00" + len(header + "\n").to_bytes(2, "little") + header.encode() + b"\n")
            with archive.open("labels.npy", "w") as handle:
                np.lib.format.write_array(handle, labels)
    elif kind == "0x0 images":
        np.savez(path, images=np.zeros((6, 0, 0, 3), np.uint8), labels=labels)


@pytest.mark.parametrize("kind", ["object arrays", "member not .npy", ".npy renamed .npz", "oversized header", "declared larger than held", "0x0 images"])
@pytest.mark.parametrize("as_what", ["--data", "--calibration"])
def test_a_malformed_npz_is_one_line(project, kind, as_what):
    odd_npz(project / "odd.npz", kind)
    if as_what == "--data":
        refused("evaluate", "--data", "odd.npz", cwd=project, mentions="odd.npz")
    else:
        refused("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "odd.npz", "--output", "q.onnx",
                cwd=project, mentions="odd.npz")


def test_non_ascii_class_names_on_an_ascii_terminal(project):
    images, labels = colour_images(2)
    np.savez(project / "uni.npz", images=images, labels=labels, class_names=np.array(["rouge", "vért", "bleu€"]))
    result = subprocess.run([sys.executable, "-m", "ptq_cli", "evaluate", "--data", "uni.npz", "--per-class"], cwd=project,
                            env={**os.environ, "PYTHONIOENCODING": "ascii"}, capture_output=True, text=True, encoding="ascii", errors="strict")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "v\\xe9rt" in result.stdout


def test_a_hand_edited_record_is_refused_not_shown(project):
    ok("evaluate", "--data", "colours.npz", cwd=project)
    record_path = next((project / "results").glob("*.json"))
    record = json.loads(record_path.read_text())
    record["accuracy"] = 99.99  # its own correct/images say 100
    record_path.write_text(json.dumps(record))
    result = invoke("report", "--json", cwd=project)
    assert "99.99" not in result.stdout
    assert "is not its 12/12 correct" in result.output


def test_an_edited_cache_entry_with_its_digest_recomputed_is_not_served(project):
    import hashlib

    first = json.loads(ok("evaluate", "--data", "colours.npz", "--json", cwd=project).stdout)
    entry = next((project / "cache").glob("npz-*.npz"))
    with np.load(entry) as arrays:
        images, labels = np.zeros_like(arrays["images"]), arrays["labels"]
    digest = hashlib.sha256(str((images.dtype, images.shape, labels.dtype, labels.shape)).encode())
    digest.update(images.data)
    digest.update(labels.data)
    np.savez(entry, images=images, labels=labels, digest=np.array(digest.hexdigest()))
    again = json.loads(ok("evaluate", "--data", "colours.npz", "--json", cwd=project).stdout)
    assert again["correct"] == first["correct"] == 12


def test_a_cache_directory_others_can_write_is_refused(project, monkeypatch):
    shared = project / "shared-cache"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(settings.CACHE_ENV, str(shared))
    refused("evaluate", "--data", "colours.npz", cwd=project, mentions="writable by everyone")


# 6. Messages.

def test_a_failure_inside_a_write_names_the_output_not_the_temporary_file(tmp_path):
    output = tmp_path / "out.onnx"
    with pytest.raises(PtqError) as raised, atomic_output(output) as tmp:
        raise PtqError(f"{tmp}: conversion check failed")
    assert str(raised.value) == f"{output}: conversion check failed"
    with pytest.raises(PtqError) as raised, atomic_output(output) as tmp:
        raise OSError(28, "No space left on device", str(tmp))
    assert str(raised.value) == f"{output}: cannot write (No space left on device)"
    assert list(tmp_path.iterdir()) == []


def test_a_model_with_external_weights_beside_it_loads_from_any_folder(project):
    model = onnx.load(str(project / "models" / "m.onnx"))
    (project / "ext").mkdir()
    onnx.save_model(model, str(project / "ext" / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    assert (project / "ext" / "m.data").is_file()
    ok("evaluate", "--model", "ext/m.onnx", "--data", "colours.npz", cwd=project)
    ok("quantize", "--model", "ext/m.onnx", "--data", "colours.npz", "--calibration-data", "colours.npz", "--output", "q.onnx", cwd=project)
    from onnx.external_data_helper import set_external_data

    model = onnx.load(str(project / "models" / "m.onnx"))  # written by hand: onnx itself refuses to save '..'
    tensor = model.graph.initializer[0]
    (project / "m.data").write_bytes(tensor.raw_data or numpy_helper.to_array(tensor).tobytes())
    set_external_data(tensor, "../m.data", 0, (project / "m.data").stat().st_size)
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    (project / "ext" / "outside.onnx").write_bytes(model.SerializeToString())
    refused("evaluate", "--model", "ext/outside.onnx", "--data", "colours.npz", cwd=project, mentions="outside the model's folder")


@pytest.mark.parametrize("symbol", ["int", "return", "__x", "été"])
def test_export_refuses_a_symbol_c_cannot_declare(project, symbol):
    (project / "m.tflite").write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(64))
    refused("export", "--model", "m.tflite", "--c-array", "--symbol", symbol, cwd=project, mentions="--symbol")


def test_library_warnings_stay_off_stderr(project):
    result = subprocess.run([sys.executable, "-m", "ptq_cli", "evaluate", "--data", "colours.npz", "--std", "1e-45"], cwd=project,
                            capture_output=True, text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
