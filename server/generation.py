"""One request's generation, advanced one unit of work at a time by the worker.

A unit is one prefill chunk or one decoded token, so the worker can interleave
many requests step by step. The session's `tokens` always equal what its
caches hold: a generation stopped at any step (finished, cancelled, failed)
leaves a consistent conversation behind.
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from server.jobs import Delta, Finished, SamplingParams, TokenLogprob
from server.sessions import Session

PENALTY_CONTEXT = 64  # tokens the presence/frequency penalties look back on


def make_request_sampler(temperature: float, top_p: float, min_p: float, seed: int | None):
    """mlx-lm's top-p/min-p filters, then sampling from this request's own random key.

    A key per request (not MLX's global one) keeps a seeded request reproducible
    while other requests are interleaved with it.
    """
    if temperature == 0:
        return greedy_sampler
    key = mx.random.key(secrets.randbits(62) if seed is None else seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=draw)

    return sample


def stop_holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopText:
    """A reply's text as it grows: cut at the first stop string, sent only when safe.

    Text that could still grow into a stop string is held back until it cannot,
    so a client never sees part of a stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text, self.sent = "", 0  # the reply so far; how much of it was released
        self.stopped = False  # a stop string was found (the reply ends before it)

    def add(self, piece: str, final: bool = False) -> str:
        """Append `piece`; return the newly releasable text (all of it when `final`)."""
        self.text += piece
        if self.stops:
            start = max(0, self.sent - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        end = len(self.text)
        if self.stops and not (final or self.stopped):
            end -= stop_holdback(self.text, self.stops)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


class Generation:
    def __init__(
        self,
        model,
        tokenizer,
        session: Session,
        prompt: list[int],
        reused: int,
        params: SamplingParams,
        prefill_step: int,
    ):
        self.model, self.tokenizer, self.session = model, tokenizer, session
        self.prompt, self.reused, self.params = prompt, reused, params
        self.prefill_step = prefill_step
        self.pending = prompt[reused:]  # fed to the model next (the last one yields logits)
        self.generated: list[int] = []
        self.reply = StopText(params.stop)
        self.finish_reason: str | None = None
        self.detokenizer = tokenizer.detokenizer
        self.sampler = make_request_sampler(
            params.temperature, params.top_p, params.min_p, params.seed
        )
        self.processors = make_logits_processors(
            params.logit_bias,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=PENALTY_CONTEXT,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=PENALTY_CONTEXT,
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return len(self.pending) > 1

    def step(self) -> Delta | None:
        """Prefill one chunk (returns None) or decode one token (returns its Delta)."""
        caches = self.session.caches
        if self.prefilling:
            chunk = self.pending[: min(self.prefill_step, len(self.pending) - 1)]
            self.model(mx.array(chunk)[None], cache=caches)
            mx.eval([c.state for c in caches])
            self._fed(chunk)
            return None
        fed = self.pending
        logits = self.model(mx.array(fed)[None], cache=caches)[:, -1, :]
        self._fed(fed)
        if self.processors:
            context = mx.array((self.prompt + self.generated)[-PENALTY_CONTEXT:])
            for process in self.processors:
                logits = process(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        mx.eval(token, logprobs)
        return self._accept(token.item(), logprobs[0])

    def _fed(self, tokens: list[int]) -> None:
        """The caches now hold `tokens` (the head of `pending`)."""
        self.session.tokens.extend(tokens)
        self.pending = self.pending[len(tokens) :]

    def _accept(self, token: int, logprobs: mx.array) -> Delta:
        self.generated.append(token)
        self.pending = [token]
        delta = Delta()
        if self.params.logprobs is not None:
            delta.logprobs.append(self._logprob(token, logprobs))
        piece = ""
        if token in self.tokenizer.eos_token_ids:
            self.finish_reason = "stop"
        else:
            self.detokenizer.add_token(token)
            piece = self.detokenizer.last_segment
            if len(self.generated) >= self.params.max_tokens:
                self.finish_reason = "length"
        if self.finish_reason:
            self.detokenizer.finalize()
            piece += self.detokenizer.last_segment
        delta.text = self.reply.add(piece, final=self.finish_reason is not None)
        if self.reply.stopped:
            self.finish_reason = "stop"
        delta.finish_reason = self.finish_reason
        return delta

    def _logprob(self, token: int, logprobs: mx.array) -> TokenLogprob:
        k = self.params.logprobs or 0
        top: list[tuple[int, float]] = []
        if k:
            ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            values = logprobs[ids]
            top = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda t: -t[1])
        return TokenLogprob(token, logprobs[token].item(), top)

    def finished(self) -> Finished:
        return Finished(len(self.prompt), len(self.generated), self.reused)
