"""Independent work as tasks on Ray (issue 38): the same answer as in this process, faults said in one line,
no Ray process left behind. A local Ray instance of 1 or 2 workers, started and stopped by each test."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from synthetic import calibrated_colours_project, colours_project, invoke, ok, one_line_error

from ptq_cli import settings
from ptq_cli.errors import PtqError
from ptq_cli.services import executor as executor_service
from ptq_cli.services.study import candidates

ray = pytest.importorskip("ray")  # installed by `make install` (the ray extra)
ray_version = ray.__version__

# A calibration set drawn by `ptq calibrate` (10 a class) and 20 validation images a class from the rest of the training images.
TUNE = ("tune", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--validation-per-class", "20",
        "--max-float-layers", "1", "--json")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return calibrated_colours_project(tmp_path)



def _figures(result: dict) -> list:
    """What a tune decided and measured, without the times."""
    return [result["chosen"]["settings"], result["met_budget"], result["reason"],
            [(candidate["stage"], candidate["settings"], candidate["validation_accuracy"], candidate["output_sqnr_db"], candidate["size_bytes"])
             for candidate in result["candidates"]]]


SESSION_NAME = re.compile(rb"/[^\0\s]*?/ptq-ray-[A-Za-z0-9_]+")


def _named_sessions() -> dict[int, set[bytes]]:
    """Each live process of Ray's (its GCS, raylet, agents and workers) that names a ptq Ray session folder (on its
    command line, in its environment or as an open file), and the folders it names. Another test's instance may run
    meanwhile (on the other pytest worker): its processes name its own folder, which exists while they live. (A
    process that was a driver keeps its Ray log files open after ray.shutdown: not Ray's, not counted.)"""
    named = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue  # ended
            texts = [(entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()]
            if not (texts[0].startswith(b"ray::") or b"/ray/" in texts[0]):
                continue
            texts += [os.readlink(descriptor).encode() for descriptor in (entry / "fd").iterdir()]
        except OSError:
            continue
        folders = {match.group() for text in texts for match in SESSION_NAME.finditer(text)}
        if folders:
            named[int(entry.name)] = folders
    return named


def _left_over(sessions_before: set[Path]) -> tuple[dict[int, set[bytes]], set[Path]]:
    """(the processes that name a session folder that is gone, the session folders in /tmp made since
    `sessions_before` that no process names): what ended instances left. Asked again for a few seconds, as an
    instance starting or stopping beside this test may be between making its folder and starting its processes."""
    deadline = time.monotonic() + 20
    while True:
        named = _named_sessions()
        orphans = {pid: folders for pid, folders in named.items() if not all(Path(folder.decode()).exists() for folder in folders)}
        in_use = {Path(folder.decode()) for folders in named.values() for folder in folders}
        unused = set(Path("/tmp").glob("ptq-ray-*")) - sessions_before - in_use
        if (not orphans and not unused) or time.monotonic() > deadline:
            return orphans, unused
        time.sleep(0.5)


def test_tune_on_ray_chooses_what_it_chooses_here_and_writes_the_same_bytes(project, monkeypatch):
    """On 1 and 2 workers, the figures and bytes of this process; with 2 workers, one piped progress line per finished
    candidate; and the candidates Ray scored (in a shared results folder) are not scored again here."""
    here = json.loads(ok(*TUNE, "--output", "models/here.onnx", "--results-dir", "here", cwd=project).stdout)
    assert len(here["candidates"]) >= 4
    for workers in ("1", "2"):
        result = ok(*TUNE, "--workers", workers, "--output", f"models/w{workers}.onnx", "--results-dir", "shared" if workers == "2" else "w1", cwd=project)
        there = json.loads(result.stdout)
        assert _figures(there) == _figures(here), workers
        assert (project / "models" / f"w{workers}.onnx").read_bytes() == (project / "models" / "here.onnx").read_bytes(), workers
    steps = [line for line in result.stderr.splitlines() if line.startswith("Tuning int8 (onnxruntime, local Ray instance, 2 workers): ")]
    total = int(steps[-1].rsplit("/", 1)[1])
    assert [int(line.rsplit(": ", 1)[1].split("/")[0]) for line in steps] == list(range(1, total + 1))

    def scored_again(job, inputs):
        raise AssertionError(f"scored again: {job}")

    monkeypatch.setattr(candidates, "score_candidate", scored_again)
    again = json.loads(ok(*TUNE, "--output", "models/again.onnx", "--results-dir", "shared", cwd=project).stdout)
    assert _figures(again) == _figures(here)
    assert (project / "models" / "again.onnx").read_bytes() == (project / "models" / "here.onnx").read_bytes()


@pytest.mark.parametrize("scratch_path", ["short", "long"])
def test_no_ray_process_or_file_outlives_the_command(project, tmp_path, scratch_path):
    """Ray's session and its workers' temporary files go to the command's temporary folder (TMPDIR), or /tmp
    where that path is too long for Ray's sockets, and go with the command."""
    sessions = set(Path("/tmp").glob("ptq-ray-*"))
    with tempfile.TemporaryDirectory(dir="/tmp" if scratch_path == "short" else tmp_path) as scratch:
        command = [sys.executable, "-m", "ptq_cli", *TUNE, "--workers", "2", "--output", "models/t.onnx"]
        finished = subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "TMPDIR": scratch})
        assert finished.returncode == 0, finished.stderr
        assert json.loads(finished.stdout)["chosen"]
        assert _left_over(sessions) == ({}, set())
        assert [path.name for path in Path(scratch).iterdir() if path.name != ".ses"] == []  # .ses: onnxruntime's, made as it is imported


