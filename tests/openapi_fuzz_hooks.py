"""Schemathesis hooks of tests/test_openapi_fuzz.py (`SCHEMATHESIS_HOOKS`): the positive cases (those the
document calls valid, which `positive_data_acceptance` requires the server to accept) made to keep what
JSON Schema cannot say, and the test's generation budget. The document says each rule in a description.

- The prompt fits the context beside max_tokens: counted by the server's /tokenize (a chat as generation
  renders it, tools included; a Responses API input as the server translates it), the prompt is cut
  (tools offered, the last of several messages, items or prompts, then every text halved) until it
  leaves room for the budget below; min_tokens within max_tokens.
- The budget: a positive case generates at most BUDGET tokens (its max_tokens, set where absent, at
  most that): a step of the test model costs ~20 ms on a loaded CI machine, and hundreds of valid
  requests each generating to the end of the context would take minutes. Long generations are other
  tests' concern.
- n x a completion's prompts within the server's request cap.
- At most one structured-output field constraining (the document says so, but as a rule beside the others
  it is more than Schemathesis expands); a regex, a Lark grammar or a JSON schema the engine compiles: a
  fixed one of each kind in place of the generated text, as is a tool's parameter schema.
- tools of distinct names; previous_response_id naming a stored response: left out (none is stored
  before the fuzzing); /v1/score's text_1 and text_2 of one length (for a pooling server).
- JSON's integers: a whole number spelled as a float (3.0) is an integer to JSON Schema, not to msgspec,
  which decodes only 3 as an `int`; written as 3. An integer inside a free-form object lies in INT_RANGE
  (the document's description): one outside is clamped to it.

Negative cases are left as generated: the server must answer them without a 5xx.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

import msgspec
import schemathesis

from batchserve.procs.api.responses_request import ResponsesRequest, to_chat
from batchserve.procs.api.schemas import INT_RANGE
from batchserve.shared.errors import Refusal

URL = os.environ.get("FUZZ_URL", "http://127.0.0.1:8000")
MAX_CONTEXT = int(os.environ.get("FUZZ_MAX_CONTEXT", "128"))
REQUEST_CAP = int(os.environ.get("FUZZ_REQUEST_CAP", "1088"))  # --max-running-requests + --max-waiting
BUDGET = 2  # tokens a positive case generates, at most
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
REGEX, GRAMMAR, SCHEMA, PARAMETERS = "[a-z]{1,8}", 'start: "yes" | "no"', {"type": "boolean"}, {"type": "object"}
KEPT = ("role", "type")  # what halving a message leaves alone
RENDERED = ("content", "tool_calls", "tool_call_id", "name")  # what a chat template writes of a message
# the fields of messages, content parts, calls and Responses API items (others are ignored)
FIELDS = frozenset(
    {*RENDERED, *KEPT, "text", "id", "function", "arguments", "call_id", "output", "encrypted_content", "status"}
)
HERMES_CHARS = 600  # the tool instructions the server writes for a template that renders no tools


@schemathesis.hook.apply_to(method="POST")  # (a case hook slows the generation of every operation it applies to)
def map_case(context: Any, case: Any) -> Any:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return case
    body = whole_numbers(case.body)
    path = case.operation.path
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        body.pop("previous_response_id", None)
        constrain(body)
        fit(body, path)
    elif path in ("/v1/score", "/score"):
        paired(body)
    elif path == "/tokenize":  # its text, as rendered, may have as many characters as the context has tokens
        while rendered_chars(body) > MAX_CONTEXT - 1 and shorten(body):
            pass
    case.body = body
    return case


def whole_numbers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return min(max(value, INT_RANGE[0]), INT_RANGE[1])
    if isinstance(value, dict):
        return {k: whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_numbers(v) for v in value]
    return value


# ---- the context


def fit(body: dict, path: str) -> None:
    """Cut the prompt until it leaves room for BUDGET tokens; then the max_tokens fields to that."""
    room = MAX_CONTEXT - BUDGET
    while (tokens := prompt_tokens(body, path)) is not None and tokens > room and shorten(body):
        pass
    if path == "/v1/completions" and isinstance(body.get("n"), int):
        body["n"] = max(1, min(body["n"], REQUEST_CAP // len(batch(body["prompt"]))))
    if path == "/v1/responses":
        body["max_output_tokens"] = min(body.get("max_output_tokens") or BUDGET, BUDGET)
    else:
        for field in ("max_tokens", "max_completion_tokens"):
            if field == "max_tokens" or body.get(field) is not None:
                body[field] = min(body.get(field) or BUDGET, BUDGET)
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"], BUDGET)


def prompt_tokens(body: dict, path: str) -> int | None:
    """The prompt's tokens (of the longest of a completion's prompts), as the server's /tokenize counts
    them; None where it cannot tell (the request is refused for something else, which the check reports)."""
    if path == "/v1/completions":
        counts = [len(p) if isinstance(p, list) else tokenize({"prompt": p}) for p in batch(body.get("prompt"))]
        return None if None in counts else max(c for c in counts if c is not None)
    if path == "/v1/responses":
        try:
            chat = msgspec.to_builtins(to_chat(msgspec.convert(body, ResponsesRequest), []).request)
        except (Refusal, msgspec.ValidationError):
            return None
    else:
        chat = body
    offered = chat.get("tool_choice") != "none"
    return tokenize({"messages": chat.get("messages"), "tools": chat.get("tools") if offered else None})


def tokenize(query: dict) -> int | None:
    """/tokenize's count; more than the context where it refuses a text too long to count."""
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(URL + "/tokenize", json.dumps(query).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())["count"]
    except urllib.error.HTTPError as exc:
        return 2 * MAX_CONTEXT if "maximum context length" in exc.read().decode(errors="replace") else None


