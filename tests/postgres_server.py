"""A throwaway PostgreSQL server for the tests: Debian's `postgresql` package (which `.ci/run` installs),
`initdb` into a fresh directory and `pg_ctl start` on a Unix socket only (no TCP port). As root, the server
runs as the package's `postgres` user (PostgreSQL refuses to run as root). `None` with a reason where no
server can start (no package, no such user)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

PORT = 5433


@dataclass
class PostgresServer:
    directory: Path
    bin_dir: Path
    prefix: list[str]  # runs a command as the server's user

    @property
    def url(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.directory / 'socket'}&port={PORT}"

    def stop(self) -> None:
        subprocess.run(
            [*self.prefix, str(self.bin_dir / "pg_ctl"), "-D", str(self.directory / "data"), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(self.directory, ignore_errors=True)


def start_postgres() -> tuple[PostgresServer | None, str]:
    """(a running server, "") or (None, why not)."""
    initdb = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))), None)
    if initdb is None:
        return None, "no PostgreSQL server here (Debian's postgresql package: .ci/run installs it)"
    bin_dir = Path(os.path.realpath(initdb)).parent
    prefix: list[str] = []
    directory = Path(tempfile.mkdtemp(prefix="batchserve-pg-"))
    (directory / "socket").mkdir()
    if os.geteuid() == 0:
        if shutil.which("runuser") is None or subprocess.run(["id", "postgres"], capture_output=True).returncode:
            return None, "running as root without the postgres user to run PostgreSQL as"
        shutil.chown(directory, "postgres")
        shutil.chown(directory / "socket", "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    data = str(directory / "data")
    steps = [
        [str(bin_dir / "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        [
            str(bin_dir / "pg_ctl"),
            "-D",
            data,
            "-w",
            "-t",
            "60",
            "-l",
            str(directory / "log"),
            "-o",
            f"-p {PORT} -k {directory / 'socket'} -c listen_addresses=''",
            "start",
        ],
    ]
    for step in steps:
        done = subprocess.run([*prefix, *step], capture_output=True, text=True, timeout=120)
        if done.returncode:
            shutil.rmtree(directory, ignore_errors=True)
            return None, f"PostgreSQL did not start: {(done.stderr or done.stdout).strip()[-300:]}"
    return PostgresServer(directory, bin_dir, prefix), ""
