"""Put the assets where ptq expects them: download (checksum-verified) or copy from a local mirror.

Nothing reaches its final place before it is complete and valid: downloads go to a temporary file
beside the destination and are renamed only after the checksum matches; CIFAR-10 is unpacked into a
temporary directory, validated by structure, then renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptq_cli.datasets import cifar10 as cifar
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.model_file import HDF5_SIGNATURE

CIFAR = "cifar"
MODEL = "model"
ASSETS = (CIFAR, MODEL)
CIFAR_DIR_NAME = "cifar-10-batches-py"
MODEL_DIR_NAME = "mlperf-tiny-resnet8"
MODEL_FILE_NAME = "pretrainedResnet.h5"
# The official python tarball and the md5 published next to it on the CIFAR-10 page.
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
# MLCommons Tiny's reference model; the sha256 is that of the copy this project was built and tested with.
MODEL_URL = "https://github.com/mlcommons/tiny/raw/master/benchmark/training/image_classification/trained_models/pretrainedResnet.h5"
MODEL_SHA256 = "5f938a8eea605438cc7360aa13c987bc6d7bd0c8d931b2917361ae7ae4eeda2f"
CHUNK = 1 << 16
TIMEOUT_SECONDS = 60

ProgressCallback = Callable[[str, int, int], None]  # (asset, bytes done, bytes total or 0)


@dataclass(frozen=True)
class Source:
    url: str
    algorithm: str  # "md5" or "sha256"
    digest: str
    max_bytes: int = 1 << 30  # a download that goes on past this is not the asset (a stream of zeros, a wrong URL)


# The assets' sizes, with room: the CIFAR-10 tarball is 170,498,071 bytes, the .h5 under 1 MB.
CIFAR_MAX_BYTES = 256 * 2**20
MODEL_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class FetchedAsset:
    asset: str  # CIFAR or MODEL
    destination: Path
    action: str  # "downloaded", "copied", "already present" or "checked in place"
    source: str  # URL or mirror path
    summary: str  # what validation found


@dataclass(frozen=True)
class FetchResult:
    destination: Path
    assets: list[FetchedAsset]


def cifar_source(url: str | None = None, md5: str | None = None) -> Source:
    return Source(url or CIFAR_URL, "md5", (md5 or CIFAR_MD5).lower(), CIFAR_MAX_BYTES)


def model_source(url: str | None = None, sha256: str | None = None) -> Source:
    return Source(url or MODEL_URL, "sha256", (sha256 or MODEL_SHA256).lower(), MODEL_MAX_BYTES)


def download(source: Source, destination: Path, progress: Callable[[int, int], None] | None = None,
             check: Callable[[Path], object] | None = None, named: Path | None = None) -> None:
    """Stream `source.url` to `destination` through a temporary file; it is renamed into place only when
    every announced byte arrived, the checksum matches and `check` accepts it, else deleted. Messages name
    `named` (where the asset goes) when `destination` is ptq's own staging file. A download that has not ended
    within bounded.DOWNLOAD_SECONDS is stopped, however slowly bytes keep coming."""
    digest = hashlib.new(source.algorithm)
    shown = named or destination
    deadline = time.monotonic() + bounded.DOWNLOAD_SECONDS.value()
    with atomic_output(destination) as tmp:
        try:
            with _opened(source.url) as (response, total), tmp.open("wb") as handle:
                done = 0
                while chunk := _next_chunk(response, source.url):
                    if done + len(chunk) > source.max_bytes:
                        raise PtqError(f"{source.url}: more than {source.max_bytes:,} bytes, more than the asset is; nothing written to {shown}")
                    if time.monotonic() > deadline:
                        raise PtqError(f"{source.url}: not done within {bounded.DOWNLOAD_SECONDS.value():,} seconds ({done:,} bytes came; "
                                       f"raise {bounded.DOWNLOAD_SECONDS.env}); nothing written to {shown}")
                    handle.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if progress:
                        progress(done, total)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
            reason = getattr(error, "reason", None) or getattr(error, "strerror", None) or error
            raise PtqError(f"{source.url}: download failed ({reason}); nothing written to {shown}") from error
        if total and done != total:
            raise PtqError(f"{source.url}: connection closed after {done:,} of {total:,} bytes; nothing written to {shown}")
        if digest.hexdigest() != source.digest:
            raise PtqError(
                f"{source.url}: {source.algorithm} {digest.hexdigest()} does not match the expected {source.digest}; nothing written to {shown}"
            )
        if check:
            check(tmp)


@contextlib.contextmanager
def _opened(url: str) -> Iterator[tuple[Any, int]]:
    """(a stream of the URL's bytes, the size announced or 0). A file:// URL is read as every file ptq reads:
    a regular file only, and never a read that waits (urllib would wait on /proc/kmsg for ever)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        if not path.is_file():
            raise PtqError(f"{url}: not a regular file" + ("" if path.exists() else " (not found)"))
        try:
            with bounded.open_regular(path, "file") as handle:
                yield handle, 0
        except PtqError as error:
            raise PtqError(f"{url}: {str(error).partition(': ')[2]}") from None
        return
    with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as response:
        yield response, int(response.headers.get("Content-Length") or 0)


def _next_chunk(stream: Any, url: str) -> bytes:
    try:
        chunk = stream.read1(CHUNK)  # what has come, not a wait for a whole chunk that a trickle would stretch past any deadline
    except BlockingIOError:
        chunk = None
    if chunk is None:  # a non-blocking local file with nothing to give
        raise PtqError(f"{url}: waits for data when read (a special file of the system, not a download); refused")
    return chunk


def check_keras_file(path: Path) -> str:
    """An HDF5 file holding a Keras image model, N x H x W x C input (structure, not a hash)."""
    path = Path(path)
    if not path.is_file():
        raise PtqError(f"{path}: Keras model file not found")
    if bounded.read_head(path, len(HDF5_SIGNATURE), "Keras model file") != HDF5_SIGNATURE:
        raise PtqError(f"{path}: not an HDF5 file (no HDF5 signature)")
    try:
        import h5py
    except ImportError:  # h5py comes with the keras extra; without it, the signature is all we can check
        return "HDF5 file"

    try:
        with h5py.File(path, "r") as handle:
            config = bounded.json_loads(handle.attrs["model_config"])
    except (OSError, KeyError, ValueError) as error:
        raise PtqError(f"{path}: not a Keras .h5 model (no readable model_config: {error})") from error
    layers = config.get("config", {}).get("layers", [])
    shape = layers[0].get("config", {}).get("batch_input_shape") if layers else None
    if shape is None or len(shape) != 4 or shape[3] not in (1, 3) or not shape[1] or not shape[2]:
        raise PtqError(f"{path}: Keras model input {shape} is not N x H x W x C images")
    return f"Keras {config.get('class_name', 'model')}, input {'x'.join(map(str, shape[1:]))}, {len(layers)} layers"


def _cifar_summary(summary: cifar.DirectorySummary) -> str:
    return f"{summary.train_images:,} train + {summary.test_images:,} test images, 1,000 test per class"


def _swap_directory(new: Path, final: Path) -> None:
    """Put the complete directory `new` at `final` once `new` is ready. Where `final` exists, only the files ptq
    fetched are replaced, one by one: anything else a user keeps there stays."""
    if not final.exists():
        new.rename(final)
        return
    if not final.is_dir() or final.is_symlink():
        raise PtqError(f"{final}: exists and is not a folder ptq can put {CIFAR_DIR_NAME} files in")
    for path in sorted(new.iterdir()):
        target = final / path.name
        if target.is_dir() and not target.is_symlink():
            raise PtqError(f"{target}: a folder where ptq puts the file {path.name}")
        os.replace(path, target)


def _staging_dir(destination: Path) -> Path:
    try:
        destination.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".ptq-fetch-", dir=destination))
    except OSError as error:
        raise PtqError(f"{destination}: cannot write ({error.strerror or error})") from error


