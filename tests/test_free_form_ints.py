"""An integer past what the processes' messages carry (msgpack: [-2**63, 2**64)) inside a free-form field
(chat_template_kwargs, a tool's parameters) is a 400 naming the field, not a 500 where the message is
encoded (found by Schemathesis with random seeds)."""

from __future__ import annotations

import json

import pytest

from batchserve.procs.api.schemas import ChatCompletionRequest, TokenizeBody, decode_body
from batchserve.shared.errors import Refusal

HUGE = 99999999999999999999999
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maximum": HUGE}}}


@pytest.mark.parametrize(
    "schema, body, field",
    [
        (ChatCompletionRequest, {"chat_template_kwargs": {"x": HUGE}}, "chat_template_kwargs"),
        (ChatCompletionRequest, {"chat_template_kwargs": {"x": [1, {"y": -HUGE}]}}, "chat_template_kwargs"),
        (ChatCompletionRequest, {"tools": [TOOL]}, "tools"),
        (TokenizeBody, {"chat_template_kwargs": {"x": 2**64}}, "chat_template_kwargs"),
    ],
)
def test_a_huge_integer_in_a_free_form_field_is_refused_naming_it(schema, body, field):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Refusal, match=f"{field} holds an integer outside") as refused:
        decode_body(json.dumps({"messages": messages, **body}).encode(), schema)
    assert refused.value.param == field


def test_integers_the_messages_carry_pass():
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": 2**64 - 1, "b": -(2**63)}}
    assert (
        decode_body(json.dumps(body).encode(), ChatCompletionRequest).chat_template_kwargs
        == body["chat_template_kwargs"]
    )
