"""Data parallelism end to end: `batchserve serve --data-parallel-size 2 --router smg`, two replicas of a
tiny model (each its five processes, its own port and sockets) behind a real smg process on loopback,
called through the gateway with the `openai` package: chat, streaming, n and structured output; API keys
checked at the gateway as at each replica, and none of them opens smg's control plane, whose key (made by
`serve` for this start) only the router and the replicas' apis have; a conversation's next turn reaches
the replica holding its history (cache_aware); each replica is an ordinary server with the gauges
routers read. Last, a replica's worker killed mid-stream: its streams end with their terminal events,
`serve` removes that replica's shared memory at once, the gateway stops sending to it, and new requests
succeed on the other replica. Skipped where smg's wheel is not installed (the router extra). The gateway
alone, in front of a replica that never answers: tests/test_router_gateway.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import aiohttp
import openai
import pytest
from e2e_server import ReplicatedServer, http, metric, wait_until
from fault_injection import StreamRecord, health, stream_until_end
from pydantic import BaseModel, Field

from batchserve.procs.api.auth import INTERNAL_KEY_ENV
from batchserve.procs.api.metrics import PROTOCOL_ALIASES
from batchserve.procs.router import healthy_workers

pytest.importorskip(
    "smg",
    reason="smg is not installed: `pip install -e '.[router]'` installs the gateway "
    "(its wheel, smg==1.13.0) that these tests run in front of the replicas",
)

KEYS = ("k1", "k2")
FLAGS = (
    "--kv-capacity-tokens",
    "4096",
    "--max-running-requests",
    "16",
    "--drain-timeout-s",
    "5",
    "--api-key",
    KEYS[0],
    "--api-key",
    KEYS[1],
)
SYSTEM = " ".join(f"item {i}" for i in range(40))  # ~300 tokens: whole pages for the prefix cache
GONE_WITHIN_S = 15.0  # a dead replica out of the gateway's rotation: its health checks, every second


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ReplicatedServer(
        model,
        tmp_path_factory.mktemp("data-parallel") / "serve.log",
        "--data-parallel-size",
        "2",
        "--router",
        "smg",
        *FLAGS,
    )
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def chat(url: str, model: Path, messages: list[dict], key: str = KEYS[0], **kw):
    return client(url, key).chat.completions.create(
        model=str(model), messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", 16), **kw
    )


class Reply(BaseModel):
    ok: bool
    colour: Literal["red", "green"]
    word: str = Field(max_length=8)


def test_replicas_are_ordinary_servers_on_their_own_ports(server):
    assert server.url.rsplit(":", 1)[1] == str(server.port)  # the gateway on --port, the replicas after it
    assert [u.rsplit(":", 1)[1] for u in server.replica_urls] == [str(server.port + 1), str(server.port + 2)]
    assert {"router", "worker@0", "api@0", "worker@1", "api@1"} <= set(server.pids)
    for url in server.replica_urls:
        assert health(url) == 200
    assert server.runtime_dir is not None
    assert sorted(p.name for p in server.runtime_dir.glob("replica-*")) == ["replica-0", "replica-1"]


def test_chat_stream_n_and_structured_output_through_the_gateway(server, model):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    whole = chat(server.url, model, messages, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16
    for url in server.replica_urls:  # the same weights everywhere: greedy answers agree
        assert (
            chat(url, model, messages, extra_body={"ignore_eos": True}).choices[0].message.content
            == whole.choices[0].message.content
        )
    text, finish = [], None
    for chunk in chat(server.url, model, messages, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert ("".join(text), finish) == (whole.choices[0].message.content, "length")
    several = client(server.url).completions.create(
        model=str(model), prompt="jumps over", n=3, max_tokens=8, temperature=0.9, seed=5
    )
    assert [c.index for c in several.choices] == [0, 1, 2] and several.usage.completion_tokens == 24
    parsed = client(server.url).chat.completions.parse(
        model=str(model),
        messages=[{"role": "user", "content": '{"name": "Ada", "age": 36, "ok": true}'}],
        response_format=Reply,
        temperature=0,
        max_tokens=80,
    )
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, Reply)  # pydantic validated it against the schema


def test_new_request_fields_pass_the_gateway(server, model):
    """skip_special_tokens (vLLM's) and reasoning_effort (OpenAI's) reach the replicas through smg with a
    key: a special token the bias forces shows in the text only when asked for."""
    messages = [{"role": "user", "content": "the quick brown fox"}]
    texts = {}
    for url in (server.url, server.replica_urls[0]):
        for skip in (True, False):
            reply = chat(
                url,
                model,
                messages,
                max_tokens=3,
                reasoning_effort="low",
                extra_body={"ignore_eos": True, "skip_special_tokens": skip, "logit_bias": {"1": 100}},
            )
            texts[url, skip] = reply.choices[0].message.content
    assert texts[server.url, False] == texts[server.replica_urls[0], False] == "<s>" * 3
    assert texts[server.url, True] == texts[server.replica_urls[0], True] == ""


def test_the_api_keys_hold_at_the_gateway_as_at_each_replica(server, model):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    for url in (server.url, *server.replica_urls):
        for key in KEYS:
            assert chat(url, model, messages, key=key).choices[0].finish_reason in ("stop", "length"), (url, key)
        with pytest.raises(openai.AuthenticationError):
            chat(url, model, messages, key="not-a-key")
        status, _ = http(f"{url}/v1/chat/completions", {"model": str(model), "messages": messages})  # no key
        assert status == 401, url


def environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in entries if entry)


def internal_key(server: ReplicatedServer) -> str:
    """The key `serve` made for the router and the replicas' apis: from the router's environment."""
    return environment(server.pids["router"])[INTERNAL_KEY_ENV]


def test_only_the_internal_key_opens_smgs_control_plane(server):
    key = internal_key(server)
    assert len(key) >= 40 and key not in KEYS
    for name in ("api@0", "api@1"):  # the replicas' apis accept it; no other process is given it
        assert environment(server.pids[name])[INTERNAL_KEY_ENV] == key, name
    for name in ("worker@0", "scheduler@1", "tokenizer@0", "detokenizer@1"):
        assert INTERNAL_KEY_ENV not in environment(server.pids[name]), name
    assert healthy_workers(server.url, key) == set(server.replica_urls)
    for client_key in (*KEYS, None):
        headers = {"Authorization": f"Bearer {client_key}"} if client_key else {}
        assert http_status(f"{server.url}/workers", "GET", headers) == 401, client_key
        assert http_status(f"{server.url}/workers", "POST", headers, {"url": "http://127.0.0.1:9"}) == 401, client_key
    assert healthy_workers(server.url, key) == set(server.replica_urls)


def http_status(url: str, method: str, headers: dict[str, str], body: dict | None = None) -> int:
    request = urllib.request.Request(
        url,
        method=method,
        headers={"Content-Type": "application/json", **headers},
        data=json.dumps(body).encode() if body is not None else None,
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_conversations_next_turn_reaches_the_replica_holding_its_history(server, model):
    """cache_aware: a turn's text starts with the previous turn's, so smg sends it where that went, and
    that replica's prefix cache has its KV. Several conversations, so that each replica serves some."""
    for i in range(4):
        history = [
            {"role": "system", "content": f"conversation {i}: {SYSTEM}"},
            {"role": "user", "content": "the quick brown fox"},
        ]
        first = chat(server.url, model, history)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "jumps over the lazy dog"},
        ]
        second = chat(server.url, model, history)
        assert first.usage.prompt_tokens > 250
        # every whole page of the first turn's prompt: the last partial page stays private
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16, i