def fetch_cifar(destination: Path, source: Source, mirror: Path | None, force: bool, progress: ProgressCallback | None) -> FetchedAsset:
    final = destination / CIFAR_DIR_NAME
    if mirror is not None:
        origin = mirror / CIFAR_DIR_NAME
        summary = cifar.validate_directory(origin)
        if final.exists() and final.resolve() == origin.resolve():
            return FetchedAsset(CIFAR, final, "checked in place", str(origin), _cifar_summary(summary))
    if final.is_dir() and not force:
        try:
            return FetchedAsset(CIFAR, final, "already present", str(final), _cifar_summary(cifar.validate_directory(final)))
        except PtqError:
            pass  # present but broken: fetch it again
    staging = _staging_dir(destination)
    try:
        if mirror is not None:
            unpacked = staging / CIFAR_DIR_NAME
            unpacked.mkdir()
            names = (cifar.META_FILE, *cifar.TRAIN_BATCHES, cifar.TEST_BATCH)
            for index, name in enumerate(names, 1):
                shutil.copyfile(mirror / CIFAR_DIR_NAME / name, unpacked / name)
                if progress:
                    progress(CIFAR, index, len(names))
            action, origin_text = "copied", str(mirror / CIFAR_DIR_NAME)
        else:
            archive = staging / "cifar-10-python.tar.gz"
            download(source, archive, (lambda done, total: progress(CIFAR, done, total)) if progress else None, named=final)
            unpacked = _unpack(archive, staging)
            action, origin_text = "downloaded", source.url
        try:
            summary = cifar.validate_directory(unpacked)
        except PtqError as error:  # named by where the data came from, not ptq's staging folder
            raise PtqError(str(error).replace(str(unpacked), origin_text)) from error
        _swap_directory(unpacked, final)
    except OSError as error:
        raise PtqError(f"{final}: cannot write ({error.strerror or error})") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return FetchedAsset(CIFAR, final, action, origin_text, _cifar_summary(summary))


