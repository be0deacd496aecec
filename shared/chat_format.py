"""What a model's chat template says about its output format, read once from the template's text.

Used by the tokenizer (how to render tools, which call format to constrain to) and the api (whether
to split `<think>` reasoning out of the answer, or read harmony's channels). A template that takes no
`tools` gets them from us in Hermes' format (Qwen2.5's own system text), which the api parses like a
Hermes template's. A template that writes `<|channel|>` is OpenAI's harmony format (gpt-oss): the answer
is channel messages (`procs.api.harmony_output`), its special tokens kept in the text for that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ToolCallStyle = Literal["hermes", "json"]
# How the answer carries reasoning: "" none, "think" a <think>...</think> block first (Qwen3, DeepSeek-R1),
# "harmony" channel messages (gpt-oss: analysis = reasoning, final = the answer, commentary = tool calls)
ReasoningFormat = Literal["", "think", "harmony"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_STOPS = ("<|return|>", "<|call|>")  # a harmony answer ends at its final message or at a tool call


@dataclass(frozen=True)
class ChatFormat:
    template_takes_tools: bool  # the template renders a `tools` variable itself
    # How the model writes a call: "hermes" = <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    # (Qwen, Hermes, and our own prompt for templates without tools); "json" = a bare
    # {"name": ..., "parameters": {...}} object (Llama 3.1+).
    tool_call_style: ToolCallStyle
    reasoning: ReasoningFormat

    @property
    def harmony(self) -> bool:
        return self.reasoning == "harmony"

    @classmethod
    def of(cls, template: str | None) -> ChatFormat:
        template = template or ""
        takes_tools = "tools" in template
        style: ToolCallStyle = "json" if takes_tools and HERMES_OPEN not in template else "hermes"
        reasoning: ReasoningFormat = (
            "harmony" if HARMONY_CHANNEL in template else "think" if THINK_CLOSE in template else ""
        )
        return cls(template_takes_tools=takes_tools, tool_call_style=style, reasoning=reasoning)


def read_chat_template(model_dir: Path) -> str | None:
    """The template as transformers finds it: chat_template.jinja, else tokenizer_config.json's."""
    jinja = Path(model_dir) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = Path(model_dir) / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None
