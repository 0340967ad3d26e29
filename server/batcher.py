"""Rounds of work for every active generation: one batched decode pass, budgeted prefill.

Each round, on the worker thread:
1. every decoding generation feeds its next input in ONE forward pass (several
   sessions' caches as one batch, cache/batch.py: the weights are read once for
   all rows) and draws its next token lazily, launched with `mx.async_eval`;
2. while that computes, prompts are prefilled, at most `prefill_budget` tokens
   this round when anyone is decoding (`prefill_step` when nobody is), so a
   decoding stream never waits for a whole long prompt. Chunks are whole
   `prefill_step` pieces of a request's prompt, never cut by the budget: H2O
   evicts after each chunk, so a request's cache must not depend on the load;
3. last round's draws, which were this round's inputs, are read and become
   the replies' Deltas (building a step while the previous one computes is what
   mlx-lm's generate_step does too).
A generation whose sampling, reading or prefill raises fails alone; a forward
pass that raises fails the rows it carried.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from cache import install_router
from cache.batch import batch_caches
from server.generation import Generation
from server.jobs import Delta

log = logging.getLogger("h2o_server.batcher")


@dataclass
class Round:
    """What one round did: per generation a Delta or the exception it failed with."""

    outcomes: list[tuple[Generation, Delta | Exception]] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seconds: float = 0.0


class Batcher:
    def __init__(self, model, prefill_step: int, prefill_budget: int):
        self.model = model
        self.prefill_step = prefill_step
        self.prefill_budget = prefill_budget
        self.batched = can_batch(model)  # else one forward pass per decoding row

    def run(self, gens: list[Generation]) -> Round:
        done = Round()
        decoding = [g for g in gens if not g.prefilling]
        t0 = time.perf_counter()
        decoding, draws = self._decode(decoding, done) if decoding else ([], [])
        t1 = time.perf_counter()
        budget = self.prefill_budget if decoding else self.prefill_step
        done.prefill_tokens = self._prefill([g for g in gens if g.prefilling], budget, done)
        t2 = time.perf_counter()
        for g, draw in zip(decoding, draws, strict=True):
            if g.sampled is not None:
                try:
                    done.outcomes.append((g, g.read()))
                except Exception as e:  # this request's tokenizer or logprobs: it alone fails
                    done.outcomes.append((g, e))
                    continue
            if not g.done:
                g.sampled, g.next_input = draw, draw[0]
        done.decode_seconds = (t1 - t0) + (time.perf_counter() - t2)
        return done

    def _decode(self, rows: list[Generation], done: Round) -> tuple[list, list]:
        """One forward pass feeding every row's next input; (rows still going, their draws)."""
        try:
            inputs = mx.concatenate([g.input_array() for g in rows])[:, None]
            for g in rows:
                g.fed()
            logits = self._forward(inputs, [g.session.caches for g in rows])
        except Exception as e:  # the pass itself: every row it carried
            done.outcomes += [(g, e) for g in rows]
            return [], []
        draws = []
        for i, g in enumerate(rows):
            try:
                draws.append(g.sample(logits[i : i + 1]))
            except Exception as e:  # this request's processors or sampler
                done.outcomes.append((g, e))
                draws.append(None)
        kept = [(g, d) for g, d in zip(rows, draws, strict=True) if d is not None]
        mx.async_eval([x for _, d in kept for x in d])
        return [g for g, _ in kept], [d for _, d in kept]

    def _forward(self, inputs: mx.array, sessions: list[list]) -> mx.array:
        """Last-position logits [rows, vocab] of one token per session."""
        if len(sessions) == 1:
            return self.model(inputs, cache=sessions[0])[:, -1, :]
        if self.batched:
            return self.model(inputs, cache=batch_caches(sessions))[:, -1, :]
        rows = [self.model(inputs[i : i + 1], cache=c)[:, -1, :] for i, c in enumerate(sessions)]
        return mx.concatenate(rows, axis=0)

    def _prefill(self, gens: list[Generation], budget: int, done: Round) -> int:
        """Whole prompt chunks in admission order while they fit `budget` (at least one)."""
        fed = 0
        for g in gens:
            while g.prefilling:
                n = g.next_chunk(self.prefill_step)
                if fed and fed + n > budget:
                    return fed
                try:
                    fed += g.prefill(self.model, self.prefill_step)
                except Exception as e:
                    done.outcomes.append((g, e))
                    break
        return fed


def can_batch(model) -> bool:
    """Whether this model's attention takes BatchedCaches (it goes through the router).

    Traces, never evaluates, one batched step over two fresh caches.
    """
    install_router(model)
    try:
        rows = [make_prompt_cache(model) for _ in range(2)]
        model(mx.zeros((2, 1), dtype=mx.int32), cache=batch_caches(rows))
    except Exception as e:  # e.g. attention that calls mx.fast directly
        log.warning("this model's attention cannot batch sessions (%s): one pass per row", e)
        return False
    return True
