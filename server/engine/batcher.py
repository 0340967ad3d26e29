"""Rounds of work for every active generation: one batched decode pass, budgeted prefill.

Each round, on the worker thread:
1. every decoding generation feeds its next input in ONE forward pass (several
   sessions' caches as one batch, cache/batching/batch.py: the weights are read once for
   all rows) and draws its next token lazily, launched with `mx.async_eval`.
   Decoding sessions whose caches are plain (mlx-lm's KVCache, or a sliding window
   that keeps no sinks: Gemma 3's) share a KVSlab: one cache update
   and one attention call per layer for all of them. A session joins when its
   prompt is in, if the slab's padding stays under half of it, and leaves
   (its rows written back) when its request ends. H2O sessions (dense or
   packed) of one configuration share an H2OSlab (cache/batching/h2o_slab.py) the same way,
   h2o-kvarn sessions holding equally many tokens a KVarNSlab (cache/batching/kvarn_slab.py),
   kvarn sessions a KVarNPaddedSlab (cache/batching/kvarn_padded.py) while its padding stays
   under what its rows hold;
2. while that computes, last round's draws, which were this round's inputs, are
   read and become the replies' Deltas (building a step while the previous one
   computes is what mlx-lm's generate_step does too). `decode` ends here, so
   the caller can send them before the prefill below: a stream's token never
   waits for other requests' prompts;
3. `prefill`: prompts are prefilled in passes of one chunk per waiting request,
   at most `prefill_budget` tokens this round when anyone is decoding (one
   pass, every waiting request's next chunk, when nobody is), so a decoding
   stream never waits for a whole long prompt. Chunks share forward passes,
   right-padded, as mlx-lm's own server prefills a batch, as long as a pass holds
   at most one chunk's worth of padded tokens (its working set stays a chunk's);
   each cache stores and attends only its own chunk (cache/batching/batch.py), so H2O
   caches score and evict as alone (quantized ones prefill alone: `_passes`).
   Chunks are whole `prefill_step` pieces of a request's prompt, never cut by
   the budget: H2O evicts after each chunk, so a request's cache must not depend
   on the load.
A generation whose sampling, reading or prefill raises fails alone; a forward
pass that raises fails the rows it carried.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from cache import install_router, make_cache
from cache.batching.batch import KVSlab, batch_caches, open_h2o_slab
from cache.batching.h2o_slab import H2OSlab, near_wall, slab_key
from cache.batching.kvarn_slab import KVarNSlab
from cache.contract import draft_room, hold_draft, step_scores
from cache.factory import dense_layers, outgrows_dense, pack_dense
from config.cache_spec import CacheSpec
from server.engine.generation import Generation
from server.engine.jobs import Delta, joined

log = logging.getLogger("h2o_server.batcher")

# Layers of a dense-first session packed a round as it nears its dense share: all at once
# paused every stream of that round (5.5 s at 7k tokens of the default model on a 2-core
# CPU); a few a round spread it over the rounds before.
PACK_LAYERS = 4


@dataclass
class Round:
    """What one round did: per generation a Delta or the exception it failed with."""

    outcomes: list[tuple[Generation, Delta | Exception]] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seconds: float = 0.0
    decode_passes: int = 0  # forward passes its decode took (0 or 1)
    decoding: list[Generation] = field(default_factory=list)  # still decoding after it


class Batcher:
    def __init__(
        self,
        model,
        prefill_step: int,
        prefill_budget: int,
        make_caches: Callable[[CacheSpec], list] | None = None,
    ):
        self.model = model
        # A spec's fresh caches (what a session is packed into): the session store's.
        self.make_caches = make_caches or partial(make_cache, model)
        self.prefill_step = prefill_step
        self.prefill_budget = prefill_budget
        self.batched = can_batch(model)  # else one forward pass per decoding row
        self.slab = KVSlab()  # plain sessions decoding together (members: Generations)
        self.h2o_slabs: dict[tuple, H2OSlab | KVarNSlab] = {}  # H2O ones, by their key

    @property
    def slabs(self) -> list:
        """Every slab, in the order their rows lead a decode pass."""
        return [self.slab, *self.h2o_slabs.values()]

    def run(self, gens: list[Generation]) -> Round:
        """One whole round: `decode`, then `prefill`, their outcomes together."""
        done = self.decode(gens)
        filled = self.prefill(gens, decoding=bool(done.decoding))
        done.outcomes += filled.outcomes
        done.prefill_tokens = filled.prefill_tokens
        return done

    def decode(self, gens: list[Generation]) -> Round:
        """Launch this round's decode pass over every decoding generation, then read last
        round's draws into Deltas (the pass computes meanwhile)."""
        done = Round()
        t0 = time.perf_counter()
        decoding = [g for g in gens if not g.prefilling]
        rows = self._pack_outgrown(decoding, lambda g, k: len(g.session.tokens) + k, done)
        if len(rows) == 1 and self._takes_drafts(rows[0]) and rows[0].expects_drafts():
            self._speculate(rows[0], done)
            done.decode_seconds = time.perf_counter() - t0
            return done
        drafting = self._drafting(rows) if self.batched and len(rows) > 1 else []
        if drafting:
            self._verify_drafts(rows, drafting, done)
            done.decode_seconds = time.perf_counter() - t0
            return done
        rows, draws = self._decode(rows, done) if rows else ([], [])
        done.decode_passes = int(bool(rows))
        self._read_draws(rows, draws, done)
        done.decode_seconds = time.perf_counter() - t0
        return done

    def _read_draws(self, rows: list[Generation], draws: list, done: Round) -> None:
        """Read last round's draws of `rows` (this round fed them) into Deltas, while this
        round's `draws` compute; they become the rows' next inputs."""
        for g, draw in zip(rows, draws, strict=True):
            if g.sampled is not None:
                try:
                    done.outcomes.append((g, g.read()))
                except Exception as e:  # this request's tokenizer or logprobs: it alone fails
                    done.outcomes.append((g, e))
                    self.leave(g, broken=True)
                    continue
            if g.done:
                self.leave(g)
            else:
                g.sampled, g.next_input = draw, draw[0]
                done.decoding.append(g)

    def _takes_drafts(self, g: Generation) -> bool:
        """Whether a decoding row out of any slab may take a speculative round
        (server/engine/speculation.py): its caches give a refused draft back exactly
        (cache/contract.py `draft_room`: a plain KVCache trims; a dense H2O cache until its
        next eviction), and it stays clear of its dense share (packing runs a token a
        round). Whether it has a draft is `Generation.expects_drafts`."""
        s = g.session
        if g.drafter is None or draft_room(s.caches) == 0:
            return False
        rounds = math.ceil(dense_layers(s.caches) / PACK_LAYERS) + 1
        return not outgrows_dense(
            s.spec, s.caches, len(s.tokens) + g.drafter.length.ceiling + rounds
        )

    def _speculate(self, g: Generation, done: Round) -> None:
        """One speculative round for `g` alone: its draw read, a draft verified with it."""
        self.leave(g)  # out of any slab it decoded in beside others
        try:
            delta = g.speculate(self.model)
        except Exception as e:  # its pass, grammar or sampler: it alone fails
            done.outcomes.append((g, e))
            self.leave(g, broken=True)
            return
        done.decode_passes = 1
        if delta is not None:
            done.outcomes.append((g, delta))
        if not g.done:
            done.decoding.append(g)

    def _drafting(self, rows: list[Generation]) -> list[Generation]:
        """The rows among several that verify a draft this round: a draft that pays in a
        pass as wide as theirs (`Generation.expects_drafts`), from caches that give a
        refused one back. They decode outside any slab, each in its own cache."""
        wanting = [g for g in rows if self._may_draft(g) and g.expects_drafts(len(rows))]
        for g in wanting:
            self.leave(g)
        return [g for g in wanting if self._takes_drafts(g)]

    def _may_draft(self, g: Generation) -> bool:
        """Whether g's caches may take a draft, read without taking it out of a slab (a
        member's caches lend their arrays and counters to it: their kind tells)."""
        if g.drafter is None:
            return False
        slab = next((s for s in self.h2o_slabs.values() if g in s), None)
        if slab is None:
            return draft_room(g.session.caches) > 0
        return not slab.near_wall(g) and all(c.verifies_drafts for c in g.session.caches)

    def _verify_drafts(self, rows: list[Generation], drafting: list[Generation], done: Round):
        """One pass for every decoding row, of which `drafting` feed their input and a
        draft (each verified as alone: Generation.verify) and the rest their input alone,
        in their slabs: rows right-padded to the widest, each cache taking its own."""
        # id(g) -> (the Delta its draw read, its tokens, its forced drafts): one Delta a
        # round per generation (the worker ends a request at the first that finishes it)
        fed: dict[int, tuple[Delta | None, list[int], int]] = {}
        verifying = []
        for g in drafting:
            try:
                fed[id(g)] = g.propose()
            except Exception as e:  # its tokenizer or grammar: it alone fails
                done.outcomes.append((g, e))
                continue
            verifying.append(g)
        try:
            seated, alone = self._seat([g for g in rows if g not in drafting])
            ordered = [*seated, *verifying]
            width = max(len(tokens) for _, tokens, _ in fed.values())
            inputs, lengths = [], []
            for g in ordered:
                row = mx.array(fed[id(g)][1]) if id(g) in fed else g.input_array()
                padding = mx.zeros(width - row.size, mx.int32)
                inputs.append(mx.concatenate([row.astype(mx.int32), padding]))
                lengths.append(row.size)
                if id(g) not in fed:
                    g.fed()
            for g in verifying:
                hold_draft(g.session.caches)
            own = [g.session.caches for g in [*alone, *verifying]]
            caches = batch_caches(own, *self.slabs, lengths=lengths)
            logits = self.model(mx.stack(inputs), cache=caches)
        except Exception as e:  # the pass itself: every row it carried
            done.outcomes += [(g, e) for g in rows if g in verifying or g not in drafting]
            self.reset()
            return
        done.decode_passes = 1
        plain, draws = [], []
        for i, g in enumerate(ordered):
            try:
                if id(g) in fed:
                    delta, tokens, forced = fed[id(g)]
                    verified = g.verify(self.model, logits[i, : len(tokens)], tokens[1:], forced)
                    delta = joined(delta, verified)
                    if delta is not None:
                        done.outcomes.append((g, delta))
                    if g.done:
                        self.leave(g)
                    else:
                        done.decoding.append(g)
                else:
                    draws.append(g.sample(logits[i : i + 1, 0]))
                    plain.append(g)
            except Exception as e:  # this request's grammar, processors or sampler
                done.outcomes.append((g, e))
                self.leave(g, broken=id(g) in fed)
        self._launch(draws, alone)
        self._read_draws(plain, draws, done)

    def prefill(self, gens: list[Generation], decoding: bool) -> Round:
        """Prefill the waiting generations among `gens`: within `prefill_budget` tokens
        while others decode (`decoding`), else one pass over every waiting request."""
        done = Round()
        waiting = [g for g in gens if g.prefilling]
        budget = self.prefill_budget if decoding else None
        done.prefill_tokens = self._prefill(waiting, budget, done)
        return done

    def leave(self, g: Generation, broken: bool = False) -> None:
        """The generation stops decoding: its session gets its caches back from the slab
        (a broken one's are dropped). Safe to call for any generation."""
        for slab in self.slabs:
            if g in slab:
                slab.leave(g, None if broken else g.session.caches)

    def reset(self) -> None:
        """Forget every slab after a pass failed: half updated, perhaps, so their members'
        sessions are lost (their requests fail)."""
        self.slab, self.h2o_slabs = KVSlab(), {}

    def lend(self) -> None:
        """Slab members' own caches show their contents until the next round (readers on
        the worker thread between rounds: the cache view)."""
        for slab in self.slabs:
            for g in slab.members:
                slab.lend(g, g.session.caches)

    def _pack_outgrown(
        self, gens: list[Generation], reach: Callable[[Generation, int], int], done: Round
    ) -> list[Generation]:
        """Pack the dense-first sessions (CacheSpec.dense_until) among `gens` as they near
        their dense share: PACK_LAYERS a round from as many rounds before it as that takes
        (`reach(g, k)`: the tokens g holds after k more rounds), every layer left where the
        next round would pass it. Return the ones that go on (a session whose packing
        raises fails alone)."""
        going = []
        for g in gens:
            s = g.session
            rounds = math.ceil(dense_layers(s.caches) / PACK_LAYERS)
            if outgrows_dense(s.spec, s.caches, reach(g, rounds + 1)):
                must = outgrows_dense(s.spec, s.caches, reach(g, 1))
                try:
                    self.leave(g)  # a slab member's rows back in its caches first
                    fresh = self.make_caches(s.spec.replace(dense_until=0))
                    s.caches = pack_dense(s.caches, fresh, None if must else PACK_LAYERS)
                    if not dense_layers(s.caches):
                        log.info("session %s packed at %d tokens", s.id, len(s.tokens))
                except Exception as e:
                    done.outcomes.append((g, e))
                    continue
            going.append(g)
        return going

    def _regroup(self, rows: list[Generation]) -> list[Generation]:
        """Bring the slab's membership up to this round's decoding rows; return the rows
        that decode outside it, in order."""
        for g in [m for m in self.slab.members if m not in rows]:
            self.leave(g)  # e.g. a caller that dropped a finished generation itself
        fresh = [g for g in rows if g not in self.slab and self._slabbable(g)]
        if self.slab.rows + len(fresh) < 2:  # a slab of one would only cost copies
            for g in list(self.slab.members):
                self.leave(g)
            return self._regroup_h2o(rows)
        lengths, joining = [len(g.session.tokens) for g in self.slab.members], []
        for g in fresh:
            n = len(g.session.tokens)
            width = max([n, *lengths])
            if (len(lengths) + 1) * width <= 2 * (sum(lengths) + n):  # padding <= the K/V held
                joining.append((g, g.session.caches))
                lengths.append(n)
        if joining:
            self.slab.join(joining)
        return self._regroup_h2o([g for g in rows if g not in self.slab])

    def _regroup_h2o(self, rows: list[Generation]) -> list[Generation]:
        """The same for H2O sessions: one slab per configuration, of two rows or
        more; members near their model's context leave (re-indexing runs alone). A KVarN
        slab's key holds its rows' size, which moves: two that came to one size merge."""
        by_key: dict[tuple, H2OSlab | KVarNSlab] = {}
        for slab in self.h2o_slabs.values():
            if slab.key in by_key:  # its rows join the other one below, as fresh rows
                for g in list(slab.members):
                    self.leave(g)
            else:
                by_key[slab.key] = slab
        self.h2o_slabs = by_key
        for slab in self.h2o_slabs.values():
            for g in list(slab.members):
                if g not in rows or slab.near_wall(g):
                    self.leave(g)
        fresh: dict[tuple, list[Generation]] = {}
        for g in rows:
            key = self._h2o_slab_key(g)
            if key is not None and not any(g in s for s in self.h2o_slabs.values()):
                fresh.setdefault(key, []).append(g)
        for key, joining in fresh.items():
            slab = self.h2o_slabs.get(key) or open_h2o_slab(key)
            admitted = slab.admits([g.session.caches for g in joining])
            joining = [g for g, ok in zip(joining, admitted, strict=True) if ok]
            if joining and slab.rows + len(joining) >= 2:  # a slab of one would only cost copies
                slab.join([(g, g.session.caches) for g in joining])
                self.h2o_slabs[key] = slab
        for key, slab in list(self.h2o_slabs.items()):
            if slab.rows < 2:
                for g in list(slab.members):
                    self.leave(g)
                del self.h2o_slabs[key]
        return [g for g in rows if not any(g in s for s in self.h2o_slabs.values())]

    def _h2o_slab_key(self, g: Generation) -> tuple | None:
        if not (self.batched and g.session.spec.info.slab):
            return None
        key = slab_key(g.session.caches)
        return None if key is None or near_wall(g.session.caches) else key

    def _slabbable(self, g: Generation) -> bool:
        return self.batched and g.plain_caches and g.session.caches[0].offset > 0

    def _decode(self, rows: list[Generation], done: Round) -> tuple[list, list]:
        """One forward pass feeding every row's next input; (rows still going, their draws)."""
        try:
            rows, alone = self._seat(rows)
            inputs = mx.concatenate([g.input_array() for g in rows])[:, None]
            for g in rows:
                g.fed()
            logits = self._forward(inputs, [g.session.caches for g in alone])
        except Exception as e:  # the pass itself: every row it carried
            done.outcomes += [(g, e) for g in rows]
            self.reset()
            return [], []
        if any(g.constraint for g in rows):
            mx.async_eval(logits)  # the pass runs while the host computes grammar masks
        draws = []
        for i, g in enumerate(rows):
            try:
                draws.append(g.sample(logits[i : i + 1]))
            except Exception as e:  # this request's processors or sampler
                done.outcomes.append((g, e))
                draws.append(None)
        kept = [(g, d) for g, d in zip(rows, draws, strict=True) if d is not None]
        self._launch([d for _, d in kept], alone)
        return [g for g, _ in kept], [d for _, d in kept]

    def _seat(self, rows: list[Generation]) -> tuple[list[Generation], list[Generation]]:
        """Bring the slabs up to `rows` (`_regroup`): (every row in the order a pass feeds
        them, the slabs' members first; the rows decoding in their own caches)."""
        alone = self._regroup(rows)
        for slab in self.slabs:
            slab.reclaim()
        return [*(g for slab in self.slabs for g in slab.members), *alone], alone

    def _launch(self, draws: list, alone: list[Generation]) -> None:
        """Start computing the pass's draws with the step's scores (the caches of `alone`
        and the H2O slabs wait for them: scores_with_step)."""
        scored = [c for g in alone for c in g.session.caches]
        scored += [layer for slab in self.h2o_slabs.values() for layer in slab.layers]
        mx.async_eval([x for d in draws for x in d], step_scores(scored))

    def _forward(self, inputs: mx.array, sessions: list[list]) -> mx.array:
        """Last-position logits [rows, vocab] of one token per slab row, then per session."""
        if len(sessions) == 1 and not any(slab.members for slab in self.slabs):
            return self.model(inputs, cache=sessions[0])[:, -1, :]
        if self.batched:
            return self.model(inputs, cache=batch_caches(sessions, *self.slabs))[:, -1, :]
        rows = [self.model(inputs[i : i + 1], cache=c)[:, -1, :] for i, c in enumerate(sessions)]
        return mx.concatenate(rows, axis=0)

    def _prefill_reach(self, g: Generation, rounds: int) -> int:
        """Tokens g holds after `rounds` more chunks of its prompt (the last one decodes)."""
        first = g.next_chunk(self.prefill_step)
        more = min(first + (rounds - 1) * self.prefill_step, len(g.pending) - 1)
        return len(g.session.tokens) + more

    def _prefill(self, gens: list[Generation], budget: int | None, done: Round) -> int:
        """Passes of one chunk per waiting generation, in admission order, while they fit
        `budget` (the first chunk always goes; None: one pass over all of them)."""
        fed, failed = 0, set()
        while True:
            # before every pass: a round's budget may feed a prompt several chunks
            waiting = [g for g in gens if g.prefilling and id(g) not in failed]
            gens = self._pack_outgrown(waiting, self._prefill_reach, done)
            chunks, size = [], 0
            for g in gens:
                n = g.next_chunk(self.prefill_step)
                if budget is not None and (fed or chunks) and fed + size + n > budget:
                    break
                chunks.append(g)
                size += n
            if not chunks:
                return fed
            fed += self._prefill_pass(chunks, done, failed)
            if budget is None:
                return fed

    def _prefill_pass(self, gens: list[Generation], done: Round, failed: set) -> int:
        """Each generation's next chunk: in forward passes of at most `prefill_step`
        padded tokens (one by one for a model whose attention cannot batch)."""
        fed = 0
        for group in self._passes(gens):
            try:
                fed += self._prefill_rows(group)
            except Exception as e:  # that pass: every row it carried
                done.outcomes += [(g, e) for g in group]
                failed.update(id(g) for g in group)
        return fed

    def _passes(self, gens: list[Generation]) -> list[list[Generation]]:
        """Consecutive chunks grouped while rows x the widest chunk stays within one
        chunk's tokens: a pass's working set (activations grow with its padded tokens;
        +125 MiB for 4 x 512 tokens of the default model) stays a chunk's, whatever the
        number of waiting requests. Short prompts share passes; long ones go alone."""
        if not self.batched:
            return [[g] for g in gens]
        # Evicting quantized caches prefill alone: a batched matmul rounds a key apart
        # from a one-row one, which can land it one code over and tip an eviction
        # near-tie, which keeps or loses a token for good. (kvarn evicts nothing: its
        # tiles take batched keys in every decode step anyway.)
        groups, alone, width = [], [], 0
        for g in gens:
            if g.session.spec.info.quantized and g.session.spec.info.bounded:
                alone.append([g])
                continue
            n = g.next_chunk(self.prefill_step)
            if groups and (len(groups[-1]) + 1) * max(width, n) <= self.prefill_step:
                groups[-1].append(g)
                width = max(width, n)
            else:
                groups.append([g])
                width = n
        return groups + alone

    def _prefill_rows(self, gens: list[Generation]) -> int:
        if len(gens) == 1:
            return gens[0].prefill(self.model, self.prefill_step)
        sizes = [g.next_chunk(self.prefill_step) for g in gens]
        width = max(sizes)
        # Right padding, never stored or attended: each cache takes its row's real tokens.
        rows = [g.pending[:n] + [0] * (width - n) for g, n in zip(gens, sizes, strict=True)]
        caches = batch_caches([g.session.caches for g in gens], lengths=sizes)
        logits = self.model(mx.array(rows), cache=caches)  # lazy: computed only if scored
        mx.eval([c.state for g in gens for c in g.session.caches])
        for i, (g, n) in enumerate(zip(gens, sizes, strict=True)):
            g.score_prompt(logits[i], n)
        return sum(g.prefilled(n) for g, n in zip(gens, sizes, strict=True))


def can_batch(model) -> bool:
    """Whether this model's attention takes BatchedCaches (it goes through the router).

    Traces, never evaluates, one batched decode step and one batched chunk over two
    fresh caches.
    """
    install_router(model)
    try:
        for width in (1, 2):
            rows = [make_prompt_cache(model) for _ in range(2)]
            model(mx.zeros((2, width), dtype=mx.int32), cache=batch_caches(rows))
    except Exception as e:  # e.g. attention that calls mx.fast directly
        log.warning("this model's attention cannot batch sessions (%s): one pass per row", e)
        return False
    return True
