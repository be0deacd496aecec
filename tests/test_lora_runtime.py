"""LoRA adapters loaded and unloaded while serving (issue 47): vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` behind `--enable-lora-runtime-updates` (absent without it, behind the API key
with keys); a folder checked before its load (400 naming `lora_path`), a name taken (400), an unknown name
(404); an unloaded adapter's requests in flight finish on its weights while new ones get 404; a name
loaded again is a new index, so its prefix cache never serves the old weights; vLLM's
`vllm:lora_requests_info` gauge. End to end: a tiny Llama served with no adapter at start, one loaded at
run time answers as PEFT does."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import numpy as np
import openai
import pytest
from aiohttp.test_utils import TestServer
from api_fake_engine import FakeEngine
from test_lora_engine import PROMPTS, engine_for, generate, setup  # noqa: F401 (setup: a module fixture)
from test_lora_worker import NEW_TOKENS

from batchserve.procs.api.app import create_app
from batchserve.procs.scheduler.lora.adapter_updates import WorkerAdapters, adapters_in_use
from batchserve.procs.scheduler.request import Status
from batchserve.shared.config import ServerConfig
from batchserve.shared.lora import PREFIX
from batchserve.shared.messages import AdapterUpdate, ForwardBatch, SchedulerStats, SlotStart

CONFIG = ServerConfig(enable_lora=True, enable_lora_runtime_updates=True, lora_modules=["sql=/adapters/sql"])


def fake_adapter(folder, rank: int = 4, **config) -> str:
    """A PEFT folder as the api checks it: its config, and tensors named as PEFT names q_proj's pairs."""
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"], **config})
    )
    pair = {f"{PREFIX}0.self_attn.q_proj.lora_{part}.weight": np.zeros((4, 4), dtype=np.float32) for part in "AB"}
    save_file(pair, str(folder / "adapter_model.safetensors"))
    return str(folder)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def post(http: aiohttp.ClientSession, url, body: dict) -> tuple[int, str]:
    async with http.post(url, json=body) as response:
        return response.status, await response.text()


def test_load_and_unload_at_run_time(tmp_path):
    engine = FakeEngine(["ok"])
    good = fake_adapter(tmp_path / "good")

    async def go():
        async with (
            TestServer(create_app(engine, CONFIG)) as server,
            aiohttp.ClientSession() as http,
            openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as client,
        ):
            load, unload = server.make_url("/v1/load_lora_adapter"), server.make_url("/v1/unload_lora_adapter")
            answers = [await post(http, load, {"lora_name": "new", "lora_path": good})]
            models = [m.id for m in (await client.models.list()).data]
            chat = await client.chat.completions.create(model="new", messages=[{"role": "user", "content": "hi"}])
            answers.append(await post(http, load, {"lora_name": "new", "lora_path": good}))  # taken
            answers.append(await post(http, unload, {"lora_name": "new"}))
            with pytest.raises(openai.NotFoundError, match="The model `new` does not exist"):
                await client.completions.create(model="new", prompt="hi", max_tokens=2)
            answers.append(await post(http, unload, {"lora_name": "new"}))  # gone already
            answers.append(await post(http, load, {"lora_name": "new", "lora_path": good}))  # a new index
            after = [m.id for m in (await client.models.list()).data]
            return answers, models, chat.model, after

    answers, models, chat_model, after = run(go())
    assert answers[0] == (200, "Success: LoRA adapter 'new' added successfully.")
    assert models == ["fake-model", "sql", "new"] and chat_model == "new" and after == models
    assert answers[1][0] == 400 and "The lora adapter 'new' has already been loaded." in answers[1][1]
    assert answers[2] == (200, "Success: LoRA adapter 'new' removed successfully.")
    assert answers[3][0] == 404 and "cannot be found" in answers[3][1]
    assert answers[4][0] == 200
    assert engine.adapter_updates == [
        AdapterUpdate(index=2, name="new", path=good),
        AdapterUpdate(index=2, name="new"),
        AdapterUpdate(index=3, name="new", path=good),
    ]
    assert [r.params.adapter for r in engine.requests] == [2]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"rank": 32}, "r 32 is above --max-lora-rank 16"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["lm_head"]}, "target_modules"),
        ({"target_modules": ["k_proj"]}, "tensors of no served projection"),  # q_proj's tensors, k_proj targeted
    ],
)
def test_a_folder_is_checked_before_it_is_loaded(tmp_path, config, message):
    engine = FakeEngine(["ok"])
    rank = config.pop("rank", 4)
    folder = fake_adapter(tmp_path / "bad", rank=rank, **config)

    async def go():
        async with TestServer(create_app(engine, CONFIG)) as server, aiohttp.ClientSession() as http:
            url = server.make_url("/v1/load_lora_adapter")
            return [
                await post(http, url, body)
                for body in (
                    {"lora_name": "bad", "lora_path": folder},
                    {"lora_name": "x", "lora_path": str(tmp_path / "none")},
                    {"lora_name": "fake-model", "lora_path": folder},
                    {"lora_name": "x"},
                )
            ]

    (bad, missing, base, no_path) = run(go())
    assert bad[0] == 400 and message in bad[1] and '"param":"lora_path"' in bad[1]
    assert missing[0] == 400 and "cannot read adapter_config.json" in missing[1]
    assert base[0] == 400 and "the served model" in base[1] and no_path[0] == 400 and "lora_path" in no_path[1]
    assert engine.adapter_updates == []


