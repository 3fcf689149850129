"""Independent pieces of work (tune's candidates, ...) run one after another in this process, or as tasks on
Ray: one seam. Without `--workers` or `--ray-address`, Ray is not imported at all.

A task is a module-level function of (item, shared): `shared` goes to the cluster once (Ray's object store)
and every task reads it from there. A task returns a value; it writes nothing the user sees: the driver
alone writes models and records (temporary file, then rename), so a worker killed mid-task leaves nothing
half-written, and Ray runs its task again (RETRIES times) before the command fails in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ptq_cli import settings
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards.library_noise import native_stderr_silenced

Item = TypeVar("Item")
Result = TypeVar("Result")
# (tasks done, tasks in all), after each finished task.
Done = Callable[[int, int], None]
# (the item's position, its result), as each task finishes: what is measured is kept even if a later task fails.
Each = Callable[[int, Any], None]

RETRIES = 2  # a task whose worker died runs again this many times
TASK_CPUS = 1  # what Ray gives a task, and what the task keeps to
HEARTBEAT_SECONDS = 2.0  # while no task finishes, the cluster's head is asked this often whether it is there
# Ray's shared-memory store for what tasks share (the model's bytes, the calibration and validation images):
# bounded, so that a local instance does not claim a third of the machine's memory as Ray's default does.
OBJECT_STORE_BYTES = 1 << 30
AHEAD_PER_CPU = 2  # tasks sent per CPU of the cluster before one finishes: each CPU has its next task waiting


@dataclass(frozen=True)
class Workers:
    """Where independent work runs: here (neither set), on a local Ray instance of `count` workers that ptq
    starts and stops, or on the Ray cluster at `address`."""

    count: int | None = None
    address: str | None = None

    @property
    def on_ray(self) -> bool:
        return self.count is not None or self.address is not None

    def describe(self) -> str:
        if self.address is not None:
            return f"Ray cluster at {self.address}"
        return f"local Ray instance, {self.count} worker{'s' if self.count != 1 else ''}" if self.count is not None else "in this process"


HERE = Workers()  # no Ray: every task in this process


class Executor(Protocol):
    task_threads: int | None  # inference threads a task takes: all of the machine's here, one on a Ray worker (Ray gives a task one CPU)

    def map(self, task: Callable[[Item, Any], Result], items: Sequence[Item], shared: Any = None, done: Done | None = None,  # noqa: PLR0913  the work, and who hears of it
            each: Each | None = None) -> list[Result]:
        """`task(item, shared)` for every item, the results in the items' order."""
        ...


class InProcess:
    """One task after another, here."""

    task_threads: int | None = None

    def map(self, task: Callable[[Item, Any], Result], items: Sequence[Item], shared: Any = None, done: Done | None = None,  # noqa: PLR0913  the work, and who hears of it
            each: Each | None = None) -> list[Result]:
        results = []
        for item in items:
            results.append(task(item, shared))
            if each:
                each(len(results) - 1, results[-1])
            if done:
                done(len(results), len(items))
        return results


