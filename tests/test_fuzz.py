"""Fuzz harness: every kind of file ptq reads, mutated, and option values drawn, by hypothesis.

The contract, for every case: exit 0 with a sound result, or exit 2 with one line on stderr and nothing
written; never a traceback. In-process (CliRunner) on tests/synthetic.py's tiny classifier and images, so
it runs on every change: all 6,200 cases in `make test` (CI), a quarter of them in `make test-fast`.
Cases are derandomized: a failure reproduces.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from synthetic import CLASSES, channel_mean_classifier, colour_images, image_folder, invoke

from ptq_cli import settings as ptq_settings

FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def fuzz(examples: int):
    """`examples` cases (6,200 over the harness), scaled by PTQ_FUZZ_SCALE: `make test-fast` runs a quarter."""
    return settings(FUZZ, max_examples=max(10, round(examples * float(os.environ.get("PTQ_FUZZ_SCALE", "1")))))
OUTPUTS = ("models", "results", "res", "reports", "out", "calibration", "q.onnx", "report.md", "calib_out.npz")


def colours_npz(path: Path) -> Path:
    train_images, train_labels = colour_images(4, seed=1)
    test_images, test_labels = colour_images(4, seed=2)
    np.savez(path, train_images=train_images, train_labels=train_labels, test_images=test_images, test_labels=test_labels,
             class_names=np.array(CLASSES))
    return path


def cifar_dir(root: Path) -> Path:
    """The CIFAR-10 python layout (10 class names), 2 images of each of the first 3 classes, 32x32."""
    root.mkdir(parents=True)
    images, labels = colour_images(2, size=32, seed=3)
    data = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    for name in [f"data_batch_{index}" for index in range(1, 6)] + ["test_batch"]:
        with open(root / name, "wb") as handle:
            pickle.dump({b"data": data, b"labels": labels.tolist(), b"batch_label": name.encode()}, handle)
    with open(root / "batches.meta", "wb") as handle:
        names = [*CLASSES, *(f"other{index}" for index in range(7))]
        pickle.dump({b"label_names": [name.encode() for name in names], b"num_cases_per_batch": len(labels)}, handle)
    return root


def torch_payload(path: Path) -> None:
    """A TorchScript file whose forward overwrites ./victim.txt (torch.from_file(shared=True)), as the issue found."""
    import torch

    class WritesAFile(torch.nn.Module):
        def forward(self, x):
            mapped = torch.from_file("victim.txt", shared=True, size=4, dtype=torch.uint8)  # the case's copy (cwd)
            mapped.fill_(88)
            return x.mean(dim=(2, 3))

    torch.jit.save(torch.jit.script(WritesAFile()), str(path))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Iterator[Path]:
    """Every kind of file ptq reads, made by ptq itself where ptq writes it."""
    root = tmp_path_factory.mktemp("fuzz-template")
    (root / "models").mkdir()
    channel_mean_classifier(root / "models" / "m.onnx")
    channel_mean_classifier(root / "big.onnx", size=32, classes=10)
    colours_npz(root / "colours.npz")
    (root / "victim.txt").write_bytes(b"mine")
    torch_payload(root / "evil.pt")
    image_folder(root / "folder", per_class=3)
    cifar_dir(root / "cifar")
    cache = root / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ptq_settings.CACHE_ENV, str(cache))
        for command in (("calibrate", "--data", "colours.npz", "--output", "calib.npz"),
                        ("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "models/m_uint8.onnx", "--dtype", "uint8"),
                        ("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-openvino", "--runs", "2"),
                        ("evaluate", "--data", "colours.npz"),
                        ("evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "cifar-results")):
            result = invoke(*command, cwd=root)
            assert result.exit_code == 0, (command, result.output)
    made = contents(root)
    yield root
    # The cases' files are hard links to these (`project`): a write into one instead of a new file would show here.
    after = contents(root)
    assert after == made, sorted(name for name in set(made) | set(after) if made.get(name) != after.get(name))


def contents(directory: Path) -> dict[str, str]:
    """Every regular file's sha256 below `directory`."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file() and not path.is_symlink()}


def snapshot(directory: Path) -> dict[str, tuple]:
    """Every file as what a write changes: its inode, size and modification and change times (ptq writes a new file
    and renames it, which gives a new inode; a write into the file moves its times); a symbolic link as where it points
    (a case's link may lead to a file that blocks when read). Stat, not bytes: a case's files are read twice a case."""
    found: dict[str, tuple] = {}
    for root, folders, files in os.walk(directory):
        place = Path(root).relative_to(directory)
        if place == Path() and "cache" in folders:
            folders.remove("cache")
        for name in [*files, *(folder for folder in folders if (Path(root) / folder).is_symlink())]:
            path = Path(root) / name
            status = path.lstat()
            if stat.S_ISLNK(status.st_mode):
                found[str(place / name)] = ("->", os.readlink(path))
            elif stat.S_ISREG(status.st_mode):
                found[str(place / name)] = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    return found


_CASES: list[Path] = []  # the folder of the example being run


def project(template: Path, tmp_path_factory) -> Path:
    """The template's files for one example, as hard links to them (a copy of each would take most of a case's time);
    the previous example's folder is removed (the last one stays, for a failure). ptq writes a new file and renames it
    over an old one, never into it, so a case cannot change the template's files; a test that writes into one first
    makes it its own (`own`), and the template's teardown checks that none changed."""
    while _CASES:
        shutil.rmtree(_CASES.pop(), ignore_errors=True)
    work = tmp_path_factory.mktemp("case")
    _CASES.append(work)
    shutil.copytree(template, work, dirs_exist_ok=True, copy_function=os.link)
    return work


def own(path: Path) -> Path:
    """`path`, to be written into: a hard link to the template's file becomes a file of its own with the same bytes;
    a name the case does not hold yet stays as it is."""
    if path.is_file() and not path.is_symlink() and path.stat().st_nlink > 1:
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    return path


def check_contract(result, work: Path, before: dict[str, tuple], after: dict[str, tuple], command) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), (command, repr(result.exception), result.output)
    assert "Traceback" not in result.output, (command, result.output)
    assert result.exit_code in (0, 2), (command, result.exit_code, result.output)
    if result.exit_code == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error:"), (command, result.stderr)
        assert after == before, (command, sorted(set(after) ^ set(before)) or [k for k in after if after[k] != before.get(k)])
        return
    for name, written in after.items():
        if name.endswith(".json") and before.get(name) != written:
            assert written[0] != "->", (command, f"{name}: a symbolic link written")
            json.loads((work / name).read_bytes(), parse_constant=lambda constant, name=name: pytest.fail(f"{command}: {name} holds {constant}"))