def test_a_process_of_the_instance_that_holds_no_file_in_its_folder_is_stopped_too(tmp_path):
    """A worker that Ray is still starting has opened nothing in the session folder yet: it is known by its
    command line or its TMPDIR, and stopped before the command returns. Processes that only look alike stay."""
    folder = tmp_path / "ptq-ray-session"
    folder.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    instance = [subprocess.Popen([*sleep, f"--temp-dir={folder}"]), subprocess.Popen([*sleep, f"{folder}/sockets/raylet"]),
                subprocess.Popen(sleep, env={**os.environ, "TMPDIR": str(folder)})]
    others = [subprocess.Popen([*sleep, f"{folder}-other"]), subprocess.Popen(sleep, env={**os.environ, "TMPDIR": f"{folder}-other"})]
    try:
        time.sleep(0.5)  # each has exec'd its interpreter
        executor_service._stop_left_over(str(folder))
        assert [Path(f"/proc/{process.pid}").exists() for process in instance] == [False] * 3  # stopped, and reaped
        assert [process.poll() for process in others] == [None, None]
    finally:
        for process in instance + others:
            process.kill()
            process.wait()


def test_the_environment_is_as_it_was_after_a_local_instance():
    """Ray's start sets variables in the process's environment (RAY_AUTH_MODE=token): a local instance started
    afterwards by a child process, with that environment, would not come up."""
    before = dict(os.environ)
    with executor_service.executor(executor_service.Workers(1)) as runs:
        assert runs.map(lambda item, _shared: item + 1, [1]) == [2]
    assert dict(os.environ) == before


def test_a_worker_killed_mid_task_is_retried_and_the_answer_stands(tmp_path):
    marker = tmp_path / "killed-once"

    def dies_once(item: int, shared: int) -> int:
        if item == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return item * shared

    with executor_service.executor(executor_service.Workers(2)) as runs:
        assert runs.map(dies_once, [0, 1, 2, 3], 10) == [0, 10, 20, 30]
    assert marker.exists()  # it did die


def test_a_task_that_kills_its_worker_every_time_fails_in_one_line(tmp_path):
    done = []

    def always_dies(item: int, _shared: None) -> int:
        if item == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return item

    with pytest.raises(PtqError, match=r"a worker of the local Ray instance, 1 worker died running a task, 3 times; nothing was written"), \
            executor_service.executor(executor_service.Workers(1)) as runs:
        runs.map(always_dies, [0, 1], None, done=lambda finished, total: done.append(finished))
    assert not ray.is_initialized()  # stopped on the way out