def _unpack(archive: Path, staging: Path) -> Path:
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(staging / "unpacked", filter="data")  # "data": no absolute paths, links out or devices
    except (tarfile.TarError, EOFError, OSError) as error:
        raise PtqError(f"{archive.name}: not a readable CIFAR-10 tarball ({error})") from error
    unpacked = staging / "unpacked" / CIFAR_DIR_NAME
    if not unpacked.is_dir():
        raise PtqError(f"{archive.name}: has no {CIFAR_DIR_NAME}/ directory")
    return unpacked


def fetch_model(destination: Path, source: Source, mirror: Path | None, force: bool, progress: ProgressCallback | None) -> FetchedAsset:
    final = destination / MODEL_DIR_NAME / MODEL_FILE_NAME
    if mirror is not None:
        origin = mirror / MODEL_DIR_NAME / MODEL_FILE_NAME
        summary = check_keras_file(origin)
        if final.exists() and final.resolve() == origin.resolve():
            return FetchedAsset(MODEL, final, "checked in place", str(origin), summary)
    if final.is_file() and not force:
        try:
            return FetchedAsset(MODEL, final, "already present", str(final), check_keras_file(final))
        except PtqError:
            pass  # present but broken: fetch it again
    if mirror is not None:
        with atomic_output(final) as tmp:
            shutil.copyfile(origin, tmp)
            check_keras_file(tmp)
        return FetchedAsset(MODEL, final, "copied", str(origin), summary)
    download(source, final, (lambda done, total: progress(MODEL, done, total)) if progress else None, check_keras_file)
    return FetchedAsset(MODEL, final, "downloaded", source.url, check_keras_file(final))


def fetch(
    destination: Path,
    assets: tuple[str, ...] = ASSETS,
    mirror: Path | None = None,
    cifar_from: Source | None = None,
    model_from: Source | None = None,
    force: bool = False,
    progress: ProgressCallback | None = None,
) -> FetchResult:
    destination = Path(destination)
    if mirror is not None and not Path(mirror).is_dir():
        raise PtqError(f"--mirror: {mirror} is not a directory")
    if mirror is not None and destination.resolve() != Path(mirror).resolve() and destination.resolve().is_relative_to(Path(mirror).resolve()):
        raise PtqError(f"--dest: {destination} is inside the mirror {mirror}, which fetch reads; give a folder outside it (or the mirror itself, to check it)")
    fetched = []
    if CIFAR in assets:
        fetched.append(fetch_cifar(destination, cifar_from or cifar_source(), mirror and Path(mirror), force, progress))
    if MODEL in assets:
        fetched.append(fetch_model(destination, model_from or model_source(), mirror and Path(mirror), force, progress))
    return FetchResult(destination, fetched)
