"""Speculative decoding from the conversation itself: where drafts come from, how long they
are, and the rule that keeps the target model's distribution.

A draft is a guess at the next tokens. The batcher (server/engine/batcher.py) feeds the
decoding token and the draft in one forward pass, which on a weight-bound step costs
little more than one token, and `Generation.verify` keeps the drafted tokens the model
would have produced itself. Drafts come from two places that cost no model:
- the tokens a grammar forces (llguidance's fast-forward tokens: `{"name": "` of a
  forced tool call, the rest of a JSON key), which are always taken;
- n-gram lookup over the conversation's whole token history (every turn's prompt and
  reply, whatever its cache evicted, and a request's `prediction`): the tokens that
  followed the latest earlier occurrence of the history's last few tokens. An agent's
  reply repeats what it was shown: code it edits, paths, a tool result's JSON.
Where neither has a draft that pays, a draft model (`--draft-model`, a small model with
the same tokenizer: server/engine/draft_model.py) guesses greedily, its passes counted
against what it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.contract import is_state
from config.settings import DRAFT_MAX as MAX_DRAFT  # the adaptive length's ceiling by default
from server.engine.draft_model import DraftModel

NGRAM_SIZES = (4, 3, 2)  # suffix lengths looked up, longest first (a longer match guesses better)
# What a speculative round costs beyond a plain one, in one-token passes: a fixed part (it
# reads its draw before its pass, so no pass overlaps the round's own work) and a part per
# drafted token (the wider pass). On the 2-core CPU a pass of 5 tokens costs 1.3-1.7x one
# of 1, a pass of 13 1.6-2.1x (docs/speculation.md); a GPU's wider pass costs less.
ROUND_COST = 0.1
TOKEN_COST = 0.1


class NgramIndex:
    """Where each n-gram of a token history last occurred (n in `sizes`).

    The n-grams ending at the history's last token are indexed only once another token
    follows, so a lookup of the history's own suffix finds an earlier occurrence, and
    the continuation after it holds at least one token.
    """

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest copy ends
        self._indexed = 0  # n-grams followed by a token before this position are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        history = self.tokens
        for end in range(self._indexed, len(history)):  # the n-grams just before `end`
            for n in self.sizes:
                if end >= n:
                    self._after[tuple(history[end - n : end])] = end
        self._indexed = len(history)

    def sync(self, history: Sequence[int]) -> None:
        """Catch up with `history`, which only grew since the last call."""
        if len(history) > len(self.tokens):
            self.extend(history[len(self.tokens) :])

    def propose(self, k: int, tail: Sequence[int] | None = None) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier copy of the longest suffix of
        `tail` (default: this history's own), that suffix's length); ([], 0) when none
        recurs."""
        history = self.tokens
        tail = history if tail is None else tail
        for n in self.sizes:
            if len(tail) > n or (tail is not history and len(tail) == n):
                at = self._after.get(tuple(tail[-n:]))
                if at is not None:
                    return history[at : at + k], n
        return [], 0


@dataclass
class Acceptance:
    """How likely one draft source's next drafted token is taken, given the ones before it
    were: taken / tried (a refused token ends a draft), recent drafts weighing more, from
    a prior of one in two. A source pays where the tokens a draft of k is expected to add,
    r + r^2 + ... + r^k, beat what its wider pass costs (for every row of the pass); one
    that does not forgets slowly while it is not drafted, so it is tried again later."""

    DECAY = 0.8  # per draft
    FORGET = 0.97  # per round it was not worth drafting: back toward the prior

    taken: float = 1.0
    tried: float = 2.0

    @property
    def rate(self) -> float:
        return self.taken / self.tried

    def update(self, proposed: int, accepted: int) -> None:
        self.taken = self.DECAY * self.taken + accepted
        self.tried = self.DECAY * self.tried + accepted + (accepted < proposed)

    def pays(self, k: int, rows: int = 1, per_token: float = 0.0, replays: bool = False) -> bool:
        """Whether a draft of k pays in a pass of `rows` rows: every row's input widens to
        k + 1 tokens, so the cost is paid per row, the tokens gained by this one alone;
        `per_token`: what making a drafted token costs (a draft model's pass); `replays`:
        a refused token costs a pass more (recurrent layers take the kept tokens again)."""
        r = self.rate
        expected = r * (1 - r**k) / (1 - r) if r < 1 else float(k)
        cost = rows * (ROUND_COST + TOKEN_COST * k) + per_token * k
        if replays:  # refused with probability 1 - r^k: a pass of the kept tokens again
            cost += (1 - r**k) * (1 + TOKEN_COST * expected)
        if expected > cost:
            return True
        self.taken = self.FORGET * self.taken + (1 - self.FORGET) * 1.0
        self.tried = self.FORGET * self.tried + (1 - self.FORGET) * 2.0
        return False


