"""The CPU image, built from this checkout and run for real (root; `make test-docker`, and in CI `make test`).

The setup installs Debian's docker.io and debootstrap when missing, starts
dockerd when none runs (and stops the one it started), and makes the base
image with launch/base-image.sh when no registry has it. The build gets a
CA bundle as a BuildKit secret: this machine's bundle plus a CA made here,
so the layer check has something that must not be found. Tests skip, with
the reason, only where the kernel refuses containers.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import S3_KEY_ID, S3_SECRET, output_of, read_json, tiny_in, unavailable, write_images

# A test whose containers run two ranks is marked multiprocess (it runs alone, as every job of
# several ranks does); the others read the image or run one process and share the machine.
pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[1]
DOCKER_SH = REPO / "launch" / "docker.sh"
IMAGE = "hvd-train:cpu-test"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CALLER = 4321  # a user that is not the image's hvd (1000) and not root


def sh(*args, timeout=600, check=True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))}\n{output_of(proc)}")
    return proc


@pytest.fixture(scope="session")
def docker(tmp_path_factory):
    """The Debian docker client (BuildKit on), with a running daemon; yields its path."""
    if os.geteuid() != 0:
        unavailable("docker", "the Docker tests need root (CI runs as root)")
    missing = [p for p in ("docker.io", "debootstrap") if sh("dpkg-query", "-W", p, check=False).returncode]
    if missing:
        sh("apt-get", "update", "-qq", timeout=600)
        sh("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, timeout=900,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
    client = "/usr/bin/docker"  # Debian's client builds with BuildKit without buildx
    started = None
    if sh(client, "info", check=False, timeout=60).returncode != 0:
        log = open(tmp_path_factory.mktemp("dockerd") / "dockerd.log", "w")
        started = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while sh(client, "info", check=False, timeout=60).returncode != 0:
            if started.poll() is not None or time.time() > deadline:
                unavailable("docker", f"dockerd does not start here: {Path(log.name).read_text()[-500:]}")
            time.sleep(0.5)
    try:
        sh("bash", REPO / "launch" / "base-image.sh", timeout=900, env={**os.environ, "DOCKER": client})
        probe = sh(client, "run", "--rm", "debian:trixie-slim", "true", check=False, timeout=120)
        if probe.returncode != 0:
            unavailable("docker", f"the kernel refuses containers here: {probe.stderr.strip()[-300:]}")
        yield client
    finally:
        if started is not None:
            started.terminate()
            started.wait(timeout=60)


@pytest.fixture(scope="session")
def marker_ca(tmp_path_factory) -> tuple[Path, str]:
    """This machine's CA bundle plus a CA made for this build; returns (bundle, the new CA's body)."""
    folder = tmp_path_factory.mktemp("ca")
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
       "-subj", f"/CN=hvd-train-test-{uuid.uuid4().hex}",
       "-keyout", folder / "key.pem", "-out", folder / "ca.pem")  # fmt: skip
    pem = (folder / "ca.pem").read_text()
    bundle = folder / "bundle.crt"
    bundle.write_text((HOST_CA.read_text() if HOST_CA.exists() else "") + pem)
    return bundle, pem_bodies(pem)[0]


def pem_bodies(text: str) -> list[str]:
    """The first base64 line of every certificate: enough to recognise one anywhere."""
    return re.findall(r"-----BEGIN CERTIFICATE-----\s*\n([A-Za-z0-9+/=]{40,})", text)


@pytest.fixture(scope="session")
def image(docker, marker_ca):
    bundle, _ = marker_ca
    started = time.time()
    proc = sh(docker, "build", "--build-arg", "VARIANT=cpu", "--secret", f"id=ca,src={bundle}", "-t", IMAGE, REPO,
              timeout=3600, env={**os.environ, "DOCKER_BUILDKIT": "1"})  # fmt: skip
    print(f"image built in {time.time() - started:.0f} s")
    assert "[install] downloads trust the CA bundle" in proc.stdout + proc.stderr or "CACHED" in proc.stderr
    return IMAGE


def in_image(docker, image, *args, entrypoint="bash", timeout=300, check=True):
    return sh(docker, "run", "--rm", "--entrypoint", entrypoint, image, *args, timeout=timeout, check=check)


def test_image_runs_as_hvd_without_a_compiler(docker, image):
    out = in_image(docker, image, "-c", "id -u; id -g; for c in gcc cc g++ c++ clang ld; do command -v $c; done; true")
    assert out.stdout.split() == ["1000", "1000"], out.stdout  # no compiler or linker found
    inspect = json.loads(sh(docker, "image", "inspect", image).stdout)[0]["Config"]
    assert inspect["User"] == "1000:1000" and inspect["Entrypoint"] == ["hvd-train"]
    # The stack and hvd_train's own files are separate layers: a change to the code alone is a small layer on top.
    history = sh(docker, "history", "--no-trunc", "--human=false", "--format", "{{.Size}} {{.CreatedBy}}", image)
    layers = [line.split(" ", 1) for line in history.stdout.splitlines()]
    newest = next((int(size), made) for size, made in layers if int(size) > 0)
    assert "COPY /code/ /" in newest[1] and newest[0] < 10e6, history.stdout
    stack = [int(size) for size, made in layers if "COPY /opt/hvd_train /opt/hvd_train" in made]
    assert len(stack) == 1 and stack[0] > 500e6, history.stdout


def test_no_ca_bundle_secret_or_pip_cache_in_any_layer(docker, image, marker_ca):
    _, marker = marker_ca
    # Certificates of the secret that the public bundles in the image (Debian's, certifi's)
    # lack: the CA made for this build, and this machine's proxy CA if it has one.
    bundles = "cat /etc/ssl/certs/ca-certificates.crt $(find / -name cacert.pem 2>/dev/null)"
    public = in_image(docker, image, "-c", bundles)
    extra = {marker} | (set(pem_bodies(HOST_CA.read_text())) if HOST_CA.exists() else set())
    extra -= set(pem_bodies(public.stdout))
    assert marker in extra
    needles = [body.encode() for body in extra]
    # Read as `docker save` writes it (a stream: gigabytes never land on disk).
    saving = subprocess.Popen([docker, "save", image], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    found, scanned = [], 0
    with saving:
        try:
            outer = tarfile.open(fileobj=saving.stdout, mode="r|")
        except tarfile.ReadError as e:  # docker save failed before its first byte (a full disk, a daemon gone)
            pytest.fail(f"`docker save` wrote no image ({e}; exit {saving.wait(timeout=60)}): {saving.stderr.read()}")
        with outer:
            for layer in outer:
                if not layer.name.endswith("layer.tar"):
                    continue
                with tarfile.open(fileobj=outer.extractfile(layer), mode="r|") as inner:
                    for member in inner:
                        name = member.name
                        if "/.cache/pip" in f"/{name}" or name.startswith(("run/secrets/", "root/.cache")):
                            found.append(f"{layer.name}: {name}")
                        if member.isfile():
                            data = inner.extractfile(member).read()
                            scanned += len(data)
                            if any(n in data for n in needles):
                                found.append(f"{layer.name}: {name} holds a certificate of the build secret")
            assert saving.wait(timeout=900) == 0, saving.stderr.read()[-2000:]
    assert scanned > 500e6  # the whole image was read
    assert not found, found
    history = sh(docker, "history", "--no-trunc", image).stdout
    assert "BEGIN CERTIFICATE" not in history and "ca-certificates.crt" not in history.replace("src=", "")


def test_models_and_doctor_work_inside(docker, image):
    models = sh(docker, "run", "--rm", image, "models")
    assert "ResNet50" in models.stdout and "MobileNetV2" in models.stdout
    doctor = sh(docker, "run", "--rm", "--network", "none", image, "doctor", check=False)
    assert doctor.returncode == 0, output_of(doctor)
    assert "0.28.1" in doctor.stdout and "does not resolve" in doctor.stdout
    assert "gethostname.so: built" in doctor.stdout


def caller_folder() -> Path:
    """A folder of the calling user (uid CALLER), as their data and run folder would be."""
    folder = Path("/tmp") / f"hvd-docker-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o755)
    os.chown(folder, CALLER, CALLER)
    return folder


def as_caller(*args, timeout=900, **env) -> subprocess.CompletedProcess:
    """Runs a command as uid CALLER, in the docker group (how a non-root user uses Docker)."""
    group = grp.getgrnam("docker").gr_gid
    home = Path("/tmp") / f"hvd-home-{CALLER}"
    home.mkdir(exist_ok=True)
    os.chown(home, CALLER, CALLER)
    setpriv = ["setpriv", f"--reuid={CALLER}", f"--regid={CALLER}", f"--groups={group}", "--"]
    environment = {"PATH": os.environ["PATH"], "HOME": str(home), "DOCKER": "/usr/bin/docker", **env}
    return sh(*setpriv, *args, timeout=timeout, check=False, env=environment)


@pytest.fixture(scope="module")
def demo_in_image(docker, image):
    """The demo run by the caller through ``docker.sh box`` (2 ranks) with no network: its folder and the command."""
    folder = caller_folder()
    try:
        # No network at all: the container's name does not resolve, and Horovod, told so once, uses loopback.
        box = ["bash", DOCKER_SH, "box", "--image", image, "--np", "2", "--network", "none", "--mount", folder]
        demo = ["demo", "--data", folder / "data", "--output", folder / "run", "--min-accuracy", "0.9"]
        yield folder, as_caller(*box, "--", *demo)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.multiprocess
def test_demo_through_docker_sh_box_without_a_network_reaches_accuracy(demo_in_image):
    folder, proc = demo_in_image
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, output_of(proc)
    assert "Segmentation fault" not in text and "Traceback" not in text
    assert len(re.findall(r"does not resolve; single-host job, so Horovod uses loopback", text)) == 1, text[-3000:]
    summary = read_json(folder / "run" / "summary.json")
    assert summary["world_size"] == 2 and summary["val_accuracy"] >= 0.9
    assert summary["val_images"] == 200  # 5 classes x 200 images, 20% held out
    assert re.search(r"demo: held-out accuracy (0\.9\d+|1\.0+)", text), output_of(proc)
    print(f"demo in the image: held-out accuracy {summary['val_accuracy']:.3f}")


# One process, after the demo's job (this file's order): it shares the machine.
def test_the_image_exports_the_demo_checked_in_each_runtime_and_every_output_belongs_to_the_caller(
    demo_in_image, image
):
    folder, proc = demo_in_image
    assert proc.returncode == 0, output_of(proc)
    # The image exports what it trained, each file checked in its runtime on the held-out images.
    single = ["bash", DOCKER_SH, "box", "--image", image, "--np", "1", "--mount", folder]
    exported = as_caller(*single, "--", "export", folder / "run", "--format", "tflite,onnx", "--check")
    assert exported.returncode == 0, output_of(exported)
    check = read_json(folder / "run" / "export" / "manifest.json")["check"]
    assert check["images"] == 200 and all(r["passed"] for r in check["formats"]), check
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in folder.rglob("*")}
    assert owners == {(CALLER, CALLER)}, owners


@pytest.mark.multiprocess
def test_two_containers_are_two_nodes_on_a_user_defined_network(docker, image, demo_small, tmp_path):
    tag = uuid.uuid4().hex[:6]
    network, worker, primary = f"hvdnet-{tag}", f"hvd-worker-{tag}", f"hvd-primary-{tag}"
    folder = Path("/tmp") / f"hvd-nodes-{tag}"
    keys = folder / "ssh"
    keys.mkdir(parents=True)
    shutil.copytree(demo_small, folder / "data")
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", keys / "id_ed25519")
    shutil.copy(keys / "id_ed25519.pub", keys / "authorized_keys")
    sh("chown", "-R", "1000:1000", folder)  # the image's user hvd reads the keys and writes the run
    keys.chmod(0o700)
    sh(docker, "network", "create", network)
    common = ["--image", image, "--network", network, "--ssh-dir", keys, "--mount", folder]
    try:
        sh("bash", DOCKER_SH, "worker", "--name", worker, *common, env={**os.environ, "DOCKER": docker})
        proc = sh("bash", DOCKER_SH, "primary", "--name", primary, *common, "--hosts", f"{primary}:1,{worker}:1",
                  "--network-interface", "eth0", "--", "train", "--data", folder / "data", "--output", folder / "run",
                  *tiny_in(folder), "--val-split", "0.2", "--epochs", "2",
                  timeout=900, check=False, env={**os.environ, "DOCKER": docker})  # fmt: skip
        assert proc.returncode == 0, output_of(proc)
        summary = read_json(folder / "run" / "summary.json")
        epochs = [line.split(",")[0] for line in (folder / "run" / "metrics.csv").read_text().splitlines()[1:]]
        assert summary["world_size"] == 2 and epochs == ["1", "2"]
        assert summary["weights_identical_across_ranks"] is True and summary["val_images"] == 25
        assert "[1]<stdout>" in proc.stdout or "[1]<stderr>" in proc.stderr  # rank 1 ran, in the worker
    finally:
        sh(docker, "rm", "-f", worker, primary, check=False)
        sh(docker, "network", "rm", network, check=False)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.multiprocess
def test_a_container_trains_from_the_loopback_s3_server_with_credentials_by_name(docker, image, s3_server, tmp_path):
    source = write_images(tmp_path / "src", {"red": 12, "green": 12, "blue": 12})
    s3_server.client().create_bucket(Bucket="docker-train")
    s3_server.upload_folder(source, "docker-train", "train/")
    folder = Path("/tmp") / f"hvd-s3-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    env = {**os.environ, **s3_server.env, "DOCKER": docker}
    args = ["box", "--image", image, "--np", "2", "--mount", folder, "--", "train", "--data", "s3://docker-train/train/",
            "--val-split", "0.25", "--output", folder / "run", *tiny_in(folder), "--epochs", "1"]  # fmt: skip
    try:
        dry = sh("bash", DOCKER_SH, *args, env={**env, "DRY_RUN": "1"})
        assert "-e AWS_SECRET_ACCESS_KEY" in dry.stderr and "-e AWS_ENDPOINT_URL" in dry.stderr
        proc = sh("bash", DOCKER_SH, *args, timeout=900, check=False, env=env)
        assert proc.returncode == 0, output_of(proc)
        summary = read_json(folder / "run" / "summary.json")
        assert summary["world_size"] == 2 and summary["val_images"] == 9 and sum(summary["input_objects"]) > 0
        for text in (dry.stdout + dry.stderr, proc.stdout + proc.stderr):
            assert S3_SECRET not in text and S3_KEY_ID not in text
        for path in folder.rglob("*"):
            if path.is_file():
                assert S3_SECRET.encode() not in path.read_bytes(), path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- launch/k8s/mpijob.yaml, replayed as the MPI Operator (v2beta1) runs it ---
#
# No Kubernetes control plane can run here, so this test does with Docker what the operator does
# with pods (kubeflow/mpi-operator, pkg/controller/mpi_job_controller.go): workers named
# <job>-worker-<i>, reachable as <job>-worker-<i>.<job>.<namespace>.svc; a hostfile of those
# names at /etc/mpi/hostfile; an ssh key pair (a Secret: id_rsa, id_rsa.pub, authorized_keys,
# mode 0644, owned by root) at sshAuthMountPath in every pod; the launcher's environment
# (OMPI_MCA_orte_default_hostfile, OMPI_MCA_plm_rsh_args="-o ConnectionAttempts=10", ...) after
# the template's own. Each container runs its template's command and args, as its user and with
# its CPU limit; the launcher's hvd-train arguments are swapped for a tiny run, and --np for 2.
MPIJOB = REPO / "launch" / "k8s" / "mpijob.yaml"


def mpijob_replay_parts(folder: Path, data: Path):
    import yaml

    job = yaml.safe_load(MPIJOB.read_text())
    name, specs = job["metadata"]["name"], job["spec"]["mpiReplicaSpecs"]
    workers = specs["Worker"]["replicas"]
    keys = folder / "ssh"
    keys.mkdir()
    sh("ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-m", "PEM", "-N", "", "-f", keys / "id_rsa")
    shutil.copy(keys / "id_rsa.pub", keys / "authorized_keys")
    for f in keys.iterdir():
        f.chmod(0o644)
    (folder / "mpi").mkdir()
    names = [f"{name}-worker-{i}" for i in range(workers)]
    (folder / "mpi" / "hostfile").write_text("".join(f"{n}.{name}.default.svc slots=1\n" for n in names))
    runs = folder / "runs"
    runs.mkdir()
    shutil.copytree(data, runs / "data")
    # Where each rank ran: the launcher's HVD_TRAIN (launch/mpirun.sh's program) notes it first.
    (runs / "rank.sh").write_text('#!/bin/sh\nhostname > "/runs/host-$OMPI_COMM_WORLD_RANK"\nexec hvd-train "$@"\n')
    (runs / "rank.sh").chmod(0o755)
    tiny = tiny_in(runs, "/runs")
    sh("chown", "-R", "1000:1000", runs)

    def container(role):
        template = specs[role]["template"]["spec"]
        [c] = template["containers"]
        user = template.get("securityContext", {})
        opts = ["--user", f"{user.get('runAsUser', 1000)}:{user.get('runAsGroup', 1000)}"]
        opts += ["-v", f"{keys}:{job['spec']['sshAuthMountPath']}:ro", "-v", f"{runs}:/runs"]
        opts += ["-e", f"K_MPI_JOB_ROLE={role.lower()}"]
        for e in c.get("env", []):
            opts += ["-e", f"{e['name']}={e['value']}"]
        cpu = c.get("resources", {}).get("limits", {}).get("cpu")
        if cpu:
            opts += ["--cpus", str(cpu)]
        return opts, c["command"], c.get("args", [])

    worker_opts, worker_cmd, worker_args = container("Worker")
    launcher_opts, launcher_cmd, launcher_args = container("Launcher")
    launcher_opts += ["-v", f"{folder / 'mpi'}:/etc/mpi:ro", "-e", "HVD_TRAIN=/runs/rank.sh"]
    for env in (
        "OMPI_MCA_orte_keep_fqdn_hostnames=true",
        "OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile",
        "OMPI_MCA_plm_rsh_args=-o ConnectionAttempts=10",
        f"OMPI_MCA_orte_set_default_slots={job['spec']['slotsPerWorker']}",
    ):
        launcher_opts += ["-e", env]
    at = launcher_args.index("--")
    options = launcher_args[:at]
    options[options.index("--np") + 1] = str(workers)
    # 6 epochs of 6 quick steps: the stop, asked for after step 8, lands well before the end.
    train = ["train", "--data", "/runs/data", "--output", "/runs/run", *tiny, "--val-split", "0.2", "--epochs", "6",
             "--deterministic", "--sample-log", "/runs/samples"]  # fmt: skip
    return name, names, (worker_opts, worker_cmd, worker_args), (launcher_opts, launcher_cmd, [*options, "--", *train])


@pytest.mark.multiprocess
def test_the_mpijob_replayed_with_containers_trains_and_a_stopped_launcher_resumes(docker, image, demo_small):
    tag = uuid.uuid4().hex[:6]
    folder = Path("/tmp") / f"hvd-mpijob-{tag}"
    folder.mkdir()
    name, workers, worker, launcher = mpijob_replay_parts(folder, demo_small)
    network = f"hvd-mpijob-{tag}"
    sh(docker, "network", "create", network)
    started = []

    def run_container(cname, opts, cmd, args, detach=True):
        alias = f"{cname}.{name}.default.svc"
        started.append(cname)
        return sh(docker, "run", *(["-d"] if detach else []), "--name", cname, "--hostname", cname,
                  "--network", network, "--network-alias", alias, *opts, "--entrypoint", cmd[0], image,
                  *cmd[1:], *args, timeout=900, check=False)  # fmt: skip

    try:
        for w in workers:
            proc = run_container(w, *worker)
            assert proc.returncode == 0, output_of(proc)
        proc = run_container(f"{name}-launcher", *launcher, detach=False)
        logs = "\n".join(sh(docker, "logs", w, check=False).stderr[-2000:] for w in workers)
        assert proc.returncode == 0, f"{output_of(proc)}\n--- workers\n{logs}"
        summary = read_json(folder / "runs" / "run" / "summary.json")
        assert summary["world_size"] == 2 and summary["weights_identical_across_ranks"] is True
        assert summary["val_images"] == 25
        ran_on = sorted((folder / "runs" / f"host-{r}").read_text().strip() for r in range(2))
        assert ran_on == workers, f"the ranks ran on {ran_on}, not on the workers\n{output_of(proc)}"

        # Preemption as Kubernetes does it: SIGTERM to the launcher's first process, SIGKILL after
        # the grace period (docker stop -t); the operator then starts a new launcher (restartPolicy
        # OnFailure) while the workers keep running.
        sh(docker, "rm", f"{name}-launcher")
        opts, cmd, args = launcher
        args = [a.replace("/runs/run", "/runs/run2").replace("/runs/samples", "/runs/samples2") for a in args]
        first = run_container(f"{name}-launcher", opts, cmd, args)
        assert first.returncode == 0, output_of(first)
        samples = folder / "runs" / "samples2"
        deadline = time.time() + 300
        while sum(len(p.read_text().splitlines()) for p in samples.glob("rank-0-*.jsonl")) < 8:
            assert time.time() < deadline, sh(docker, "logs", f"{name}-launcher", check=False).stderr[-3000:]
            time.sleep(0.05)
        t0 = time.time()
        sh(docker, "stop", "-t", "60", f"{name}-launcher", timeout=120)
        stopped = sh(docker, "wait", f"{name}-launcher").stdout.strip()
        print(f"docker stop of the launcher to its exit: {time.time() - t0:.1f} s")
        log = sh(docker, "logs", f"{name}-launcher").stderr
        assert stopped == "75", f"exit {stopped}\n{log[-4000:]}"
        lines = [line for line in log.splitlines() if "stopped by SIGUSR1" in line]
        assert len(lines) == 2 and "Traceback" not in log, log[-4000:]
        checkpoint = re.search(r"checkpoint (\S+); rerun the same command", lines[0]).group(1)
        sh(docker, "rm", f"{name}-launcher")
        t0 = time.time()
        again = run_container(f"{name}-launcher", opts, cmd, args, detach=False)
        print(f"new launcher to the end of the resumed run: {time.time() - t0:.1f} s")
        assert again.returncode == 0 and f"resuming from {checkpoint}" in again.stderr, output_of(again)
        resumed = read_json(folder / "runs" / "run2" / "summary.json")
        assert resumed["weights_digest"] == summary["weights_digest"], "the resumed run is not bit-identical"
    finally:
        sh(docker, "rm", "-f", *started, check=False)
        sh(docker, "network", "rm", network, check=False)
        shutil.rmtree(folder, ignore_errors=True)
