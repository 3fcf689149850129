"""Hostile input, third round: no code from an ONNX node name or an "image", no memory bomb through aliased external
data, no hang on a file that blocks, a slow server or a port that is not Ray. In-process on tests/synthetic.py's
tiny models unless a real hang has to be shown ended (a child process with a deadline)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from synthetic import channel_mean_classifier, colours_npz, conv_classifier, image_folder, invoke, one_line_error

from ptq_cli.model_file import file_sha256
from ptq_cli.transforms.graph import generated_node_names, subgraph_depth

PTQ = str(Path(sys.executable).with_name("ptq"))


def payload(marker: Path) -> str:
    """A node name that torch.fx, writing it unescaped into the source it generates, would run."""
    return f'flatten") if getattr(__import__("os"),"system")("touch {marker}") else getattr(self,"flatten'


def named_like_code(path: Path, marker: Path) -> Path:
    conv_classifier(path)
    model = onnx.load(str(path))
    for index, node in enumerate(model.graph.node):
        node.name = payload(marker) + str(index) if index % 2 else f'x"]; __import__("os").system("touch {marker}"); y=["{index}'
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("command", [
    ("convert", "--onnx", "m.onnx", "--torch", "out.pt", "--data", "colours.npz"),
    ("quantize", "--backend", "pytorch", "--model", "m.onnx", "--data", "colours.npz", "--output", "q.pt"),
])
def test_an_onnx_node_name_never_becomes_code(tmp_path, command):
    marker = tmp_path / "PWNED"
    named_like_code(tmp_path / "m.onnx", marker)
    colours_npz(tmp_path / "colours.npz")
    result = invoke(*command, cwd=tmp_path)
    assert not marker.exists(), "a node name ran as code"
    assert result.exit_code == 0, result.output
    assert (tmp_path / command[command.index("--torch" if "--torch" in command else "--output") + 1]).is_file()


def test_the_converter_is_given_names_ptq_chose_subgraphs_included():
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"], name='evil"name')], "then", [],
                                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["c"], ["out"], name="if\"'", then_branch=then_branch, else_branch=then_branch)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph)
    renamed = generated_node_names(model)
    names = [renamed.graph.node[0].name, *(inner.name for attribute in renamed.graph.node[0].attribute for inner in attribute.g.node)]
    assert all(name.isidentifier() and name.startswith("node_") for name in names) and len(set(names)) == 3
    assert model.graph.node[0].name == "if\"'"  # the caller's model is left as it was
    assert subgraph_depth(renamed.graph) == 1 and subgraph_depth(graph.node[0].attribute[0].g) == 0


POSTSCRIPT = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n{ } loop\n"


@pytest.mark.parametrize(("content", "named"), [
    (POSTSCRIPT, "a PostScript file"),
    (b"%PDF-1.4\n1 0 obj << >> endobj\n", "a PDF file"),
    (b"\xc5\xd0\xd3\xc6" + b"\0" * 28 + POSTSCRIPT, "an EPS file"),
    (b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "a GIF image"),
])
@pytest.mark.parametrize("command", ["evaluate", "calibrate"])
def test_only_the_documented_image_decoders_open_a_file_whatever_its_name(tmp_path, monkeypatch, content, named, command):
    """Pillow picks a decoder by content: an EPS named .png would go to Ghostscript. It is refused by what it is."""
    from PIL import EpsImagePlugin

    ran = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
    monkeypatch.setattr(EpsImagePlugin, "gs_windows_binary", None)
    image_folder(tmp_path / "images")
    victim = sorted((tmp_path / "images" / ("train" if command == "calibrate" else "test") / "red").iterdir())[0]
    victim.write_bytes(content)
    channel_mean_classifier(tmp_path / "m.onnx")
    arguments = ["--model", "m.onnx", "--data", "images"] + (["--output", "c.npz"] if command == "calibrate" else [])
    result = invoke(command, *arguments, cwd=tmp_path)
    one_line_error(result, f"{victim.relative_to(tmp_path)}: {named}, not a PNG, JPEG, BMP or WebP image")
    assert not ran and not (tmp_path / "c.npz").exists()


def test_real_images_still_open_jpeg_bmp_webp(tmp_path):
    channel_mean_classifier(tmp_path / "m.onnx")
    for suffix in (".jpg", ".bmp", ".webp"):
        image_folder(tmp_path / suffix[1:], suffix=suffix)
        result = invoke("evaluate", "--model", "m.onnx", "--data", suffix[1:], "--json", cwd=tmp_path)
        assert result.exit_code == 0, result.output


def aliased(folder: Path, tensors: int, mib: int) -> Path:
    """A tiny model whose `tensors` initializers all name the same `mib` MiB of one external file."""
    channel_mean_classifier(folder / "m.onnx")
    model = onnx.load(str(folder / "m.onnx"))
    with (folder / "weights.bin").open("wb") as handle:
        handle.truncate(mib * 2**20)
    for index in range(tensors):
        tensor = TensorProto(name=f"alias{index}", data_type=TensorProto.FLOAT, dims=[mib * 2**18], data_location=TensorProto.EXTERNAL)
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", "weights.bin"
        model.graph.initializer.append(tensor)
    onnx.save(model, str(folder / "bomb.onnx"))
    return folder / "bomb.onnx"


def test_aliased_external_data_counts_every_tensor(tmp_path):
    """40 tensors naming one 64 MiB file are 2.5 GiB once read in: refused before a byte of it is read."""
    aliased(tmp_path, 40, 64)
    colours_npz(tmp_path / "colours.npz")
    for command in (("evaluate", "--model", "bomb.onnx", "--data", "colours.npz"),
                    ("quantize", "--model", "bomb.onnx", "--data", "colours.npz", "--output", "q.onnx")):
        result = invoke(*command, cwd=tmp_path)
        one_line_error(result, "bytes with its external data (counted per tensor), over the limit of 2,147,483,648 bytes")
    assert not (tmp_path / "q.onnx").exists()


def test_external_data_is_read_by_tensor_offsets_and_a_span_past_the_end_is_named(tmp_path):
    channel_mean_classifier(tmp_path / "m.onnx")
    model = onnx.load(str(tmp_path / "m.onnx"))
    onnx.save(model, str(tmp_path / "e.onnx"), save_as_external_data=True, location="e.data", size_threshold=0)
    colours_npz(tmp_path / "colours.npz")
    whole = invoke("evaluate", "--model", "m.onnx", "--data", "colours.npz", "--json", "--results-dir", "a", cwd=tmp_path)
    split = invoke("evaluate", "--model", "e.onnx", "--data", "colours.npz", "--json", "--results-dir", "b", cwd=tmp_path)
    assert whole.exit_code == split.exit_code == 0, split.output
    assert json.loads(split.stdout)["correct"] == json.loads(whole.stdout)["correct"] == json.loads(whole.stdout)["images"]
    with (tmp_path / "e.data").open("r+b") as handle:
        handle.truncate(8)
    one_line_error(invoke("evaluate", "--model", "e.onnx", "--data", "colours.npz", cwd=tmp_path), "which holds 8")


def blocking_file() -> Path:
    """A regular file of the kernel's that waits for data when read (readable by root), or skip."""
    path = Path("/proc/kmsg")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pytest.skip("/proc/kmsg is not readable here")
    return path


