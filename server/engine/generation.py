"""One request's generation: its prompt still to prefill, its sampling, its reply so far.

The worker's Batcher (server/engine/batcher.py) drives it: `prefill` runs prompt
chunks through the session's caches; each decode round the Batcher feeds
`next_input` in one batched forward pass with the other decoding requests,
`sample` draws the next token (lazily: it is read a round later, while the
next round computes), and `accept` turns a read token into the reply's Delta.
`session.tokens` always equals what the caches hold once a round's tokens are
read, so a generation stopped at any round (finished, cancelled, failed)
leaves a consistent conversation behind.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from cache.batching.batch import kv_slab_layer
from cache.contract import draft_room, hold_draft, settle_draft
from server.engine.detokenize import IncrementalText, decoder
from server.engine.draft_model import DraftModel
from server.engine.grammar import Constraint
from server.engine.jobs import Delta, Finished, SamplingParams, TokenLogprob, joined
from server.engine.speculation import Drafter
from server.sessions.conversation import keep_checkpoint
from server.sessions.store import Session

PENALTY_CONTEXT = 64  # tokens the presence/frequency penalties look back on


LOGPROB_FLOOR = -9999.0  # a logprob JSON can carry (vLLM's floor): never -inf


class RequestSampler:
    """mlx-lm's top-k/top-p/min-p filters, then sampling from this request's own random key.

    A key per request (not MLX's global one) keeps a seeded request reproducible
    while other requests are interleaved with it. Choice i > 0 of a request with `n`
    draws from its own key split off the seed's, so each choice is reproducible and
    choice 0 is the reply the same request with n = 1 gets.
    """

    def __init__(
        self,
        temperature: float,
        top_p: float,
        min_p: float,
        seed: int | None,
        choice: int = 0,
        top_k: int = 0,
    ):
        self.temperature, self.top_p, self.min_p, self.top_k = temperature, top_p, min_p, top_k
        self.greedy = temperature == 0
        self.key = None
        if not self.greedy:
            self.key = mx.random.key(secrets.randbits(62) if seed is None else seed)
            if choice:
                self.key = mx.random.split(self.key, choice + 1)[choice]

    def _draw_key(self) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return draw

    def scaled(self, logprobs: mx.array) -> mx.array:
        """The logits a token is drawn from: filtered, over the temperature ([..., vocab])."""
        if 0 < self.top_k < logprobs.shape[-1]:  # k as large as the vocabulary filters nothing
            logprobs = apply_top_k(logprobs, self.top_k)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        return logprobs * (1 / self.temperature)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.greedy:
            return greedy_sampler(logprobs)
        draw = self._draw_key()
        return mx.random.categorical(self.scaled(logprobs), key=draw)

    def verify(self, logprobs: mx.array, drafts: list[int]) -> tuple[int, mx.array]:
        """How many of `drafts` the target takes, and the token drawn after them ([1]).

        `logprobs` [k + 1, vocab]: the target's distribution at each fed position (row i
        predicts what follows drafts[:i]). Greedy: a draft is taken while it is the
        argmax. Sampled: the standard rule for a point-mass draft, which keeps the
        target's distribution exactly: draft x is taken with probability p(x); at the
        first one refused, the token is drawn from p without x, renormalized; after a
        draft taken whole, from the last row.
        """
        k = len(drafts)
        if self.greedy:
            best = mx.argmax(logprobs, axis=-1).tolist()
            taken = next((i for i in range(k) if best[i] != drafts[i]), k)
            return taken, mx.array([best[taken]])
        scaled = self.scaled(logprobs)
        taken = k
        if k:
            p = mx.softmax(scaled[:k], axis=-1)[mx.arange(k), mx.array(drafts)]
            u = mx.random.uniform(shape=(k,), key=self._draw_key())
            refused = (u >= p).tolist()
            taken = next((i for i in range(k) if refused[i]), k)
        row = scaled[taken]
        if taken < k:  # p without the refused draft
            row = mx.where(mx.arange(row.shape[-1]) == drafts[taken], -mx.inf, row)
        return taken, mx.random.categorical(row, key=self._draw_key()).reshape(1)


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
        self.matched: str | None = None  # which one (the earliest in the text)

    def add(self, piece: str, final: bool = False) -> str:
        """Append `piece`; return the newly releasable text (all of it when `final`)."""
        self.text += piece
        if self.stops:
            start = max(0, self.sent - max(len(s) for s in self.stops))
            hits = [(at, s) for s in self.stops if (at := self.text.find(s, start)) >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:at]
                self.stopped = True
        end = len(self.text)
        if self.stops and not (final or self.stopped):
            end -= stop_holdback(self.text, self.stops)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


class Generation:
    def __init__(
        self,
        tokenizer,
        session: Session,
        prompt: list[int],
        reused: int,
        params: SamplingParams,
        prefix_len: int = 0,
        keep_prefix: Callable[[Session], None] | None = None,
        constraint: Constraint | None = None,
        choice: int = 0,
        draft_max: int = 0,
        predicted: list[int] | None = None,
        draft_model: DraftModel | None = None,
    ):
        self.tokenizer, self.session = tokenizer, session
        self.choice = choice  # which of the request's n choices this is
        # A shareable prefix ends here (the system prompt): prefill chunks break at it, and
        # `keep_prefix` gets the session once its caches hold exactly that prefix.
        self.prefix_len, self.keep_prefix = prefix_len, keep_prefix
        self.constraint = constraint  # the grammar the reply follows (server/engine/grammar.py)
        self.prompt, self.reused, self.params = prompt, reused, params
        self.pending = prompt[reused:]  # prompt tokens not yet fed; the last starts decoding
        self.generated: list[int] = []
        self.reply = StopText(params.stop)
        self.finish_reason: str | None = None
        self.text = IncrementalText(decoder(tokenizer), prompt)
        self.sampler = RequestSampler(
            params.temperature, params.top_p, params.min_p, params.seed, choice, params.top_k
        )
        # /v1/completions echo with logprobs: each prompt token's logprob, from the
        # logits of the prefill (the first token has none); None when not asked for.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs and reused == 0 else None
        )
        self.processors = make_logits_processors(
            params.logit_bias,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=PENALTY_CONTEXT,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=PENALTY_CONTEXT,
        )
        # Decoding: the token fed next round (an int, or a sampled array not yet read) and
        # what this round sampled (token, logprobs), read once the next round is launched.
        self.next_input: int | mx.array | None = None
        self.sampled: tuple[mx.array, mx.array] | None = None
        # Speculative decoding (server/engine/speculation.py): None where it is off.
        self.drafter = (
            Drafter(draft_max, predicted or [], draft_model, session) if draft_max else None
        )
        self._start_decoding()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return bool(self.pending)

    # ------------------------------------------------------------------ prefill

    def next_chunk(self, step: int) -> int:
        """Size of the next prefill chunk: `step` tokens, the last one short (all but the
        prompt's last token, which starts decoding).

        Chunks are fixed per request, whatever else the worker is doing, because
        H2O evicts after each chunk: a request prefilled alone or beside others
        keeps the same cache. A chunk never crosses the end of a shareable prefix: a
        conversation forked there (server/sessions/prefixes.py) then takes the same chunks
        as one that prefilled the prefix itself.
        """
        n = min(step, len(self.pending) - 1)
        held = len(self.session.tokens)
        return min(n, self.prefix_len - held) if held < self.prefix_len else n

    def prefill(self, model, step: int) -> int:
        """Feed the next chunk of the prompt (never its last token); return its size."""
        chunk = self.pending[: self.next_chunk(step)]
        caches = self.session.caches
        logits = model(mx.array(chunk)[None], cache=caches)  # lazy: computed only if scored
        mx.eval([c.state for c in caches])
        self.score_prompt(logits[0], len(chunk))
        return self.prefilled(len(chunk))

    @property
    def plain_caches(self) -> bool:
        """Whether every layer is mlx-lm's KVCache or a sink-less sliding window
        (server/engine/batcher.py decodes such sessions in one KVSlab)."""
        return all(kv_slab_layer(c) for c in self.session.caches)

    def prefilled(self, n: int) -> int:
        """The next `n` prompt tokens are in the caches now; return n."""
        self.session.tokens.extend(self.pending[:n])
        self.pending = self.pending[n:]
        if self.keep_prefix and n and len(self.session.tokens) == self.prefix_len:
            self.keep_prefix(self.session)
        self._start_decoding()
        if self.next_input is not None:  # the prompt's end: a point later turns rewind to
            keep_checkpoint(self.session)
        return n

    def _start_decoding(self) -> None:
        """Once one prompt token is left, it is the first decode round's input."""
        if len(self.pending) == 1:
            self.next_input = self.pending.pop()

    # ------------------------------------------------------------------ decode

    def input_array(self) -> mx.array:
        """This round's input token as a [1] array (sampled ones stay lazy)."""
        token = self.next_input
        return mx.array([token]) if isinstance(token, int) else token

    def fed(self) -> int | None:
        """Account for the input this round fed: a known token now, a sampled one once read.

        Returns the token when it was known (the last prompt token).
        """
        if isinstance(self.next_input, int):
            self.session.tokens.append(self.next_input)
            return self.next_input
        return None

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """(token [1], logprobs [vocab]) drawn from logits [1, vocab], lazily.

        The previous round's draw (`sampled`) may still be unread: it is part of
        the penalties' context as an array.
        """
        if self.processors:
            logits = self._processed(logits)
        if self.constraint is not None:
            if self.sampled is not None:  # last round's draw, fed this round: the grammar takes it
                self.constraint.consume(self.sampled[0].item())
            logits = self.constraint.apply(logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs).reshape(1), logprobs[0]

    def read(self) -> Delta:
        """Read last round's draw, which this round fed; it joins the conversation."""
        token_arr, logprobs = self.sampled
        token = token_arr.item()
        self.sampled = None
        self.session.tokens.append(token)
        return self.accept(token, logprobs)

    # ------------------------------------------------------------------ speculation

    @property
    def room(self) -> int:
        """Tokens the reply may still take."""
        return self.params.max_tokens - len(self.generated)

    def expects_drafts(self, rows: int = 1) -> bool:
        """Whether this round should feed a draft (asked once a round, for a row that may
        speculate beside `rows` - 1 others): a grammar may force tokens; else the
        history's suffix recurs. A seeded sampled reply asks as if alone: which rounds
        draft decides which random draws it takes, so the rows beside it must not."""
        if self.drafter is None or self.room < 2:
            return False
        if self.params.seed is not None:
            rows = 1
        found = self.drafter.expects(self.session.tokens, not self.generated, rows)
        return found or self.constraint is not None

    def speculate(self, model) -> Delta | None:
        """One speculative round alone: `propose`, both fed in one forward pass, `verify`.
        Returns the reply's new tokens as one Delta (None when it has none yet: the
        prompt's first round)."""
        delta, tokens, forced = self.propose()
        hold_draft(self.session.caches)
        logits = model(mx.array(tokens)[None], cache=self.session.caches)[0]
        return joined(delta, self.verify(model, logits, tokens[1:], forced))

    def propose(self) -> tuple[Delta | None, list[int], int]:
        """Read last round's draw (it is this round's input) and draft what may follow it:
        (the Delta read, or None on the prompt's first round; the tokens to feed: the
        input, then the drafts; how many drafts the grammar forces)."""
        delta = None
        if self.sampled is not None:
            delta = self.read()
            token = self.session.tokens[-1]  # the draw read() took in
            if self.constraint is not None and not self.done:
                self.constraint.consume(token)
            self.next_input = token
        else:
            self.fed()  # the prompt's last token
        drafts, forced = [], 0
        if not self.done:
            room = min(self.room - 1, draft_room(self.session.caches))
            drafts, forced = self.drafter.draft(
                self.session.tokens, self.constraint, room, opening=not self.generated
            )
        return delta, [self.next_input, *drafts], forced

    def verify(self, model, logits: mx.array, drafts: list[int], forced: int = 0) -> Delta | None:
        """The pass that fed this round's input and `drafts` (its caches held:
        `hold_draft`) gave `logits` [k + 1, vocab]: keep the drafted tokens the model takes
        (RequestSampler.verify); the caches give back the rest (cache/contract.py
        `settle_draft`: as if never fed), and the grammar forgets them. The token drawn
        after the kept ones is this generation's next input, as a plain round's draw. The
        first `forced` drafts are the grammar's (always taken: not counted against the
        draft length). Recurrent layers that refused a token go back to before the pass,
        and `model` takes the kept tokens again (`_replay`)."""
        caches = self.session.caches
        if self.done:  # the input ended the reply: fed so the caches hold what the tokens say
            self._replay(model, settle_draft(caches, len(drafts) + 1, 1), 1)
            mx.eval([c.state for c in caches])
            return None
        rows, consumed = self._draft_rows(logits, drafts)
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        taken, draw = self.sampler.verify(logprobs, drafts)
        delta, kept = None, 0
        while kept < taken and not self.done:
            piece = self.accept(drafts[kept], logprobs[kept])
            delta = piece if delta is None else delta.join(piece)
            kept += 1
        replay = settle_draft(caches, len(drafts) + 1, kept + 1)
        self.session.tokens.extend(drafts[:kept])
        self._replay(model, replay, kept + 1)
        if self.constraint is not None and consumed > kept:
            self.constraint.rollback(consumed - kept)
        self.drafter.took(len(drafts), kept, forced)
        if self.done:
            self.sampled = None
        else:
            self.sampled, self.next_input = (draw, logprobs[taken]), draw
        return delta

    def _replay(self, model, replay: bool, n: int) -> None:
        """Where the caches went back to before a verify pass (`settle_draft`: recurrent
        layers), feed its `n` kept tokens (the conversation's last) again."""
        if replay:
            model(mx.array(self.session.tokens[-n:])[None], cache=self.session.caches)

    def _draft_rows(self, logits: mx.array, drafts: list[int]) -> tuple[mx.array, int]:
        """The logits [k + 1, vocab] each position draws from (penalties over the drafts
        before it, the grammar's mask after them), and how many drafts the grammar took in
        (it stops at one it refuses: that draft is refused, so later rows go unread)."""
        rows = [logits[i : i + 1] for i in range(len(drafts) + 1)]
        if self.processors:
            rows = [self._processed(row, drafts[:i]) for i, row in enumerate(rows)]
        consumed = 0
        if self.constraint is not None:
            for i, row in enumerate(rows):
                rows[i] = self.constraint.apply(row)
                if i == len(drafts) or not self.constraint.advance(drafts[i]):
                    break
                consumed += 1
        return mx.concatenate(rows), consumed

    def _processed(self, logits: mx.array, drafts: list[int] | None = None) -> mx.array:
        """Penalties and logit bias over the last PENALTY_CONTEXT tokens of prompt and reply
        (and, verifying a draft, of the drafted tokens before this position)."""
        unread = None if self.sampled is None else self.sampled[0]
        known = self.prompt + self.generated + (drafts or [])
        context = mx.array(known[-(PENALTY_CONTEXT - (unread is not None)) :])
        if unread is not None:
            context = mx.concatenate([context, unread])
        for process in self.processors:
            logits = process(context, logits)
        return logits

    def accept(self, token: int, logprobs: mx.array) -> Delta:
        self.generated.append(token)
        delta = Delta(choice=self.choice)
        if self.prompt_logprobs is not None and len(self.generated) == 1:
            delta.prompt_logprobs = self.prompt_logprobs
        piece = ""
        if token in self.tokenizer.eos_token_ids:  # ends the reply; no part of its text
            self.finish_reason = "stop"
        else:
            if self.params.logprobs is not None:
                delta.logprobs.append(self._logprob(token, logprobs))
            piece = self.text.add(token)
            if len(self.generated) >= self.params.max_tokens:
                self.finish_reason = "length"
        if self.finish_reason:
            piece += self.text.flush()
        delta.text = self.reply.add(piece, final=self.finish_reason is not None)
        if self.reply.stopped:
            self.finish_reason = "stop"
            delta.stop_sequence = self.reply.matched
        delta.finish_reason = self.finish_reason
        return delta

    def _logprob(self, token: int, logprobs: mx.array) -> TokenLogprob:
        return token_logprob(token, logprobs, self.params.logprobs or 0)

    def score_prompt(self, logits: mx.array, n: int) -> None:
        """Logprobs of prompt tokens from a prefill chunk's logits [n, vocab] (position j
        predicts the token after it): kept when the request echoes them."""
        if self.prompt_logprobs is None:
            return
        start = len(self.session.tokens)  # the chunk's first token
        targets = self.prompt[start + 1 : start + n + 1]
        logprobs = logits[: len(targets)]
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        k = self.params.logprobs or 0
        for j, token in enumerate(targets):
            self.prompt_logprobs.append(token_logprob(token, logprobs[j], k))

    def finished(self) -> Finished:
        d = self.drafter
        taken, refused = (d.accepted, d.proposed - d.accepted) if d else (0, 0)
        return Finished(len(self.prompt), len(self.generated), self.reused, taken, refused)


def token_logprob(token: int, logprobs: mx.array, k: int) -> TokenLogprob:
    """`token`'s logprob and the k most likely tokens', from logprobs [vocab] of the
    distribution it was drawn from. Tokens a grammar masked out (-inf) are never among
    the alternatives: fewer than k when fewer are allowed."""
    top: list[tuple[int, float]] = []
    if k:
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        values = logprobs[ids]
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        top = sorted(((t, v) for t, v in pairs if math.isfinite(v)), key=lambda t: -t[1])
    return TokenLogprob(token, max(logprobs[token].item(), LOGPROB_FLOOR), top)
