"""The web pages in a real browser (headless chromium, `tests/browser.py`): the chat playground streams an
answer equal to the API's greedy answer, stops a long one (the server sees the abort), keeps model output
inert text, keeps conversations; the scheduler's live view shows a running request during a long
generation and an empty running set after it; with API keys both pages work only once the key is given.
Screenshots of both pages are saved for a person to look at (BATCHSERVE_SCREENSHOT_DIR, else pytest's
temporary folder)."""

from __future__ import annotations

import re
import threading

import openai
import pytest
from api_fake_engine import FakeEngine
from browser import AppThread, chromium_driver, save_screenshot, wait_for
from e2e_server import http, start_server

from batchserve.loadtests.browser import quit_driver
from batchserve.procs.api.app import create_app
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig
from batchserve.shared.messages import SchedulerStats
from batchserve.shared.scheduler_view import KvView, SchedulerView

XSS = '<img src=x onerror="window.pwned=1">'


@pytest.fixture(scope="module")
def driver():
    d = chromium_driver()
    yield d
    quit_driver(d)


def _by(driver, css: str):
    return driver.find_elements("css selector", css)


def _answer(driver):
    """The last answer's (state, text, stats) once it has left the streaming state."""
    node = _by(driver, "#messages .message.assistant")[-1]
    state = node.get_attribute("data-state")
    if state == "streaming":
        return None
    return (
        state,
        _by(node, ".content")[0].get_attribute("textContent"),
        _by(node, ".stats")[0].get_attribute("textContent"),
    )


def _send(driver, prompt: str, **fields: str) -> None:
    for field, value in fields.items():
        box = driver.find_element("id", field.replace("_", "-"))
        box.clear()
        box.send_keys(value)
    driver.find_element("id", "prompt").send_keys(prompt)
    driver.find_element("id", "send").click()


def _serve_fake(engine: FakeEngine, **config) -> AppThread:
    return AppThread(create_app(engine, ServerConfig(**config)))


def test_model_output_is_text_never_markup_and_conversations_are_kept(driver):
    server = _serve_fake(FakeEngine([XSS, " and <b>bold</b>"]))
    try:
        driver.get(server.url + "/")
        wait_for(lambda: _by(driver, "#model option"), what="the model list")
        _send(driver, "show me markup")
        state, text, _ = wait_for(lambda: _answer(driver), what="the answer")
        assert state == "done" and text == XSS + " and <b>bold</b>"
        assert not _by(driver, "#messages img") and not _by(driver, "#messages b")
        assert driver.execute_script("return window.pwned === undefined")
        driver.refresh()  # the conversation is in localStorage
        wait_for(lambda: _by(driver, "#messages .message.assistant"), what="the kept conversation")
        assert _by(driver, "#conversations li span")[0].text == "show me markup"
        assert _answer(driver)[1] == text
    finally:
        server.stop()


def test_the_settings_reach_the_server_and_reasoning_is_shown_apart(driver):
    engine = FakeEngine(["<think>", "Paris is", " in France.", "</think>", '{"city":', ' "Paris"}'])
    server = AppThread(create_app(engine, ServerConfig(), reasoning="think"))
    try:
        driver.get(server.url + "/")
        wait_for(lambda: _by(driver, "#model option"), what="the model list")
        driver.find_element("id", "system").send_keys("Answer in JSON.")
        driver.find_element("id", "stop").send_keys("END")
        driver.find_element("id", "json-schema").send_keys(
            '{"type": "object", "properties": {"city": {"type": "string"}}}'
        )
        _send(driver, "Where is Paris?", temperature="0.5", top_p="0.9", max_tokens="40", seed="7")
        state, text, _ = wait_for(lambda: _answer(driver), what="the answer")
        assert (state, text) == ("done", '{"city": "Paris"}')
        reasoning = _by(driver, "#messages .message.assistant details.reasoning div")[0]
        assert reasoning.get_attribute("textContent") == "Paris is in France."
        sent = engine.requests[-1]
        assert [m.content for m in sent.messages] == ["Answer in JSON.", "Where is Paris?"]
        params = sent.params
        assert (params.sampling.temperature, params.sampling.top_p, params.sampling.seed) == (0.5, 0.9, 7)
        assert (params.stop.max_tokens, tuple(params.stop.stop)) == (40, ("END",))
        assert (
            params.constraint is not None
            and params.constraint.kind == "json_schema"
            and "city" in params.constraint.spec
        )
    finally:
        server.stop()


def test_the_stop_button_aborts_the_request(driver):
    engine = FakeEngine([f" w{i}" for i in range(400)], delay=0.05)
    server = _serve_fake(engine, max_running_requests=4)
    try:
        driver.get(server.url + "/")
        driver.execute_script("localStorage.clear()")
        driver.refresh()
        wait_for(lambda: _by(driver, "#model option"), what="the model list")
        _send(driver, "go on")
        wait_for(lambda: len(_by(driver, "#messages .message.assistant .content")[-1].text) > 10, what="streamed text")
        driver.find_element("id", "stop-button").click()
        state, text, _ = wait_for(lambda: _answer(driver), what="the stopped answer")
        assert state == "stopped" and 0 < len(text.split()) < 400
        wait_for(lambda: engine.aborts, timeout=10, what="the server to see the abort")
        assert driver.find_element("id", "send").is_enabled()
    finally:
        server.stop()


