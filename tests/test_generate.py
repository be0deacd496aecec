"""`batchserve generate` and the `OfflineEngine` under it: the scheduler core driving the worker core
in one process gives transformers' greedy tokens under every policy, honours stop strings, and
answers bad input with a one-line error."""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest
from test_model_equivalence import transformers_greedy_text

from batchserve.procs.cli import main as cli_main
from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig, config_from_args
from batchserve.shared.config_scopes import SERVER_ONLY_FIELDS
from batchserve.shared.errors import Refusal

PROMPTS = ["w5 w9 w11", "w7", "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15", "w100 w200 w300 w31 w32 w33"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer=True, seed=3)


@pytest.fixture(scope="module")
def reference(model_dir):
    return transformers_greedy_text(model_dir, PROMPTS, NEW_TOKENS)


def _greedy_requests(**stop):
    return [
        request(
            f"r{i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": NEW_TOKENS, "ignore_eos": True, **stop}
        )
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("policy", ["prefill-first", "mixed", "fixed"])
def test_offline_engine_matches_transformers_under_every_policy(model_dir, reference, policy):
    # A budget of 8 chunks the 14-token prompt; 2 slots make requests wait and join mid-stream.
    config = ServerConfig(
        model=str(model_dir),
        policy=policy,
        prefill_budget=8,
        max_running_requests=2,
        page_size=4,
        kv_capacity_tokens=256,
    )
    completions = OfflineEngine(config).generate(_greedy_requests())
    assert [c.token_ids for c in completions] == reference
    assert all(c.finish_reason == "length" for c in completions)


def test_stop_string_ends_text_and_generation(model_dir, reference):
    engine = OfflineEngine(ServerConfig(model=str(model_dir), page_size=4, kv_capacity_tokens=512))
    full = engine.generate(_greedy_requests())[0]
    stop_word = full.text.split()[3]  # the 4th generated word
    first = full.text.split().index(stop_word)
    stopped = engine.generate(
        [
            request(
                "s",
                prompt=PROMPTS[0],
                sampling={"temperature": 0},
                stop={"max_tokens": NEW_TOKENS, "ignore_eos": True, "stop": [stop_word]},
            )
        ]
    )[0]
    assert stopped.finish_reason == "stop"
    assert stop_word not in stopped.text
    assert stopped.text.split() == full.text.split()[:first]
    assert stopped.token_ids == full.token_ids[: first + 1]  # generation stopped within the matching step
    assert engine.scheduler.kv_used_tokens == 0 and not engine.scheduler.has_unfinished()


def test_a_refused_request_queues_none_of_its_call(model_dir, reference):
    """The scheduler refuses the second request (a priority under fcfs): the first is not left queued
    for the next call to run (and to find no completion for)."""
    engine = OfflineEngine(ServerConfig(model=str(model_dir), page_size=4, kv_capacity_tokens=512))
    first, *_ = _greedy_requests()
    refused = request("p", prompt=PROMPTS[1], priority=1)
    with pytest.raises(Refusal, match="priority 1 needs --scheduling-policy priority") as caught:
        engine.generate([first, refused])
    assert caught.value.param == "priority"
    assert [c.token_ids for c in engine.generate(_greedy_requests())] == reference
    assert engine.scheduler.kv_used_tokens == 0 and not engine.scheduler.has_unfinished()


def test_generate_cli_json_lines(model_dir, reference, capsys):
    args = [
        "generate",
        "--model",
        str(model_dir),
        "--temperature",
        "0",
        "--max-tokens",
        str(NEW_TOKENS),
        "--ignore-eos",
        "--json",
        "--page-size",
        "4",
        "--kv-capacity-tokens",
        "512",
    ]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    assert cli_main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS
    assert [line["token_ids"] for line in lines] == reference
    assert all(line["finish_reason"] == "length" and line["text"] for line in lines)


