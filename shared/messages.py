"""Messages exchanged between batchserve's processes.

Every message is a `msgspec.Struct`; on the wire they are msgpack. Bulk integer arrays are
`numpy.ndarray` fields: `shared.codec` turns them into bytes (or shared-memory references) on the way
out and back into arrays on the way in.

The scheduler <-> worker contract is `ForwardBatch` -> `StepResult`: the scheduler decides which
tokens run, where their KV goes and which pages each request slot owns; the worker only executes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from batchserve.shared.scheduler_view import SchedulerView


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request picks its next token. `temperature == 0` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed -> same tokens, whatever the batch


class LogitsParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request changes to the model's logits and what to report of them. The worker keeps these
    with the request's slot (sent once, when the slot starts), with the token counts they need.

    Order: the repetition penalty on the model's logits (as HF's processor sees them), then
    logit_bias, frequency and presence penalties (additive), then the min_tokens ban, then
    `SamplingParams`' temperature and filters. Greedy requests are adjusted too. Logprobs are the
    model's own log-softmax, before any of this (vLLM's default `raw_logprobs`).
    """

    presence_penalty: float = 0.0  # OpenAI: minus this once for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count among generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: tokens in prompt or output: logit / p if > 0 else logit * p
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are generated
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (-100 bans it)
    logprobs: int | None = None  # per generated token: its logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    # Structured output: an llguidance grammar (its JSON form) the output must match, compiled from the
    # request's `OutputConstraint` or forced tool call by the tokenizer process. The worker masks
    # every token the grammar does not allow, last, after all of the above.
    grammar: str | None = None
    grammar_param: str | None = None  # the request field it came from, named if it fails mid-answer
    # A thinking model's `</think>` token: the grammar holds from the token after it (the thinking is free).
    grammar_after: int | None = None

    @property
    def penalizes(self) -> bool:
        """Some penalty is on: the sampled tokens must be counted."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        return self.penalizes or bool(self.min_tokens or self.logit_bias)

    @property
    def is_plain(self) -> bool:
        """Nothing to adjust or report: the worker keeps no state for the slot."""
        return (
            not self.adjusts_logits and self.logprobs is None and self.prompt_logprobs is None and self.grammar is None
        )

    @property
    def needs_output_ids(self) -> bool:
        """The slot's state follows the generated tokens: a restart (preemption) must replay them."""
        return self.penalizes or self.grammar is not None


PLAIN_LOGITS = LogitsParams()


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One token's logprob under the model, and the `k` most likely tokens at that position."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class StopParams(msgspec.Struct, frozen=True, kw_only=True):
    """When a request stops generating (checked by the scheduler, except `stop` strings), and how the
    detokenizer writes its text (`stop` strings, `skip_special_tokens`).

    `max_tokens` is None in a `GenerateRequest` whose client gave none: the tokenizer settles it (the
    default, and the context check) and every later stage reads an int."""

    max_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: matched by the detokenizer
    include_stop_str_in_output: bool = False  # the text ends with the stop string that matched, not before it
    skip_special_tokens: bool = True  # special tokens left out of the text (kept in a harmony chat's, to parse)


NO_STOP = StopParams()


class SlotStart(msgspec.Struct, kw_only=True):
    """A request starts in a worker slot (admitted, or re-admitted after a preemption): the slot's
    state is reset to its `params` (the logits state from `params.logits`). Ids are sent only when
    its logits need them."""

    slot: int
    params: RequestParams = msgspec.field(default_factory=lambda: DEFAULT_PARAMS)
    prompt_len: int = 0  # as prefilled (grown by a preemption's recompute): a rope switching factors follows it
    client_prompt_len: int = 0  # the client's prompt alone (0: prompt_len): dynamic NTK's keys follow it
    prompt_ids: list[int] = []  # for the repetition penalty and prompt logprobs
    output_ids: list[int] = []  # generated before a preemption: the penalties count them
    min_tokens_banned: list[int] = []  # EOS and stop_token_ids: banned until min_tokens are generated
    restore_state: int = -1  # a hybrid model: the state snapshot its slot's state starts from (-1: zeros)
    adapter: int = 0  # its LoRA adapter's index in the worker (0: the base model)


class AdapterUpdate(msgspec.Struct, tag=True, kw_only=True):
    """A LoRA adapter loaded or unloaded while serving (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`):
    api -> tokenizer -> scheduler, the same socket as the requests, so a request sent after a load never
    overtakes it; the scheduler passes it to the worker on the next step (`ForwardBatch.adapter_updates`),
    an unload once no request of the adapter is left."""

    index: int  # >= 1 (`shared.lora`)
    name: str
    path: str = ""  # the PEFT folder to load; "": unload


