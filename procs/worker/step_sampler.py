"""`StepSampler`: a step's logits into its tokens, on the rank that samples (rank 0 of `ModelRunner`).

Each slot's penalties, `logit_bias` and bans adjust its rows' logits (`SlotLogitsState`, grammar masks
last), one logit row per sampled position; every position draws its token; a row that carried a draft is
verified (`SampleRows.accepted`: by rejection sampling where the draft model drew a token from its
distribution, else by an exact match), and only the tokens verification keeps reach the penalty counts
and grammar matchers. Logprobs, the sampled tokens' and the prompt's, come from the logits as the model
gave them. The sampler also keeps each slot's last sampled token, which a `FUTURE_TOKEN` input (a decode
the scheduler planned before that token reached it) is fed.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from batchserve.kernels.sampling import rejection_sample, sample_batch, sample_with_scores, speculative_noise
from batchserve.procs.worker.logits_state import SlotLogitsState
from batchserve.procs.worker.sample_rows import SampleRows
from batchserve.procs.worker.step_hooks import RowDistributions, VerifiesRows
from batchserve.shared.messages import (
    FUTURE_TOKEN,
    ForwardBatch,
    SamplingParams,
    SlotStart,
    StepResult,
    TokenLogprobs,
)

# A step's prefill chunks that want prompt logprobs: (slot, prompt positions, packed token rows) each
PromptChunks = list[tuple[int, range, np.ndarray]]


class StepSampler:
    """Samples the steps of one runner's slots (see the module's docstring); `verifier`: the feature whose
    proposals the rows carry, with the distributions it drew them from, told what verification accepted
    (None: proposals are one token for sure, prompt lookup's)."""

    def __init__(
        self,
        logits_state: SlotLogitsState,
        max_running_requests: int,
        device: torch.device,
        verifier: VerifiesRows | None,
    ) -> None:
        self.logits_state = logits_state
        self.device = device
        self.verifier = verifier
        self.last_sampled = np.zeros(max_running_requests, dtype=np.int32)  # what FUTURE_TOKEN inputs feed

    def start(self, slot_starts: Sequence[SlotStart]) -> None:
        """The step's new requests: their slots' sampling state."""
        for start in slot_starts:
            self.logits_state.start(start)

    def fill_future_tokens(self, batch: ForwardBatch) -> ForwardBatch:
        """Feed each `FUTURE_TOKEN` input (a decode planned before its token reached the scheduler; only
        ever first in a row) the token this worker sampled last for the slot."""
        ids = batch.input_ids
        extend_lens = np.asarray(batch.extend_lens, dtype=np.int64)
        firsts = np.cumsum(extend_lens) - extend_lens
        future = ids[firsts] == FUTURE_TOKEN
        if not future.any():
            return batch
        ids = ids.copy()  # the batch's arrays are views of the scheduler's shared memory
        ids[firsts[future]] = self.last_sampled[np.asarray(batch.slots, dtype=np.int64)[future]]
        return msgspec.structs.replace(batch, input_ids=ids)

    def prompt_rows(self, batch: ForwardBatch) -> tuple[PromptChunks, np.ndarray | None]:
        """The step's prefill chunks that want prompt logprobs, and the packed token rows whose logits they
        need after the sampled positions' (None: none)."""
        chunks = self.logits_state.prompt_logprob_chunks(batch.slots, batch.prefix_lens, batch.extend_lens)
        return chunks, np.concatenate([rows for _, _, rows in chunks]) if chunks else None

    def sample(
        self,
        batch: ForwardBatch,
        logits: torch.Tensor,
        prompt_chunks: PromptChunks,
        result: StepResult,
    ) -> None:
        """Into `result`: the prompt logprobs of `prompt_chunks` (their rows' logits follow the sampled
        positions'), the sampled tokens with their logprobs, and, where rows carried drafts, how many tokens
        of each verification accepted; then count the tokens kept and note each slot's last one."""
        num_sampled = batch.num_sampled
        if prompt_chunks:
            result.prompt_logprobs = self.logits_state.chunks_prompt_logprobs(prompt_chunks, logits[num_sampled:])
        if not num_sampled:
            return
        rows = SampleRows.of_batch(batch)
        sampling = [p for p, n in zip(batch.sampling, batch.sample_lens) for _ in range(n)]
        drafts = None if self.verifier is None else self.verifier.distributions
        token_ids, result.logprob_rows, result.logprobs = self._sample(logits[:num_sampled], sampling, rows, drafts)
        result.next_token_ids = token_ids.to(torch.int32).cpu().numpy()
        kept_rows, kept = rows, None
        if rows.width > 1:  # proposed tokens: keep what verification accepts (speculative decoding)
            accepted = rows.accepted(result.next_token_ids)
            result.accepted_lens = accepted.tolist()
            kept_rows, kept = rows.kept(accepted)
            if self.verifier is not None:
                self.verifier.verified(batch, accepted)
        self.logits_state.record(
            kept_rows,
            token_ids if kept is None else token_ids.index_select(0, torch.from_numpy(kept).to(self.device)),
        )
        lasts = rows.firsts + kept_rows.lens - 1
        self.last_sampled[rows.slots[lasts]] = result.next_token_ids[lasts]
        if self.logits_state.grammars is not None:  # matchers advanced by `record` (or replayed at start)
            result.grammar_failures = self.logits_state.grammars.take_failures()

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: list[SamplingParams],
        rows: SampleRows,
        drafts: RowDistributions | None = None,
    ) -> tuple[torch.Tensor, list[int], list[TokenLogprobs]]:
        """Adjust (penalties, bias, bans) and sample, one logit row per sampled position; logprobs from
        the logits as the model gave them. The caller counts the tokens it keeps. `drafts`: where a
        proposed token was drawn from a draft distribution, the position before it samples by rejection
        (`kernels.sampling.rejection_sample`); every other proposed token is one token for sure (prompt
        lookup, or a greedy draft), which sampling then verifies as it is (`shared.verification`)."""
        state = self.logits_state
        wanted = state.logprob_rows(rows.slots)
        row_index = torch.from_numpy(wanted).to(self.device) if wanted.shape[0] else None
        raw = None if row_index is None else torch.log_softmax(logits[row_index], dim=-1)
        state.adjust_(logits, rows)
        if drafts is None:
            token_ids = sample_batch(logits, sampling, rows.counts.tolist())
        else:
            token_ids, scores = sample_with_scores(logits, sampling, rows.counts.tolist())
            assert scores is not None  # drafts are sampled rows' only
            token_ids = self._rejection_sample(scores, rows, drafts, token_ids)
        if raw is None:
            return token_ids, [], []
        return token_ids, wanted.tolist(), state.sampled_logprobs(raw, token_ids[row_index], rows.slots[wanted])

    def _rejection_sample(
        self, scores: torch.Tensor, rows: SampleRows, drafts: RowDistributions, token_ids: torch.Tensor
    ) -> torch.Tensor:
        """`token_ids` with the positions `drafts` names sampled by rejection against their draft
        distributions (`scores`: the filtered scores the positions were sampled from)."""
        at = drafts.positions
        index = torch.from_numpy(at).to(self.device)
        target = scores.index_select(0, index).softmax(dim=-1)
        uniform, log_noise = speculative_noise(at.shape[0], scores.shape[1], self.device)
        proposed = torch.from_numpy(rows.fed[at + 1]).to(self.device)  # a named position is never a row's last
        return token_ids.index_copy(0, index, rejection_sample(target, drafts.probs, proposed, uniform, log_noise))