def test_a_ptq_error_in_a_task_is_said_in_its_own_words():
    def refuses(item: int, _shared: None) -> int:
        raise PtqError(f"item {item}: refused")

    with pytest.raises(PtqError, match=r"^item 0: refused$"), executor_service.executor(executor_service.Workers(1)) as runs:
        runs.map(refuses, [0], None)


class _Ref:
    def __init__(self, task, item, shared) -> None:
        self.task, self.item, self.shared = task, item, shared


class _Reads(list):
    """Items that log which position is read when: a lazy sequence (evaluation's shards) loads an item then."""

    def __init__(self, items, log: list) -> None:
        super().__init__(items)
        self.log = log

    def __getitem__(self, position):
        self.log.append(("read", position))
        return super().__getitem__(position)


class _Cluster:
    """The Ray calls OnRay.map makes, on a cluster of `cpus` CPUs that finishes the latest task sent first."""

    exceptions = type("exceptions", (), {name: type(name, (Exception,), {}) for name in
                                          ("RayTaskError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError", "RaySystemError")})

    def __init__(self, cpus: int, log: list) -> None:
        self.cpus, self.log = cpus, log

    def remote(self, **_options):
        return lambda task: type("Remote", (), {"remote": staticmethod(lambda item, shared: _Ref(task, item, shared))})

    def put(self, value):
        return value

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": float(self.cpus)}

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        return refs[-num_returns:], refs[:-num_returns]

    def get(self, ref: _Ref):
        self.log.append(("back", ref.item))
        return ref.task(ref.item, ref.shared)


def test_tasks_are_sent_a_few_ahead_of_the_workers_and_come_back_in_order():
    """The driver reads an item (evaluation loads a shard then) only when fewer than two tasks per CPU are out:
    what it and Ray's object store hold stays bounded, however many items there are."""
    log: list = []
    runs = executor_service.OnRay(_Cluster(cpus=2, log=log), "test cluster")
    items = _Reads(range(20), log)
    assert runs.map(lambda item, shared: item * shared, items, 3) == [item * 3 for item in range(20)]
    assert [position for event, position in log if event == "read"] == list(range(20))  # every item read once, in order
    out = most = 0
    for event, _ in log:
        out += 1 if event == "read" else -1
        most = max(most, out)
    assert most == executor_service.AHEAD_PER_CPU * 2 and out == 0


def test_without_workers_ray_is_not_imported(project):
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from synthetic import invoke; from pathlib import Path\n"
              f"result = invoke(*{list(TUNE)!r}, '--output', 'models/t.onnx', cwd=Path('.'))\n"
              "assert result.exit_code == 0, result.output\n"
              "print(sorted(name for name in sys.modules if name == 'ray' or name.startswith('ray.')))")
    finished = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], cwd=project, capture_output=True, text=True,
                              timeout=600, check=False)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip().splitlines()[-1] == "[]"


def test_workers_and_a_cluster_address_are_one_choice(project):
    one_line_error(invoke(*TUNE, "--workers", "2", "--ray-address", "auto", cwd=project), "--workers and --ray-address: give one")


def test_a_cluster_that_is_not_there_is_said_in_one_line(project):
    result = invoke(*TUNE, "--ray-address", "127.0.0.1:9", cwd=project)
    one_line_error(result, "--ray-address 127.0.0.1:9: Ray did not start")
    assert not list((project / "models").glob("*tuned*"))