def test_generate_cli_prompts_file_and_chat(model_dir, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps(p) for p in PROMPTS[:2]) + "\n")
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompts-file",
                str(prompts_file),
                "--chat",
                "--temperature",
                "0",
                "--max-tokens",
                "3",
                "--json",
                "--kv-capacity-tokens",
                "512",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == PROMPTS[:2]
    assert all(1 <= len(line["token_ids"]) <= 3 for line in lines)


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "no prompts"),
        (["--prompt", "w5", "--max-tokens", "0"], "--max-tokens"),
        (["--prompt", "w5", "--top-p", "0"], "--top-p"),
        (["--prompt", "w5", "--policy", "lifo"], "policy"),
        (["--prompts-file", "/nonexistent/prompts.jsonl"], "--prompts-file"),
        (["--prompt", "w5", "--max-tokens", "100000"], "max_tokens"),
        # tensor-parallel layouts that cannot run: refused before any rank starts
        (["--prompt", "w5", "--tp", "2", "--nnodes", "3"], "nnodes must be >= 1 and divide tensor_parallel_size 2"),
        (["--prompt", "w5", "--tp", "2", "--nnodes", "2"], "dist_init_addr HOST:PORT is required with nnodes > 1"),
        (
            ["--prompt", "w5", "--tensor-parallel-size", "2", "--dist-init-addr", "nohost"],
            "dist_init_addr must be HOST:PORT",
        ),
        (["--prompt", "w5", "--step-timeout-s", "0"], "step_timeout_s must be > 0"),
        (
            ["--prompt", "w5", "--tp", "2", "--step-timeout-s", "1"],
            "step_timeout_s must be > 2 with tensor_parallel_size > 1",
        ),
    ],
)
def test_generate_cli_bad_input_is_one_line(model_dir, capsys, extra, message):
    status = cli_main(["generate", "--model", str(model_dir), "--kv-capacity-tokens", "512", *extra])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and "Traceback" not in err


def test_generate_cli_unknown_model(capsys):
    assert cli_main(["generate", "--model", "/nonexistent/model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/model" in err and "Traceback" not in err


def _config_flags(module) -> dict[str, tuple[str, ...]]:
    """The `ServerConfig` flags a subcommand's parser takes: field -> its option strings."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    fields = set(ServerConfig.__struct_fields__)
    return {a.dest: tuple(a.option_strings) for a in parser._actions if a.dest in fields}


def test_generate_takes_every_engine_flag_serve_takes():
    from batchserve.procs import generate, serve

    serve_flags, generate_flags = _config_flags(serve), _config_flags(generate)
    engine_of_serve = {name: flags for name, flags in serve_flags.items() if name not in SERVER_ONLY_FIELDS}
    assert generate_flags == engine_of_serve
    assert set(serve_flags) == set(ServerConfig.__struct_fields__)  # serve: every setting
    for flag in ("--speculative", "--num-speculative-tokens", "--ngram-min", "--ngram-max", "--draft-model", "--tp"):
        assert any(flag in flags for flags in generate_flags.values()), flag


def test_generate_cli_speculative_ngram_gives_the_greedy_tokens(model_dir, reference, capsys):
    """Prompt lookup verified by the model keeps greedy output unchanged; the stderr line shows that the
    flags reached the engine: drafts were proposed (single-token matches: some are found)."""
    args = [
        "generate",
        "--model",
        str(model_dir),
        "--temperature",
        "0",
        "--max-tokens",
        str(NEW_TOKENS),
        "--ignore-eos",
        "--json",
        "--page-size",
        "4",
        "--kv-capacity-tokens",
        "512",
        "--speculative",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--ngram-min",
        "1",
        "--ngram-max",
        "2",
    ]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["token_ids"] for line in lines] == reference
    said = re.search(r"speculative ngram: (\d+) of (\d+) proposed tokens accepted", captured.err)
    assert said is not None, captured.err
    accepted, proposed = map(int, said.groups())
    assert proposed > 0 and 0 <= accepted <= proposed


def test_generate_cli_speculative_flags_reach_the_engine_config(monkeypatch):
    from batchserve.procs.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["batchserve", "generate"])  # build_parser adds argv[1]'s arguments
    args = build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "x",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "3",
            "--ngram-min",
            "1",
            "--ngram-max",
            "2",
        ]
    )
    config = config_from_args(args, env={})
    assert (config.speculative, config.num_speculative_tokens, config.ngram_min, config.ngram_max) == ("ngram", 3, 1, 2)
