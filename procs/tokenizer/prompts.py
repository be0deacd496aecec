"""Turning a `GenerateRequest` into prompt token ids, and refusing prompts that cannot run.

Used by the tokenizer process; the offline engine can use the same class so that both tokenize
identically. `/tokenize` and `/detokenize` are answered here too (`inspect_ids`, `token_strs`,
`detokenize`), with the very ids generation would use.

`max_tokens` is settled here and only here (`settle_max_tokens`): this is the first process that knows
the prompt's length. Every token id a request names is checked against the vocabulary here too
(`_check_vocab`).

A text too long for the context is refused without tokenizing all of it (`_encode`): at once when
its length in characters proves it (`shared.checks.max_prompt_chars`), else after tokenizing
leading pieces whose tokens already reach the context. A piece ends between two words (a letter,
one space, a letter), where byte-level BPE pre-tokenizers (GPT-2's, Llama 3's, Qwen's) and
SentencePiece end a pre-token too, so the whole text's tokens include each piece's; the count
still gives up `PIECE_BOUNDARY_SLACK` tokens per piece for what a piece's own start may add (a
SentencePiece "▁" prefix). `tests/test_api_limits.py` measures that bound on real text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any

import llguidance
import msgspec
import numpy as np

from batchserve.procs.tokenizer.grammars import GrammarCompiler
from batchserve.procs.tokenizer.pooling_inputs import pooling_ids
from batchserve.procs.tokenizer.tools import offered_tools, template_inputs
from batchserve.shared.chat_format import HARMONY_STOPS, THINK_CLOSE, ChatFormat
from batchserve.shared.checks import check_prompt_chars, max_prompt_chars, max_token_chars
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import ModelLoadError, Refusal
from batchserve.shared.messages import GenerateRequest, PoolingParams, StopParams, TokenizedRequest
from batchserve.shared.model import ModelSpec
from batchserve.shared.pooling import ChatInput, read_chat_input

log = logging.getLogger("batchserve.tokenizer")
PROMPT_THINK_WINDOW = 8  # Qwen3 with thinking off ends its prompt with "<think>\n\n</think>\n\n"
# A long text is counted in pieces of about this many characters per context token (prose runs
# ~4 characters a token): a text too long for the context is refused after a piece or two.
PIECE_CHARS_PER_TOKEN = 8
PIECE_BOUNDARY_SLACK = 2  # tokens a piece's count gives up for its start (see the module's text)
_WORD_GAP = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")  # letter, space, letter: a cut goes before the space
CHAT_TEMPLATE_RESERVED = ("conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat: the context left


def settle_max_tokens(
    prompt_len: int,
    given: int | None,
    param: str,
    max_context: int,
    *,
    chat: bool,
    prompt_param: str = "prompt",
    min_tokens: int = 0,
) -> int:
    """The request's max_tokens: the client's (`given`, from field `param`) if it fits the context
    beside a `prompt_len`-token prompt, else a `Refusal`; not given: 16 for a completion, the
    context left for a chat, either lowered to what the prompt leaves. `min_tokens` may not exceed the
    client's max_tokens (as vLLM checks it; a default only cuts the output short)."""
    if prompt_len >= max_context:
        raise Refusal(
            f"This model's maximum context length is {max_context} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion.",
            prompt_param,
        )
    room = max_context - prompt_len
    if given is None:
        return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if given < 1:
        raise Refusal(f"{param} must be at least 1 (got {given})", param)
    if given > room:
        raise Refusal(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_len + given} tokens ({prompt_len} in the prompt, {given} in the completion). "
            f"Please reduce the prompt or {param}.",
            param,
        )
    if min_tokens > given:
        raise Refusal(f"min_tokens ({min_tokens}) must not exceed {param} ({given})", "min_tokens")
    return given


def _pooling_chat(spec: ModelSpec) -> ChatInput | None:
    """How the folder's sentence-transformers config says a text is embedded (`shared.pooling`). A folder it
    refuses is refused by the worker at start on the pooling runner; the generate runner never pools."""
    try:
        return read_chat_input(spec.model_dir)
    except ModelLoadError:
        return None


