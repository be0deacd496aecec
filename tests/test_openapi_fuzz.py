"""Schemathesis fuzzes every operation of the server's own OpenAPI document (`/openapi.json`) against
`batchserve serve` on a tiny random model: at least 50 generated requests each, valid and invalid. No
answer may be a 5xx, every answer must match the document's schema and media type, and the server's
log must hold no ERROR line and no traceback afterwards.

Schemathesis runs as its command line (`st run`), as CI jobs run it; kept to a few minutes on 2 cores:
the context is 128 tokens, so a generation is short or refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_server import start_server

CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"
ST = Path(sys.executable).with_name("st")


@pytest.fixture(scope="module")
def fuzzed_server(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama", with_tokenizer="bytes")
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    srv = start_server(model, log, "--max-context", "128", "--kv-capacity-tokens", "4096")
    yield srv
    srv.stop()


def test_no_5xx_and_every_answer_as_documented(fuzzed_server, tmp_path):
    command = [
        str(ST), "run", fuzzed_server.url + "/openapi.json", "--checks", CHECKS, "--max-examples", "50",
        "--request-timeout", "120", "--generation-deterministic", "--report", "junit",
        "--report-junit-path", str(tmp_path / "junit.xml"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    junit = (tmp_path / "junit.xml").read_text()
    operations = re.findall(r"<testcase [^>]*name=\"([^\"]+)\"", junit)
    assert len(operations) >= 15, operations  # every operation of the document ran


def test_the_log_holds_no_error_after_the_fuzzing(fuzzed_server):
    """After the fuzzing above (pytest runs a module's tests in order)."""
    log = fuzzed_server.log()
    assert "Traceback" not in log and not re.search(r"\bERROR\b", log), log[-4000:]
