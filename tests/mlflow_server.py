"""A real MLflow tracking server on 127.0.0.1 (its own process, SQLite backend, artefacts served), and
its runs read back with MLflow's client, as a user would."""

import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class MlflowServer:
    """``with MlflowServer(folder, port) as uri``: the server runs inside the block."""

    def __init__(self, folder: Path, port: int):
        self.folder, self.port = folder, port

    def __enter__(self) -> str:
        self.log = open(self.folder / "server.log", "wb")  # noqa: SIM115 - the server's whole life
        self.proc = subprocess.Popen(
            [
                Path(sys.executable).parent / "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.folder / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.folder / "artifacts"),
                "--workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )
        uri = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return uri
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(
                    f"the MLflow server did not start: {(self.folder / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.3)

    def __exit__(self, *exc) -> None:
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def mlflow_runs_of(uri: str, experiment: str):
    """MLflow's client of ``uri`` and the runs of ``experiment``."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    return client, client.search_runs([found.experiment_id])