FUTURE_TOKEN = -1  # an input id the worker fills with the slot's last sampled token (see ForwardBatch)
DRAFT_TOKEN = -2  # an input id the worker's draft model fills with a proposed token (see ForwardBatch)


class ForwardBatch(msgspec.Struct, kw_only=True):
    """One model step, planned by the scheduler and executed by the worker.

    Requests appear in batch order; request i feeds `extend_lens[i]` tokens, which occupy the next
    `extend_lens[i]` entries of the packed arrays `input_ids`, `positions` and `kv_locs`.
    `kv_locs` are flat KV-pool indices (`page * page_size + offset`) where each token's K/V is written.
    `page_table_*` are page-table entries the worker must set before running:
    `page_table[page_table_slots[j], page_table_cols[j]] = page_table_pages[j]`.
    An input id `FUTURE_TOKEN` is a decode input planned before its token came back (overlap
    scheduling): the worker feeds the token it sampled last for that slot. It only ever stands first
    in a row.
    A decode row of k tokens (prefix_lens[i] > 0, extend_lens[i] == sample_lens[i] == k) feeds the
    request's last token, then k - 1 proposed tokens; each of its k positions samples one token.
    With a draft model (`--speculative draft`) the proposed tokens are `DRAFT_TOKEN`s, which the
    worker's draft model fills before the step runs (`procs.worker.speculation.draft_model`).
    """

    step: int
    slots: list[int]  # request-table row of each request
    prefix_lens: list[int]  # tokens already in the KV cache before this step
    extend_lens: list[int]  # tokens fed this step (prefill chunk length, or k for a decode row of k tokens)
    # How many of the row's last fed tokens are sampled (logit positions): 0 for an intermediate
    # prefill chunk, 1 for a last chunk or a plain decode, k for a decode row of k tokens.
    sample_lens: list[int]
    sampling: list[SamplingParams]
    # Tokens this request sampled before this step; the row's j-th sampled position counts as
    # sample_counts[i] + j (seeded generators, the min_tokens ban, penalties' counts).
    sample_counts: list[int]
    input_ids: np.ndarray  # [num_tokens] int32
    positions: np.ndarray  # [num_tokens] int32
    kv_locs: np.ndarray  # [num_tokens] int32
    page_table_slots: np.ndarray  # [num_updates] int32
    page_table_cols: np.ndarray  # [num_updates] int32
    page_table_pages: np.ndarray  # [num_updates] int32
    slot_starts: list[SlotStart] = []  # applied before the step runs
    state_saves: list[tuple[int, int]] = []  # a hybrid model's (slot, snapshot): its state kept, after the step
    adapter_updates: list[AdapterUpdate] = []  # LoRA adapters loaded or unloaded before the step (its slot starts)

    @property
    def num_requests(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sampled(self) -> int:
        return sum(self.sample_lens)


class StepResult(msgspec.Struct, kw_only=True):
    """What the worker returns for a `ForwardBatch`: one token per sampled position, in batch order
    (a row's positions in order)."""

    step: int
    next_token_ids: np.ndarray  # [num_sampled] int32
    # For the sampled positions whose requests asked for logprobs: their index in next_token_ids, and them.
    logprob_rows: list[int] = []
    logprobs: list[TokenLogprobs] = []
    # Prefill chunks of requests that asked for prompt logprobs: (slot, logprobs of the prompt
    # tokens this chunk predicts, in order).
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]] = []
    # Rows with proposed tokens (speculative decoding): how many positions of each sampling row (rows
    # with sample_lens > 0, in batch order) verification kept, the first always; [] when every row has
    # one position. The tokens of the others are in next_token_ids and do not count.
    accepted_lens: list[int] = []
    # Seconds the worker's draft model spent proposing this step's draft tokens (its passes after the
    # first, which runs every step to keep its KV; `procs.worker.speculation.draft_model`); 0 without one.
    draft_s: float = 0.0
    # Seconds of one-off work in this step (adapters loaded, CUDA graphs captured for adapter rows): not what a
    # step of its shape costs, so the scheduler's step-cost fit leaves them out.
    setup_s: float = 0.0
    # A mixture-of-experts model: the tokens routed to each expert of each MoE layer [layers, experts]
    # since the worker last sent them (about once a second), for /metrics; None between.
    expert_load: np.ndarray | None = None
    # The pooling runner: each sampling row's pooled final hidden states [num_sampled, hidden] float32, in
    # batch order (its next_token_ids are placeholders); None from the generate runner.
    pooled: np.ndarray | None = None
    # Slots whose grammar failed on a token this step (its engine's limit, a replay that no longer matches),
    # with llguidance's error: their requests end with an error, never unconstrained text.
    grammar_failures: list[tuple[int, str]] = []


