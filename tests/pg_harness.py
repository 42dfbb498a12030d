"""A real PostgreSQL server for tests, from the distribution's packages (``apt-get install postgresql``).

initdb into a temporary directory, ``pg_ctl start`` on a free loopback port (trust authentication, loopback
only), torn down afterwards. Postgres refuses to run as root, so as root it runs as the ``postgres`` user the
package creates. ``postgres_or_skip`` skips with the reason when the binaries (or that user) are absent.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.gateway_harness import free_port


def _bin_dir() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    def __init__(self) -> None:
        bindir = _bin_dir()
        if bindir is None:
            pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql; .ci/run installs them)")
        self.bindir = bindir
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no 'postgres' user to run the server as")
            self.prefix = ["runuser", "-u", "postgres", "--"]
        self.dir = Path(tempfile.mkdtemp(prefix="splitserve-pg-"))
        if self.prefix:
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self.data = self.dir / "data"
        self.port = free_port()
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60", "-o",
                  f"-h 127.0.0.1 -p {self.port} -k {self.dir} -F", "start")
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.prefix, str(self.bindir / tool), *args], check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def postgres_or_skip() -> PostgresServer:
    return PostgresServer()
