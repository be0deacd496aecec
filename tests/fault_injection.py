"""Helpers for the fault-injection tests: a five-process stack under `batchserve serve` or as five
`batchserve proc` processes (as systemd runs them, with no supervisor), streams that record every
SSE event with its arrival time, and the checks for what a failure left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from e2e_server import REPO, free_port, start_server

from batchserve.shared.commands import cli_command
from batchserve.shared.config import ServerConfig
from batchserve.shared.shm import SEGMENT_PREFIX

PROCESSES = ("worker", "scheduler", "tokenizer", "detokenizer", "api")


def health(url: str) -> int:
    """/health's status; 0 when the api does not answer at all."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def segments_of(pids: list[int]) -> list[str]:
    return sorted(p.name for pid in pids for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}-{pid}-*"))


class Stack:
    """The five processes serving `model`, started one way or the other; `pids` by process name."""

    def __init__(self, mode: str, model: Path, tmp: Path, *flags: str) -> None:
        self.mode, self.model, self.tmp, self.flags = mode, model, tmp, flags
        self.pids: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = ""
        self.runtime_dir: Path | None = None
        self.generation = 0

    def start(self) -> None:
        self.generation += 1
        log = self.tmp / f"{self.mode}-{self.generation}.log"
        if self.mode == "serve":
            server = start_server(self.model, log, *self.flags)
            self.url, self.pids, self.runtime_dir = server.url, server.pids, server.runtime_dir
            self.procs = {"serve": server.proc}
            return
        port = free_port()
        self.runtime_dir = self.tmp / "run"
        config = self.tmp / "config.json"
        args = dict(zip(self.flags[::2], self.flags[1::2]))
        fields = {k.lstrip("-").replace("-", "_"): v for k, v in args.items()}
        cfg = ServerConfig(model=str(self.model), port=port, runtime_dir=str(self.runtime_dir))
        raw = json.loads(cfg.to_json())
        for name, value in fields.items():
            raw[name] = type(raw[name])(value)
        config.write_text(json.dumps(raw))
        out = open(log, "ab")
        for name in PROCESSES:
            self.procs[name] = subprocess.Popen(
                [*cli_command("proc", name), "--config", str(config)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
            )
        self.pids = {name: p.pid for name, p in self.procs.items()}
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while health(self.url) != 200:
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            assert all(p.poll() is None for p in self.procs.values()), log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)

    def inject(self, process: str, how: str) -> None:
        os.kill(self.pids[process], {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[how])

    def stop(self) -> int | None:
        """Stop whatever still runs (as `systemctl stop` would: SIGCONT so a stopped process can take
        SIGTERM); returns serve's exit status (None under proc)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return self.procs["serve"].returncode if self.mode == "serve" else None


@dataclass
class StreamRecord:
    events: list[tuple[float, str]] = field(default_factory=list)  # (arrival time, data) per SSE event
    error: str = ""  # how the connection broke, if it did
    status: int = 0
    ended_at: float = 0.0

    @property
    def chunks(self) -> int:
        return sum(1 for _, data in self.events if data.startswith("{") and '"choices"' in data)

    def terminal(self) -> str:
        """What the client saw at the end: the shape of the last events."""
        if self.error:
            return f"connection lost ({self.error})"
        if self.status != 200:
            return f"HTTP {self.status}"
        datas = [data for _, data in self.events]
        if datas[-1:] != ["[DONE]"]:
            return "no [DONE]"
        last = json.loads(datas[-2]) if len(datas) >= 2 else {}
        if "error" in last:
            finish = json.loads(datas[-3])["choices"][0].get("finish_reason") if len(datas) >= 3 else None
            return f"finish_reason {finish} + error {last['error']['type']} + [DONE]"
        return "completed + [DONE]"


async def stream_until_end(session: aiohttp.ClientSession, url: str, body: dict, record: StreamRecord) -> None:
    try:
        async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
            record.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    record.events.append((time.monotonic(), line[6:]))
    except (TimeoutError, aiohttp.ClientError) as exc:
        record.error = type(exc).__name__
    finally:
        record.ended_at = time.monotonic()


async def streams_through_fault(
    url: str, body: dict, records: list[StreamRecord], inject: Callable[[], None], *, timeout: float = 60
) -> tuple[float, float | None]:
    """Stream `body` once per record; once every stream has 2 chunks, `inject()` the fault, then wait for
    /health to turn from 200 (within 30 s) and for every stream to end. Returns (when the fault was
    injected, when /health turned or None), as `time.monotonic()`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout + 30)) as session:
        tasks = [asyncio.create_task(stream_until_end(session, url, body, r)) for r in records]
        deadline = time.monotonic() + timeout
        while any(r.chunks < 2 for r in records):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), [r.terminal() for r in records]
            await asyncio.sleep(0.01)
        fault_at = time.monotonic()
        inject()
        down_at = None
        while down_at is None and time.monotonic() - fault_at < 30:
            if await asyncio.to_thread(health, url) != 200:
                down_at = time.monotonic()
            else:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
        return fault_at, down_at
