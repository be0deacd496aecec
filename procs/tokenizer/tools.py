"""Chat messages and tools as the chat template receives them.

A template that renders `tools` itself (Qwen2.5/3, Llama 3.1+, Hermes) gets them in HF's form and
the messages as they came (assistant `tool_calls` with their arguments as objects, `tool` messages).
Other templates (SmolLM2's) know only role + content: we write Qwen2.5's Hermes tool instructions
into the system message, earlier calls as `<tool_call>` blocks and tool results as user turns in
`<tool_response>` blocks, which is the format the api then parses calls from.
"""

from __future__ import annotations

import json
from typing import Any

from batchserve.shared.chat_format import HERMES_CLOSE, HERMES_OPEN, ChatFormat
from batchserve.shared.messages import ChatMessage, GenerateRequest, ToolCall, ToolFunction

HERMES_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def offered_tools(request: GenerateRequest) -> list[ToolFunction]:
    """The tools the model is told about: none when the client chose "none"."""
    return [] if request.tool_choice == "none" else request.tools


def tool_schema(tool: ToolFunction) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def template_inputs(request: GenerateRequest, chat_format: ChatFormat) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template arguments) for a chat request."""
    messages = request.messages or []
    tools = offered_tools(request)
    if chat_format.template_takes_tools:
        extra = {"tools": [tool_schema(t) for t in tools]} if tools else {}
        return [_as_template_message(m) for m in messages], extra
    return _hermes_messages(messages, tools), {}


def _as_template_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _arguments(call: ToolCall) -> Any:
    """Templates index and `tojson` the arguments: give them the object (HF's convention)."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _hermes_messages(messages: list[ChatMessage], tools: list[ToolFunction]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.content or ''}\n</tool_response>"})
        elif m.tool_calls:
            calls = "\n".join(
                f"{HERMES_OPEN}\n{json.dumps({'name': c.name, 'arguments': _arguments(c)})}\n{HERMES_CLOSE}"
                for c in m.tool_calls
            )
            out.append({"role": m.role, "content": ((m.content or "") + "\n" + calls).lstrip("\n")})
        else:
            out.append({"role": m.role, "content": m.content or ""})
    if tools:
        instructions = HERMES_INSTRUCTIONS.format(tools="\n".join(json.dumps(tool_schema(t)) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
