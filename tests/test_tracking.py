"""``--track mlflow`` against a real MLflow tracking server on 127.0.0.1 (SQLite backend), read back with
MLflow's client; TensorBoard's HParams from the event files."""

import json
import shutil
import sys

import pytest

from hvd_train.errors import UserError

from conftest import TINY, cli, free_port, kill_group, output_of, png_with_a_corrupt_middle, start
from mlflow_server import mlflow_runs_of

SECRET = "tracking-secret-5b1e-never-logged"
# TINY with TensorBoard on: HParams are written beside its logs.
TRACKED = [a for a in TINY if a != "--no-tensorboard"]


@pytest.fixture(scope="module")
def tracked_run(mlflow_server, tmp_path_factory, demo_small):
    """Two epochs tracked, then a resume to three: one MLflow run."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    args = [
        "train",
        "--data",
        demo_small,
        "--output",
        out,
        "--val-split",
        "0.2",
        *TRACKED,
        "--track",
        "mlflow",
        "--tracker-uri",
        mlflow_server,
        "--tracker-project",
        "flowers",
        # A credential in the configuration must reach no parameter.
        "--s3-endpoint",
        f"http://someone:{SECRET}@127.0.0.1:9",
    ]
    first = cli([*args, "--epochs", "2"])
    second = cli([*args, "--epochs", "3"])
    return {"out": out, "first": first, "second": second}


def test_a_tracked_run_logs_its_config_epochs_and_files_to_one_mlflow_run(tracked_run, mlflow_server):
    for proc in (tracked_run["first"], tracked_run["second"]):
        assert proc.returncode == 0, output_of(proc)
    out = tracked_run["out"]
    client, runs = mlflow_runs_of(mlflow_server, "flowers")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert json.loads((out / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    params = run.data.params
    assert params["optim.base_lr"] == "0.01" and params["run.track"] == "mlflow"
    # Every epoch once, the resumed ones included, as metrics.csv has them.
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    csv_rows = (out / "metrics.csv").read_text().splitlines()
    assert sorted(m.step for m in history) == [1, 2, 3] == list(range(1, len(csv_rows)))
    summary = json.loads((out / "summary.json").read_text())
    assert run.data.metrics["final_val_accuracy"] == pytest.approx(summary["val_accuracy"])
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"model.keras", "summary.json", "curves.png", "report.html", "run_config.yaml"} <= files, files


def test_no_credential_reaches_mlflow(tracked_run, mlflow_server):
    client, runs = mlflow_runs_of(mlflow_server, "flowers")
    logged = json.dumps(runs[0].data.params) + json.dumps(runs[0].data.tags)
    assert "127.0.0.1:9" in logged and SECRET not in logged
    for proc in (tracked_run["first"], tracked_run["second"]):
        assert SECRET not in proc.stdout + proc.stderr


def test_tensorboard_hparams_hold_the_config_and_the_final_numbers(tracked_run):
    from tensorboard.plugins.hparams import plugin_data_pb2

    from hvd_train.compat import tf

    events = list((tracked_run["out"] / "tensorboard" / "hparams").glob("events.out.tfevents.*"))
    assert events
    hparams, finals = {}, {}
    for path in events:
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    if data.HasField("session_start_info"):
                        hparams = dict(data.session_start_info.hparams)
                elif value.tag.startswith("final/"):
                    finals[value.tag] = float(tf.make_ndarray(value.tensor))
    assert hparams["optim.base_lr"].number_value == pytest.approx(0.01)
    assert hparams["run.track"].string_value == "mlflow"
    summary = json.loads((tracked_run["out"] / "summary.json").read_text())
    assert finals["final/val_accuracy"] == pytest.approx(summary["val_accuracy"])


def test_a_tracking_server_that_does_not_answer_stops_the_run_at_once(tmp_path, demo_small):
    uri = f"http://someone:{SECRET}@127.0.0.1:{free_port()}"
    proc = cli(["train", "--data", demo_small, "--output", tmp_path, *TINY, "--track", "mlflow", "--tracker-uri", uri])
    assert proc.returncode == 2, output_of(proc)
    assert "cannot log to MLflow at http://127.0.0.1:" in proc.stderr and SECRET not in proc.stderr
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


# --- MLflow's default store: a SQLite mlflow.db in the working folder --------------------------------


@pytest.fixture
def in_a_fresh_folder(tmp_path, monkeypatch):
    """The working folder an empty one, and no MLFLOW_TRACKING_URI: MLflow's default store is its mlflow.db."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_a_sweeps_default_store_is_made_once_before_its_trials_which_then_log_to_it(in_a_fresh_folder):
    from hvd_train.training.tracking import mlflow as tracking

    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{in_a_fresh_folder / 'mlflow.db'}"
    tracking.prepare(uri, "sweep")  # what a sweep does before its first trial
    tracking.prepare(uri, "sweep")  # and again when it goes on
    _, runs = mlflow_runs_of(uri, "sweep")
    assert runs == []
    # A trial: its run in the store and experiment made for it.
    (in_a_fresh_folder / "trial-0000").mkdir()
    tracker = tracking.MlflowTracker.start(
        _tracked_config(in_a_fresh_folder / "trial-0000", "", "sweep"), resumed=False
    )
    tracker.finish({"val_accuracy": 0.25})
    _, runs = mlflow_runs_of(uri, "sweep")
    assert [(r.info.run_name, r.info.status) for r in runs] == [("trial-0000", "FINISHED")]