class OnRay:
    """Every item a Ray task; results gathered as they finish (each reported to `done`), returned in order."""

    task_threads: int | None = TASK_CPUS

    def __init__(self, ray: Any, where: str) -> None:
        self.ray, self.where = ray, where

    def map(self, task: Callable[[Item, Any], Result], items: Sequence[Item], shared: Any = None, done: Done | None = None,  # noqa: PLR0913  the work, and who hears of it
            each: Each | None = None) -> list[Result]:
        ray = self.ray
        remote = ray.remote(max_retries=RETRIES, num_cpus=TASK_CPUS)(task)
        shared_ref = ray.put(shared)
        # Items are read (a lazy sequence loads each then) and sent a few ahead of the workers, not all at once:
        # the driver and the object store hold those in flight, whatever the number of items.
        ahead = max(1, AHEAD_PER_CPU * int(ray.cluster_resources().get("CPU", 1)))
        pending: dict[Any, int] = {}
        results: dict[int, Result] = {}
        while len(results) < len(items):
            while len(results) + len(pending) < len(items) and len(pending) < ahead:
                position = len(results) + len(pending)
                pending[remote.remote(items[position], shared_ref)] = position
            ready, _ = self._wait(list(pending))
            for ref in ready:
                position = pending.pop(ref)
                results[position] = self._get(ref)
                if each:
                    each(position, results[position])
                if done:
                    done(len(results), len(items))
        return [results[index] for index in range(len(items))]

    def _wait(self, waiting: list) -> tuple[list, list]:
        """(the next finished task, the others). Ray waits on a cluster whose head is gone for a minute, then ends
        the whole process: the head is asked every HEARTBEAT_SECONDS while nothing finishes."""
        while True:
            ready, waiting = self.ray.wait(waiting, num_returns=1, timeout=HEARTBEAT_SECONDS)
            if ready:
                return ready, waiting
            address = self.ray.get_runtime_context().gcs_address
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
            except OSError as error:
                raise PtqError(f"{self.where}: its head at {address} stopped answering ({error.strerror or error}); "
                               "the cluster is gone, nothing was written") from error

    def _get(self, ref: Any) -> Any:
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(ref)
        except exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, PtqError):
                raise cause from None
            raise PtqError(f"a task failed on the {self.where} ({type(cause).__name__ if cause else 'error'}: "
                           f"{first_line(cause) if cause else first_line(error)})") from error
        except (exceptions.WorkerCrashedError, exceptions.NodeDiedError, exceptions.ObjectLostError) as error:
            raise PtqError(f"a worker of the {self.where} died running a task, {RETRIES + 1} times; nothing was written") from error
        except exceptions.RaySystemError as error:
            raise PtqError(f"the {self.where} is gone ({first_line(error)}); nothing was written") from error


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise PtqError("--workers/--ray-address: Ray is not installed (pip install 'ptq[ray]', or `make install`)") from error
    return ray


@contextlib.contextmanager
def executor(workers: Workers) -> Iterator[Executor]:
    """The executor for `workers`; a local Ray instance is started here and stopped on the way out, whatever happens."""
    if not workers.on_ray:
        yield InProcess()
        return
    if workers.count is not None and workers.count < 1:
        raise PtqError(f"--workers: must be at least 1, got {workers.count}")
    ray = _ray()
    # A local instance keeps its sockets, logs and spilled objects in a folder of ptq's, removed with it.
    session = None if workers.address is not None else tempfile.TemporaryDirectory(prefix="ptq-ray-", dir=_session_parent(), ignore_cleanup_errors=True)
    # ray.init sets variables in this process's environment (RAY_AUTH_MODE among them), which would reach
    # whatever this process starts afterwards (a local instance started then would not come up): put back.
    environment = dict(os.environ)
    try:
        _start(ray, workers, session.name if session else None)
        yield OnRay(ray, workers.describe())
    finally:
        with native_stderr_silenced():
            ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)
        if session:
            _stop_left_over(session.name)
            session.cleanup()


def _stop_left_over(folder: str) -> None:
    """Stops what is left of a local instance ptq started, and waits until it is gone (Ray's agents outlive a
    head that was killed, and ray.shutdown cannot reach them then). Scanned again after each kill: a raylet
    that is dying may still be starting a worker."""
    deadline = time.monotonic() + CONNECT_SECONDS
    stopped: set[int] = set()
    while time.monotonic() < deadline:
        left = _instance_processes(folder)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        stopped |= set(left)
        for pid in list(stopped):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)  # reaped here if it is this process's child (the head's), else by its parent
            if not Path(f"/proc/{pid}").exists():
                stopped.discard(pid)
        if not left and not stopped:
            return
        time.sleep(0.05)


def _instance_processes(folder: str) -> list[int]:
    """The running processes of the local instance whose session is `folder`: those with a file open in it,
    naming it on their command line or given it as TMPDIR (a worker still starting has opened nothing yet)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue  # ended; waited for above if it was one of the instance's
            arguments, environment = (entry / "cmdline").read_bytes() + b"\0", b"\0" + (entry / "environ").read_bytes() + b"\0"
            named = any(folder.encode() + end in arguments for end in (b"/", b"\0")) or b"\0TMPDIR=" + folder.encode() + b"\0" in environment
            if named or any(os.readlink(descriptor).startswith(folder + os.sep) for descriptor in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except (OSError, IndexError):  # gone meanwhile, or not ours
            continue
    return found


# Ray's sockets lie some 75 characters deep in its session folder, and a socket's path holds at most 107.
SESSION_PARENT_CHARS = 24


def _session_parent() -> str | None:
    """The temporary folder, if short enough for Ray's sockets; else /tmp."""
    parent = tempfile.gettempdir()
    return parent if len(parent) <= SESSION_PARENT_CHARS or not Path("/tmp").is_dir() else "/tmp"