def test_stored_responses_chain_across_the_replicas_through_the_gateway(server, model):
    """The replicas' apis share one SQLite store (the state directory of the machine): 20 chained Responses
    turns through the gateway, whichever replica smg picks (it does not route by previous_response_id),
    each continue the last; every id is then readable at both replicas with its key, not with the other
    key, and a DELETE at one replica is seen at the other. smg 1.13 answers GET and DELETE
    /v1/responses/{id} itself, from its own history, which holds nothing for HTTP workers: 404 there."""
    gateway, rid, ids = client(server.url), None, []
    for i in range(20):
        response = gateway.responses.create(
            model=str(model), input=f"turn {i}", previous_response_id=rid, max_output_tokens=3, temperature=0
        )
        assert response.store and response.status in ("completed", "incomplete")
        rid = response.id
        ids.append(rid)
    assert len(set(ids)) == 20
    mine = [client(url) for url in server.replica_urls]
    theirs = client(server.replica_urls[0], KEYS[1])
    for rid in ids:
        assert {c.responses.retrieve(rid).id for c in mine} == {rid}
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        gateway.responses.retrieve(ids[-1])  # smg's own (empty) history
    mine[0].responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        mine[1].responses.retrieve(ids[0])


def test_each_replica_exports_the_gauges_routers_read(server):
    for url in server.replica_urls:
        status, page = http(f"{url}/metrics")
        assert status == 200
        names = {line.split("{")[0].split(" ")[0] for line in str(page).splitlines() if not line.startswith("#")}
        for name in (
            *PROTOCOL_ALIASES,
            *PROTOCOL_ALIASES.values(),
            "batchserve_time_to_first_token_seconds_count",
            "batchserve_inter_token_latency_seconds_count",
            "batchserve_e2e_request_latency_seconds_count",
            "batchserve_request_queue_time_seconds_count",
        ):
            assert name in names, (url, name)
        assert 0 <= metric(url, "vllm:kv_cache_usage_perc") <= 1
        assert metric(url, "batchserve_request_queue_time_seconds_count") > 0  # requests have been through both


