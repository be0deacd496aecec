"""Stored responses that survive (issue 46): the database stores on their own, SQLite and a real PostgreSQL
server (tests/postgres_server.py; skipped with the reason where none starts): kept across a reopen, shared
by two writers at once, scoped by owner, an age limit; and through the api with the `openai` package: two
API keys never see each other's responses, a restarted api continues a chain from the same database, a
store that cannot open (a corrupt file, a server that does not answer) is one line and /health says so
while generation goes on (503 naming the store for a stored response, `store: false` on new ones), and a
write that fails mid-run answers the request."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer
from api_fake_engine import FakeEngine
from postgres_server import start_postgres

from batchserve.procs.api.app import HANDLERS_KEY, create_app
from batchserve.procs.api.responses_sql import PostgresResponseStore, SqliteResponseStore
from batchserve.procs.api.responses_store import MemoryResponseStore, UnavailableResponseStore, owner_of, state_dir
from batchserve.procs.api.stored_response import ResponseStoreError
from batchserve.shared.config import ServerConfig


@pytest.fixture(scope="module")
def postgres():
    server, why = start_postgres()
    if server is None:
        pytest.skip(why)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path) -> Callable[..., SqliteResponseStore | PostgresResponseStore]:
    """A factory of stores on one database (each call: another connection, as another replica's or a
    restart's), emptied first."""
    if request.param == "sqlite":
        return lambda ttl_s=3600.0, **limits: SqliteResponseStore(
            tmp_path / "r.sqlite3", ttl_s=ttl_s, **_limits(limits)
        )
    url = request.getfixturevalue("postgres").url

    def make(ttl_s: float = 3600.0, **limits: int) -> PostgresResponseStore:
        return PostgresResponseStore(url, ttl_s=ttl_s, **_limits(limits))

    make()._sql("DELETE FROM responses")
    return make


def _limits(limits: dict[str, int]) -> dict[str, int]:
    return {"max_entries": limits.get("max_entries", 1000), "max_bytes": limits.get("max_bytes", 1 << 20)}


def sqlite(path: Path, ttl_s: float = 3600.0, **limits: int) -> SqliteResponseStore:
    return SqliteResponseStore(path, ttl_s=ttl_s, **_limits(limits))


def test_kept_across_a_reopen_and_scoped_by_owner(database):
    first = database()
    assert first.put("resp_1", owner_of("k1"), {"id": "resp_1", "output": []}, [])
    first.close()
    again = database()  # a restart, or another replica
    assert again.get("resp_1", owner_of("k1")).response == {"id": "resp_1", "output": []}
    assert again.get("resp_1", owner_of("k2")) is None and again.get("resp_1", "") is None
    assert not again.delete("resp_1", owner_of("k2")) and again.get("resp_1", owner_of("k1")) is not None
    assert again.delete("resp_1", owner_of("k1")) and again.get("resp_1", owner_of("k1")) is None
    assert owner_of("k1") != "k1" and len(owner_of("k1")) == 64  # a hash is stored, never the key


def test_a_new_sqlite_file_is_the_server_users_alone(tmp_path):
    store = sqlite(tmp_path / "state" / "r.sqlite3")
    store.put("a", "", {"id": "a"}, [])
    assert (tmp_path / "state" / "r.sqlite3").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700


def test_two_writers_at_once_both_keep_everything(database):
    """Two replicas' stores on one database, writing at once: no write lost (SQLite: WAL and the busy timeout)."""
    stores = [database(), database()]

    def write(index: int) -> None:
        for i in range(100):
            assert stores[index].put(f"r{index}-{i}", "", {"i": i}, [])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(stores[0]) == 200 and stores[1].get("r0-99", "").response == {"i": 99}


def test_an_expired_response_is_neither_served_nor_kept(database):
    store = database(ttl_s=0.2)
    store.put("old", "", {"id": "old"}, [])
    time.sleep(0.3)
    assert store.get("old", "") is None
    store._purged_at = 0.0  # the next write purges (at most once a minute)
    store.put("new", "", {"id": "new"}, [])
    assert len(store) == 1 and store.get("new", "") is not None


@pytest.mark.parametrize("memory", [False, True])
def test_the_limits_push_out_the_least_recently_used(database, memory):
    store = (
        MemoryResponseStore(max_entries=3, max_bytes=10_000) if memory else database(max_entries=3, max_bytes=10_000)
    )
    for i in range(3):
        assert store.put(f"r{i}", "", {"id": f"r{i}"}, [])
    store.get("r0", "")  # used: r1 is now the oldest
    store.put("r3", "", {"id": "r3"}, [])
    assert [rid for rid in ("r0", "r1", "r2", "r3") if store.get(rid, "")] == ["r0", "r2", "r3"]
    assert not store.put("big", "", {"text": "x" * 20_000}, [])  # larger than the store: not kept
    store.put("half", "", {"text": "x" * 6_000}, [])
    store.put("half2", "", {"text": "y" * 6_000}, [])  # together over max_bytes: the older goes
    assert store.get("half", "") is None and store.get("half2", "") is not None


def test_a_broken_postgres_connection_fails_one_call_and_the_next_reconnects(postgres):
    store = PostgresResponseStore(postgres.url, max_entries=100, max_bytes=1 << 20, ttl_s=3600)
    other = PostgresResponseStore(postgres.url, max_entries=100, max_bytes=1 << 20, ttl_s=3600)
    other._sql("SELECT pg_terminate_backend(?)", (store._db.info.backend_pid,))
    assert not store.put("a", "", {"id": "a"}, [])  # the broken connection: not kept, answered all the same
    assert store.put("b", "", {"id": "b"}, []) and other.get("b", "").response == {"id": "b"}


def test_a_postgres_server_that_does_not_answer_is_one_error_without_the_password(caplog):
    url = "postgresql://batchserve:secret@127.0.0.1:1/responses"
    with caplog.at_level(logging.ERROR, logger="batchserve.api"):
        app = create_app(FakeEngine(["hi"]), ServerConfig(responses_store=url))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("responses store postgresql://batchserve:***@127.0.0.1:1/responses: ")
    assert "secret" not in line and isinstance(app[HANDLERS_KEY].responses.store, UnavailableResponseStore)


def test_a_corrupt_file_is_one_error_naming_the_store(tmp_path, caplog):
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"not a database, " * 100)
    with pytest.raises(ResponseStoreError, match=f"responses store sqlite:{path}: file is not a database"):
        sqlite(path)
    with caplog.at_level(logging.ERROR, logger="batchserve.api"):
        app = create_app(FakeEngine(["hi"]), ServerConfig(responses_store=f"sqlite:{path}"))
    assert isinstance(app[HANDLERS_KEY].responses.store, UnavailableResponseStore)
    assert [r.getMessage() for r in caplog.records] == [f"responses store sqlite:{path}: file is not a database"]


