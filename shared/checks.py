"""Request checks made in more than one place, written once: the api and `batchserve generate` check
sampling parameters with `check_sampling`. (`max_tokens` is settled in one place, the tokenizer:
`procs.tokenizer.prompts.settle_max_tokens`.)

Also every limit on what a request may ask for, as named constants (stop sequences, grammar sizes
and repetition bounds: `shared.grammar` checks those), and the bound on a prompt's length in
characters that proves it cannot fit the context (`max_token_chars`, `max_prompt_chars`), which
the api checks before a prompt is sent to the tokenizer and the tokenizer before tokenizing it.

A refusal is a `Refusal` (400) naming the request field.
"""

from __future__ import annotations

from pathlib import Path

from batchserve.shared.errors import Refusal
from batchserve.shared.messages import GenerateRequest

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 arrays
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a 32-bit integer, as vLLM's (lower first)


def check_sampling(
    temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None, flag: str = ""
) -> None:
    """vLLM's ranges; `flag` prefixes the names in messages (`--` for the CLI's flags)."""
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise Refusal(f"{flag}temperature must be in [0, {MAX_TEMPERATURE:g}] (got {temperature})", "temperature")
    if not (0.0 < top_p <= 1.0):
        raise Refusal(f"{flag}top_p must be in (0, 1] (got {top_p})", "top_p")
    if top_k == 0 or top_k < -1 or top_k > MAX_TOKEN_ID:
        raise Refusal(f"{flag}top_k must be -1 (off) or >= 1 (got {top_k})", "top_k")
    if not (0.0 <= min_p <= 1.0):
        raise Refusal(f"{flag}min_p must be in [0, 1] (got {min_p})", "min_p")
    if seed is not None and not (0 <= seed <= MAX_SEED):
        raise Refusal(f"{flag}seed must be in [0, 2**63 - 1] (got {seed})", "seed")


def check_priority(priority: int) -> None:
    """A request's `priority`: a 32-bit integer (a bigger one cannot travel in a message)."""
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise Refusal(f"priority must be a 32-bit integer, in [-2**31, 2**31 - 1] (got {priority})", "priority")


# ---- limits on what a request may ask for (the "Limits" table of docs/api.md lists these)

# Stop strings: OpenAI allows 4; vLLM, SGLang and llama.cpp's server set no limit. lm-evaluation-harness
# sends a handful (its `until`), agent frameworks a few markers: 32 of up to 512 characters each is far
# above what clients send, and bounds the detokenizer's per-token matching and held-back text.
MAX_STOP_SEQUENCES = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids: checked against every sampled token

# Structured output, checked before anything is compiled. llguidance bounds the grammar itself
# (`LLParserLimits`: grammar size, lexer fuel and states) but expands regex repetitions lazily, while
# generating: `(a{1,100}){1,100}` passes its validation and fails ("too many expressions") after ~20
# tokens, leaving the rest of the answer unconstrained. So repetition bounds are checked here, as
# llama.cpp does for its grammars (MAX_REPETITION_THRESHOLD 2000, the product of nested repetitions).
MAX_GRAMMAR_CHARS = 128 * 1024  # a JSON schema (as JSON text), a Lark grammar, guided_choice's JSON
MAX_REGEX_CHARS = 16 * 1024  # guided_regex, and each regex in a schema ("pattern") or a Lark grammar
MAX_REGEX_REPEAT = 10_000  # any one repetition bound: {m,n}, Lark's ~ n..m
MAX_NESTED_REPEAT = 2_000  # the product of the bounds of repetitions nested in one another