def test_a_broken_default_store_is_refused_in_one_line_naming_it(in_a_fresh_folder):
    from hvd_train.training.tracking import mlflow as tracking

    (in_a_fresh_folder / "mlflow.db").write_bytes(b"not a database, " * 100)
    for attempt in (
        lambda: tracking.prepare(tracking.tracking_uri(), "sweep"),
        lambda: tracking.MlflowTracker.start(_tracked_config(in_a_fresh_folder, "", "run"), resumed=False),
    ):
        with pytest.raises(UserError) as refused:
            attempt()
        message = str(refused.value)
        assert message.startswith(f"cannot log to MLflow at sqlite:///{in_a_fresh_folder / 'mlflow.db'} ("), message
        assert "check --tracker-uri / MLFLOW_TRACKING_URI" in message and "\n" not in message, message


# Makes a new store ready as a sweep does before its trials (prepare) or as a tracked run does at its start,
# once the test says go: two of them at once make the store's tables at once.
AT_ONCE = """
import os, sys, time
import mlflow.tracking
from hvd_train import config
from hvd_train.training.tracking import mlflow as tracking

uri, go, how, output = sys.argv[1:]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
if how == "prepare":
    tracking.prepare(uri, "at-once")
else:
    os.makedirs(output)
    run = {"output": output, "track": "mlflow", "tracker_uri": uri, "tracker_project": "at-once"}
    tracking.MlflowTracker.start(config.build({"data": {"train": "images"}, "run": run}), resumed=False)
"""


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_processes_that_make_a_new_store_at_once_both_log_to_it(tmp_path, request, store):
    if store == "sqlite":
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    else:
        from postgres_server import new_database

        uri = new_database(request.getfixturevalue("postgres_url"), "at_once")
    go = tmp_path / "go"
    procs = [start([sys.executable, "-c", AT_ONCE, uri, go, how, tmp_path / how]) for how in ("prepare", "run")]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready", proc.communicate()
        go.touch()
        done = [(proc.wait(timeout=240), *proc.communicate()) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    assert [code for code, _, _ in done] == [0, 0], done
    _, runs = mlflow_runs_of(uri, "at-once")
    assert [r.info.run_name for r in runs] == ["run"]


def test_a_store_whose_tables_are_half_made_is_refused_in_one_line_saying_so(tmp_path):
    import sqlite3

    from hvd_train.training.tracking import mlflow as tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.prepare(f"sqlite:///{tmp_path}/./mlflow.db", "made")  # another spelling: MLflow keeps a store per URI
    # As a migration cut short leaves them: some tables made, and no record of the migrations that made them.
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("DELETE FROM alembic_version")
        db.execute("DROP TABLE experiment_tags")
    with pytest.raises(UserError) as refused:
        tracking.prepare(uri, "made")
    message = str(refused.value)
    assert message.startswith(f"cannot log to MLflow at {uri} (") and "\n" not in message, message
    assert "its tables are half made" in message and "move that database aside" in message, message


# --- a tracking server over HTTPS, its certificate self-signed -------------------------------------


@pytest.fixture(scope="module")
def https_mlflow(tmp_path_factory):
    from mlflow_server import MlflowServer, self_signed

    folder = tmp_path_factory.mktemp("mlflow-https")
    certificate, key = self_signed(folder)
    with MlflowServer(folder, free_port(), tls=(certificate, key)) as uri:
        yield uri, certificate


def _tracked_config(output, uri: str, experiment: str):
    from hvd_train import config

    run = {"output": str(output), "track": "mlflow", "tracker_uri": uri, "tracker_project": experiment}
    return config.build({"data": {"train": "images"}, "run": run})


# Each of the ways MLflow's own client is told to trust a server's certificate (or not to check it).
TRUST = {
    "MLFLOW_TRACKING_SERVER_CERT_PATH": lambda certificate: str(certificate),
    "REQUESTS_CA_BUNDLE": lambda certificate: str(certificate),
    "MLFLOW_TRACKING_INSECURE_TLS": lambda certificate: "true",
}


@pytest.mark.parametrize("variable", sorted(TRUST))
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")  # MLflow's client's, told so
def test_a_https_server_mlflow_trusts_is_tracked_to(https_mlflow, tmp_path, monkeypatch, variable):
    from hvd_train.training.tracking.mlflow import MlflowTracker

    uri, certificate = https_mlflow
    for name in TRUST:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, TRUST[variable](certificate))
    tracker = MlflowTracker.start(_tracked_config(tmp_path, uri, variable), resumed=False)
    tracker.log_epoch(1, {"val_accuracy": 0.5})
    tracker.finish({"val_accuracy": 0.5})
    _, runs = mlflow_runs_of(uri, variable)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(tracker.run_id, "FINISHED")]
    assert runs[0].data.metrics["final_val_accuracy"] == 0.5


