"""`ptq fetch`: downloads from a local HTTP server (there is no outside network here), and mirrors."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import KERAS_MODEL, assert_clean_failure, ptq, ptq_ok

from ptq_cli.datasets import cifar10 as cifar
from ptq_cli.services import fetch

CLASS_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _batch(labels: list[int]) -> bytes:
    data = np.zeros((len(labels), 3072), dtype=np.uint8)
    data[:, 0] = np.array(labels, dtype=np.uint8)  # one pixel tells the class, so batches differ
    return pickle.dumps({b"data": data, b"labels": labels}, protocol=2)


def _cifar_files(test_labels: list[int]) -> dict[str, bytes]:
    files = {cifar.META_FILE: pickle.dumps({b"label_names": [name.encode() for name in CLASS_NAMES]}, protocol=2)}
    files.update({name: _batch(list(range(10))) for name in cifar.TRAIN_BATCHES})
    files[cifar.TEST_BATCH] = _batch(test_labels)
    return files


def _tarball(files: dict[str, bytes]) -> bytes:
    """A small CIFAR-10 python tarball: the official layout, 10 training images per batch, 10,000 blank test images."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{fetch.CIFAR_DIR_NAME}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


VALID_TEST_LABELS = [label for label in range(10) for _ in range(1000)]


@pytest.fixture(scope="module")
def archive() -> bytes:
    return _tarball(_cifar_files(VALID_TEST_LABELS))


