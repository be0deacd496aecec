"""Helpers for the end-to-end tests: a real `batchserve serve` subprocess, HTTP, and an in-process
greedy reference (the same scheduler core and worker core, no sockets)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.liveness import pid_gone

REPO = Path(__file__).resolve().parent.parent
SERVING_LINE = re.compile(r"batchserve: serving .* at (http://\S+) .*?; (worker=\d+ .*?api=\d+);")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    pids: dict[str, int]
    log_path: Path
    runtime_dir: Path | None = None
    extra: dict = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(model: str | Path, log_path: Path, *args: str, startup_timeout: float = 240) -> Server:
    """Start `batchserve serve` and wait for its "serving" line (every process reported ready)."""
    port = free_port()
    cmd = [sys.executable, "-m", "procs.cli", "serve", "--model", str(model), "--port", str(port), *args]
    out = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        match = SERVING_LINE.search(log_path.read_text(errors="replace"))
        if match:
            pids = {k: int(v) for k, v in (kv.split("=") for kv in match.group(2).split())}
            dir_match = re.search(r"runtime dir (\S+)\)", log_path.read_text(errors="replace"))
            return Server(proc, match.group(1), pids, log_path, Path(dir_match.group(1)) if dir_match else None)
        if proc.poll() is not None:
            raise RuntimeError(f"batchserve serve exited {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"batchserve serve not ready in {startup_timeout}s:\n{log_path.read_text(errors='replace')}")


def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
    """POST `body` (or GET) and return (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def stream(url: str, body: dict, timeout: float = 120) -> tuple[str, str | None, list[dict]]:
    """POST a streaming request; return (joined text, finish_reason, chunks)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, text, finish = [], [], None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                text.append(piece or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish, chunks


def metric(url: str, name: str) -> float:
    status, text = http(f"{url}/metrics")
    assert status == 200
    for line in str(text).splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until(predicate, timeout: float = 15, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def pid_alive(pid: int) -> bool:
    return not pid_gone(pid)


def reference_greedy(model: str | Path, prompts: list[list[int]], max_tokens: int, *, ignore_eos: bool = False,
                     **config: object) -> list[list[int]]:
    """Each prompt's greedy tokens, run alone through `OfflineEngine` (the scheduler core and the worker
    core in one process, no sockets)."""
    from procs.engine import OfflineEngine
    from shared.config import ServerConfig
    from shared.messages import GenerateRequest, SamplingParams, StopParams

    engine = OfflineEngine(ServerConfig(model=str(model), **config))
    outputs = []
    for i, prompt in enumerate(prompts):
        req = GenerateRequest(rid=f"ref-{i}", prompt_token_ids=list(prompt), sampling=SamplingParams(temperature=0.0),
                              stop=StopParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
        outputs.append(engine.generate([req])[0].token_ids)
    return outputs