def check_stop(stop: tuple[str, ...], stop_token_ids: tuple[int, ...]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise Refusal(f"stop may hold at most {MAX_STOP_SEQUENCES} strings (got {len(stop)})", "stop")
    for s in stop:
        if s == "":
            raise Refusal("stop strings must not be empty", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise Refusal(f"each stop string may be at most {MAX_STOP_CHARS} characters (got {len(s)})", "stop")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise Refusal(
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids (got {len(stop_token_ids)})", "stop_token_ids"
        )
    if any(not 0 <= t <= MAX_TOKEN_ID for t in stop_token_ids):
        raise Refusal(f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]", "stop_token_ids")


# ---- prompts too long to fit, known from their length in characters

# NFC/NFKC compose up to 4 code points into one (U+1F82 is 4 in NFD): a normalized text is at least
# a quarter of the characters it came from.
_NFC_SHRINK = 4
_SAFE_NORMALIZERS = frozenset({"NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Prepend", "Replace"})
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"})


def _parts(component: dict | None, kind: str) -> list[dict] | None:
    """The steps of a normalizer or pre-tokenizer (a Sequence flattened); None: one we cannot vouch for."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        out: list[dict] = []
        for step in component.get(kind, []):
            sub = _parts(step, kind)
            if sub is None:
                return None
            out.extend(sub)
        return out
    return [component]


def max_token_chars(tokenizer_json: str) -> int | None:
    """The most characters of input text one token can stand for, from a `tokenizer.json`; None when
    the tokenizer can make text vanish (so no character count bounds its tokens from below).

    A token covers at most as many input characters as its string has: a byte-level token has one
    character per byte, a SentencePiece token one per character ("▁" is one space), byte fallback
    "<0x41>" six for one byte, an added token its content. That holds for BPE models whose
    normalizer and pre-tokenizer drop nothing: normalizers that only map characters to one or more
    characters (NFC/NFKC may also compose up to 4 into one: counted), and pre-tokenizers that only
    split. Dropping whitespace (BERT's Whitespace split), stripping, collapsing whitespace or fusing
    a run of unknown characters into one token all make text vanish: None.
    """
    import json

    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    normalizers = _parts(spec.get("normalizer"), "normalizers")
    pre_tokenizers = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if normalizers is None or pre_tokenizers is None:
        return None
    if any(n.get("type") not in _SAFE_NORMALIZERS for n in normalizers):
        return None
    for n in normalizers:  # Replace must map a string to one at least as long: SentencePiece's " " -> "▁"
        if n.get("type") == "Replace":
            pattern = (n.get("pattern") or {}).get("String")
            if pattern is None or len(n.get("content", "")) < len(pattern):
                return None
    if any(p.get("type") not in _SAFE_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre_tokenizers):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
    if model.get("unk_token") is not None and model.get("fuse_unk") and not (byte_level or model.get("byte_fallback")):
        return None
    longest = max((len(token) for token in model.get("vocab") or {}), default=1)
    longest = max([longest, *(len(t.get("content", "")) for t in spec.get("added_tokens") or [])])
    if any(n.get("type") in ("NFC", "NFKC") for n in normalizers):
        longest *= _NFC_SHRINK
    return max(longest, 1)


def model_token_chars(model_dir: Path) -> int | None:
    """`max_token_chars` of a model folder's tokenizer.json, with the added tokens its
    tokenizer_config.json declares besides (transformers adds those when it loads the tokenizer);
    None without a tokenizer.json. For a process that does not load the tokenizer (the api)."""
    import json

    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if not tokenizer_json.is_file():
        return None
    token_chars = max_token_chars(tokenizer_json.read_text())
    config = Path(model_dir) / "tokenizer_config.json"
    if token_chars is not None and config.is_file():
        added = json.loads(config.read_text()).get("added_tokens_decoder") or {}
        token_chars = max([token_chars, *(len(t.get("content", "")) for t in added.values() if isinstance(t, dict))])
    return token_chars


def max_prompt_chars(max_context: int, token_chars: int | None) -> int | None:
    """The longest prompt text, in characters, that can still fit the context: a longer one has at
    least `max_context` tokens (none of which covers more than `token_chars` characters), so
    the tokenizer's `settle_max_tokens` would refuse it. None: no such bound is known."""
    return None if token_chars is None else max(max_context - 1, 0) * token_chars


def check_prompt_chars(chars: int, limit: int | None, max_context: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt whose `chars` characters prove it cannot fit (`limit`:
    `max_prompt_chars`)."""
    if limit is not None and chars > limit:
        raise Refusal(
            f"This model's maximum context length is {max_context} tokens; this prompt's {chars} "
            f"characters are at least {max_context} tokens, which leaves no room for a completion.",
            param,
        )


def prompt_chars(request: GenerateRequest) -> tuple[int, str]:
    """The characters of a request's prompt that its tokens must cover, and the field they are in.
    A chat counts its system, user and tool messages: templates render those whole, while some
    leave out parts of earlier assistant turns (Qwen3 drops their thinking). Token ids count 0."""
    if request.messages is not None:
        return sum(len(m.content or "") for m in request.messages if m.role != "assistant"), "messages"
    return len(request.prompt or ""), "prompt"


def check_prompt_size(request: GenerateRequest, limit: int | None, max_context: int) -> None:
    """`check_prompt_chars` for a request (`limit`: `max_prompt_chars`)."""
    chars, param = prompt_chars(request)
    check_prompt_chars(chars, limit, max_context, param)
