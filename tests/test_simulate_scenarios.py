"""`batchserve simulate` against the hand-derived traces of every scenario, under every policy.

Scenarios are in tests/scenarios/ (the rules they follow: procs/scheduler/SCHEDULING.md): the chapter's,
copied from the team folder beside the checkout (../shared/scenarios/ and ../shared/scenarios-next/,
the originals, which the copies must not drift from where that folder exists), and our own
cancellation, paging and prefix-cache cases. A file that exists only in the team folder is picked up too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchserve.procs.cli import main as cli_main
from batchserve.procs.scheduler.simulate import (
    load_scenario,
    run_scenario,
    scenario_scheduler,
    scheduler_config_from_scenario,
)

HERE = Path(__file__).resolve().parent
LOCAL = HERE / "scenarios"
TEAM = HERE.parent.parent / "shared"  # the team folder beside the checkout, where it exists
ORIGINALS = [TEAM / "scenarios", TEAM / "scenarios-next"]


def _scenario_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for folder in (*ORIGINALS, LOCAL):  # the local copy wins
        if folder.is_dir():
            files.update({p.name: p for p in sorted(folder.glob("*.json"))})
    return files


CASES = [(path, policy) for path in _scenario_files().values() for policy in json.loads(path.read_text())["expected"]]


def _normalise(trace: list[dict]) -> list[dict]:
    return [{**s, "finished": sorted(s["finished"]), "cancelled": sorted(s["cancelled"])} for s in trace]


def test_the_shared_scenarios_are_all_covered() -> None:
    names = {p.name for p, _ in CASES}
    assert {"figure3.json", "figure8.json", "chunked.json", "admission.json"} <= names
    assert {
        "cancels.json",
        "paged_admission.json",
        "idle_and_last_cancel.json",
        "preemption.json",
        "prefix_cache.json",
    } <= names


@pytest.mark.skipif(
    not any(d.is_dir() for d in ORIGINALS),
    reason=f"{TEAM} is absent (a checkout without the "
    "team folder beside it): no originals to compare tests/scenarios/ with",
)
def test_the_copies_match_their_originals() -> None:
    """Every file in both tests/scenarios/ and a folder of originals is byte for byte the original;
    files only in tests/scenarios/ are our own additions."""
    local = {p.name for p in LOCAL.iterdir() if p.is_file()}
    originals = {p.name: p for d in ORIGINALS if d.is_dir() for p in d.iterdir() if p.is_file()}
    both = sorted(local & set(originals))
    assert both, f"no file of {ORIGINALS} has a copy in {LOCAL}"
    drifted = [name for name in both if (LOCAL / name).read_bytes() != originals[name].read_bytes()]
    assert not drifted, f"tests/scenarios/ has drifted from its originals in {drifted}: copy them again"


@pytest.mark.parametrize(("path", "policy"), CASES, ids=[f"{p.stem}-{pol}" for p, pol in CASES])
def test_simulate_reproduces_the_expected_trace(path: Path, policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", str(path), "--policy", policy]) == 0
    lines = capsys.readouterr().out.splitlines()
    got = [json.loads(line) for line in lines]
    expected = json.loads(path.read_text())["expected"][policy]
    assert _normalise(got) == _normalise(expected)
    # Exactly the documented keys, in order; `preempted` and `drafts` only where they happen, `cap` and `ms`
    # on every step of a scenario with the step-time bound.
    bound = ["cap", "ms"] if json.loads(path.read_text())["config"].get("max_step_ms") else []
    for line in lines:
        keys = list(json.loads(line))
        base = ["step", "prefill", "decode", "finished", "cancelled"]
        assert keys in [base + extra + bound for extra in ([], ["preempted"], ["drafts"], ["preempted", "drafts"])]


@pytest.mark.parametrize(("path", "policy"), CASES, ids=[f"{p.stem}-{pol}" for p, pol in CASES])
def test_scenarios_leave_no_slot_or_page_behind(path: Path, policy: str) -> None:
    scenario = load_scenario(path)
    config = scheduler_config_from_scenario(scenario, policy)
    scheduler = scenario_scheduler(scenario, config)
    run_scenario(scenario, config, scheduler=scheduler)
    assert not scheduler.has_unfinished()
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.kv.reserved_pages() * scheduler.page_size == 0
    cached = scheduler.kv.cache.num_pages if scheduler.kv.cache is not None else 0  # unreferenced: free to evict
    assert scheduler.kv_used_tokens == 0
    assert scheduler.allocator.num_free + cached == config.num_kv_pages


def test_table_format_reads_like_figure_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", str(LOCAL / "figure3.json"), "--format", "table"]) == 0
    rows = [line.split("  ") for line in capsys.readouterr().out.splitlines()]
    text = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert text[0] == ["Step", "Current execution", "Outputs (A / B / C)", "Finished", "Cancelled"]
    assert text[2] == ["0", "Prefill: A, B", "1 / 1 / 0"]
    assert text[3] == ["1", "Decode: A, B", "2 / 2 / 0", "A"]
    assert text[4] == ["2", "Prefill: C", "2 / 2 / 1"]
    assert text[7] == ["5", "Decode: B", "2 / 5 / 2", "B"]


def test_table_shows_chunks_and_mixed_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", str(LOCAL / "chunked.json"), "--format", "table", "--policy", "mixed"]) == 0
    out = capsys.readouterr().out
    assert "Decode: B + Prefill: C [0:1023 of 2500]" in out
    assert "Decode: B + Prefill: C [2046:2500 of 2500]" in out


def test_table_shows_preemptions_and_the_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", str(LOCAL / "preemption.json"), "--format", "table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "Preempted"
    assert lines[10].split() == ["8", "Decode:", "A", "8", "/", "7", "/", "3", "B"]
    assert "Prefill: B [0:8 of 11]" in lines[12] and "Prefill: B [8:11 of 11]" in lines[13]


def test_table_shows_cancellations_and_idle_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", str(LOCAL / "idle_and_last_cancel.json"), "--format", "table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:2] == ["0", "Idle"]
    assert lines[-1].split() == ["7", "Idle", "3", "/", "2", "B"]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            '{"config": {"max_running_requests": 2, "prefill_budget": "x", "kv_capacity_tokens": 5}, "requests": []}',
            "$.config.prefill_budget",
        ),
        (
            '{"config": {"max_running_requests": 0, "prefill_budget": 4, "kv_capacity_tokens": 5}, "requests": []}',
            "$.config.max_running_requests",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 5, "budget": 1},'
            ' "requests": []}',
            "budget",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50},'
            ' "requests": [{"id": "A", "arrival_step": 0, "input_tokens": 3}]}',
            "output_tokens",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50},'
            ' "requests": [{"id": "A", "arrival_step": -1, "input_tokens": 3, "output_tokens": 1}]}',
            "$.requests[0].arrival_step",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50}, "requests": ['
            '{"id": "A", "arrival_step": 0, "input_tokens": 3, "output_tokens": 1},'
            '{"id": "A", "arrival_step": 0, "input_tokens": 3, "output_tokens": 1}]}',
            "$.requests[1].id",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50},'
            ' "requests": [{"id": "A", "arrival_step": 0, "input_tokens": 3, "output_tokens": 1}],'
            ' "cancels": [{"id": "Z", "before_step": 1}]}',
            "$.cancels[0].id",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50},'
            ' "requests": [{"id": "A", "arrival_step": 3, "input_tokens": 3, "output_tokens": 1}],'
            ' "cancels": [{"id": "A", "before_step": 1}]}',
            "$.cancels[0].before_step",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 5},'
            ' "requests": [{"id": "A", "arrival_step": 0, "input_tokens": 3, "output_tokens": 3}]}',
            "can never fit in the KV cache of 5 tokens - at `$.requests[0]`",
        ),
        (
            '{"config": {"max_running_requests": 4, "prefill_budget": 4, "kv_capacity_tokens": 50, "policy": "mixed"},'
            ' "requests": []}',
            "prefill_budget > max_running_requests",
        ),
        (
            '{"config": {"max_running_requests": 4, "prefill_budget": 9, "kv_capacity_tokens": 50, "policy": "lifo"},'
            ' "requests": []}',
            "$.config.policy",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50,'
            ' "kv_reserve_ratio": 0}, "requests": []}',
            "kv_reserve_ratio must be in (0, 1]",
        ),
        (
            '{"config": {"max_running_requests": 1, "prefill_budget": 4, "kv_capacity_tokens": 50,'
            ' "kv_reserve_ratio": 0.125}, "requests": []}',
            "whole number of percents",
        ),
        ('{"config": ', "not valid JSON"),
    ],
)
def test_bad_scenarios_exit_2_with_the_field_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], document: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(document)
    assert cli_main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchserve simulate: error: {path}: ")
    assert message in err
    assert "Traceback" not in err


def test_missing_scenario_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