# ---------------------------------------------------------------------------------------------
# Request path: api -> tokenizer -> scheduler -> detokenizer -> api.
# Tagged structs so one socket can carry a union (a request and its abort share a socket, so an
# abort can never overtake its request).


class ToolCall(msgspec.Struct, kw_only=True):
    """A function call an assistant message made (OpenAI's `tool_calls[i]`)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str  # "system" | "user" | "assistant" | "tool" (other roles: as the chat template takes them)
    content: str | None = None  # None: an assistant message that only calls tools
    tool_calls: list[ToolCall] = []  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers
    name: str | None = None  # tool: the function's name, where the client gave it


class ToolFunction(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None = None
    # JSON schema of the arguments (OpenAI: omitted means no arguments)
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})


class OutputConstraint(msgspec.Struct, frozen=True, kw_only=True):
    """Structured output: what the generated text must match. The tokenizer compiles it (cached) into
    `LogitsParams.grammar`, or rejects it with a 400 naming `param`."""

    kind: str  # "json_object" (any JSON object) | "json_schema" | "regex" | "choice" | "lark"
    spec: str = ""  # json_schema: the schema as JSON text; regex; choice: a JSON list of strings; lark
    param: str = "response_format"  # the request field it came from


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True):
    """A pooling request (the pooling runner, `/v1/embeddings`): one prefill, whose pooled final hidden
        states are its answer (`TokenDelta.pooled`) in place of generated tokens: its `stop.max_tokens` is 0,
        and the one row it samples, its prompt's last, gives its vector (SCHEDULING.md section 11). The api
    finishes the vector (a Matryoshka cut, normalisation, an activation), so only the input's cut is here."""

    truncate_prompt_tokens: int | None = None  # only the prompt's last k tokens run (the tokenizer cuts)