def test_with_an_api_key_the_pages_work_only_once_it_is_given(driver, tmp_path):
    engine = FakeEngine(["Hi", " there"])
    server = _serve_fake(engine, api_key=["sesame"])
    try:
        driver.get(server.url + "/")
        form = wait_for(lambda: [f for f in _by(driver, "#key-form") if f.is_displayed()], what="the key form")[0]
        assert not _by(driver, "#model option")
        driver.find_element("id", "api-key").send_keys("wrong")
        driver.find_element("id", "save-key").click()
        wait_for(lambda: "Incorrect API key" in driver.find_element("id", "key-message").text, what="the refusal")
        assert form.is_displayed() and not _by(driver, "#model option")
        key_box = driver.find_element("id", "api-key")
        key_box.clear()
        key_box.send_keys("sesame")
        driver.find_element("id", "save-key").click()
        wait_for(lambda: _by(driver, "#model option"), what="the model list")
        _send(driver, "hello")
        assert wait_for(lambda: _answer(driver), what="the answer")[:2] == ("done", "Hi there")

        driver.execute_script("localStorage.clear()")
        driver.get(server.url + "/dashboard")
        wait_for(lambda: driver.find_element("id", "key-form").is_displayed(), what="the dashboard's key form")
        assert driver.find_element("id", "status").text == "needs an API key"
        view = SchedulerView(
            requests=[],
            num_waiting=0,
            slots_total=4,
            slots_used=0,
            kv=KvView(page_size=16, total=64, used=0, free=64, reserved=0),
        )
        server.call(
            engine.push_stats,
            SchedulerStats(num_running=0, num_waiting=0, kv_used_tokens=0, kv_total_tokens=1024, view=view),
        )
        driver.find_element("id", "api-key").send_keys("sesame")
        driver.find_element("id", "save-key").click()
        wait_for(lambda: driver.find_element("id", "status").text.startswith("live"), what="the live view")
    finally:
        server.stop()


# ---- on the default model, served by the five processes


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    server = start_server(
        DEFAULT_MODEL,
        tmp_path_factory.mktemp("webui") / "serve.log",
        "--kv-capacity-tokens",
        "8192",
        "--max-running-requests",
        "8",
        startup_timeout=600,
    )
    yield server
    server.stop()


@pytest.mark.slow
def test_the_playground_streams_the_api_greedy_answer(driver, real_server, tmp_path):
    question, settings = (
        "What is the capital of France? Answer in one sentence.",
        {"temperature": "0", "max_tokens": "24"},
    )
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    expected = (
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, top_p=1, max_tokens=24
        )
        .choices[0]
        .message.content
    )
    driver.get(real_server.url + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    wait_for(lambda: _by(driver, "#model option"), what="the model list")
    _send(driver, question, **settings)
    state, text, stats = wait_for(lambda: _answer(driver), timeout=120, what="the answer")
    assert (state, text) == ("done", expected)
    assert re.search(r"TTFT \d+ ms · \d+ tokens · [\d.]+ tok/s · \d+ of \d+ prompt tokens cached", stats), stats
    _send(driver, "And of Italy?")  # the second turn's prompt starts with the first's: its KV is cached
    state, _, stats = wait_for(
        lambda: len(_by(driver, "#messages .message.assistant")) == 2 and _answer(driver),
        timeout=120,
        what="the second answer",
    )
    cached = int(re.search(r"(\d+) of \d+ prompt tokens cached", stats).group(1))
    assert state == "done" and cached > 0, stats
    save_screenshot(driver, "webui_chat.png", tmp_path)


@pytest.mark.slow
def test_the_dashboard_shows_a_long_generation_then_an_empty_running_set(driver, real_server, tmp_path):
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = threading.Event()

    def long_generation() -> None:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell a story."}],
            max_tokens=160,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            pass
        done.set()

    driver.get(real_server.url + "/dashboard")
    wait_for(lambda: driver.find_element("id", "status").text.startswith("live"), what="the live view")
    worker = threading.Thread(target=long_generation, daemon=True)
    worker.start()
    rows = wait_for(lambda: _by(driver, "#running tr"), timeout=60, what="a running request")
    cells = [c.text for c in _by(rows[0], "td")]
    assert cells[2] in ("prefilling", "running") and cells[1] == "0"
    assert int(driver.find_element("id", "running-count").text) == 1
    wait_for(
        lambda: int(_by(driver, "#running tr td")[5].text.split(" / ")[0]) > 20, timeout=60, what="tokens generated"
    )
    wait_for(lambda: re.fullmatch(r"[\d.]+ ms", driver.find_element("id", "step-ms").text), what="a step's time")
    wait_for(
        lambda: float(re.search(r"tokens/s ([\d.]+)", driver.find_element("id", "legend-throughput").text)[1]) > 0,
        timeout=30,
        what="output tokens/s while it streams",
    )
    save_screenshot(driver, "webui_dashboard.png", tmp_path)
    assert done.wait(120)
    worker.join()
    wait_for(
        lambda: driver.find_element("id", "running-empty").is_displayed() and not _by(driver, "#running tr"),
        timeout=15,
        what="an empty running set",
    )
    assert driver.find_element("id", "running-count").text == "0"
    status, snapshot = http(real_server.url + "/dashboard/snapshot")
    assert status == 200 and snapshot["scheduler"]["slots_used"] == 0 and snapshot["scheduler"]["kv"]["reserved"] == 0