class PromptTokenizer:
    """Chat template + tokenization + the length checks of the tokenizer process, and the compiled
    grammar of a structured-output request (`grammar_tokenizer` builds llguidance's view of the
    tokenizer, on first use; None: structured output is refused)."""

    def __init__(
        self,
        tokenizer: Any,
        max_context: int,
        grammar_tokenizer: Callable[[], llguidance.LLTokenizer] | None = None,
        pooling_chat: ChatInput | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.pooling_chat = pooling_chat  # an embedder's texts as its chat template renders them
        self.vocab_size = len(tokenizer)
        self.chat_format = ChatFormat.of(getattr(tokenizer, "chat_template", None))
        self._grammar_tokenizer = grammar_tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's tokenizer.json
        self.max_prompt_chars = (
            None if backend is None else max_prompt_chars(max_context, max_token_chars(backend.to_str()))
        )
        # Cutting at a word gap must not cut an added token ("<|im start|>" would be cut at its space).
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._pieces = backend is not None and not any(" " in str(t) for t in added.values())

    @classmethod
    def of(cls, spec: ModelSpec, tokenizer: Any = None) -> PromptTokenizer:
        """For a model (`tokenizer`: its tokenizer, if already loaded)."""
        return cls(
            spec.load_tokenizer() if tokenizer is None else tokenizer,
            spec.context_length,
            spec.grammar_tokenizer,
            _pooling_chat(spec),
        )

    @classmethod
    def load(cls, config: ServerConfig) -> PromptTokenizer:
        prompts = cls.of(ModelSpec.from_config(config))
        try:
            prompts.grammars  # noqa: B018 - built at start, not on the first request that needs it
        except Refusal as exc:
            log.warning("%s", exc.message)
        return prompts

    @cached_property
    def grammars(self) -> GrammarCompiler:
        if self._grammar_tokenizer is None:
            raise Refusal("structured output is not available in this engine", "response_format")
        try:
            return GrammarCompiler(self._grammar_tokenizer())
        except Exception as exc:  # llguidance takes byte-level and sentencepiece tokenizers, not every kind
            raise Refusal(
                f"structured output is not available for this model's tokenizer: {exc}", "response_format"
            ) from None

    def prompt_ids(
        self,
        request: GenerateRequest,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool | None = None,
    ) -> tuple[list[int], str]:
        """The prompt's token ids and the name of the field they came from. The keywords are
        `/tokenize`'s (vLLM's); their defaults are generation's: a chat ends with the generation
        prompt and gets no special tokens beyond the template's, a text gets the tokenizer's."""
        if request.messages is not None:
            if not request.messages:
                raise Refusal("messages must not be empty", "messages")
            messages, extra = template_inputs(request, self.chat_format)
            clash = sorted(set(request.chat_template_kwargs) & set(CHAT_TEMPLATE_RESERVED))
            if clash:
                raise Refusal(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
            options = {"continue_final_message": True} if continue_final_message else {}
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    **options,
                    **extra,
                    **request.chat_template_kwargs,
                )
            except Exception as exc:  # jinja raises for roles/orders a template does not accept
                raise Refusal(f"the chat template cannot render these messages: {exc}", "messages") from None
            # The template already wrote any BOS it wants: do not add special tokens twice.
            return self._encode(text, bool(add_special_tokens), "messages"), "messages"
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            self._check_vocab(ids, "prompt")
            return ids, "prompt"
        if request.prompt is None or request.prompt == "":
            raise Refusal("prompt must not be empty", "prompt")
        return self._encode(request.prompt, add_special_tokens is not False, "prompt"), "prompt"

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """`tokenizer.encode(text)`, refusing a text that cannot fit the context without tokenizing
        all of it (see the module's text)."""
        check_prompt_chars(len(text), self.max_prompt_chars, self.max_context, param)
        piece = PIECE_CHARS_PER_TOKEN * self.max_context
        if self._pieces and len(text) > 2 * piece:
            counted, start = 0, 0
            while len(text) - start > piece:
                gap = _WORD_GAP.search(text, start + piece)
                if gap is None:  # no word gap ahead: the rest is tokenized whole (bounded by the above)
                    break
                ids = self.tokenizer.encode(text[start : gap.start()], add_special_tokens=False)
                counted += max(len(ids) - PIECE_BOUNDARY_SLACK, 0)
                if counted >= self.max_context:
                    raise Refusal(
                        f"This model's maximum context length is {self.max_context} tokens; the "
                        f"first {gap.start()} of this prompt's {len(text)} characters are already "
                        f"at least {counted} tokens, which leaves no room for a completion.",
                        param,
                    )
                start = gap.start()
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def inspect_ids(
        self,
        request: GenerateRequest,
        *,
        add_special_tokens: bool | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> list[int]:
        """`/tokenize`: the ids `prompt_ids` gives. A text `_encode` proves too long for the context is
        refused as for generation; any other count is answered, past the context too (vLLM answers
        every count; this server does not tokenize megabytes for it)."""
        ids, _ = self.prompt_ids(
            request,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
        )
        return ids

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's own string in the vocabulary (byte-level BPE: "Ġworld"), as vLLM's `token_strs`."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def detokenize(self, ids: list[int]) -> str:
        """`/detokenize`: the text of `ids` (special tokens kept), or a `Refusal` naming `tokens`."""
        self._check_vocab(ids, "tokens")
        return self.tokenizer.decode(ids)

    def tokenize(self, request: GenerateRequest) -> TokenizedRequest:
        """Tokenize and check the length; raises `Refusal`."""
        if request.params.pooling is not None:
            return self._pooling_request(request, request.params.pooling)
        ids, field = self.prompt_ids(request)
        n = len(ids)
        if n == 0:
            raise Refusal(f"{field} must not be empty", field)
        params = request.params
        max_tokens = settle_max_tokens(
            n,
            params.stop.max_tokens,
            request.max_tokens_param,
            self.max_context,
            chat=request.messages is not None,
            prompt_param=field,
            min_tokens=params.logits.min_tokens,
        )
        stop = msgspec.structs.replace(params.stop, max_tokens=max_tokens)
        if request.messages is not None and self.chat_format.harmony:
            stop = self._harmony_stop(stop)
        self._check_vocab(stop.stop_token_ids, "stop_token_ids", "stop token id")
        self._check_vocab(params.logits.logit_bias, "logit_bias", "logit_bias token id")
        logits = params.logits
        grammar = self._grammar(request)
        if grammar is not None:
            logits = msgspec.structs.replace(
                logits,
                grammar=grammar,
                grammar_param=params.constraint.param if params.constraint is not None else "tool_choice",
                grammar_after=self._thinking_end(ids) if request.messages else None,
            )
        return TokenizedRequest(
            rid=request.rid,
            prompt_ids=np.asarray(ids, dtype=np.int32),
            # the constraint, compiled into logits.grammar, travels no further
            params=msgspec.structs.replace(params, stop=stop, logits=logits, constraint=None),
            arrival_time=request.arrival_time,
        )

    def _pooling_request(self, request: GenerateRequest, pooling: PoolingParams) -> TokenizedRequest:
        """A pooling request: its input's ids, cut to `truncate_prompt_tokens` as vLLM cuts them
        (`pooling_inputs`), at most the context; it generates nothing (max_tokens 0: its one sampled row is
        its vector, SCHEDULING.md section 11)."""
        ids, field = pooling_ids(
            self.tokenizer, self.prompt_ids, request, pooling.truncate_prompt_tokens, self.pooling_chat
        )
        if not ids:
            raise Refusal(f"{field} must not be empty", field)
        if len(ids) > self.max_context:
            raise Refusal(
                f"This model's maximum context length is {self.max_context} tokens; this input has "
                f"{len(ids)} tokens (truncate_prompt_tokens cuts it)",
                field,
            )
        return TokenizedRequest(
            rid=request.rid,
            prompt_ids=np.asarray(ids, dtype=np.int32),
            params=msgspec.structs.replace(request.params, stop=StopParams(max_tokens=0)),
            arrival_time=request.arrival_time,
        )

    def _harmony_stop(self, stop: StopParams) -> StopParams:
        """A harmony chat's text keeps its special tokens (the api reads the channels from them) and ends at
        `<|return|>` or `<|call|>` (the checkpoint's generation config lists them too; here they hold whatever
        it says)."""
        vocab = self.tokenizer.get_vocab()
        ends = tuple(vocab[t] for t in HARMONY_STOPS if t in vocab and vocab[t] not in stop.stop_token_ids)
        return msgspec.structs.replace(stop, skip_special_tokens=False, stop_token_ids=stop.stop_token_ids + ends)

    def _check_vocab(self, ids: Iterable[int], param: str, what: str = "token id") -> None:
        """Refuse, naming `param`, the first of `ids` outside the vocabulary [0, vocab_size)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise Refusal(f"{what} {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def _thinking_end(self, prompt_ids: list[int]) -> int | None:
        """A thinking model's `</think>` token, when the answer will start by thinking: the grammar
        then starts after it (as vLLM's reasoning parsers have it). None when the template does not
        think, or the prompt already closed the block (e.g. Qwen3 with enable_thinking false)."""
        think_close = self._think_close_id
        if think_close is None or think_close in prompt_ids[-PROMPT_THINK_WINDOW:]:
            return None
        return think_close

    @cached_property
    def _think_close_id(self) -> int | None:
        if self.chat_format.reasoning != "think":
            return None
        ids = self.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _grammar(self, request: GenerateRequest) -> str | None:
        """The compiled grammar the output must match: a forced tool call, or the constraint."""
        tools = offered_tools(request)
        forced = bool(tools) and (request.tool_choice == "required" or request.forced_tool is not None)
        constraint = request.params.constraint
        if not forced and constraint is None:
            return None
        # the field that asked for it (not forced: the constraint, which there is then)
        param = "tool_choice" if forced or constraint is None else constraint.param
        if self.chat_format.harmony and request.messages is not None:  # a grammar would have to allow the headers
            raise Refusal(
                "structured output and forced tool calls are not supported for models that answer in "
                "the harmony format (gpt-oss); call tools with tool_choice 'auto'",
                param,
            )
        try:
            grammars = self.grammars
        except Refusal as exc:  # no grammar engine for this tokenizer: name the field that asked
            exc.param = param
            raise
        if forced or constraint is None:
            return grammars.for_tool_call(tools, request.forced_tool, self.chat_format.tool_call_style)
        return grammars.for_constraint(constraint)
