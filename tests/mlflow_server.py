"""A real MLflow tracking server on 127.0.0.1 (its own process, SQLite backend, artefacts served), over
HTTP or HTTPS, and its runs read back with MLflow's client, as a user would."""

import os
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
            # No job runner: its three consumer processes import MLflow and poll for the server's whole
            # life, and tracking needs none of them.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
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


class AuthProxy:
    """``with AuthProxy(upstream, port, user, password, token) as uri``: a reverse proxy on 127.0.0.1 in front
    of the server at ``upstream`` that answers 401 to every request, ``/health`` included, without
    ``user:password`` (basic) or ``token`` (bearer): as a proxy that guards a tracking server does (MLflow's
    own basic-auth app leaves ``/health`` open)."""

    def __init__(self, upstream: str, port: int, user: str, password: str, token: str):
        import base64

        self.upstream, self.port = upstream, port
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.accepted = {f"Basic {basic}", f"Bearer {token}"}

    def __enter__(self) -> str:
        import http.client
        import http.server
        import threading
        import urllib.parse

        accepted = self.accepted
        target = urllib.parse.urlsplit(self.upstream)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") not in accepted:
                    self._answer(401, {"WWW-Authenticate": 'Basic realm="mlflow"'}, b"credentials, please")
                    return
                kept = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=kept)
                    answer = upstream.getresponse()
                    data = answer.read()
                    passed = {
                        k: v
                        for k, v in answer.getheaders()
                        if k.lower() not in ("transfer-encoding", "connection", "content-length")
                    }
                    self._answer(answer.status, passed, data)
                finally:
                    upstream.close()

            def _answer(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