def test_the_default_store_is_sqlite_in_the_state_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "systemd"))
    assert state_dir() == tmp_path / "systemd"
    app = create_app(FakeEngine(["hi"]), ServerConfig())
    assert app[HANDLERS_KEY].responses.store.name == f"sqlite:{tmp_path / 'systemd' / 'responses.sqlite3'}"
    with pytest.raises(ValueError, match="responses_store 'redis://x': expected memory, sqlite:PATH, postgresql:"):
        ServerConfig(responses_store="redis://x")


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


@asynccontextmanager
async def served(config: ServerConfig, replies: list[str]):
    async with TestServer(create_app(FakeEngine(replies), config)) as server:
        yield server


def client_of(server: TestServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


def store_spec(kind: str, tmp_path: Path, request) -> str:
    if kind == "sqlite":
        return f"sqlite:{tmp_path / 'r.sqlite3'}"
    return request.getfixturevalue("postgres").url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_two_keys_cannot_see_each_others_responses(kind, tmp_path, request):
    config = ServerConfig(api_key=["k1", "k2"], responses_store=store_spec(kind, tmp_path, request))

    async def go():
        async with (
            served(config, ["one"]) as server,
            client_of(server, "k1") as mine,
            client_of(server, "k2") as theirs,
        ):
            first = await mine.responses.create(model="fake-model", input="hi")
            assert (await mine.responses.retrieve(first.id)).output_text == "one"
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.retrieve(first.id)
            with pytest.raises(openai.BadRequestError, match="not found"):
                await theirs.responses.create(model="fake-model", input="next", previous_response_id=first.id)
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.delete(first.id)
            second = await mine.responses.create(model="fake-model", input="next", previous_response_id=first.id)
            await mine.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await mine.responses.retrieve(first.id)
            return second.output_text

    assert run(go()) == "one"


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_restarted_api_continues_the_chain_from_the_same_database(kind, tmp_path, request):
    config = ServerConfig(responses_store=store_spec(kind, tmp_path, request))

    async def turn(previous: str | None) -> str:
        async with served(config, ["ok"]) as server, client_of(server, "x") as client:  # a fresh app: a restart
            response = await client.responses.create(model="fake-model", input="go on", previous_response_id=previous)
            assert response.store
            return response.id

    async def go():
        rid = None
        for _ in range(3):
            rid = await turn(rid)
        return rid

    assert run(go()).startswith("resp_")


def test_an_unavailable_store_answers_and_names_itself(tmp_path):
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"garbage " * 200)
    config = ServerConfig(responses_store=f"sqlite:{path}")

    async def go():
        async with served(config, ["fine"]) as server, client_of(server, "x") as client:
            response = await client.responses.create(model="fake-model", input="hi")  # answered, not kept
            with pytest.raises(openai.InternalServerError) as missing:
                await client.responses.retrieve(response.id)
            async with __import__("aiohttp").ClientSession() as http:
                async with http.get(server.make_url("/health")) as health:
                    return response, missing.value, health.status, await health.json()

    response, missing, status, health = run(go())
    assert response.output_text == "fine" and response.store is False
    assert missing.status_code == 503 and f"sqlite:{path}" in missing.message
    assert status == 200 and health["responses_store"].startswith(f"unavailable (responses store sqlite:{path}")