def run_with_deadline(args: list[str], cwd: Path, env: dict | None = None, seconds: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PTQ, *args], cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=seconds, check=False)


@pytest.mark.parametrize("where", ["cpuinfo", "model", "classes", "image"])
def test_a_file_that_blocks_when_read_is_refused_not_waited_on(tmp_path, where):
    kmsg = blocking_file()
    channel_mean_classifier(tmp_path / "m.onnx")
    image_folder(tmp_path / "images")
    env, model = {}, "m.onnx"
    if where == "cpuinfo":
        env["PTQ_CPUINFO"] = str(kmsg)
    elif where == "model":
        (tmp_path / "k.onnx").symlink_to(kmsg)
        model = "k.onnx"
    elif where == "classes":
        (tmp_path / "images" / "classes.txt").unlink()
        (tmp_path / "images" / "classes.txt").symlink_to(kmsg)
    else:
        victim = sorted((tmp_path / "images" / "test" / "red").iterdir())[0]
        victim.unlink()
        victim.symlink_to(kmsg)
    run = run_with_deadline(["evaluate", "--model", model, "--data", "images"], tmp_path, env)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("Error:"), run.stderr


def test_a_fetch_from_a_trickling_server_ends_at_its_deadline(tmp_path):
    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            for _ in range(60):  # a byte every 0.2 s: never idle long enough for a socket timeout
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        url = f"http://127.0.0.1:{server.server_address[1]}/cifar.tar.gz"
        run = run_with_deadline(["fetch", "--dest", "assets", "--asset", "cifar", "--cifar-url", url], tmp_path, {"PTQ_DOWNLOAD_TIMEOUT": "2"})
        took = time.monotonic() - started
    finally:
        server.shutdown()
    assert run.returncode == 2 and "not done within 2 seconds" in run.stderr, run.stderr
    assert "assets/cifar-10-batches-py" in run.stderr and ".ptq-fetch" not in run.stderr  # where it goes, not ptq's staging file
    assert took < 10
    assert not (tmp_path / "assets").exists() or not any((tmp_path / "assets").rglob("*.gz"))