class RequestParams(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one request asks of the engine besides its prompt, as one struct that travels whole:
    the api builds it, the tokenizer settles it (`stop.max_tokens`, the grammar compiled from
    `constraint` into `logits.grammar`), the scheduler keeps it on the request, the worker gets it with
    the slot (`SlotStart`) and the detokenizer its `stop` with the first delta. A new per-request field
    is a field here (or in the struct of its kind) and the code that reads it; nothing copies fields."""

    sampling: SamplingParams = SamplingParams()
    stop: StopParams = StopParams()
    logits: LogitsParams = PLAIN_LOGITS
    constraint: OutputConstraint | None = None  # structured output; the tokenizer compiles it (then None)
    priority: int = 0  # lower runs first under --scheduling-policy priority (SCHEDULING.md section 8)
    speculative: bool = True  # False: never speculate for it (the request's "speculative": false)
    adapter: int = 0  # its LoRA adapter (`shared.lora`: the index of --lora-modules' entry + 1; 0: the base model)
    pooling: PoolingParams | None = None  # a pooling request (the pooling runner); None: generation


DEFAULT_PARAMS: RequestParams = RequestParams()  # annotated: SlotStart's default reads it before its definition
TOOL_CHOICES = ("none", "auto", "required")


class GenerateRequest(msgspec.Struct, tag=True, kw_only=True):
    """api -> tokenizer. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    rid: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # chat: the tokenizer applies the chat template
    # Chat only: functions the model may call (given to the chat template), and whether it must:
    # `tool_choice` is one of TOOL_CHOICES; `forced_tool` names the one function it must call.
    # "required" and `forced_tool` constrain the output to one call by grammar; "none" hides the tools.
    tools: list[ToolFunction] = []
    tool_choice: str = "auto"
    forced_tool: str | None = None
    chat_template_kwargs: dict[str, Any] = {}  # extra variables for the chat template (enable_thinking, ...)
    params: RequestParams = DEFAULT_PARAMS
    arrival_time: float = 0.0  # time.time() at the api
    # The field `params.stop.max_tokens` came from (chat: max_completion_tokens or max_tokens), so that the
    # tokenizer's refusal names the one the client sent.
    max_tokens_param: str = "max_tokens"
    # A cross-encoder's pair (`/v1/score`, `/v1/rerank`): the second text, tokenized with `prompt` as the
    # model's tokenizer joins a pair ([CLS] prompt [SEP] prompt_pair [SEP]).
    prompt_pair: str | None = None


class AbortRequest(msgspec.Struct, tag=True, kw_only=True):
    """Cancel `rid` wherever it is (api -> tokenizer -> scheduler)."""

    rid: str


class TokenizedRequest(msgspec.Struct, tag=True, kw_only=True):
    """tokenizer -> scheduler."""

    rid: str
    prompt_ids: np.ndarray  # [prompt_len] int32
    params: RequestParams  # settled: stop.max_tokens is an int, a constraint compiled into logits.grammar
    arrival_time: float = 0.0


class RequestRejected(msgspec.Struct, tag=True, kw_only=True):
    """tokenizer or scheduler -> api: the request cannot run (HTTP 400 / 503)."""

    rid: str
    status: int  # HTTP status the api answers with
    message: str
    param: str | None = None


# Prompt ids decoded in front of the generated ones, so that the first generated token is decoded in
# context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): `TokenDelta.prompt_tail`'s length.
PROMPT_TAIL_TOKENS = 5


class TokenDelta(msgspec.Struct, tag=True, kw_only=True):
    """scheduler -> detokenizer: new tokens of one request (and its end, if `finish_reason` is set)."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # With "abort": why the request failed (its output constraint could not be held), for the api's error.
    error: str | None = None
    error_param: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total generated so far
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # speculative decoding so far: draft tokens its rows carried, and those verification accepted
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Set on a request's first delta only, for the detokenizer's per-request state:
    stop: StopParams | None = None  # its stop strings (`stop.stop`)
    prompt_tail: list[int] = []  # the prompt's last few ids: context for decoding the first tokens
    logprobs: list[TokenLogprobs] = []  # one per token of token_ids, when the request asked for logprobs
    # First delta only, when the request asked for prompt logprobs: every prompt id, and the
    # logprobs of prompt tokens 1.. (token 0 has none).
    prompt_ids: list[int] = []
    prompt_logprobs: list[TokenLogprobs] = []
    # A pooling request's last delta: its vector, float32 little-endian bytes as the model pooled it (the
    # api cuts and normalises it, `shared.pooling`); its token_ids are empty.
    pooled: bytes = b""


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those whose KV came from the prefix cache
    # speculative decoding: draft tokens proposed for it, and those accepted (OpenAI's predicted outputs'
    # accepted_prediction_tokens / rejected_prediction_tokens)
    draft_tokens: int = 0
    accepted_tokens: int = 0


class TopLogprob(msgspec.Struct, array_like=True):
    token: str  # the token's own text (decoded alone)
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True):
    """A token with its text, its logprob (None for a prompt's first token) and the top alternatives."""

    token: str
    token_id: int
    logprob: float | None
    top: list[TopLogprob] = []


class TextDelta(msgspec.Struct, tag=True, kw_only=True):
    """detokenizer -> api: new text of one request; the last one carries `finish_reason` and `usage`."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = []  # one per token of token_ids, when asked for
    # First delta only, when prompt logprobs were asked for (echo): the prompt's text and its tokens.
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] = []
    pooled: bytes = b""  # a pooling request's vector (`TokenDelta.pooled`), on its last delta


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    """scheduler -> api (for /metrics), sent after steps (at most every ~100 ms) and when idle."""

    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    kv_request_pages_max: int = 0  # the most KV pages one decoding request holds now
    model_weight_bytes: int = 0  # the worker's weights (`WorkerInfo.weight_bytes`)
    batch_sizes: list[int] = []  # requests per step since the previous stats message
    # seconds each request admitted since then waited in the queue (arrival here to its first admission)
    queue_times: list[float] = []
    # prefix cache: counters since the previous stats message, then the cache's size now
    cache_hit_tokens: int = 0
    cache_queried_tokens: int = 0
    cache_evicted_pages: int = 0
    cache_pages: int = 0
    cache_referenced_pages: int = 0
    preemptions: int = 0  # requests preempted since the previous stats message
    steps_target_out_of_reach: int = 0  # steps since then whose decodes alone took the step-time target
    kv_reserve_ratio: float = 1.0  # the scheduler's configured ratio (procs/scheduler/SCHEDULING.md's rho)
    # speculative decoding since then: decode rows with a draft, their draft tokens, the accepted ones
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    # LoRA: the adapters (indices, `shared.lora`) of the requests running and of those waiting, now
    running_adapters: list[int] = []
    waiting_adapters: list[int] = []
    spec_accepted_tokens: int = 0
    # mixture of experts: tokens routed to each expert of each MoE layer [layers, experts] since then
    expert_load: np.ndarray | None = None
    view: SchedulerView | None = None  # the live view's (`/dashboard`): requests, slots, pages, steps since then