def test_auto_resolves_to_the_address_ray_would_wait_on_and_checks_it(project, monkeypatch):
    """`auto` with RAY_ADDRESS (or a stale `ray start` file) naming a cluster long gone: one line, not Ray's wait."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", gone)
    result = invoke("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--ray-address", "auto", cwd=project)
    one_line_error(result, f"--ray-address {gone}: Ray did not start (no cluster answers there")
    assert not ray.is_initialized()


def test_a_port_that_answers_but_is_not_ray_is_said_in_one_line(project):
    """Ray would wait on such a port for ever, deaf to SIGTERM: an HTTP server on loopback is refused at once."""
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):  # the server's own log would reach this process's stderr
            pass

    server = HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        result = invoke("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--ray-address", address, cwd=project)
    finally:
        server.shutdown()
    one_line_error(result, f"--ray-address {address}: Ray did not start (something answers there, but not a Ray head")
    assert not ray.is_initialized()


def test_sensitivity_on_ray_ranks_the_layers_as_it_does_here(project):
    sensitivity = ("sensitivity", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--validation-per-class", "20", "--json")
    here = json.loads(ok(*sensitivity, "--results-dir", "here", cwd=project).stdout)
    there = json.loads(ok(*sensitivity, "--workers", "2", "--results-dir", "there", cwd=project).stdout)
    assert here["layers"] and there["layers"] == here["layers"]


def _record_figures(record: dict) -> dict:
    """A record without what differs from run to run (times, where it ran)."""
    return {key: value for key, value in record.items() if key not in ("images_per_second", "timestamp")}


def test_evaluation_in_shards_on_ray_writes_the_record_one_process_writes(project):
    ok("quantize", "--model", "models/m.onnx", "--data", "colours.npz", "--dtype", "int8", "--output", "models/q.onnx", cwd=project)
    for model in ("models/m.onnx", "models/q.onnx"):
        here = json.loads(ok("evaluate", "--model", model, "--data", "colours.npz", "--results-dir", "here", "--batch-size", "7", "--json",
                             cwd=project).stdout)
        there = json.loads(ok("evaluate", "--model", model, "--data", "colours.npz", "--results-dir", "there", "--batch-size", "7",
                              "--workers", "2", "--json", cwd=project).stdout)
        assert _record_figures(there) == _record_figures(here), model
        assert here["images"] == 120 and here["confusion_matrix"]
    assert here["fidelity"] is not None  # the quantized model's fidelity sums, measured in shards too


# A worker that loads a model for its shards and is then killed (as Ray stops a cluster's workers): nothing of its own cleanup runs.
KILLED_WORKER = """
import os, pickle, sys
from ptq_cli.services.measure import evaluate
images, shared = pickle.loads(sys.stdin.buffer.read())
evaluate.predict_shard(images, shared)
print(os.getpid(), flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_shard_folder_a_killed_worker_left_is_removed_by_the_next_worker(project, tmp_path, monkeypatch):
    """A worker keeps its copy of the model in a folder of its own while it lives (the temporary directory); a killed
    one cannot remove it, so the next worker to load a model does. A live process's folder stays, and so does what ptq
    did not name so."""
    from synthetic import colour_images

    from ptq_cli.services.measure import evaluate

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read again from TMPDIR
    images, _ = colour_images(2)
    shared = evaluate.ShardedModel((("m.onnx", (project / "models" / "m.onnx").read_bytes()),), None, None, None, False, False, 1, 4, "test")
    killed = subprocess.run([sys.executable, "-c", KILLED_WORKER], input=pickle.dumps((images, shared)), capture_output=True, check=False,
                            env={**os.environ, "TMPDIR": str(scratch)}, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    (left,) = scratch.glob(f"ptq-shard-{int(killed.stdout)}-*")
    assert (left / "m.onnx").is_file()
    alive = scratch / f"ptq-shard-{os.getppid()}-abcd_123"  # a live process's (this one's parent)
    others = [scratch / "ptq-shard-of-someone", scratch / "ptq-shard-1x-abcd_123"]
    for folder in (alive, *others):
        folder.mkdir()
    evaluate._SHARD_MODELS.clear()
    try:
        scores, _ = evaluate.predict_shard(images, shared)
        assert scores.shape == (len(images), 3)
        assert not left.exists()
        assert sorted(scratch.glob("ptq-shard-*")) == sorted([alive, *others, *scratch.glob(f"ptq-shard-{os.getpid()}-*")])
        assert len(list(scratch.glob(f"ptq-shard-{os.getpid()}-*"))) == 1  # this process's, while it holds the model
    finally:
        evaluate._SHARD_MODELS.clear()
    assert not list(scratch.glob(f"ptq-shard-{os.getpid()}-*"))  # removed with the model


SWEEP = ("sweep", "--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--sparsity", "0,0.3,0.6", "--json")


def test_sweep_on_ray_makes_the_models_and_the_record_it_makes_here(project):
    here = json.loads(ok(*SWEEP, "--models-dir", "made", "--results-dir", "here", cwd=project).stdout)
    assert [point["sparsity"] for point in here["points"]] == [0.0, 0.3, 0.6]
    assert here["points"][0]["achieved_sparsity"] == 0 and all(point["achieved_sparsity"] > 0.2 for point in here["points"][1:])
    (project / "made").rename(project / "made_here")  # the models name their source by its path: made in the same folder
    there = json.loads(ok(*SWEEP, "--models-dir", "made", "--results-dir", "there", "--workers", "2", cwd=project).stdout)
    assert {**there, "record": None} == {**here, "record": None}
    made = sorted(path.name for path in (project / "made_here").glob("*.onnx"))
    assert len(made) == 5 and made == sorted(path.name for path in (project / "made").glob("*.onnx"))  # two pruned, three quantized
    for name in made:
        assert (project / "made" / name).read_bytes() == (project / "made_here" / name).read_bytes(), name


def test_a_cluster_gone_mid_run_is_said_in_one_line_and_nothing_is_left():
    sessions = set(Path("/tmp").glob("ptq-ray-*"))

    def kills_the_cluster(item: int, _shared: None) -> int:
        """The second task kills the instance's head (its GCS and raylet: those naming its session folder, the
        worker's TMPDIR), as a crashed or stopped cluster."""
        if item == 1:
            session = os.environ["TMPDIR"].encode()
            for entry in Path("/proc").iterdir():
                try:
                    args = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
                except OSError:
                    continue
                if (b"gcs_server" in args or b"raylet" in args) and session + b"/" in args:
                    os.kill(int(entry.name), signal.SIGKILL)
        time.sleep(1)
        return item

    with pytest.raises(PtqError, match=r"^local Ray instance, 2 workers: its head at \S+ stopped answering .*the cluster is gone, nothing was written$"), \
            executor_service.executor(executor_service.Workers(2)) as runs:
        runs.map(kills_the_cluster, [0, 1, 2, 3])
    assert not ray.is_initialized()
    assert _left_over(sessions) == ({}, set())


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray cluster started apart from ptq (`ray start --head`, 2 CPUs), as a user's is; its address. Without
    Ray's token authentication, on both sides (a user's cluster gives its token through Ray's own settings)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="ptq-cluster-", dir="/tmp") as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--port", str(port),
                   "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", folder]
        # Its workers' own temporary files (a shard's model) in its folder too: the teardown kills them, which leaves those.
        started = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "TMPDIR": folder})
        assert started.returncode == 0, started.stderr[-2000:]
        try:
            yield f"{ray.util.get_node_ip_address()}:{port}"  # where Ray listens: the machine's address
        finally:
            executor_service._stop_left_over(folder)


