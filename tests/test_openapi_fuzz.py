"""Schemathesis fuzzes every operation of the server's own OpenAPI document (`/openapi.json`) against
`batchserve serve` on a tiny random model: at least 50 generated requests each, valid and invalid. No
answer may be a 5xx, every answer must match the document's schema and media type, no request the
document calls valid may be refused (`positive_data_acceptance`: the document is this server's own,
narrowed to what it accepts, `procs.api.openapi_rules`), and the server's log must hold no ERROR line
and no traceback afterwards.

What JSON Schema cannot say is kept by hooks on the valid requests only (tests/openapi_fuzz_hooks.py):
the prompt's tokens beside max_tokens within the context, min_tokens within max_tokens, n x prompts
within the request cap, at most one structured-output field, a regex/grammar/schema the engine
compiles, distinct tool names, no previous_response_id (none is stored), whole numbers as JSON integers;
and a budget: a valid request generates at most 2 tokens. Invalid requests go as generated.

Schemathesis runs as its command line (`st run`), as CI jobs run it, one request at a time (a second
could find the server full, a 503); kept to about a minute on 2 cores: the context is 128 tokens, so a
prompt is short, and the request cap 32 choices, so a valid completion asks for at most 32."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from e2e_server import start_server

CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance,positive_data_acceptance"
ST = Path(sys.executable).with_name("st")
HOOKS = Path(__file__).with_name("openapi_fuzz_hooks.py")
MAX_CONTEXT = 128
RUNNING, WAITING = 16, 16  # a request cap of 32 choices, so `n` is at most 32 (the document says so)


@pytest.fixture(scope="module")
def fuzzed_server(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama", with_tokenizer="bytes")
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    srv = start_server(
        model, log, "--max-context", str(MAX_CONTEXT), "--kv-capacity-tokens", "4096",
        "--max-running-requests", str(RUNNING), "--max-waiting", str(WAITING),
    )  # fmt: skip
    yield srv
    srv.stop()


def test_no_5xx_and_every_answer_as_documented(fuzzed_server, tmp_path):
    command = [
        str(ST), "run", fuzzed_server.url + "/openapi.json", "--checks", CHECKS, "--max-examples", "50",
        "--request-timeout", "120", "--generation-deterministic", "--workers", "1", "--report", "junit",
        "--report-junit-path", str(tmp_path / "junit.xml"),
    ]  # fmt: skip
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": str(HOOKS),
        "FUZZ_URL": fuzzed_server.url,
        "FUZZ_MAX_CONTEXT": str(MAX_CONTEXT),
        "FUZZ_REQUEST_CAP": str(RUNNING + WAITING),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    junit = (tmp_path / "junit.xml").read_text()
    ran = set(re.findall(r"<testcase [^>]*name=\"([^\"]+)\"", junit))
    with urllib.request.urlopen(fuzzed_server.url + "/openapi.json") as answer:
        paths = json.loads(answer.read())["paths"]
    operations = {f"{method.upper()} {path}" for path, entry in paths.items() for method in entry}
    assert ran == operations - {"GET /openapi.json"}  # every operation but the document's own ran


def test_the_documents_token_ids_are_the_models(fuzzed_server, tiny_model_dir):
    """The api reads the vocabulary size from the model's tokenizer.json (it loads no tokenizer)."""
    tokenizer = json.loads((tiny_model_dir("llama", with_tokenizer="bytes") / "tokenizer.json").read_text())
    with urllib.request.urlopen(fuzzed_server.url + "/openapi.json") as answer:
        schemas = json.loads(answer.read())["components"]["schemas"]
    assert schemas["DetokenizeBody"]["properties"]["tokens"]["items"]["maximum"] == len(tokenizer["model"]["vocab"]) - 1


def test_the_log_holds_no_error_after_the_fuzzing(fuzzed_server):
    """After the fuzzing above (pytest runs a module's tests in order)."""
    log = fuzzed_server.log()
    assert "Traceback" not in log and not re.search(r"\bERROR\b", log), log[-4000:]
