"""Helpers for the end-to-end tests: a real `batchserve serve` subprocess, HTTP, and an in-process
greedy reference (the same scheduler core and worker core, no sockets)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, REPO, ServerProcess, free_port
from batchserve.loadtests.sse import StreamReader
from batchserve.shared.liveness import pid_gone

__all__ = [
    "REPO",
    "ReplicatedServer",
    "Server",
    "free_port",
    "http",
    "metric",
    "pid_alive",
    "reference_greedy",
    "start_server",
    "stream",
    "wait_until",
]

SERVING_LINE = re.compile(r"batchserve: serving .* at (http://\S+) .*?; (worker=\d+ .*?api=\d+);")
RUNTIME_DIR = re.compile(r"runtime dir (\S+)\)")
# `serve --data-parallel-size N [--router R]`: the gateway's URL (with a router), the replicas' URLs, and
# every child's pid, named NAME@REPLICA (and `router`).
REPLICATED_LINE = re.compile(
    r"batchserve: serving \S+ (?:at (http://\S+) through .*? )?(?:over|on) \d+ "
    r"replica\(s\) at ((?:http://\S+ )+)\(ready in \S+; (.*?); runtime dir (\S+)\)"
)


class Server(ServerProcess):
    """`batchserve serve` on a free port, ready once it prints its "serving" line (every process
    reported ready): then `url`, `pids` (by process name) and `runtime_dir` are set."""

    def __init__(self, model: str | Path, log_path: Path, *args: str, startup_timeout: float = 240):
        super().__init__(
            [*DEFAULT_SERVE_COMMAND, "--model", str(model), *args],
            log_path,
            health_timeout_s=startup_timeout,
            stop_timeout_s=60,
            cwd=REPO,
        )
        self.url = ""
        self.pids: dict[str, int] = {}
        self.runtime_dir: Path | None = None
        self.extra: dict = {}

    def ready(self) -> bool:
        log = self.log()
        match = SERVING_LINE.search(log)
        if not match:
            return False
        self.url = match.group(1)
        self.pids = {k: int(v) for k, v in (kv.split("=") for kv in match.group(2).split())}
        dir_match = RUNTIME_DIR.search(log)
        self.runtime_dir = Path(dir_match.group(1)) if dir_match else None
        return True


class ReplicatedServer(Server):
    """`batchserve serve --data-parallel-size N` (and `--router`): ready once it prints its "serving" line;
    then `url` is the router's (else replica 0's), `replica_urls` every replica's, and `pids` every child's
    by its name in that line (`worker@1`, `api@0`, `router`)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.replica_urls: list[str] = []

    def ready(self) -> bool:
        match = REPLICATED_LINE.search(self.log())
        if not match:
            return False
        self.replica_urls = match.group(2).split()
        self.url = match.group(1) or self.replica_urls[0]
        self.pids = {k: int(v) for k, v in (kv.split("=") for kv in match.group(3).split())}
        self.runtime_dir = Path(match.group(4))
        return True


def start_server(model: str | Path, log_path: Path, *args: str, startup_timeout: float = 240) -> Server:
    """Start `batchserve serve` and wait for its "serving" line (every process reported ready)."""
    server = Server(model, log_path, *args, startup_timeout=startup_timeout)
    server.start()
    return server


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
    req = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    reader = StreamReader()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            if not reader.feed(line):
                break
    return reader.text, reader.finish_reason, reader.chunks


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


def reference_greedy(
    model: str | Path, prompts: list[list[int]], max_tokens: int, *, ignore_eos: bool = False, **config: object
) -> list[list[int]]:
    """Each prompt's greedy tokens, run alone through `OfflineEngine` (the scheduler core and the worker
    core in one process, no sockets)."""
    from batchserve.procs.engine import OfflineEngine
    from batchserve.shared.config import ServerConfig
    from batchserve.shared.messages import GenerateRequest, RequestParams, SamplingParams, StopParams

    engine = OfflineEngine(ServerConfig(model=str(model), **config))
    outputs = []
    for i, prompt in enumerate(prompts):
        params = RequestParams(
            sampling=SamplingParams(temperature=0.0), stop=StopParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        )
        req = GenerateRequest(rid=f"ref-{i}", prompt_token_ids=list(prompt), params=params)
        outputs.append(engine.generate([req])[0].token_ids)
    return outputs


async def stream_completion(client: Any, model: str, prompt: str, max_tokens: int) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of one greedy streamed completion through an `openai.AsyncOpenAI`
    client, generating `max_tokens` tokens (ignore_eos)."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage = [], None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return "".join(text), finish, usage
