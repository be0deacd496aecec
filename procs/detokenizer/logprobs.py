"""Token ids with logprobs (`TokenLogprobs`, from the scheduler) -> the same with each token's text
(`TokenLogprob`, for the api). A token's text is its own decode, special tokens included, as
vLLM reports them; texts are cached per id, since the same few tokens come back again and again."""

from __future__ import annotations

from batchserve.procs.detokenizer.incremental import make_decode
from batchserve.shared.messages import TokenLogprob, TokenLogprobs, TopLogprob

_CACHE_LIMIT = 1 << 16


class LogprobTexts:
    def __init__(self, tokenizer: object) -> None:
        self._decode = make_decode(tokenizer, skip_special_tokens=False)
        self._texts: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if len(self._texts) >= _CACHE_LIMIT:
                self._texts.clear()
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def convert(self, entries: list[TokenLogprobs]) -> list[TokenLogprob]:
        return [
            TokenLogprob(
                token=self.token(e.token_id),
                token_id=e.token_id,
                logprob=e.logprob,
                top=[TopLogprob(self.token(t), t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)],
            )
            for e in entries
        ]

    def prompt(self, prompt_ids: list[int], entries: list[TokenLogprobs]) -> tuple[str, list[TokenLogprob]]:
        """The prompt's text, and its tokens: the first without a logprob, the rest with theirs."""
        first = TokenLogprob(token=self.token(prompt_ids[0]), token_id=prompt_ids[0], logprob=None)
        return self._decode(prompt_ids), [first, *self.convert(entries)]
