"""A real PostgreSQL server on 127.0.0.1, from Debian's ``postgresql`` package, for the sweeps' shared studies.

PostgreSQL will not run as root: the server's files belong to the package's
``postgres`` user, and it runs as that user (``runuser``), in a folder of its
own under the system's temporary folder (pytest's is private to root).
"""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

# The sweeps' user's password: tests look for it in every file and log, where it must never be.
PASSWORD = "hvdtrain-pg-never-print-me"
ADMIN = "hvdtrain-pg-admin"


class Unavailable(Exception):
    """No PostgreSQL server can run here (not root, no package, no ``postgres`` user)."""


def bindir() -> Path:
    """The newest installed PostgreSQL's programs (/usr/lib/postgresql/VERSION/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise Unavailable("no PostgreSQL server here (Debian's postgresql package)")
    return Path(found[-1]).parent


class PostgresServer:
    """``with PostgresServer(port) as url``: a server with a database ``sweeps`` owned by user ``sweep``, who
    may create others (``new_database``)."""

    def __init__(self, port: int):
        self.port = port

    def __enter__(self) -> str:
        if os.geteuid() != 0:
            raise Unavailable("starting PostgreSQL as its postgres user needs root")
        bin_ = bindir()
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("no postgres user (Debian's postgresql package makes it)") from None
        self.root = Path(tempfile.mkdtemp(prefix="hvd-train-pg-"))
        os.chown(self.root, user.pw_uid, user.pw_gid)
        (self.root / "pw").write_text(ADMIN + "\n")
        os.chown(self.root / "pw", user.pw_uid, user.pw_gid)
        self.as_postgres = ["runuser", "-u", "postgres", "--"]
        self.pg_ctl = bin_ / "pg_ctl"
        self._run(
            bin_ / "initdb", "-D", self.root / "data", "-U", "postgres", "--auth=scram-sha-256",
            f"--pwfile={self.root / 'pw'}", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run(
            self.pg_ctl,
            "-D",
            self.root / "data",
            "-l",
            self.root / "server.log",
            "-w",
            "-t",
            "60",
            "-o",
            options,
            "start",
        )
        self.started = True
        for sql in (f"CREATE ROLE sweep LOGIN CREATEDB PASSWORD '{PASSWORD}'", "CREATE DATABASE sweeps OWNER sweep"):
            self._run(bin_ / "psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "postgres",
                      "-v", "ON_ERROR_STOP=1", "-c", sql, env={"PGPASSWORD": ADMIN})  # fmt: skip
        return f"postgresql://sweep:{PASSWORD}@127.0.0.1:{self.port}/sweeps"

    def _run(self, *args, env=None) -> None:
        done = subprocess.run(
            [*self.as_postgres, *map(str, args)],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **(env or {})},
        )
        if done.returncode:
            log = self.root / "server.log"
            self.__exit__()
            raise RuntimeError(
                f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}\n"
                f"{log.read_text()[-2000:] if log.exists() else ''}"
            )

    def __exit__(self, *exc) -> None:
        if getattr(self, "started", False):
            subprocess.run(
                [*self.as_postgres, str(self.pg_ctl), "-D", str(self.root / "data"), "-m", "immediate", "stop"],
                cwd=self.root,
                capture_output=True,
                timeout=60,
            )
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)


def new_database(url: str, name: str) -> str:
    """The URL of a new empty database ``name`` on the server of ``url`` (``postgres_url``'s), made by its user."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name