def run_case(work: Path, *command):
    before = snapshot(work)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ptq_settings.CACHE_ENV, str(work / "cache"))
        result = invoke(*command, cwd=work)
    check_contract(result, work, before, snapshot(work), command)
    return result


# Byte-level mutations, for any file.

def mutate_bytes(data: bytes, draw) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "random", "empty", "append", "splice"]))
    if kind == "empty" or not data:
        return b""
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flip":
        position = draw(st.integers(0, len(data) - 1))
        return data[:position] + bytes([data[position] ^ draw(st.integers(1, 255))]) + data[position + 1 :]
    if kind == "random":
        return draw(st.binary(min_size=0, max_size=64))
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=32))
    start = draw(st.integers(0, len(data) - 1))
    return data[:start] + draw(st.binary(min_size=1, max_size=16)) + data[start + 16 :]


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def mutate_json(value, draw):
    """`value` with one node somewhere replaced by an odd value (or removed)."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        copy = dict(value)
        if draw(st.integers(0, 4)) == 0:
            del copy[key]
        else:
            copy[key] = mutate_json(value[key], draw)
        return copy
    if isinstance(value, list) and value and draw(st.booleans()):
        index = draw(st.integers(0, len(value) - 1))
        return [*value[:index], mutate_json(value[index], draw), *value[index + 1 :]]
    return draw(ODD_VALUES)


def odd_array(draw, like: np.ndarray) -> np.ndarray:
    try:
        return _odd_array(draw, like)
    except (ValueError, TypeError, IndexError):  # e.g. class names as floats: the drawn change does not apply
        return np.zeros(like.shape, np.float32)


def _odd_array(draw, like: np.ndarray) -> np.ndarray:
    kind = draw(st.sampled_from(["dtype", "shape", "nan", "negative", "huge", "empty", "strings", "scalar", "object-free float"]))
    if kind == "dtype":
        return like.astype(draw(st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_])))
    if kind == "shape":
        return like.reshape(-1) if like.ndim > 1 else like.reshape(1, -1)
    if kind == "nan":
        return np.full(like.shape, np.nan, np.float32)
    if kind == "negative":
        return (-np.abs(like.astype(np.int64)) - 1).astype(np.int64)
    if kind == "huge":
        return np.full(like.shape, 2**40, np.int64)
    if kind == "empty":
        return like[:0]
    if kind == "strings":
        return np.array([str(item) for item in like.reshape(-1)[:5]])
    if kind == "scalar":
        return np.array(draw(st.integers(-5, 5)))
    return like.astype(np.float32) / 255.0


def mutate_npz(path: Path, draw) -> None:
    with np.load(path, allow_pickle=False) as data:
        arrays = dict(data)
    key = draw(st.sampled_from(sorted(arrays)))
    action = draw(st.sampled_from(["replace", "replace", "replace", "drop", "rename"]))
    if action == "drop":
        del arrays[key]
    elif action == "rename":
        arrays["x_" + key] = arrays.pop(key)
    else:
        arrays[key] = odd_array(draw, arrays[key])
    np.savez(own(path), **arrays)


# The fuzz tests, one per kind of file, and one for option values.

@fuzz(250)
@given(data=st.data())
def test_fuzz_model_file(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    model = work / "models" / "m.onnx"
    if data.draw(st.booleans(), label="structural"):
        proto = onnx.load(str(model))
        change = data.draw(st.sampled_from(["elem_type", "dims", "opset", "outputs", "metadata", "inputs"]), label="change")
        if change == "elem_type":
            proto.graph.input[0].type.tensor_type.elem_type = data.draw(st.sampled_from([2, 3, 6, 7, 10, 11]))
        elif change == "dims":
            dim = proto.graph.input[0].type.tensor_type.shape.dim[data.draw(st.integers(0, 3))]
            dim.Clear()
            choice = data.draw(st.one_of(st.integers(-2, 70), st.text(max_size=3)))
            if isinstance(choice, int):
                dim.dim_value = choice
            else:
                dim.dim_param = choice
        elif change == "opset":
            proto.opset_import[0].version = data.draw(st.integers(-1, 30))
        elif change == "outputs":
            del proto.graph.output[:]
        elif change == "inputs":
            proto.graph.input.append(proto.graph.input[0])
        else:
            entry = proto.metadata_props.add()
            entry.key = data.draw(st.sampled_from(["ptq.input", "ptq.quantization", "ptq.source_sha256", "ptq.pruning"]))
            entry.value = data.draw(st.one_of(st.text(max_size=20), ODD_VALUES.map(json.dumps)))
        own(model).write_bytes(proto.SerializeToString())
    else:
        own(model).write_bytes(mutate_bytes(model.read_bytes(), data.draw))
    command = data.draw(st.sampled_from([
        ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res"),
        ("benchmark", "--model", "models/m.onnx", "--runs", "1", "--batch-size", "4", "--results-dir", "res"),
        ("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx"),
    ]), label="command")
    run_case(work, *command)


@fuzz(300)
@given(data=st.data())
def test_fuzz_dataset_npz(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    mutate_npz(work / "colours.npz", data.draw)
    command = data.draw(st.sampled_from([
        ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res"),
        ("calibrate", "--data", "colours.npz", "--output", "calib_out.npz"),
    ]), label="command")
    result = run_case(work, *command)
    if result.exit_code == 0 and command[0] == "evaluate":
        record = json.loads(next((work / "res").glob("*.json")).read_text())
        assert 0 <= record["accuracy"] <= 100 and record["correct"] <= record["images"]


@fuzz(250)
@given(data=st.data())
def test_fuzz_image_folder(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    folder = work / "folder"
    target = data.draw(st.sampled_from(["image", "classes.txt", "stray file", "empty class", "extra class"]), label="target")
    if target == "image":
        images = sorted(folder.rglob("*.png"))
        victim = images[data.draw(st.integers(0, len(images) - 1))]
        own(victim).write_bytes(mutate_bytes(victim.read_bytes(), data.draw))
    elif target == "classes.txt":
        own(folder / "classes.txt").write_text(data.draw(st.text(max_size=40)))
    elif target == "stray file":
        own(folder / "test" / "red" / data.draw(st.sampled_from(["notes.txt", "x.jpg", ".DS_Store", "Thumbs.db"]))).write_bytes(data.draw(st.binary(max_size=20)))
    elif target == "empty class":
        for image in (folder / "train" / "green").iterdir():
            image.unlink()
    else:
        (folder / "test" / "purple").mkdir()
        shutil.copy(next((folder / "test" / "red").iterdir()), own(folder / "test" / "purple" / "0.png"))
    run_case(work, "evaluate", "--model", "models/m.onnx", "--data", "folder", "--results-dir", "res")


@fuzz(200)
@given(data=st.data())
def test_fuzz_cifar_batches(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    victim = work / "cifar" / data.draw(st.sampled_from(["test_batch", "batches.meta", "data_batch_1"]), label="file")
    if data.draw(st.booleans(), label="bytes"):
        own(victim).write_bytes(mutate_bytes(victim.read_bytes(), data.draw))
    else:
        with open(victim, "rb") as handle:
            content = pickle.load(handle, encoding="bytes")
        key = data.draw(st.sampled_from(sorted(content)))
        content[key] = data.draw(st.one_of(ODD_VALUES, st.just(np.zeros((2, 5), np.uint8)), st.just([b"x"] * 2),
                                           st.just(np.full((6, 3072), 255, np.float64))))
        with open(own(victim), "wb") as handle:
            pickle.dump(content, handle)
    command = data.draw(st.sampled_from([
        ("evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "res"),
        ("calibrate", "--data", "cifar", "--samples-per-class", "1", "--output", "calib_out.npz"),
    ]), label="command")
    run_case(work, *command)


@fuzz(150)
@given(data=st.data())
def test_fuzz_calibration_file(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    if data.draw(st.booleans(), label="bytes"):
        own(work / "calib.npz").write_bytes(mutate_bytes((work / "calib.npz").read_bytes(), data.draw))
    else:
        mutate_npz(work / "calib.npz", data.draw)
    run_case(work, "quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx")


@fuzz(400)
@given(data=st.data())
def test_fuzz_records(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    records = sorted((work / "results").rglob("*.json"))
    victim = records[data.draw(st.integers(0, len(records) - 1))]
    if data.draw(st.booleans(), label="bytes"):
        own(victim).write_bytes(mutate_bytes(victim.read_bytes(), data.draw))
    else:
        own(victim).write_text(json.dumps(mutate_json(json.loads(victim.read_text()), data.draw)))
    command = data.draw(st.sampled_from([
        ("report", "--json"),
        ("report", "--markdown", "report.md"),
        ("evaluate", "--model", "models/m_uint8.onnx", "--data", "colours.npz", "--per-class"),
    ]), label="command")
    result = run_case(work, *command)
    if result.exit_code == 0 and command == ("report", "--json"):
        json.loads(result.stdout, parse_constant=lambda constant: pytest.fail(f"report --json holds {constant}"))


@fuzz(100)
@given(data=st.data())
def test_fuzz_manifest(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    manifest = work / "results" / "manifest.json"
    if data.draw(st.booleans(), label="bytes"):
        own(manifest).write_bytes(mutate_bytes(manifest.read_bytes(), data.draw))
    else:
        own(manifest).write_text(json.dumps(mutate_json(json.loads(manifest.read_text()), data.draw)))
    run_case(work, "run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-openvino", "--no-benchmark", "--json")


@fuzz(150)
@given(data=st.data())
def test_fuzz_cache(template, tmp_path_factory, data):
    """A damaged cache is rebuilt: the result is the one the intact data gives."""
    work = project(template, tmp_path_factory)
    caches = sorted((work / "cache").glob("*.npz"))
    victim = own(caches[data.draw(st.integers(0, len(caches) - 1))])
    if data.draw(st.booleans(), label="bytes"):
        own(victim).write_bytes(mutate_bytes(victim.read_bytes(), data.draw))
    else:
        try:
            mutate_npz(victim, data.draw)
        except (ValueError, OSError, zipfile.BadZipFile):
            return
    result = run_case(work, "evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["correct"] == 12


OPTION_VALUES = st.one_of(st.integers(-(2**40), 2**40).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                          st.sampled_from(["", "nan", "inf", "-0", "1,2", "0,0,0", "1,2,3,4", "abc", "int8", "uint8", "none", "-1",
                                           "8", "8x8", "8x16", "0x8", "x8", "99999"]))
COMMAND_OPTIONS = {
    ("calibrate", "--data", "colours.npz", "--output", "calib_out.npz"): ["--seed", "--samples-per-class", "--model", "--input-size"],
    ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res"):
        ["--batch-size", "--threads", "--scale", "--mean", "--std", "--preprocess", "--input-size"],
    ("benchmark", "--model", "models/m.onnx", "--results-dir", "res"): ["--runs", "--batch-size", "--threads"],
    ("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--output", "q.onnx"):
        ["--dtype", "--weight-dtype", "--method", "--percentile", "--samples-per-class", "--seed", "--mean", "--std", "--scale"],
    ("prune", "--model", "models/m.onnx", "--output", "q.onnx"): ["--sparsity"],
    ("report",): ["--results-dir", "--markdown"],
}


@fuzz(500)
@given(data=st.data())
def test_fuzz_options(template, tmp_path_factory, data):
    work = project(template, tmp_path_factory)
    base = data.draw(st.sampled_from(sorted(COMMAND_OPTIONS)), label="command")
    options = []
    for option in data.draw(st.lists(st.sampled_from(COMMAND_OPTIONS[base]), min_size=1, max_size=3, unique=True), label="options"):
        options += [option, data.draw(OPTION_VALUES, label=option)]
    result = run_case(work, *base, *options)
    if result.exit_code == 0 and base[0] == "evaluate":
        record = json.loads(next((work / "res").glob("*.json")).read_text())
        assert math.isfinite(record["accuracy"]) and 0 <= record["accuracy"] <= 100


def test_the_harness_catches_a_traceback(template, tmp_path_factory, monkeypatch):
    """The contract check fails on a crash: a harness that cannot fail proves nothing."""
    work = project(template, tmp_path_factory)

    def crash(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("ptq_cli.services.measure.report.report_from_results", crash)
    with pytest.raises(AssertionError):
        run_case(work, "report")



# The trust boundaries (issue "Trust boundaries"): security payloads, special files, resource bombs and
# output collisions, each drawn at random over every file ptq reads or writes.

def evil_reduce(marker: Path, draw):
    """A callable and its arguments that create `marker` if anything calls them while unpickling."""
    choice = draw(st.sampled_from(["touch", "os.system", "eval", "exec", "subprocess", "open"]))
    if choice == "touch":
        return Path.touch, (marker,)
    if choice == "os.system":
        return os.system, (f"touch {marker}",)
    if choice == "eval":
        return eval, (f"__import__('pathlib').Path({str(marker)!r}).touch()",)
    if choice == "exec":
        return exec, (f"open({str(marker)!r}, 'w').close()",)
    if choice == "subprocess":
        import subprocess

        return subprocess.call, (["touch", str(marker)],)
    return open, (str(marker), "w")


class Reduce:
    def __init__(self, function, arguments) -> None:
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


@fuzz(500)
@given(data=st.data())
def test_fuzz_security_payloads(template, tmp_path_factory, data):
    """A pickle payload anywhere in a CIFAR batch, or a TorchScript file ptq did not write: nothing runs."""
    work = project(template, tmp_path_factory)
    marker = work / "cache" / "pwned"  # outside the snapshot: the contract's check is that it never appears
    if data.draw(st.booleans(), label="pickle"):
        victim = work / "cifar" / data.draw(st.sampled_from(["test_batch", "batches.meta", "data_batch_1", "data_batch_5"]), label="file")
        with open(victim, "rb") as handle:
            content = pickle.load(handle, encoding="bytes")
        payload = Reduce(*evil_reduce(marker, data.draw))
        where = data.draw(st.sampled_from(["new key", "replace", "nested", "whole"]), label="where")
        if where == "whole":
            content = payload
        elif where == "nested":
            content[b"filenames"] = [b"a.png", {b"x": payload}]
        else:
            content[b"payload" if where == "new key" else data.draw(st.sampled_from(sorted(content)))] = payload
        own(victim).write_bytes(pickle.dumps(content, protocol=data.draw(st.integers(0, pickle.HIGHEST_PROTOCOL), label="protocol")))
        command = data.draw(st.sampled_from([
            ("evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "res"),
            ("calibrate", "--data", "cifar", "--samples-per-class", "1", "--output", "calib_out.npz"),
            ("fetch", "--mirror", ".", "--dest", "out", "--asset", "cifar"),
        ]), label="command")
        if command[0] == "fetch":
            (work / "cifar").rename(work / "cifar-10-batches-py")
        result = run_case(work, *command)
        assert not marker.exists(), command
        read = {"evaluate": {"batches.meta", "test_batch"}, "calibrate": {"batches.meta", "data_batch_1", "data_batch_5"}}.get(command[0])
        assert result.exit_code == 2 or (read is not None and victim.name not in read), command
        return
    shutil.copy(template / "evil.pt", own(work / data.draw(st.sampled_from(["models/evil.pt", "evil.pt", "models/evil.onnx", "x.xml"]), label="as")))
    named = next(path for path in (work / "models" / "evil.pt", work / "evil.pt", work / "models" / "evil.onnx", work / "x.xml") if path.exists())
    command = data.draw(st.sampled_from([
        ("evaluate", "--data", "colours.npz", "--results-dir", "res"),
        ("evaluate", "--model", str(named.relative_to(work)), "--data", "colours.npz", "--results-dir", "res"),
        ("benchmark", "--model", str(named.relative_to(work)), "--data", "colours.npz", "--runs", "1", "--results-dir", "res"),
        ("quantize", "--model", str(named.relative_to(work)), "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx"),
    ]), label="command")
    result = run_case(work, *command)
    assert (work / "victim.txt").read_bytes() == b"mine", command
    if "--model" in command:
        assert result.exit_code == 2, command


SPECIAL_TARGETS = {
    "model": ("models/m.onnx", ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res")),
    "npz": ("colours.npz", ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res")),
    "calibration": ("calib.npz", ("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx")),
    "image": ("folder/test/red/0000.png", ("evaluate", "--model", "models/m.onnx", "--data", "folder", "--results-dir", "res")),
    "classes.txt": ("folder/classes.txt", ("evaluate", "--model", "models/m.onnx", "--data", "folder", "--results-dir", "res")),
    "cifar batch": ("cifar/test_batch", ("evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "res")),
    "cifar meta": ("cifar/batches.meta", ("calibrate", "--data", "cifar", "--samples-per-class", "1", "--output", "calib_out.npz")),
    "record": ("results/*.json", ("report", "--json")),
    "manifest": ("results/manifest.json", ("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-openvino", "--no-benchmark")),
}


def drawn_target(work: Path, targets: dict[str, tuple[str, tuple[str, ...]]], data) -> tuple[str, Path, tuple[str, ...]]:
    """A role drawn from `targets` (role -> (path or glob in the project, the command that reads it)): the role, its file, the command."""
    role = data.draw(st.sampled_from(sorted(targets)), label="role")
    pattern, command = targets[role]
    return role, sorted(work.glob(pattern))[0] if "*" in pattern else work / pattern, command


@fuzz(700)
@given(data=st.data())
def test_fuzz_special_files(template, tmp_path_factory, data):
    """Any input replaced by a FIFO, a device, a directory or a dangling link: refused in one line, never read."""
    work = project(template, tmp_path_factory)
    _, target, command = drawn_target(work, SPECIAL_TARGETS, data)
    target.unlink()
    kind = data.draw(st.sampled_from(["fifo", "/dev/zero", "/dev/null", "/dev/urandom", "directory", "dangling link", "link to a directory"]), label="kind")
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    elif kind == "dangling link":
        target.symlink_to(work / "nothing-here")
    elif kind == "link to a directory":
        target.symlink_to(work / "folder" / "test")
    else:
        target.symlink_to(kind)
    run_case(work, *command)


def png_declaring(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header says width x height (the CRC fixed): a decompression bomb's first bytes."""
    import io
    import struct
    import zlib

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def npy_header_claiming(shape: tuple[int, ...], dtype: str = "|u1") -> bytes:
    header = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape!r}, }}"
    padded = header + " " * (63 - (len(header) + 10) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded.encode()


@fuzz(700)
@given(data=st.data())
def test_fuzz_resource_bombs(template, tmp_path_factory, data):
    """Huge labels, declared arrays, pixels, dimensions, class counts, batches: refused before the memory is asked for."""
    work = project(template, tmp_path_factory)
    kind = data.draw(st.sampled_from(["label", "npz shape", "png pixels", "model dims", "fixed batch", "class names", "output classes"]), label="kind")
    big = data.draw(st.integers(2**16, 2**62), label="big")
    command = ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res")
    if kind == "label":
        images, labels = colour_images(2)
        labels[data.draw(st.integers(0, len(labels) - 1))] = big
        np.savez(own(work / "colours.npz"), images=images, labels=labels)
    elif kind == "npz shape":
        member = data.draw(st.sampled_from(["images", "labels"]), label="member")
        images, labels = colour_images(2)
        with zipfile.ZipFile(own(work / "colours.npz"), "w") as archive:
            for name, array in (("images", images), ("labels", labels)):
                if name == member:
                    shape = (big, 8, 8, 3) if name == "images" else (big,)
                    archive.writestr(f"{name}.npy", npy_header_claiming(shape, "|u1" if name == "images" else "<i8") + b"\0" * 64)
                else:
                    with archive.open(f"{name}.npy", "w") as handle:
                        np.lib.format.write_array(handle, array)
    elif kind == "png pixels":
        width = data.draw(st.integers(1, 2**31 - 1), label="width")
        own(work / "folder" / "test" / "red" / "0000.png").write_bytes(png_declaring(width, max(1, big % (2**31 - 1))))
        command = ("evaluate", "--model", "models/m.onnx", "--data", "folder", "--results-dir", "res")
    elif kind in ("model dims", "fixed batch", "output classes"):
        proto = onnx.load(str(work / "models" / "m.onnx"))
        dims = (proto.graph.output[0] if kind == "output classes" else proto.graph.input[0]).type.tensor_type.shape.dim
        index = 1 if kind == "output classes" else 0 if kind == "fixed batch" else data.draw(st.integers(1, 3))
        dims[index].Clear()
        dims[index].dim_value = big
        own(work / "models" / "m.onnx").write_bytes(proto.SerializeToString())
    else:
        images, labels = colour_images(2)
        count = data.draw(st.integers(100_001, 300_000), label="names")
        np.savez(own(work / "colours.npz"), images=images, labels=labels, class_names=np.array([f"c{index}" for index in range(count)]))
    run_case(work, *command)


COLLISION_COMMANDS = [
    (("calibrate", "--data", "colours.npz", "--output", "{out}"), ("colours.npz",)),
    (("calibrate", "--data", "colours.npz", "--model", "models/m.onnx", "--output", "{out}"), ("colours.npz", "models/m.onnx")),
    (("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "{out}"),
     ("models/m.onnx", "colours.npz", "calib.npz")),
    (("quantize", "--backend", "openvino", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "{out}"),
     ("models/m.onnx", "colours.npz", "calib.npz")),
    (("convert", "--onnx", "models/m.onnx", "--torch", "{out}", "--data", "colours.npz", "--check-images", "3"), ("models/m.onnx", "colours.npz")),
    (("prune", "--model", "models/m.onnx", "--output", "{out}", "--no-reconstruct"), ("models/m.onnx",)),
    (("report", "--markdown", "{out}"), ()),
    (("report", "--plot", "--markdown", "{out}"), ()),
]
COLLISION_PATHS = st.sampled_from(["models/m.onnx", "colours.npz", "calib.npz", "big.onnx", "models/m_uint8.onnx", "folder/test/red/0000.png",
                                   "results/*.json", "cifar/test_batch", "models/m.bin", "models/m.xml", "alias", "link"])


@fuzz(800)
@given(data=st.data())
def test_fuzz_output_collisions(template, tmp_path_factory, data):
    """An output named as an input, another output, a hard link or a symbolic link to one: no input changes."""
    work = project(template, tmp_path_factory)
    command, inputs = data.draw(st.sampled_from(COLLISION_COMMANDS), label="command")
    chosen = data.draw(COLLISION_PATHS, label="output")
    if chosen == "models/m.bin":
        own(work / "models" / "m.bin").write_bytes((work / "models" / "m.onnx").read_bytes())
    if chosen in ("alias", "link"):
        victim = data.draw(st.sampled_from([*inputs, "models/m_uint8.onnx"]), label="victim")
        suffix = data.draw(st.sampled_from([".onnx", ".npz", ".pt", ".md", ".xml"]), label="suffix")
        chosen = f"{chosen}{suffix}"
        (os.link if chosen.startswith("alias") else os.symlink)(work / victim, work / chosen)
    if "*" in chosen:
        chosen = str(sorted(work.glob(chosen))[0].relative_to(work))
    protected = {name: (work / name).read_bytes() for name in (*inputs, *(str(path.relative_to(work)) for path in (work / "results").rglob("*.json")))}
    if command[0] == "report":
        protected.update({str(path.relative_to(work)): path.read_bytes() for path in (work / "models").glob("*")})
    run_case(work, *(part.replace("{out}", chosen) for part in command))
    changed = [name for name, content in protected.items() if (work / name).read_bytes() != content]
    assert not changed, (command, chosen, changed)


# Hostile input, second round (issue 36): the kinds that broke ptq, each a category drawn at random.

def nested(depth: int, draw) -> str:
    """JSON nested `depth` deep, in lists or objects."""
    if draw(st.booleans(), label="objects"):
        return '{"a":' * depth + "1" + "}" * depth
    return "[" * depth + "]" * depth


DEEP_TARGETS = {
    "record": ("results/*.json", ("report", "--json")),
    "benchmark record": ("results/benchmarks/*.json", ("report", "--json")),
    "manifest": ("results/manifest.json", ("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-openvino", "--no-benchmark")),
    "model ptq.input": ("models/m.onnx", ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res")),
    "model ptq.quantization": ("models/m_uint8.onnx", ("evaluate", "--model", "models/m_uint8.onnx", "--data", "colours.npz", "--results-dir", "res")),
    "model ptq.pruning": ("models/m.onnx", ("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx")),
}


@fuzz(120)
@given(data=st.data())
def test_fuzz_deep_json(template, tmp_path_factory, data):
    """JSON nested past any sane depth, in a record, the manifest or a model's metadata: one line or skipped, never a RecursionError."""
    work = project(template, tmp_path_factory)
    role, target, command = drawn_target(work, DEEP_TARGETS, data)
    text = nested(data.draw(st.integers(65, 30_000), label="depth"), data.draw)
    if role.startswith("model"):
        proto = onnx.load(str(target))
        onnx.helper.set_model_props(proto, {**{prop.key: prop.value for prop in proto.metadata_props}, role.split()[1]: text})
        own(target).write_bytes(proto.SerializeToString())
    else:
        own(target).write_text(text)
    run_case(work, *command)


NAME_TEXT = st.one_of(
    st.sampled_from(["[/]", "[bold]x", "[link=file:///etc/passwd]y", "\\[x]", "[red]m[/red]", "a*/b", "x" * 240]),
    st.binary(min_size=1, max_size=12).map(lambda raw: os.fsdecode(raw.replace(b"/", b"_").replace(b"\0", b"_"))),
    st.text(alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1, max_size=20),
)


@fuzz(200)
@given(data=st.data())
def test_fuzz_names(template, tmp_path_factory, data):
    """Class folders, image files, model files and class names no codec takes, with rich markup, or at a file name's limit:
    exit 0 with every name shown, or one line."""
    work = project(template, tmp_path_factory)
    name = data.draw(NAME_TEXT, label="name").strip() or "x"
    if name in (".", ".."):
        name = "dots"
    where = data.draw(st.sampled_from(["class folder", "image file", "model file", "npz class name", "bom classes.txt"]), label="where")
    command = ("evaluate", "--model", "models/m.onnx", "--data", "folder", "--results-dir", "res", "--per-class")
    try:
        if where == "class folder":
            for split in ("train", "test"):
                (work / "folder" / split / "red").rename(work / "folder" / split / name)
            (work / "folder" / "classes.txt").unlink()
        elif where == "image file":
            (work / "folder" / "test" / "red" / "0000.png").rename(work / "folder" / "test" / "red" / f"{name[:200]}.png")
        elif where == "model file":
            shutil.copy(work / "models" / "m.onnx", own(work / f"{name[:200]}.onnx"))
            command = ("evaluate", "--model", f"{name[:200]}.onnx", "--data", "colours.npz", "--results-dir", "res")
        elif where == "npz class name":
            images, labels = colour_images(2)
            np.savez(own(work / "colours.npz"), images=images, labels=labels, class_names=np.array([name, "green", "blue"]))
            command = ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res", "--per-class")
        else:
            own(work / "folder" / "classes.txt").write_bytes(b"\xef\xbb\xbf" + (work / "folder" / "classes.txt").read_bytes())
    except OSError:  # a name this file system refuses (too long in bytes): nothing to test
        return
    result = run_case(work, *command)
    if where == "bom classes.txt":
        assert result.exit_code == 0, result.output  # a byte-order mark is not part of the first class's name
    if result.exit_code == 0:
        assert invoke("report", "--results-dir", "res", cwd=work).exit_code == 0


ENVIRONMENT = {
    "PTQ_MAX_IMAGE_PIXELS": st.sampled_from(["0", "-5", "1", "99999999999999999999999", "1e9", "", " 7 "]),
    "PTQ_MAX_MODEL_BYTES": st.sampled_from(["0", "1", "99999999999999999999999", "-1", "x"]),
    "PTQ_MAX_ARRAY_BYTES": st.sampled_from(["0", "100", "99999999999999999999999"]),
    "PTQ_MAX_TEXT_BYTES": st.sampled_from(["0", "10", "99999999999999999999999"]),
    "PTQ_CPUINFO": st.sampled_from(["/dev/zero", "/dev/null", "/dev/stdin", "fifo", "missing", "folder", "colours.npz", "random", "cpuinfo"]),
}


@fuzz(150)
@given(data=st.data())
def test_fuzz_environment(template, tmp_path_factory, data):
    """Limits at their extremes and CPU descriptions ptq cannot read (a FIFO, a device, random bytes): one line or a right
    result, never a hang, a traceback or a guessed int8 path."""
    from ptq_cli.x86 import cpu as cpu_info

    work = project(template, tmp_path_factory)
    variable = data.draw(st.sampled_from(sorted(ENVIRONMENT)), label="variable")
    value = data.draw(ENVIRONMENT[variable], label="value")
    if variable == "PTQ_CPUINFO":
        if value == "fifo":
            os.mkfifo(work / "fifo")
        elif value == "random":
            own(work / "random").write_bytes(np.random.default_rng(data.draw(st.integers(0, 99))).bytes(200))
        elif value == "cpuinfo":
            own(work / "cpuinfo").write_text("model name : Drawn CPU\nflags : avx2\n")
        value = value if value.startswith("/") else str(work / value)
    command = data.draw(st.sampled_from([("evaluate", "--model", "models/m_uint8.onnx", "--data", "colours.npz", "--results-dir", "res", "--json"),
                                         ("report", "--json")]), label="command")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(variable, value)
        cpu_info.current.cache_clear()
        try:
            result = run_case(work, *command)
        finally:
            cpu_info.current.cache_clear()
    if variable == "PTQ_CPUINFO" and command[0] == "evaluate":
        assert (result.exit_code == 0) == value.endswith("cpuinfo"), (value, result.output)  # read, or refused: never guessed
        if result.exit_code == 0:
            assert json.loads(result.stdout)["cpu"]["model"] == "Drawn CPU"


@fuzz(30)
@given(data=st.data())
def test_fuzz_study_outputs_over_user_files(template, tmp_path_factory, data):
    """`ptq run` on data that sits where one of its stages writes, or is linked there: the user's file never changes."""
    work = project(template, tmp_path_factory)
    where = data.draw(st.sampled_from(["calibration/m_calib.npz", "models/m_int8.onnx.npz", "results/x.npz"]), label="where")
    how = data.draw(st.sampled_from(["file", "hard link", "symbolic link"]), label="how")
    target = work / where
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    if how == "file":
        shutil.copy(work / "colours.npz", own(target))
        data_path = where
    else:
        (os.link if how == "hard link" else os.symlink)(work / "colours.npz", target)
        data_path = "colours.npz"
    before = (work / data_path).read_bytes()
    run_case(work, "run", "--model", "models/m.onnx", "--data", data_path, "--no-pytorch", "--no-openvino", "--no-benchmark")
    assert (work / data_path).read_bytes() == before and (work / "colours.npz").read_bytes() == before


@fuzz(40)
@given(data=st.data())
def test_fuzz_container_bombs(template, tmp_path_factory, data):
    """Arrays that fit one by one but not together, and a CIFAR batch of references to one row: refused before allocating."""
    work = project(template, tmp_path_factory)
    if data.draw(st.booleans(), label="npz"):
        members = data.draw(st.integers(2, 6), label="members")
        with zipfile.ZipFile(own(work / "colours.npz"), "w", zipfile.ZIP_DEFLATED) as archive:
            for index in range(members):
                with archive.open(f"{'images' if index == 0 else f'extra{index}'}.npy", "w") as handle:
                    np.lib.format.write_array(handle, np.zeros((60, 8, 8, 3), np.uint8))
            with archive.open("labels.npy", "w") as handle:
                np.lib.format.write_array(handle, np.zeros(60, np.int64))
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PTQ_MAX_ARRAY_BYTES", str(60 * 8 * 8 * 3 + 60 * 8 + 1))  # each fits, all together do not
            result = run_case(work, "evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res")
        assert result.exit_code == 2 and "together" in result.stderr
        return
    row = np.zeros(3072, np.uint8)
    count = data.draw(st.integers(1000, 300_000), label="references")
    own(work / "cifar" / "test_batch").write_bytes(pickle.dumps({b"data": [row] * count, b"labels": [0] * count}, protocol=2))
    result = run_case(work, "evaluate", "--model", "big.onnx", "--data", "cifar", "--results-dir", "res")
    assert result.exit_code == 2 and "test_batch" in result.stderr


SYMBOL_TEXT = st.one_of(st.sampled_from(["class", "new", "this", "template", "typeof", "constexpr", "main", "_Float32", "", "x__y", "ok",
                                         "a b", "9lives", "_x", "int", "errno"]),
                        st.text(alphabet="abcXYZ_019$-. ", min_size=0, max_size=12))


@fuzz(60)
@given(data=st.data())
def test_fuzz_export_symbols(template, tmp_path_factory, data):
    """`export --c-array` with a drawn --symbol or file name: C and C++ compile what it writes, or it refuses in one line."""
    compilers = [shutil.which("gcc"), shutil.which("g++")]
    tflite = Path(os.environ.get(ptq_settings.ASSETS_ENV, ptq_settings.DEFAULT_ASSETS)) / "mlperf-tiny-resnet8" / "pretrainedResnet_quant.tflite"
    if not tflite.is_file():
        pytest.skip("needs the MLPerf Tiny int8 .tflite (../shared/assets)")
    work = project(template, tmp_path_factory)
    if data.draw(st.booleans(), label="symbol given"):
        shutil.copy(tflite, own(work / "model.tflite"))
        command = ("export", "--model", "model.tflite", "--c-array", "--no-arena", "--output-dir", "out", "--symbol", data.draw(SYMBOL_TEXT, label="symbol"))
    else:
        name = data.draw(NAME_TEXT, label="file name").strip()[:100] or "x"
        try:
            shutil.copy(tflite, own(work / f"{name}.tflite"))
        except OSError:
            return
        command = ("export", "--model", f"{name}.tflite", "--c-array", "--no-arena", "--output-dir", "out")
        result = run_case(work, *command)
        assert result.exit_code == 0, result.output  # a derived symbol is made valid, never refused
    result = run_case(work, *command)
    written = sorted((work / "out").glob("*")) if (work / "out").is_dir() else []
    if result.exit_code == 2:
        assert not written
        return
    assert [path.suffix for path in written] == [".c", ".h"]
    if all(compilers):
        import subprocess

        for compiler, standard in zip(compilers, ("-std=c11", "-std=c++17"), strict=True):
            built = subprocess.run([compiler, standard, "-x", "c" if "++" not in compiler else "c++", "-c", str(written[0]), "-o", os.devnull],
                                   capture_output=True, text=True)
            assert built.returncode == 0, (command, built.stderr[:400])


# Hostile input, third round: the kinds that ran an attacker's code or never ended.

CODE_TEMPLATES = (
    'flatten") if getattr(__import__("os"),"system")("touch {marker}") else getattr(self,"flatten',
    'x"]; __import__("os").system("touch {marker}"); y=["',
    "x')\n__import__('pathlib').Path('{marker}').touch()\n#",
    'a\\"); open("{marker}", "w"); ("',
    "{{__import__('os').system('touch {marker}')}}",
)


@fuzz(30)
@given(data=st.data())
def test_fuzz_node_names_with_code(template, tmp_path_factory, data):
    """ONNX node names that would be code if torch.fx wrote them into its generated source: nothing runs."""
    work = project(template, tmp_path_factory)
    marker = work / "cache" / "pwned"
    model = onnx.load(str(work / "models" / "m.onnx"))
    for index, node in enumerate(model.graph.node):
        kind = data.draw(st.sampled_from(["code", "text", "empty", "same"]), label="name")
        if kind == "code":
            node.name = data.draw(st.sampled_from(CODE_TEMPLATES), label="template").format(marker=marker) + str(index)
        elif kind == "text":
            node.name = data.draw(st.text(max_size=30), label="text") + f"#{index}"
        elif kind == "empty":
            node.name = ""
    onnx.save(model, str(own(work / "models" / "named.onnx")))
    command = data.draw(st.sampled_from([
        ("convert", "--onnx", "models/named.onnx", "--torch", "out/named.pt", "--data", "colours.npz", "--check-images", "4"),
        ("quantize", "--backend", "pytorch", "--model", "models/named.onnx", "--data", "colours.npz", "--calibration", "calib.npz",
         "--output", "out/q.pt"),
    ]), label="command")
    run_case(work, *command)
    assert not marker.exists(), command


IMAGE_IMPOSTORS = {
    "PostScript": b"%!PS-Adobe-3.0\n{ } loop\n",
    "EPS": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto showpage\n",
    "binary EPS": b"\xc5\xd0\xd3\xc6" + b"\x20\x00\x00\x00" + b"\x00" * 24 + b"%!PS-Adobe-3.0 EPSF-3.0\n",
    "PDF": b"%PDF-1.7\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n",
    "GIF": b"GIF89a\x01\x00\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x00;",
    "TIFF": b"II*\x00\x08\x00\x00\x00\x00\x00",
    "SVG": b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"/>',
    "ICO": b"\x00\x00\x01\x00\x01\x00\x01\x01\x00\x00",
    "PPM": b"P6\n1 1\n255\n\x00\x00\x00",
    "XBM": b"#define x_width 1\n#define x_height 1\nstatic char x_bits[] = {0x00};\n",
}


@fuzz(200)
@given(data=st.data())
def test_fuzz_image_impostors(template, tmp_path_factory, data):
    """Files of another format under an image's name: Pillow is let open only PNG, JPEG, BMP and WebP; Ghostscript never runs."""
    from PIL import EpsImagePlugin

    work = project(template, tmp_path_factory)
    images = sorted((work / "folder").rglob("*.png"))
    victim = images[data.draw(st.integers(0, len(images) - 1), label="victim")]
    kind = data.draw(st.sampled_from(sorted(IMAGE_IMPOSTORS)), label="kind")
    content = IMAGE_IMPOSTORS[kind] + data.draw(st.binary(max_size=16), label="tail")
    victim.unlink()
    victim = victim.with_suffix(data.draw(st.sampled_from([".png", ".jpg", ".jpeg", ".bmp", ".webp"]), label="suffix"))
    own(victim).write_bytes(content)
    ran: list = []
    command = data.draw(st.sampled_from([
        ("evaluate", "--model", "models/m.onnx", "--data", "folder", "--results-dir", "res"),
        ("calibrate", "--data", "folder", "--samples-per-class", "3", "--output", "calib_out.npz"),
        ("quantize", "--model", "models/m.onnx", "--data", "folder", "--output", "q.onnx"),
    ]), label="command")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ran.append(args))
        result = run_case(work, *command)
    assert not ran, command
    reads = "test" if command[0] == "evaluate" else "train"  # calibration images come from the train split
    if victim.parent.parent.name == reads:
        assert result.exit_code == 2, (command, kind, victim)


@fuzz(200)
@given(data=st.data())
def test_fuzz_aliased_external_data(template, tmp_path_factory, data):
    """Tensors naming the same, overlapping or absent bytes of external files: bounded per tensor, one line or a sound result."""
    work = project(template, tmp_path_factory)
    model = onnx.load(str(work / "models" / "m.onnx"))
    files = {name: data.draw(st.integers(0, 4096), label=f"{name} bytes") for name in ("a.bin", "b.bin")}
    for name, size in files.items():
        own(work / "models" / name).write_bytes(bytes(size))
    for index in range(data.draw(st.integers(1, 12), label="tensors")):
        location = data.draw(st.sampled_from(["a.bin", "b.bin", "missing.bin", "../colours.npz", "/etc/passwd", ""]), label="location")
        count = data.draw(st.integers(0, 600), label="floats")
        tensor = onnx.TensorProto(name=f"alias{index}", data_type=onnx.TensorProto.FLOAT, dims=[count], data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", location), ("offset", data.draw(st.one_of(st.none(), st.integers(-8, 5000)), label="offset")),
                           ("length", data.draw(st.one_of(st.none(), st.integers(-8, 5000)), label="length"))):
            if value is not None:
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
        model.graph.initializer.append(tensor)
    onnx.save(model, str(own(work / "models" / "aliased.onnx")))
    limit = data.draw(st.sampled_from(["", "2000", "20000"]), label="limit")
    command = data.draw(st.sampled_from([
        ("evaluate", "--model", "models/aliased.onnx", "--data", "colours.npz", "--results-dir", "res"),
        ("quantize", "--model", "models/aliased.onnx", "--data", "colours.npz", "--calibration", "calib.npz", "--output", "q.onnx"),
    ]), label="command")
    with pytest.MonkeyPatch.context() as patch:
        if limit:
            patch.setenv("PTQ_MAX_MODEL_BYTES", limit)
        run_case(work, *command)


def _kernel_blocking_file() -> list[str]:
    """/proc/kmsg where this process may open it: a regular file of the kernel's that waits for data when read."""
    try:
        os.close(os.open("/proc/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        return []
    return ["/proc/kmsg"]


BLOCKING = _kernel_blocking_file()


@pytest.mark.skipif(not BLOCKING, reason="no readable file here waits for data when read (/proc/kmsg needs root)")
@fuzz(150)
@given(data=st.data())
def test_fuzz_blocking_files(template, tmp_path_factory, data):
    """Any input, or the CPU description, a link to a file that waits for data when read: one line, never a hang."""
    work = project(template, tmp_path_factory)
    role = data.draw(st.sampled_from([*sorted(SPECIAL_TARGETS), "cpuinfo", "external data"]), label="role")
    if role == "cpuinfo":
        command = ("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PTQ_CPUINFO", BLOCKING[0])
            from ptq_cli.x86 import cpu

            cpu.current.cache_clear()
            try:
                result = run_case(work, *command)
            finally:
                cpu.current.cache_clear()
        assert result.exit_code == 2
        return
    if role == "external data":
        model = onnx.load(str(work / "models" / "m.onnx"))
        onnx.save(model, str(work / "models" / "ext.onnx"), save_as_external_data=True, location="ext.bin", size_threshold=0)
        (work / "models" / "ext.bin").unlink()
        (work / "models" / "ext.bin").symlink_to(BLOCKING[0])
        run_case(work, "evaluate", "--model", "models/ext.onnx", "--data", "colours.npz", "--results-dir", "res")
        return
    _, target, command = drawn_target(work, {role: SPECIAL_TARGETS[role]}, data)
    target.unlink()
    target.symlink_to(BLOCKING[0])
    run_case(work, *command)


@fuzz(40)
@given(data=st.data())
def test_fuzz_addresses_that_are_not_ray(template, tmp_path_factory, data):
    """A --ray-address whose port answers with anything but a gRPC server's first frame: one line, at once."""
    import socketserver
    import threading

    work = project(template, tmp_path_factory)
    answer = data.draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"HTTP/1.1 400 Bad Request\r\n\r\n", b"SSH-2.0-OpenSSH_9.6\r\n",
                                                                          b"+OK redis\r\n", b"\x00\x00\x00\x07\x00\x00\x00\x00\x00"])), label="answer")
    close = data.draw(st.booleans(), label="close after")

    class Answer(socketserver.BaseRequestHandler):
        def handle(self):
            try:
                self.request.sendall(answer)
                if not close:
                    self.request.recv(64)
            except OSError:
                pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = data.draw(st.sampled_from(["{}", "ray://{}"]), label="form").format(f"127.0.0.1:{server.server_address[1]}")
        result = run_case(work, "evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "res", "--ray-address", address)
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 2


@fuzz(6)
@given(data=st.data())
def test_fuzz_slow_servers(template, tmp_path_factory, data):
    """A server that sends a little now and then, never idle long enough for a socket timeout: stopped at the download's deadline."""
    import http.server
    import threading
    import time

    work = project(template, tmp_path_factory)
    pause = data.draw(st.sampled_from([0.05, 0.2, 0.5]), label="pause")
    announced = data.draw(st.sampled_from([None, 10**6, 10**9]), label="announced")

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            if announced:
                self.send_header("Content-Length", str(announced))
            self.end_headers()
            for _ in range(int(6 / pause)):
                try:
                    self.wfile.write(b"\x1f")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(pause)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    asset = data.draw(st.sampled_from(["cifar", "model"]), label="asset")
    url = f"http://127.0.0.1:{server.server_address[1]}/x"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PTQ_DOWNLOAD_TIMEOUT", "1")
            started = time.monotonic()
            result = run_case(work, "fetch", "--dest", "out", "--asset", asset, f"--{asset}-url", url)
            took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 2 and "not done within 1 seconds" in result.stderr and took < 4