def test_a_cluster_started_apart_scores_as_this_process_does(project, cluster):
    here = json.loads(ok("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "here", "--json", cwd=project).stdout)
    there = json.loads(ok("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", "there", "--json",
                          "--ray-address", cluster, cwd=project).stdout)
    assert _record_figures(there) == _record_figures(here)
    assert not ray.is_initialized()  # disconnected; the cluster stays up, as it was


def test_a_cluster_of_another_ray_version_is_said_in_one_line(project, cluster, monkeypatch):
    monkeypatch.setattr(ray, "__version__", "2.0.0")
    result = invoke("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--ray-address", cluster, cwd=project)
    one_line_error(result, f"--ray-address {cluster}: Version mismatch: The cluster was started with: Ray: {ray_version}")
    assert "Ray: 2.0.0" in result.output


def _measured(results: Path) -> dict[tuple, tuple]:
    """(model file, runtime, precision, int8 path) -> (model sha256, top-1, images, fidelity) of each evaluation record."""
    from ptq_cli.services.measure import evaluation_records
    from ptq_cli.services.records import record_files

    records = [evaluation_records.read_record(path) for path in record_files(results)]
    return {(record.name, record.runtime, record.precision, record.int8_path): (record.model_sha256, record.accuracy, record.images, record.fidelity)
            for record in records}


def test_the_study_s_independent_stages_on_ray_make_what_they_make_here(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    study = ("run", "--model", "models/m.onnx", "--data", "colours.npz", "--no-pytorch", "--no-openvino", "--runs", "2", "--json")
    projects = {}
    for name, extra in (("here", ()), ("there", ("--workers", "2"))):
        (tmp_path / name).mkdir()
        projects[name] = colours_project(tmp_path / name)
        result = ok(*study, *extra, cwd=projects[name])
        assert len(json.loads(result.stdout)["stages"]) >= 8
    here, there = projects["here"], projects["there"]
    models = sorted(path.name for path in (here / "models").glob("*.onnx"))
    assert len(models) == 4 and models == sorted(path.name for path in (there / "models").glob("*.onnx"))
    for name in models:
        assert (there / "models" / name).read_bytes() == (here / "models" / name).read_bytes(), name
    assert _measured(there / "results") == _measured(here / "results") and len(_measured(here / "results")) >= 4
    manifest = json.loads((there / "results" / "manifest.json").read_text())
    assert [stage["command"] for stage in manifest["stages"]] == [stage["command"] for stage in json.loads((here / "results" / "manifest.json").read_text())["stages"]]
    again = json.loads(ok(*study, "--workers", "2", cwd=there).stdout)  # up to date: nothing runs again
    assert not any(stage["ran"] for stage in again["stages"])


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("records_outside", [False, True])
def test_a_stage_task_writes_nothing_in_the_run_folder_and_the_driver_writes_what_it_made(tmp_path, monkeypatch, records_outside):
    from ptq_cli.cli import run_stage_command
    from ptq_cli.services.study.stage_task import StageTask, run_stage_task

    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    project = calibrated_colours_project(tmp_path)
    records = str(tmp_path / "elsewhere" / "results") if records_outside else "results"
    monkeypatch.chdir(project)
    ok("evaluate", "--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", records, cwd=project)  # a record it may read
    before = _listing(project)
    arguments = ("--model", "models/m.onnx", "--data", "colours.npz", "--calibration", "cal.npz", "--dtype", "int8", "--output", "models/q.onnx",
                 "--results-dir", records)
    made = run_stage_task(StageTask("quantize", arguments, str(project), ("models",), records), run_stage_command)
    assert _listing(project) == before and Path.cwd() == project
    evaluated = run_stage_task(StageTask("evaluate", ("--model", "models/m.onnx", "--data", "colours.npz", "--results-dir", records), str(project), (),
                                         records), run_stage_command)
    assert _listing(project) == before
    assert [Path(path) for path, _ in evaluated.files] == [path for path in (project / records).glob("*.json")]  # its record, named as here
    files = dict(made.files)
    assert str(project / "models" / "q.onnx") in files and "models/q.onnx" in made.named
    assert all(Path(path).is_relative_to(project / "models") or Path(path).is_relative_to(project / records) for path in files)
    made.write()
    ok("quantize", *arguments[:-4], "--output", "models/direct.onnx", "--results-dir", records, cwd=project)
    assert (project / "models" / "q.onnx").read_bytes() == files[str(project / "models" / "q.onnx")]
    direct = json.loads(ok("evaluate", "--model", "models/direct.onnx", "--data", "colours.npz", "--json", "--results-dir", records, cwd=project).stdout)
    made_there = json.loads(ok("evaluate", "--model", "models/q.onnx", "--data", "colours.npz", "--json", "--results-dir", records, cwd=project).stdout)
    assert made_there["model_sha256"] == direct["model_sha256"] and made_there["accuracy"] == direct["accuracy"]