def test_a_write_that_fails_mid_run_answers_and_reports_store_false(tmp_path):
    config = ServerConfig(responses_store=f"sqlite:{tmp_path / 'r.sqlite3'}")

    async def go():
        app = create_app(FakeEngine(["still here"]), config)
        app[HANDLERS_KEY].responses.store._db.close()  # the database goes away under a running server
        async with TestServer(app) as server, client_of(server, "x") as client:
            return await client.responses.create(model="fake-model", input="hi")

    response = run(go())
    assert response.output_text == "still here" and response.store is False


def test_the_whole_server_restarted_still_chains_and_reads_its_responses(tiny_model_dir, tmp_path):
    """`batchserve serve` stopped and started again on the same store: the last id still chains, and
    GET still answers it, greedy turns and all."""
    from e2e_server import start_server

    model = tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)
    flags = ("--kv-capacity-tokens", "4096", "--responses-store", f"sqlite:{tmp_path / 'r.sqlite3'}")
    ids = []
    for run_index in range(2):
        server = start_server(model, tmp_path / f"serve-{run_index}.log", *flags)
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
            response = client.responses.create(
                model=str(model),
                input=f"turn {run_index}",
                max_output_tokens=4,
                temperature=0,
                previous_response_id=ids[-1] if ids else None,
            )
            ids.append(response.id)
            assert [client.responses.retrieve(rid).id for rid in ids] == ids
        finally:
            assert server.stop() == 0