# Seconds to wait for a cluster's head to answer: Ray itself waits minutes for one that is not there.
CONNECT_SECONDS = 10


def _check_reachable(address: str) -> None:
    """A HOST:PORT (or ray://HOST:PORT) address whose port does not answer is refused at once."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS) as connection:
            tls = os.environ.get("RAY_USE_TLS", "0") not in ("0", "")  # a TLS cluster answers only after a handshake ptq leaves to Ray
            speaks_grpc = tls or _answers_http2(connection)
    except OSError as error:
        raise PtqError(f"--ray-address {address}: Ray did not start (no cluster answers there: {error.strerror or error})") from error
    if not speaks_grpc:  # Ray would wait on it for ever, deaf to SIGTERM
        raise PtqError(f"--ray-address {address}: Ray did not start (something answers there, but not a Ray head: it does not speak gRPC)")


def _resolved(address: str) -> str:
    """The cluster address Ray would connect to for `address` ("auto": RAY_ADDRESS, else the last `ray start`'s, which
    may name a cluster long gone), so that it is checked before Ray waits on it."""
    if address != "auto" and not os.environ.get("RAY_ADDRESS"):
        return address
    try:
        with native_stderr_silenced():
            from ray._private.services import get_ray_address_from_environment

            return str(get_ray_address_from_environment(address, None))
    except Exception as error:  # noqa: BLE001  Ray's own errors for "no cluster found", in several types
        raise PtqError(f"--ray-address {address}: Ray did not start ({first_line(error)})") from error


# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (a Ray head's GCS, a Ray client server)
# answers with a SETTINGS frame of its own.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
HTTP2_SETTINGS = 4


def _answers_http2(connection: socket.socket) -> bool:
    connection.sendall(HTTP2_PREFACE)
    header = b""
    try:
        while len(header) < 9 and (piece := connection.recv(9 - len(header))):
            header += piece
    except TimeoutError:
        return False
    # A server's first frame: SETTINGS (type 4), no flags, on stream 0, a whole number of 6-byte settings.
    return len(header) == 9 and header[3] == HTTP2_SETTINGS and header[4] == 0 and header[5:] == b"\0\0\0\0" and int.from_bytes(header[:3]) % 6 == 0


def _start(ray: Any, workers: Workers, folder: str | None) -> None:
    # A local instance's workers are this interpreter, with this process's environment: they import ptq_cli as it does.
    # A task is given one CPU (num_cpus=1) and keeps to it: every thread count ptq and its libraries choose
    # follows settings.task_cpus, so the tasks Ray puts side by side on a node do not fight for its cores.
    environment = {settings.TASK_CPUS_ENV: str(TASK_CPUS)}
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    if workers.address is not None:
        address = _resolved(workers.address)
        _check_reachable(address)
        options["address"] = address
    else:
        # The workers' own temporary files (a shard's model, kept while the worker lives) go there too.
        environment["TMPDIR"] = folder or tempfile.gettempdir()
        options.update(num_cpus=workers.count, object_store_memory=OBJECT_STORE_BYTES, _temp_dir=folder)
    options["runtime_env"] = {"env_vars": environment}
    try:
        with native_stderr_silenced():
            ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as error:
        where = f"--ray-address {workers.address}" if workers.address is not None else f"--workers {workers.count}"
        if str(error).startswith("Version mismatch"):  # Ray's message names both sides' versions over several lines
            raise PtqError(f"{where}: {' '.join(str(error).split())}; install the cluster's Ray and Python here, or ptq's there") from error
        raise PtqError(f"{where}: Ray did not start ({first_line(error)})") from error