def test_the_endpoints_need_the_flag_and_the_key(tmp_path):
    async def go(config):
        async with TestServer(create_app(FakeEngine(), config)) as server, aiohttp.ClientSession() as http:
            return await post(
                http,
                server.make_url("/v1/load_lora_adapter"),
                {"lora_name": "new", "lora_path": fake_adapter(tmp_path / f"f{id(config)}")},
            )

    assert run(go(ServerConfig(enable_lora=True)))[0] == 404
    assert run(go(ServerConfig(enable_lora=True, enable_lora_runtime_updates=True, api_key=["k"])))[0] == 401
    with pytest.raises(ValueError, match="enable_lora_runtime_updates needs enable_lora"):
        ServerConfig(enable_lora_runtime_updates=True)


class _Request:
    def __init__(self, adapter: int, status: Status) -> None:
        self.params, self.status = type("P", (), {"adapter": adapter})(), status


def _batch(*adapters: int) -> ForwardBatch:
    """A batch whose slot starts name these adapters (what `WorkerAdapters.due` reads of it)."""
    empty = np.zeros(0, dtype=np.int32)
    return ForwardBatch(
        step=0,
        slots=[],
        prefix_lens=[],
        extend_lens=[],
        sample_lens=[],
        sampling=[],
        sample_counts=[],
        input_ids=empty,
        positions=empty,
        kv_locs=empty,
        page_table_slots=empty,
        page_table_cols=empty,
        page_table_pages=empty,
        slot_starts=[SlotStart(slot=i, adapter=a) for i, a in enumerate(adapters)],
    )


def test_an_unload_waits_for_the_adapters_last_request():
    adapters = WorkerAdapters(ServerConfig(enable_lora=True, lora_modules=["a=/a", "b=/b"]))
    load, unload = AdapterUpdate(index=3, name="c", path="/c"), AdapterUpdate(index=2, name="b")
    adapters.update(unload)
    adapters.update(load)
    waiting = [_Request(2, Status.WAITING), _Request(1, Status.RUNNING)]
    assert adapters.due(_batch(), waiting) == [load]  # b still has a request: its unload waits
    assert adapters.due(_batch(1), [_Request(1, Status.RUNNING)]) == [unload]
    assert list(adapters.held) == [3, 1]  # a admitted last
    assert adapters_in_use(waiting + [_Request(0, Status.RUNNING), _Request(3, Status.PREFILLING)]) == {
        "running_adapters": [1, 3],
        "waiting_adapters": [2],
    }


def test_the_worker_holds_at_most_max_cpu_loras_the_least_recently_admitted_out():
    config = ServerConfig(enable_lora=True, lora_modules=["a=/a", "b=/b", "c=/c"], max_loras=1, max_cpu_loras=2)
    adapters = WorkerAdapters(config)
    assert list(adapters.held) == [1, 2]  # as the worker loads them at start

    def load(i: int, name: str) -> AdapterUpdate:
        return AdapterUpdate(index=i, name=name, path=f"/{name}")

    assert adapters.due(_batch(1), []) == []  # a is held: used, so b is now the least recent
    assert adapters.due(_batch(3), [_Request(1, Status.RUNNING)]) == [AdapterUpdate(index=2, name="b"), load(3, "c")]
    # b again: a runs, so c (the least recent that no admitted request holds) makes room
    assert adapters.due(_batch(2), [_Request(1, Status.RUNNING), _Request(3, Status.WAITING)]) == [
        AdapterUpdate(index=3, name="c"),
        load(2, "b"),
    ]
    assert list(adapters.held) == [1, 2]
    with pytest.raises(ValueError, match="max_cpu_loras must be 0 .no limit. or at least max_loras .4."):
        ServerConfig(enable_lora=True, max_cpu_loras=2)