@pytest.fixture(scope="module")
def server(archive):
    """127.0.0.1: /cifar.tar.gz, /cut/cifar.tar.gz (announces every byte, sends half, hangs up), /model.h5."""
    files = {"/cifar.tar.gz": archive, "/model.h5": KERAS_MODEL.read_bytes()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            cut = self.path.startswith("/cut/")
            data = files.get(self.path.removeprefix("/cut") if cut else self.path)
            if data is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2] if cut else data)
            self.wfile.flush()
            if cut:
                self.close_connection = True

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _everything(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*")) if directory.exists() else []


def test_download_checks_the_md5_and_sha256_and_unpacks_cifar(tmp_path, server, archive):
    run = ptq_ok("fetch", "--dest", "assets", "--cifar-url", f"{server}/cifar.tar.gz", "--cifar-md5", hashlib.md5(archive).hexdigest(),
                 "--model-url", f"{server}/model.h5", "--json", cwd=tmp_path)
    result = json.loads(run.stdout)
    assert [(asset["asset"], asset["action"]) for asset in result["assets"]] == [("cifar", "downloaded"), ("model", "downloaded")]
    assets = tmp_path / "assets"
    assert _everything(assets) == sorted(
        ["cifar-10-batches-py", "mlperf-tiny-resnet8", "mlperf-tiny-resnet8/pretrainedResnet.h5"]
        + [f"cifar-10-batches-py/{name}" for name in (cifar.META_FILE, *cifar.TRAIN_BATCHES, cifar.TEST_BATCH)]
    )
    assert (assets / "mlperf-tiny-resnet8" / "pretrainedResnet.h5").read_bytes() == KERAS_MODEL.read_bytes()
    summary = cifar.validate_directory(assets / "cifar-10-batches-py")
    assert (summary.train_images, summary.test_images, summary.class_names) == (50, 10_000, tuple(CLASS_NAMES))
    again = json.loads(ptq_ok("fetch", "--dest", "assets", "--cifar-url", f"{server}/missing", "--json", cwd=tmp_path).stdout)
    assert {asset["action"] for asset in again["assets"]} == {"already present"}


def test_wrong_checksum_leaves_nothing(tmp_path, server):
    run = ptq("fetch", "--dest", "assets", "--asset", "cifar", "--cifar-url", f"{server}/cifar.tar.gz", "--cifar-md5", "0" * 32, cwd=tmp_path)
    assert_clean_failure(run, 2, f"{server}/cifar.tar.gz")
    assert "does not match" in run.stderr
    assert _everything(tmp_path / "assets") == []


def test_wrong_model_checksum_leaves_no_model_file(tmp_path, server):
    run = ptq("fetch", "--dest", "assets", "--asset", "model", "--model-url", f"{server}/cifar.tar.gz", cwd=tmp_path)
    assert_clean_failure(run, 2, "sha256")
    assert _everything(tmp_path / "assets") == ["mlperf-tiny-resnet8"]


def test_connection_cut_halfway_leaves_no_partial_file_and_keeps_a_good_copy(tmp_path, server, archive):
    md5 = hashlib.md5(archive).hexdigest()
    run = ptq("fetch", "--dest", "assets", "--asset", "cifar", "--cifar-url", f"{server}/cut/cifar.tar.gz", "--cifar-md5", md5, cwd=tmp_path)
    assert_clean_failure(run, 2, "connection closed after")
    assert _everything(tmp_path / "assets") == []
    ptq_ok("fetch", "--dest", "assets", "--asset", "cifar", "--cifar-url", f"{server}/cifar.tar.gz", "--cifar-md5", md5, cwd=tmp_path)
    before = _everything(tmp_path / "assets")
    run = ptq("fetch", "--dest", "assets", "--asset", "cifar", "--force", "--cifar-url", f"{server}/cut/cifar.tar.gz", "--cifar-md5", md5, cwd=tmp_path)
    assert run.returncode == 2
    assert _everything(tmp_path / "assets") == before  # the failed refetch replaced nothing


def test_mirror_copies_and_validates_the_real_assets(tmp_path, assets):
    result = json.loads(ptq_ok("fetch", "--mirror", assets, "--dest", "copy", "--json", cwd=tmp_path).stdout)
    assert [asset["action"] for asset in result["assets"]] == ["copied", "copied"]
    for name in (cifar.META_FILE, *cifar.TRAIN_BATCHES, cifar.TEST_BATCH):
        assert (tmp_path / "copy" / "cifar-10-batches-py" / name).read_bytes() == (assets / "cifar-10-batches-py" / name).read_bytes()
    in_place = json.loads(ptq_ok("fetch", "--mirror", assets, "--dest", assets, "--json", cwd=tmp_path).stdout)
    assert [asset["action"] for asset in in_place["assets"]] == ["checked in place", "checked in place"]
    text = ptq_ok("fetch", "--mirror", assets, "--dest", "copy", "--asset", "model", cwd=tmp_path).stdout
    assert "model: already present" in text and "input 32x32x3" in text


def test_mirror_with_a_wrong_class_count_is_refused(tmp_path):
    mirror = tmp_path / "mirror" / fetch.CIFAR_DIR_NAME
    mirror.mkdir(parents=True)
    for name, data in _cifar_files(VALID_TEST_LABELS[:-1] + [0]).items():  # 1,001 airplanes, 999 trucks
        (mirror / name).write_bytes(data)
    run = ptq("fetch", "--mirror", tmp_path / "mirror", "--dest", "copy", "--asset", "cifar", cwd=tmp_path)
    assert_clean_failure(run, 2, "test_batch")
    assert "expected 1000 of each" in run.stderr
    assert not (tmp_path / "copy").exists()


def test_fetch_keeps_what_a_user_put_beside_the_data_and_never_streams_forever(tmp_path, server, archive):
    """A refetch replaces only the files it fetches; a URL to a device, a FIFO or an endless stream ends in one line."""
    md5 = hashlib.md5(archive).hexdigest()
    ptq_ok("fetch", "--dest", "assets", "--asset", "cifar", "--cifar-url", f"{server}/cifar.tar.gz", "--cifar-md5", md5, cwd=tmp_path)
    notes = tmp_path / "assets" / fetch.CIFAR_DIR_NAME / "notes.txt"
    notes.write_text("mine")
    ptq_ok("fetch", "--dest", "assets", "--asset", "cifar", "--force", "--cifar-url", f"{server}/cifar.tar.gz", "--cifar-md5", md5, cwd=tmp_path)
    assert notes.read_text() == "mine" and not [path for path in (tmp_path / "assets").iterdir() if path.name.startswith(".")]
    import os

    os.mkfifo(tmp_path / "fifo")
    for url in ("file:///dev/zero", f"file://{tmp_path / 'fifo'}", f"file://{tmp_path / 'nothing'}"):
        run = ptq("fetch", "--dest", "other", "--asset", "cifar", "--cifar-url", url, cwd=tmp_path)
        assert_clean_failure(run, 2, url)
    (tmp_path / "big").write_bytes(b"\0" * (fetch.MODEL_MAX_BYTES + 1))  # past any real .h5: refused while streaming
    run = ptq("fetch", "--dest", "other", "--asset", "model", "--model-url", f"file://{tmp_path / 'big'}", cwd=tmp_path)
    assert_clean_failure(run, 2, "more than")
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").rglob("*.h5"))


def test_a_destination_inside_the_mirror_is_refused_before_any_copy(tmp_path):
    mirror = tmp_path / "mirror" / fetch.CIFAR_DIR_NAME
    mirror.mkdir(parents=True)
    for name, data in _cifar_files(VALID_TEST_LABELS).items():
        (mirror / name).write_bytes(data)
    run = ptq("fetch", "--mirror", tmp_path / "mirror", "--dest", tmp_path / "mirror" / "sub", cwd=tmp_path)
    assert_clean_failure(run, 2, "inside the mirror")
    assert not (tmp_path / "mirror" / "sub").exists()