def running(url: str) -> float:
    try:
        return metric(url, "batchserve_api_requests_in_flight")
    except (AssertionError, OSError):
        return 0.0


def healthy_in_gateway(server: ReplicatedServer) -> set[str]:
    return healthy_workers(server.url, internal_key(server))


def segments(pid: int) -> list[Path]:
    """What process `pid` has in /dev/shm (names carry the owner's pid: shared.shm)."""
    return list(Path("/dev/shm").glob(f"batchserve-{pid}-*"))


async def streams_until_a_replica_dies(
    server: ReplicatedServer, bodies: list[dict], records: list[StreamRecord]
) -> int:
    """Stream each body through the gateway; once every stream has 2 chunks, SIGKILL the worker of the
    replica serving the most of them; wait for every stream to end. Returns that replica."""
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), headers={"Authorization": f"Bearer {KEYS[0]}"}
    ) as session:
        tasks = [
            asyncio.create_task(stream_until_end(session, server.url, body, r)) for body, r in zip(bodies, records)
        ]
        deadline = time.monotonic() + 60
        while any(r.chunks < 2 for r in records):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), [r.terminal() for r in records]
            await asyncio.sleep(0.01)
        victim = max(range(len(server.replica_urls)), key=lambda i: running(server.replica_urls[i]))
        os.kill(server.pids[f"worker@{victim}"], signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return victim


def test_each_replica_serves_the_web_pages_of_its_own_scheduler(server, model):
    """The pages are a replica's: `/` and `/dashboard` on each replica's port, the live view its own
    scheduler's. The gateway (smg 1.13) routes only its known API paths: it answers them 404 (docs/api.md,
    Web pages)."""
    for url in server.replica_urls:
        for page in ("/", "/dashboard"):
            with urllib.request.urlopen(url + page, timeout=30) as resp:
                assert resp.status == 200 and b"/ui/" in resp.read()
        req = urllib.request.Request(url + "/dashboard/snapshot", headers={"Authorization": f"Bearer {KEYS[0]}"})

        def view(req: urllib.request.Request = req) -> dict | None:
            return json.loads(urllib.request.urlopen(req, timeout=30).read())["scheduler"]

        assert wait_until(view, 10) and view()["slots_total"] == 16
    for page in ("/", "/dashboard", "/dashboard/snapshot"):
        try:
            status = urllib.request.urlopen(server.url + page, timeout=30).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == 404, page


def test_a_killed_replica_ends_its_streams_and_leaves_the_rotation(server, model):
    """(Last: it leaves one replica.) The killed replica's api ends the streams it carried with their
    terminal events; `serve` stops that replica, removes its shared memory (the killed worker's too) and
    serves on; smg takes it out of rotation when its /health fails, and sends every new request to the
    other replica."""
    # distinct prompts, so that the gateway spreads them (no common prefix to follow)
    bodies = [
        {
            "model": str(model),
            "prompt": f"{i} the quick brown fox",
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(6)
    ]
    records = [StreamRecord() for _ in bodies]
    assert all(segments(server.pids[f"worker@{i}"]) for i in (0, 1))  # the workers' step buffers
    victim = asyncio.run(streams_until_a_replica_dies(server, bodies, records))
    survivor_url = server.replica_urls[1 - victim]
    ends = sorted(record.terminal() for record in records)
    assert all(end == "completed + [DONE]" or end.startswith("finish_reason abort + error") for end in ends), ends
    assert any(end.startswith("finish_reason abort") for end in ends), ends  # the victim carried some
    log = server.log()
    assert wait_until(lambda: f"stopping replica {victim}, replica {1 - victim} serves on" in server.log(), 15), log
    victims = [pid for name, pid in server.pids.items() if name.endswith(f"@{victim}")]
    assert wait_until(lambda: not any(segments(pid) for pid in victims), 30), [segments(pid) for pid in victims]
    assert segments(server.pids[f"worker@{1 - victim}"])  # the survivor's are its own
    assert wait_until(lambda: server.replica_urls[victim] not in healthy_in_gateway(server), GONE_WITHIN_S)
    assert healthy_in_gateway(server) == {survivor_url}
    served_before = metric(survivor_url, "batchserve_e2e_request_latency_seconds_count")
    for i in range(6):
        answer = chat(server.url, model, [{"role": "user", "content": f"w{i} the lazy dog"}])
        assert answer.choices[0].finish_reason in ("stop", "length")
    assert metric(survivor_url, "batchserve_e2e_request_latency_seconds_count") - served_before == 6
    assert server.proc is not None and server.proc.poll() is None  # serve serves on with one replica
