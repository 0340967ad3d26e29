"""`GET /v1/sessions/{id}/cache`: which tokens of a conversation its cache still holds.

Two halves, because only the worker thread may touch MLX: `read_contents` runs
there (through `Worker.call`) and copies out plain numbers; `cache_report` runs
in a handler's thread pool and turns them into the JSON below.

    {
      "object": "session.cache",
      ...the session's figures, exactly as /v1/sessions lists them
         (id, policy, max_kv, logical_tokens, stored_tokens, bytes, evictions, ...),
      "layers": 30, "kv_heads": 3,   # layers that hold tokens; KV heads per layer
      "segments": {"kind": "h2o", "sink": 4, "recent": 28},
                 # positions < sink are sink tokens, >= logical_tokens - recent the
                 # recent window; kind: h2o (scored eviction), rotating, or full / kvarn
                 # (nothing evicted)
      "tokens": {
        "ids":   [...],              # the conversation, one entry per position
        "text":  [...],              # each token's text; joined, the decoded conversation
        "held":  [...],              # (layer, KV head) pairs whose cache holds the token
        "score": [...]               # mean H2O score over the pairs holding it (null: none
                                     # does); the list is null for unscored policies
      },
      "heads": [{"layer": 0, "head": 0, "kind": "h2o", "held": 64, "bitmap": "..."}, ...],
                 # bitmap: base64 of the held positions as bits, little-endian:
                 # position p is bit p % 8 of byte p // 8 (ceil(logical_tokens / 8) bytes)
      "turns": [{"usage": {...OpenAI usage of the turn...},
                 "logical_tokens", "stored_tokens", "bytes", "evictions"}, ...],
      "prefix_tokens": 0,            # tokens its cache started from, a stored system prompt's
      "prefix_store": {"entries", "bytes", "capacity", "hits", "tokens"}  # the whole store
    }

An 8k-token conversation over 30 layers x 3 KV heads is about 330 KB: 130 KB of
bitmaps and ~25 bytes per token. A spilled session reports its tokens with `held` and
`score` null and no heads (its caches are on disk until its next turn). A session
answering a request is read between two of the worker's rounds, when its caches and
tokens agree (server/engine/generation.py), so the report is a consistent snapshot of it.
The types are server/api/session_protocol.py's `SessionCache`.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from config.policies import FULL, VIEW_KINDS
from server.api.session_protocol import SessionCache

if TYPE_CHECKING:  # both import MLX; read_contents imports it on the worker thread
    from cache.contents import LayerContents
    from server.sessions.store import SessionStore


@dataclass
class SessionContents:
    stats: dict
    tokens: list[int]
    layers: list[LayerContents]  # empty while the session is spilled
    turns: list[dict]


def read_contents(store: SessionStore, session_id: str, owner: str = "") -> SessionContents | None:
    """A copy of what the session's caches hold (worker thread only); None if unknown."""
    from cache.contract import layer_contents

    session = store.sessions.get((owner, session_id))
    if session is None:
        return None
    layers = []
    if session.caches is not None:
        session.refresh_stats()  # figures of this very moment, like the contents
        layers = [c for c in map(layer_contents, session.caches) if c is not None]
    elif not session.stats:
        session.refresh_stats()
    turns = [dict(t) for t in session.turns]
    stats = {**session.stats, "prefix_store": store.prefix_figures()}
    return SessionContents(stats, list(session.tokens), layers, turns)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text (a split UTF-8 character goes to its last token)."""
    detokenizer = tokenizer.detokenizer
    texts, sent = [], 0
    for token in ids:
        detokenizer.add_token(token)
        text = detokenizer.text
        texts.append(text[sent:])
        sent = max(sent, len(text))
    if texts:
        detokenizer.finalize()
        texts[-1] += detokenizer.text[sent:]
    return texts


def _bitmap(positions: np.ndarray, length: int) -> str:
    bits = np.zeros(length, dtype=bool)
    bits[positions] = True
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode()


# The segments shown are the policy's layers': VIEW_KINDS ranks the model's own bounded
# layers (sliding windows) last.


def _segments(layers: list[LayerContents]) -> dict:
    """The policy's segments: sinks every layer of its kind keeps, and the recent window
    they all hold (layers with their own max_kv have windows of their own sizes)."""
    kind = next((k for k in VIEW_KINDS if any(c.kind == k for c in layers)), None)
    if kind is None:
        return {"kind": FULL.name, "sink": 0, "recent": 0}
    own = [c for c in layers if c.kind == kind]
    return {
        "kind": kind,
        "sink": min(c.sink for c in own),
        "recent": min(c.recent for c in own),
    }


def cache_report(contents: SessionContents, tokenizer) -> SessionCache:
    """The endpoint's JSON (see the module docstring); plain numpy, no MLX."""
    ids, layers = contents.tokens, contents.layers
    length = max([len(ids), *(c.offset for c in layers)])
    held = np.zeros(length, dtype=np.int64)
    score_sum, scored = np.zeros(length), np.zeros(length, dtype=np.int64)
    heads = []
    for index, layer in enumerate(layers):
        for head, positions in enumerate(layer.positions):
            held += np.bincount(positions, minlength=length)
            if layer.scores is not None:
                score_sum += np.bincount(positions, layer.scores[head], minlength=length)
                scored += np.bincount(positions, minlength=length)
            heads.append(
                {
                    "layer": index,
                    "head": head,
                    "kind": layer.kind,
                    "held": int(len(positions)),
                    "bitmap": _bitmap(positions, length),
                }
            )
    held_list = held.tolist() if layers else None
    scores = None
    if any(c.scores is not None for c in layers):
        mean = score_sum / np.maximum(scored, 1)
        scores = [float(f"{m:.4g}") if n else None for m, n in zip(mean, scored, strict=True)]
    report = {
        **contents.stats,
        "layers": len(layers),
        "kv_heads": max((len(c.positions) for c in layers), default=0),
        "segments": _segments(layers),
        "tokens": {
            "ids": ids,
            "text": token_texts(tokenizer, ids),
            "held": held_list,
            "score": scores,
        },
        "heads": heads,
        "turns": contents.turns,
    }
    return SessionCache.model_validate(report)
