"""A real MLflow tracking server on 127.0.0.1 (its own process, SQLite backend, artefacts served), over
HTTP or HTTPS, and its runs read back with MLflow's client, as a user would."""

import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class MlflowServer:
    """``with MlflowServer(folder, port) as uri``: the server runs inside the block.

    Args:
        tls: ``(certificate, key)`` PEM files: the server speaks HTTPS with them (see ``self_signed``).
    """

    def __init__(self, folder: Path, port: int, tls: tuple[Path, Path] | None = None):
        self.folder, self.port, self.tls = folder, port, tls

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
                *(["--uvicorn-opts", f"--ssl-certfile {self.tls[0]} --ssl-keyfile {self.tls[1]}"] if self.tls else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )
        uri = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        trusted = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2, context=trusted) as r:
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


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files in ``folder``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.pem", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path