def test_a_https_server_mlflow_does_not_trust_is_refused_in_one_line(https_mlflow, tmp_path, monkeypatch):
    from hvd_train.training.tracking.mlflow import MlflowTracker

    uri, _ = https_mlflow
    for name in TRUST:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        UserError, match=r"cannot log to MLflow at https://127\.0\.0\.1:\d+ \(.*CERTIFICATE_VERIFY"
    ) as e:
        MlflowTracker.start(_tracked_config(tmp_path, uri, "untrusted"), resumed=False)
    assert "trust the server's certificate" in str(e.value) and "\n" not in str(e.value), e.value


def test_a_run_that_fails_in_training_ends_its_mlflow_run_failed(tmp_path, demo_small, mlflow_server):
    data = tmp_path / "data"
    shutil.copytree(demo_small, data)
    png_with_a_corrupt_middle(next(data.iterdir()) / "corrupt.png")  # passes the quick check, fails to decode
    args = ["train", "--data", data, "--output", tmp_path / "run", *TINY, "--on-bad-image", "fail"]
    proc = cli([*args, "--track", "mlflow", "--tracker-uri", mlflow_server, "--tracker-project", "failing"])
    assert proc.returncode == 2 and "during training; fix or remove it" in proc.stderr, output_of(proc)
    _, runs = mlflow_runs_of(mlflow_server, "failing")
    assert [r.info.status for r in runs] == ["FAILED"]


# --- a tracking server behind a proxy that demands credentials on every path, /health too -------------

PROXY_USER, PROXY_PASSWORD, PROXY_TOKEN = "alice", "proxy-secret-3c9d-never-shown", "proxy-token-77e1-never-shown"


@pytest.fixture(scope="module")
def guarded_mlflow(mlflow_server):
    from mlflow_server import AuthProxy

    with AuthProxy(mlflow_server, free_port(), PROXY_USER, PROXY_PASSWORD, PROXY_TOKEN) as uri:
        yield uri


# Each of the ways MLflow's own client is given credentials.
CREDENTIALS = {
    "in the URI": ({}, f"{PROXY_USER}:{PROXY_PASSWORD}@"),
    "MLFLOW_TRACKING_USERNAME": (
        {"MLFLOW_TRACKING_USERNAME": PROXY_USER, "MLFLOW_TRACKING_PASSWORD": PROXY_PASSWORD},
        "",
    ),
    "MLFLOW_TRACKING_TOKEN": ({"MLFLOW_TRACKING_TOKEN": PROXY_TOKEN}, ""),
}


@pytest.fixture
def no_mlflow_credentials(monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("way", sorted(CREDENTIALS))
def test_a_server_behind_a_proxy_that_demands_credentials_is_tracked_to_with_mlflows_own(
    guarded_mlflow, tmp_path, no_mlflow_credentials, way
):
    from hvd_train.training.tracking.mlflow import MlflowTracker

    variables, userinfo = CREDENTIALS[way]
    for name, value in variables.items():
        no_mlflow_credentials.setenv(name, value)
    experiment = f"guarded-{way.replace(' ', '-')}"
    tracker = MlflowTracker.start(
        _tracked_config(tmp_path, guarded_mlflow.replace("//", f"//{userinfo}"), experiment), False
    )
    tracker.log_epoch(1, {"val_accuracy": 0.5})
    tracker.finish({"val_accuracy": 0.5})
    _, runs = mlflow_runs_of(guarded_mlflow.replace("//", f"//{PROXY_USER}:{PROXY_PASSWORD}@"), experiment)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(tracker.run_id, "FINISHED")]
    assert PROXY_PASSWORD not in (tmp_path / "mlflow_run.json").read_text()


def test_a_proxy_that_refuses_the_credentials_is_named_in_one_line_without_them(
    guarded_mlflow, tmp_path, no_mlflow_credentials
):
    from hvd_train.training.tracking.mlflow import MlflowTracker

    wrong = guarded_mlflow.replace("//", f"//{PROXY_USER}:not-{PROXY_PASSWORD}@")
    with pytest.raises(UserError) as refused:
        MlflowTracker.start(_tracked_config(tmp_path, wrong, "refused"), resumed=False)
    message = str(refused.value)
    assert message.startswith(f"cannot log to MLflow at {guarded_mlflow} (") and "\n" not in message, message
    assert "401" in message and "MLFLOW_TRACKING_USERNAME" in message and PROXY_PASSWORD not in message, message