def batch(prompt: Any) -> list[Any]:
    """A completion's prompts: one text or id list, or a list of them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt]


def rendered_chars(body: dict) -> int:
    """An upper bound of the characters of a chat as its template renders it (contents, calls as JSON, the
    tool instructions and the tools' JSON), to keep below the context's tokens."""
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    rendered = sum(len(json.dumps([m.get(k) for k in RENDERED])) + 16 for m in messages if isinstance(m, dict))
    return rendered + 16 + (HERMES_CHARS + len(json.dumps(tools)) if tools else 0)


def shorten(body: dict) -> bool:
    """One step shorter: tools offered left out (their instructions alone outgrow a small context), the last
    of several messages, items or prompts dropped, else the texts halved. False when nothing is left to cut."""
    if body.get("tools") and body.get("tool_choice") != "none":
        body["tools"] = body["tool_choice"] = None
        return True
    for field in ("messages", "input", "prompt"):
        value = body.get(field)
        if isinstance(value, list) and len(value) > 1 and any(spoken(item) for item in value[:-1]):
            value.pop()
            return True
    before = json.dumps(body)
    for field in ("messages", "input", "prompt", "instructions"):
        if body.get(field) is not None:
            body[field] = halved(body[field])
    return json.dumps(body) != before


def spoken(item: Any) -> bool:
    """Not a Responses API reasoning item (an input of those alone makes no chat)."""
    return not (isinstance(item, dict) and item.get("type") == "reasoning")


def halved(value: Any) -> Any:
    """Every text and list in `value` cut to its first half (at least one), roles and types kept; of an
    object only the fields the server reads, and a call's arguments as {}."""
    if isinstance(value, str):
        return value[: max(1, len(value) // 2)]
    if isinstance(value, list):
        kept = value[: max(1, len(value) // 2)]
        first_spoken = next((v for v in value if spoken(v)), None)
        if first_spoken is not None and not any(spoken(v) for v in kept):
            kept.append(first_spoken)
        return [halved(v) for v in kept]
    if isinstance(value, dict):
        read = {k: v for k, v in value.items() if k in FIELDS}
        return {
            k: v if k in KEPT else {} if k == "arguments" and isinstance(v, dict) else halved(v)
            for k, v in read.items()
        }
    return value


def paired(body: dict) -> None:
    """Score's text_1 and text_2: two lists of one length, unless either is one text."""
    first, second = body.get("text_1"), body.get("text_2")
    if isinstance(first, list) and isinstance(second, list) and 1 not in (len(first), len(second)):
        shortest = min(len(first), len(second))
        body["text_1"], body["text_2"] = first[:shortest], second[:shortest]


# ---- structured output and tools


def constrain(body: dict) -> None:
    """Sources the engine compiles; at most one structured-output field constraining (the first)."""
    response_format = body.get("response_format")
    constraining = isinstance(response_format, dict) and response_format.get("type") != "text"
    for field in GUIDED:
        if body.get(field) is not None and constraining:
            body[field] = None
        constraining = constraining or body.get(field) is not None
    if body.get("guided_regex") is not None:
        body["guided_regex"] = REGEX
    if body.get("guided_grammar") is not None:
        body["guided_grammar"] = GRAMMAR
    if body.get("guided_json") is not None:
        body["guided_json"] = SCHEMA
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict):
        response_format["json_schema"]["schema"] = SCHEMA
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("schema") is not None:
        text["format"]["schema"] = SCHEMA
    functions = [tool.get("function", tool) for tool in body.get("tools") or []]  # chat nests it
    for i, function in enumerate(functions):
        if any(function.get("name") == other.get("name") for other in functions[:i]):
            function["name"] = f"{function['name'][:56]}_{i}"
        if function.get("parameters") is not None:
            function["parameters"] = PARAMETERS
