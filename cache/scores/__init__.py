"""Score rules: how attention adds to each stored key's importance, one file per rule.

A rule is a small dataclass of its knobs with two methods (see base.py):
`accumulate(held, logits, n_kv_heads)` folds one attention call's pre-softmax
logits into the per-slot importance an H2O cache keeps, and `rank(...)` turns
that importance into the order eviction keeps tokens by. Adding a rule is one
file here, one entry in RULES and its name in config/cache_spec.SCORE_RULES.
"""

from __future__ import annotations

from cache.scores.attn import AttnScore
from cache.scores.base import ScoreRule, per_kv_head, softmax_of
from cache.scores.ema import EmaScore
from cache.scores.learned import LearnedScore
from cache.scores.mean import MeanAttnScore
from cache.scores.snap import SnapScore
from cache.scores.tova import TovaScore
from cache.scores.value import ValueScore
from config.cache_spec import SCORE_RULES, choose

RULES: dict[str, type[ScoreRule]] = {
    "attn": AttnScore,
    "ema": EmaScore,
    "learned": LearnedScore,
    "mean": MeanAttnScore,
    "snap": SnapScore,
    "tova": TovaScore,
    "value": ValueScore,
}
assert set(RULES) == set(SCORE_RULES), "config/cache_spec.SCORE_RULES and RULES disagree"


def make_score_rule(name: str, **knobs) -> ScoreRule:
    """The rule called `name`, with its knobs (e.g. alpha for ema)."""
    return RULES[choose("score rule", name, SCORE_RULES)](**knobs)


__all__ = [
    "RULES",
    "AttnScore",
    "EmaScore",
    "LearnedScore",
    "MeanAttnScore",
    "SnapScore",
    "TovaScore",
    "ValueScore",
    "ScoreRule",
    "make_score_rule",
    "per_kv_head",
    "softmax_of",
]