def test_adapters_past_max_cpu_loras_are_loaded_at_admission_and_answer_as_peft(setup):  # noqa: F811
    base, folders, expected = setup
    engine = engine_for(base, folders, max_loras=1, max_cpu_loras=1)
    try:
        jobs = [(0, 1), (1, 2), (2, 1), (0, 0), (1, 2)]
        got = generate(engine, jobs)
    finally:
        engine.close()
    names = ["base", "a", "b"]
    assert got == [expected[names[adapter]][p] for p, adapter in jobs]


def test_the_lora_requests_info_gauge_names_the_running_and_waiting_adapters():
    engine = FakeEngine()

    async def go():
        async with (
            TestServer(
                create_app(engine, ServerConfig(enable_lora=True, lora_modules=["sql=/a", "chat=/b"], max_loras=2))
            ) as server,
            aiohttp.ClientSession() as http,
        ):
            engine._listener(
                SchedulerStats(
                    num_running=1,
                    num_waiting=1,
                    kv_used_tokens=0,
                    kv_total_tokens=1,
                    running_adapters=[2],
                    waiting_adapters=[1, 2],
                )
            )
            async with http.get(server.make_url("/metrics")) as page:
                return await page.text()

    lines = [line for line in run(go()).splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1
    assert 'max_lora="2"' in lines[0] and 'running_lora_adapters="chat"' in lines[0]
    assert 'waiting_lora_adapters="sql,chat"' in lines[0]


def test_serve_loads_an_adapter_at_run_time_and_unloads_it_after_its_requests(setup, tmp_path):  # noqa: F811
    from e2e_server import http, start_server
    from transformers import AutoTokenizer

    base, folders, expected = setup
    decode = AutoTokenizer.from_pretrained(base).decode
    server = start_server(
        base, tmp_path / "serve.log", "--kv-capacity-tokens", "1024", "--enable-lora", "--enable-lora-runtime-updates"
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)

        def ask(name: str):
            return client.completions.create(
                model=name, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )

        assert (
            http(f"{server.url}/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(folders["a"])})[0] == 200
        )
        first = ask("tuned").choices[0].text
        long = dict(model="tuned", prompt=PROMPTS[1], max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
        reference = client.completions.create(**long).choices[0].text
        pieces: list[str] = []
        started = threading.Event()

        def generate_long() -> None:  # streamed, so that the unload surely comes while it runs
            for chunk in client.completions.create(**long, stream=True):
                started.set()
                pieces.extend(c.text for c in chunk.choices)

        in_flight = threading.Thread(target=generate_long)
        in_flight.start()
        assert started.wait(timeout=120)
        status, _ = http(f"{server.url}/v1/unload_lora_adapter", {"lora_name": "tuned"})
        with pytest.raises(openai.NotFoundError):
            ask("tuned")
        in_flight.join(timeout=120)
        # the same name, other weights: none of the first load's cached KV may serve it
        assert (
            http(f"{server.url}/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(folders["b"])})[0] == 200
        )
        second = ask("tuned").choices[0].text
    finally:
        assert server.stop() == 0
    assert status == 200 and "".join(pieces) == reference  # it ran to its end, on the adapter's weights
    assert first.strip() == decode(expected["a"][0]).strip()
    assert second.strip() == decode(expected["b"][0]).strip()


def test_a_runtime_load_is_checked_against_what_the_model_serves(tmp_path, tiny_model_dir):
    """On a mixture of experts an adapter of its MLPs is refused before the load (400 naming lora_path), as
    the worker refuses it at start; one of its attention loads."""
    import msgspec

    config = msgspec.structs.replace(CONFIG, model=str(tiny_model_dir("qwen3_moe", with_tokenizer=True)))
    experts, attention = (
        fake_adapter(tmp_path / "experts", target_modules=["gate_proj"]),
        fake_adapter(tmp_path / "attn"),
    )

    async def go():
        async with TestServer(create_app(FakeEngine(["ok"]), config)) as server, aiohttp.ClientSession() as http:
            load = server.make_url("/v1/load_lora_adapter")
            return (
                await post(http, load, {"lora_name": "e", "lora_path": experts}),
                await post(http, load, {"lora_name": "a", "lora_path": attention}),
            )

    (status, body), (ok, _) = run(go())
    assert status == 400 and "mixtures of experts" in body and '"lora_path"' in body
    assert ok == 200
