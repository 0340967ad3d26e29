"""A fact evicted turns ago comes back when asked for: h2o-recall through the real server."""

from __future__ import annotations

import uuid

import pytest
from server_harness import MODEL

from bench.recall import trial_script

TRIALS, TURNS, FILLER = 4, 3, 120  # docs/recall.md's documents: ~416 tokens
MAX_KV = 128


def ask(api, parts: list[str], policy: str) -> tuple[str, dict]:
    """A document grown a part per request on one session; (the answer, the session)."""
    key = f"recall-{policy}-{uuid.uuid4().hex[:8]}"
    text = ""
    for i, part in enumerate(parts):
        text += part
        reply = api.client.completions.create(
            model=MODEL,
            prompt=text,
            temperature=0,
            max_tokens=8 if i == len(parts) - 1 else 1,
            extra_body={"prompt_cache_key": key, "kv_cache": {"policy": policy, "max_kv": MAX_KV}},
        )
    return reply.choices[0].text, api.sessions()[key]


@pytest.fixture(scope="module")
def documents(default_model):
    _, tokenizer = default_model
    return [trial_script(tokenizer, t, TURNS, FILLER, document=True) for t in range(TRIALS)]


def test_h2o_recall_answers_what_h2o_forgot(api, documents):
    hits = {"h2o": 0, "h2o-recall": 0}
    for parts, number in documents:
        for policy in hits:
            answer, session = ask(api, parts, policy)
            assert session["evictions"] >= 100  # every layer evicted the note long before
            hits[policy] += number in answer
    assert hits["h2o-recall"] >= TRIALS - 1, hits
    assert hits["h2o"] <= 1, hits  # the question-agnostic rule has lost the number