@dataclass
class DraftLength:
    """How many tokens to propose next: doubles while drafts are taken whole, shrinks to
    what was taken, and pauses (for a span that doubles each time, up to `MAX_PAUSE`
    rounds) after `MISSES` drafts in a row of which nothing was taken: where the
    conversation does not repeat itself, speculation turns itself off."""

    MISSES = 2
    MAX_PAUSE = 64

    ceiling: int = MAX_DRAFT
    k: int = 4
    misses: int = 0
    pause: int = 0  # rounds left without proposing
    _span: int = 4  # the next pause's length
    proposed: int = 0  # totals over the reply: usage reports them
    accepted: int = 0

    def allows(self) -> bool:
        """Whether this round may propose (a paused length counts the round down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def took(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if accepted == proposed:
            self.k = min(2 * self.k, self.ceiling)
        else:
            self.k = max(2, accepted + 1)
        if accepted:
            self.misses, self._span = 0, 4
            return
        self.misses += 1
        if self.misses >= self.MISSES:
            self.pause, self.misses = self._span, 0
            self._span = min(2 * self._span, self.MAX_PAUSE)


class Drafter:
    """One reply's drafts: the grammar's forced tokens first, else the n-gram lookup over
    its conversation, else a draft model's (server/engine/draft_model.py), at the length
    its acceptance earned. `session` keeps the draft model's cache across turns."""

    def __init__(
        self,
        ceiling: int = MAX_DRAFT,
        predicted: Sequence[int] = (),
        model: DraftModel | None = None,
        session=None,
    ):
        self.model, self.session = model, session
        self._from_model = False  # this round's draft comes from the model
        self.index = NgramIndex()
        self.predicted = NgramIndex()  # a request's predicted reply (chat's `prediction`)
        self.predicted.extend(predicted)
        self.length = DraftLength(ceiling, k=min(4, ceiling))
        self.forced = 0  # grammar-forced tokens fed as drafts (all taken)
        # Per source (a predicted reply; a suffix of 4, 3 or 2 tokens): how often it is right.
        self.sources: dict[str | int, Acceptance] = {}
        self._source: str | int | None = None  # the last lookup draft's
        # A draft found but not fed (it did not pay): (where it starts in the history, its
        # tokens, its source), checked against the tokens the reply then takes, so a
        # source's record learns without a pass (a batch's rows draft only where it is high).
        self._shadow: tuple[int, list[int], str | int] | None = None

    @property
    def proposed(self) -> int:
        return self.length.proposed + self.forced

    @property
    def accepted(self) -> int:
        return self.length.accepted + self.forced

    def expects(self, history: Sequence[int], opening: bool = False, rows: int = 1) -> bool:
        """Whether the lookup has a draft for `history` (a paused length counts down) that
        pays in a pass of `rows` rows. `opening`: the reply has no token yet (a predicted
        reply is drafted from its start)."""
        self._check_shadow(history)
        self._from_model = False
        if not self.length.allows():
            return False
        k = self.length.k
        replays = any(map(is_state, getattr(self.session, "caches", None) or []))
        found, source = self._lookup(history, k, opening)
        if found:
            if self.sources.setdefault(source, Acceptance()).pays(k, rows, replays=replays):
                return True
            if self._shadow is None:
                self._shadow = (len(history), found, source)
        if self.model is not None:  # a draft model agrees on most tokens: from 3 in 4
            model = self.sources.setdefault("model", Acceptance(taken=3.0, tried=4.0))
            self._from_model = model.pays(k, rows, self.model.cost, replays)
        return self._from_model

    def _check_shadow(self, history: Sequence[int]) -> None:
        """Score the draft not fed once the reply's tokens tell how much of it was right."""
        if self._shadow is None:
            return
        at, draft, source = self._shadow
        known = history[at : at + len(draft)]
        right = next((i for i, t in enumerate(known) if t != draft[i]), len(known))
        if right < len(known) or len(known) == len(draft):
            self.sources[source].update(len(draft), right)
            self._shadow = None

    def draft(
        self, history: Sequence[int], constraint, room: int, opening: bool = False
    ) -> tuple[list[int], int]:
        """(drafts, how many of them the grammar forces) of at most `room` tokens after
        `history`: the grammar's forced ones up to the ceiling (all are taken), else the
        lookup's at the length it earned."""
        if room <= 0:
            return [], 0
        if constraint is not None:
            forced = constraint.forced()[: min(room, self.length.ceiling)]
            if forced:
                return forced, len(forced)
        k = min(room, self.length.k)
        if self._from_model:
            self._source = "model"
            drafts, self.session.draft_state = self.model.propose(
                self.session.draft_state, history, k
            )
            return drafts, 0
        drafts, self._source = self._lookup(history, k, opening)
        return drafts, 0

    def _lookup(
        self, history: Sequence[int], k: int, opening: bool
    ) -> tuple[list[int], str | int | None]:
        """(drafts, their source): the predicted reply's start for a reply's first token;
        else the history's own continuation after its longest recurring suffix, else the
        predicted reply's after the same suffix."""
        if opening and self.predicted.tokens:
            return self.predicted.tokens[:k], "predicted"
        self.index.sync(history)
        found, n = self.index.propose(k)
        if found:
            return found, n
        found, n = self.predicted.propose(k, history)
        return found, "predicted" if found else None

    def took(self, proposed: int, kept: int, forced: int = 0) -> None:
        """A verify pass kept `kept` of `proposed` drafts (the first `forced` the grammar's)."""
        if forced:
            self.forced += min(forced, kept)
            return
        if proposed:
            self.length.took(proposed, kept)
            self.sources.setdefault(self._source, Acceptance()).update(proposed, kept)