def test_a_large_model_is_hashed_once_for_many_records(tmp_path, monkeypatch):
    from ptq_cli.guards import bounded

    channel_mean_classifier(tmp_path / "m.onnx")
    reads = []
    real = bounded.read_span
    monkeypatch.setattr(bounded, "read_span", lambda *args, **kwargs: reads.append(args[1]) or real(*args, **kwargs))
    digests = {file_sha256(tmp_path / "m.onnx") for _ in range(200)}
    assert len(digests) == 1 and len(reads) == 1
    model = onnx.load(str(tmp_path / "m.onnx"))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.eye(3, dtype=np.float32) * 2, "weights"))
    onnx.save(model, str(tmp_path / "m.onnx"))  # changed: read again
    assert file_sha256(tmp_path / "m.onnx") not in digests and len(reads) == 2


def nested_ifs(path: Path, depth: int) -> Path:
    """The channel-mean classifier with `depth` Ifs nested in each other between its mean and its MatMul."""
    def branch(level: int):
        if level == 0:
            return helper.make_graph([helper.make_node("Identity", ["means"], ["o0"])], "leaf", [],
                                     [helper.make_tensor_value_info("o0", TensorProto.FLOAT, None)])
        condition = helper.make_node("Constant", [], [f"c{level}"], value=numpy_helper.from_array(np.array(True)))
        node = helper.make_node("If", [f"c{level}"], [f"o{level}"], then_branch=branch(level - 1), else_branch=branch(0))
        return helper.make_graph([condition, node], f"g{level}", [], [helper.make_tensor_value_info(f"o{level}", TensorProto.FLOAT, None)])

    nodes = [helper.make_node("ReduceMean", ["image"], ["means"], axes=[2, 3], keepdims=0), *branch(depth).node,
             helper.make_node("MatMul", [f"o{depth}", "weights"], ["scores"])]
    graph = helper.make_graph(nodes, "nested", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(np.eye(3, dtype=np.float32), "weights")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return path


def test_quantize_of_deeply_nested_control_flow_ends(tmp_path):
    """onnxruntime's symbolic shape inference is exponential in the nesting (20 Ifs never finished)."""
    nested_ifs(tmp_path / "nested.onnx", 20)
    colours_npz(tmp_path / "colours.npz")
    run = run_with_deadline(["quantize", "--model", "nested.onnx", "--data", "colours.npz", "--output", "q.onnx"], tmp_path, seconds=120)
    assert run.returncode in (0, 2), run.stderr
    assert run.returncode == 0 or len(run.stderr.strip().splitlines()) == 1


def test_names_with_emoji_codes_and_markup_are_printed_as_they_are(tmp_path):
    """A class named like an emoji code or a rich tag is that name, in the table and in the JSON (which stays the data)."""
    names = np.array([":cat:", "[bold]green[/bold]", ":thumbs_up: blue"])
    colours_npz(tmp_path / "odd.npz", class_names=names)
    channel_mean_classifier(tmp_path / "m.onnx")
    table = invoke("evaluate", "--model", "m.onnx", "--data", "odd.npz", "--results-dir", "res", "--per-class", cwd=tmp_path)
    assert table.exit_code == 0, table.output
    assert all(name in table.stdout for name in names) and "\N{CAT FACE}" not in table.stdout, table.stdout
    as_json = invoke("evaluate", "--model", "m.onnx", "--data", "odd.npz", "--results-dir", "res", "--json", cwd=tmp_path)
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["class_names"] == list(names)
    report = invoke("report", "--results-dir", "res", "--json", cwd=tmp_path)
    assert report.exit_code == 0 and ":thumbs_up: blue" in report.stdout and "\N{THUMBS UP SIGN}" not in report.stdout
