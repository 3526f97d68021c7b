"""``--track mlflow``: rank 0 logs a run to MLflow.

One MLflow run per training run (its id kept in ``OUTPUT/mlflow_run.json``,
so a resumed run goes on logging to the same MLflow run): the resolved
configuration as parameters (flattened as ``section.option``, credentials
left out as in ``run_config.yaml``), every epoch's metrics.csv row as
metrics at that epoch, and at the end the run's files as artefacts
(curves.png, confusion.png, report.html, summary.json, run_config.yaml,
labels.json, model.keras) and its final numbers. ``--tracker-uri`` is the
tracking URI, ``--tracker-project`` the experiment, ``--tracker-run`` the
run's name.

The tracking server is asked at the start: a URI that does not answer stops
the run then, with the URI named, not after hours of training. A new
database store's tables are made as the run starts, by one process at a
time (a lock beside a SQLite file; on a database server, retries of those
that lose the race), whatever other runs or sweeps start beside it. Once
training runs, a failed log call is a warning: the run's own files hold
everything, and training goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import time
import urllib.parse
from typing import Any

from hvd_train import files
from hvd_train.data.storage import redact_url
from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger
from hvd_train.training.tracking.base import ARTEFACTS, Tracker, final, flat_config, numbers

log = get_logger("track")

RUN_FILE = "mlflow_run.json"
# How long the probe of a tracking server waits for an answer, unless MLFLOW_HTTP_REQUEST_TIMEOUT says (seconds).
PROBE_TIMEOUT = 10.0
# How long a process waits for another that makes a SQLite store's tables (seconds).
STORE_LOCK_WAIT = 600.0
# The database servers MLflow stores runs in (SQLAlchemy's names).
SERVER_DATABASES = ("postgresql", "mysql", "mssql")
# What a database server answers a process that makes a new store's tables while another makes them.
_RACED = ("already exists", "duplicate key", "UniqueViolation", "Online migration expected", "deadlock detected")


def _mlflow():
    try:
        import mlflow
    except ImportError:
        raise UserError("--track mlflow needs MLflow: pip install 'hvd_train[track]'.") from None
    return mlflow


class MlflowTracker(Tracker):
    """Rank 0's MLflow run (see the module docstring). A sweep is one experiment, a run per trial."""

    name = "mlflow"
    sweep_names = True

    def __init__(self, output: str, uri: str, experiment: str, run_name: str):
        self.output = output
        self.uri = uri
        self.experiment = experiment
        self.run_name = run_name
        self.client = None
        self.run_id = ""

    @classmethod
    def start(cls, cfg, resumed: bool) -> MlflowTracker:
        """The run's MLflow run begun, or found again after a resume.

        Raises:
            UserError: MLflow is not installed, or the tracking URI does not answer.
        """
        run = cfg.run
        mlflow = _mlflow()
        uri = tracking_uri(run.tracker_uri)
        experiment = run.tracker_project or "hvd_train"
        tracker = cls(run.output, uri, experiment, run.tracker_run or os.path.basename(os.path.abspath(run.output)))
        tracker._begin(mlflow, cfg, resumed)
        return tracker

    @classmethod
    def prepare_sweep(cls, uri: str, project: str) -> None:
        """The store (``uri``, else MLflow's default) and the sweep's experiment ``project`` made (``prepare``)."""
        prepare(tracking_uri(uri), project)

    def _begin(self, mlflow, cfg, resumed: bool) -> None:
        kept = files.read_json(os.path.join(self.output, RUN_FILE), {})
        try:
            self.client = _client(self.uri)
            if resumed and kept.get("run_id") and kept.get("tracking_uri") == redact_url(self.uri):
                self.run_id = kept["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
                log.info("MLflow: going on with run %s in %s", self.run_id, redact_url(self.uri))
                return
            experiment_id = _experiment_id(self.client, self.experiment)
            created = self.client.create_run(
                experiment_id, run_name=self.run_name, tags={"hvd_train.output": self.output}
            )
            self.run_id = created.info.run_id
            items = sorted((k, str(v)) for k, v in flat_config(cfg).items())
            for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters a call
                self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in items[i : i + 100]])
        except Exception as e:  # MLflow raises its own errors and requests' for a server that is not there
            raise _refused(self.uri, e) from None
        run_file = {"tracking_uri": redact_url(self.uri), "run_id": self.run_id, "experiment": self.experiment}
        files.write_json(os.path.join(self.output, RUN_FILE), run_file)
        log.info("MLflow: run %s in experiment %s at %s", self.run_id, self.experiment, redact_url(self.uri))

    def log_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        """The numbers of epoch ``epoch`` (1-based), as metrics.csv has them."""
        self._log_metrics(numbers(logs), step=epoch)

    def finish(self, summary: dict[str, Any]) -> None:
        """The final numbers (``final_val_accuracy``, ...) and the run's files; the MLflow run ends FINISHED."""
        self._log_metrics({f"final_{k}": v for k, v in final(summary).items()}, step=0)
        from hvd_train.results import report_page

        report_page.write_or_warn(self.output)
        for name in ARTEFACTS:
            path = os.path.join(self.output, name)
            if os.path.isfile(path):
                self._call(self.client.log_artifact, self.run_id, path)
        self._call(self.client.set_terminated, self.run_id, "FINISHED")

    def stopped(self) -> None:
        """A stop signal ended the run on a checkpoint: the MLflow run is KILLED until a resume goes on with it."""
        self._call(self.client.set_terminated, self.run_id, "KILLED")

    def failed(self, error: BaseException | None = None) -> None:
        """The run ended on an error: the MLflow run is FAILED (a rerun that resumes goes on with it)."""
        self._call(self.client.set_terminated, self.run_id, "FAILED")

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        if batch:
            self._call(self.client.log_batch, self.run_id, metrics=batch)

    def _call(self, method, *args, **kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception as e:  # tracking is a copy: the run's own files hold everything
            log.warning("MLflow at %s: %s failed (%s)", redact_url(self.uri), method.__name__, first_line(e))


def tracking_uri(given: str = "") -> str:
    """``given`` (``--tracker-uri``), else MLflow's: ``MLFLOW_TRACKING_URI``, else its default (a SQLite
    ``mlflow.db`` in the working folder)."""
    return given or _mlflow().get_tracking_uri()


def prepare(uri: str, experiment: str) -> None:
    """Makes the store at ``uri`` ready for runs, before any starts: its tables made (a database's, as
    MLflow's default ``mlflow.db``) and ``experiment`` created.

    A sweep calls it once before its trials: a store it cannot use stops the sweep in one line before
    any trial starts, and its trials find the tables made (processes that make them take turns, or
    retry: see ``_client``).

    Raises:
        UserError: MLflow is not installed, or the store cannot be reached or made (one line, naming ``uri``).
    """
    _mlflow()
    try:
        _experiment_id(_client(uri), experiment)
    except Exception as e:  # MLflow's errors, SQLAlchemy's (a database store), requests' (a server)
        raise _refused(uri, e) from None


def _client(uri: str, attempts: int = 5):
    """MLflow's client of ``uri``, its server asked first (``_probe``).

    A database store's tables are made or migrated here, by MLflow as the
    client is made. Processes that start together on a new store (a sweep's
    and a run's, or runs started at once) would make them at once: on a
    SQLite file they take turns (``_store_lock``); on a database server one
    makes them and the others, refused (a table or key that now exists), try
    again and find them made, as the study's storage does.
    """
    from mlflow.tracking import MlflowClient

    _probe(uri)
    with _store_lock(uri):
        for attempt in range(attempts):
            try:
                return MlflowClient(tracking_uri=uri)
            except Exception as e:  # SQLAlchemy's errors of a concurrent CREATE TABLE or migration
                raced = any(word in str(e) for word in _RACED)
                if not _on_a_server(uri) or not raced or attempt == attempts - 1:
                    raise
                time.sleep(0.2 + random.random())
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _store_lock(uri: str):
    """Holds ``DATABASE.lock`` (``flock``) beside a ``sqlite:`` store's file while the block runs, so that
    processes make or migrate its tables one at a time; nothing for any other store.

    Raises:
        TimeoutError: another process held it for ``STORE_LOCK_WAIT`` seconds.
        OSError: the lock's file cannot be made (the store's folder is not there, or not writable).
    """
    path = _sqlite_file(uri)
    if not path:
        yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + STORE_LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has held {path}.lock for {STORE_LOCK_WAIT:.0f} s, making the store's tables"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _sqlite_file(uri: str) -> str:
    """The database file of a ``sqlite:`` URI, absolute; "" for any other URI, or an in-memory database."""
    if not uri.startswith("sqlite:"):
        return ""
    from sqlalchemy.engine import make_url

    database = make_url(uri).database or ""
    if database.startswith("file:"):  # SQLite's URI filename (sqlite:///file:path?mode=rwc&uri=true)
        database = urllib.parse.urlsplit(database).path
    return "" if database in ("", ":memory:") else os.path.abspath(database)


def _on_a_server(uri: str) -> bool:
    """Whether ``uri`` is a database server's (SQLAlchemy's URL, ``postgresql+psycopg://`` too)."""
    return urllib.parse.urlsplit(uri).scheme.split("+")[0] in SERVER_DATABASES


def _experiment_id(client, name: str) -> str:
    """The id of experiment ``name``, created if it is not there (by another process meanwhile, too)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _refused(uri: str, error: Exception) -> UserError:
    return UserError(f"cannot log to MLflow at {redact_url(uri)} ({first_line(error)}); {_fix(uri, error)}.")


def _fix(uri: str, error: Exception) -> str:
    """What to do about ``error``, raised by the first calls to a tracking URI."""
    text = str(error)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            "trust the server's certificate as MLflow's client does: MLFLOW_TRACKING_SERVER_CERT_PATH or "
            "REQUESTS_CA_BUNDLE (MLFLOW_TRACKING_INSECURE_TLS=true checks none)"
        )
    if _in_migration(error):  # what MLflow's migrations found was neither new nor a schema they know
        return (
            "its tables are half made (a migration of them cut short, or run by two processes at once): move "
            "that database aside, or give --tracker-uri another"
        )
    if any(word in text for word in ("error code 401", "error code 403", "UNAUTHENTICATED", "PERMISSION_DENIED")):
        return (
            "give MLflow the server's credentials: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
            "MLFLOW_TRACKING_TOKEN"
        )
    if uri.startswith(("http://", "https://")):
        return "start the tracking server, or check --tracker-uri / MLFLOW_TRACKING_URI"
    return "check --tracker-uri / MLFLOW_TRACKING_URI"


def _in_migration(error: Exception) -> bool:
    """Whether ``error`` was raised inside MLflow's migrations of a store's tables (alembic's code): after
    ``_client``'s turns and retries, a store they cannot bring to MLflow's schema."""
    tb = error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if f"{os.sep}alembic{os.sep}" in name or f"{os.sep}db_migrations{os.sep}" in name:
            return True
        tb = tb.tb_next
    return False


def _probe(uri: str) -> None:
    """Asks a tracking server's ``/health`` once whether anything answers there: MLflow's client would
    retry a server that is not there for minutes before it fails.

    Any answer below 500 is one, a 401 or 403 included (a proxy that wants credentials on every path,
    ``/health`` too): MLflow's own first request, with the credentials MLflow is given (in the URI,
    ``MLFLOW_TRACKING_USERNAME`` and ``_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``, or a plugin's), says the
    rest, at once. The probe sends none of them. A 5xx is a proxy whose server behind is not there,
    which MLflow's client would retry for minutes: refused.

    The request is made as MLflow's client makes its own (``mlflow/utils/rest_utils.py``): with
    ``requests``, which trusts ``REQUESTS_CA_BUNDLE``, and the certificates MLflow's variables
    give (``MLFLOW_TRACKING_SERVER_CERT_PATH``, ``MLFLOW_TRACKING_CLIENT_CERT_PATH``), or none
    checked (``MLFLOW_TRACKING_INSECURE_TLS``); within ``MLFLOW_HTTP_REQUEST_TIMEOUT`` seconds where
    that is set, else ``PROBE_TIMEOUT``: a server MLflow reaches, the probe reaches.
    """
    if urllib.parse.urlsplit(uri).scheme not in ("http", "https"):
        return
    import requests
    from mlflow import environment_variables as env

    server_cert = env.MLFLOW_TRACKING_SERVER_CERT_PATH.get()
    verify = server_cert if server_cert else not env.MLFLOW_TRACKING_INSECURE_TLS.get()
    timeout = env.MLFLOW_HTTP_REQUEST_TIMEOUT
    answer = requests.get(
        f"{redact_url(uri).rstrip('/')}/health",
        timeout=timeout.get() if timeout.is_set() else PROBE_TIMEOUT,
        verify=verify,
        cert=env.MLFLOW_TRACKING_CLIENT_CERT_PATH.get(),
    )
    if answer.status_code >= 500:
        answer.raise_for_status()
