"""A draft model (`--draft-model`): a small model with the target's tokenizer that guesses
the next tokens greedily, for the drafts the conversation's own history has none of.

Each conversation gets its own draft cache (mlx-lm's KVCache, which trims exactly), kept
on its Session and synced to its tokens before each draft: what the target refused is
trimmed away, what it took and drew is fed. The draft cache never holds more than
`window` tokens: past that it restarts from the conversation's last `window / 2`, so a
conversation's memory stays bounded whatever its length (a draft needs the recent
context, not the whole). It is never spilled: a restored session's is rebuilt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

DRAFT_WINDOW = 2048  # tokens a conversation's draft cache holds at most
PREFILL_STEP = 512


class DraftModelError(ValueError):
    """The draft model cannot serve this target (its tokenizer, its caches)."""


@dataclass
class DraftState:
    """One conversation's draft cache: the tokens it holds, from `start` in the history."""

    caches: list
    start: int = 0
    tokens: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(self, model, tokenizer, target_tokenizer, cost: float, window: int = DRAFT_WINDOW):
        """`cost`: one draft pass's cost in target passes (the weights' bytes' ratio)."""
        if tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise DraftModelError("the draft model's tokenizer is not the target model's")
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise DraftModelError(
                "the draft model has layers whose cache cannot give tokens back (sliding "
                "windows, recurrent state): use a plain attention model"
            )
        self.model, self.cost, self.window = model, cost, window

    def propose(
        self, state: DraftState | None, history: Sequence[int], k: int
    ) -> tuple[list[int], DraftState]:
        """(k tokens the draft model takes greedily after `history`, its state now)."""
        kept = None if state is None else self._held(state, history)
        if (
            kept is None
            or len(history) - state.start - kept > self.window // 2  # much to feed: restart
            or len(history) - state.start + k > self.window
        ):
            start = max(0, len(history) - self.window // 2)
            state, kept = DraftState(make_prompt_cache(self.model), start), 0
        recent = history[state.start :]
        kept = min(kept, len(recent) - 1)  # the last token's logits are needed: fed again
        for c in state.caches:
            c.trim(len(state.tokens) - kept)
        state.tokens = state.tokens[:kept]
        drafts, pending = [], list(recent[kept:])
        while len(drafts) < k:
            while len(pending) > PREFILL_STEP:
                self.model(mx.array(pending[:PREFILL_STEP])[None], cache=state.caches)
                mx.eval([c.state for c in state.caches])
                state.tokens += pending[:PREFILL_STEP]
                pending = pending[PREFILL_STEP:]
            logits = self.model(mx.array(pending)[None], cache=state.caches)[0, -1]
            state.tokens += pending
            drafts.append(mx.argmax(logits).item())
            pending = drafts[-1:]
        return drafts, state

    @staticmethod
    def _held(state: DraftState, history: Sequence[int]) -> int | None:
        """How many of `history`'s tokens from `state.start` the state holds (None: none,
        the history is shorter than its start)."""
        if len(history) <= state.start:
            return None
        recent = history[state.start :]
        n = min(len(state.tokens), len(recent))
        return next((i for i in range(n) if state.tokens[i] != recent[i]), n)
