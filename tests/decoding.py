"""Replies decoded through the server's batcher, as its worker runs them, alone or together:
the helpers the speculation tests compare replies with."""

from __future__ import annotations

from cache import make_cache
from config.cache_spec import CacheSpec
from server.engine.batcher import Batcher
from server.engine.generation import Generation
from server.engine.jobs import SamplingParams
from server.engine.speculation import Acceptance
from server.sessions.store import Session

FULL = CacheSpec("full", 4096)


def decode(
    model, tokenizer, prompt, spec=FULL, draft_max=0, constraint=None, draft_model=None, **params
):
    """(tokens, logprobs, decode passes, generation) of one reply decoded alone."""
    session = Session(id="s", spec=spec, keyed=True, caches=make_cache(model, spec))
    sampling = SamplingParams(**{"max_tokens": 48, "temperature": 0.0, "logprobs": 2, **params})
    g = Generation(tokenizer, session, prompt, 0, sampling, constraint=constraint,
                   draft_max=draft_max, draft_model=draft_model)  # fmt: skip
    batcher = Batcher(model, prefill_step=256, prefill_budget=256)
    logprobs, passes = [], 0
    while not g.done:
        done = batcher.run([g])
        passes += done.decode_passes
        for _, delta in done.outcomes:
            assert not isinstance(delta, Exception), delta
            logprobs += [lp.logprob for lp in delta.logprobs]
    assert g.session.tokens == prompt + g.generated
    return g.generated, logprobs, passes, g


def decode_together(model, tokenizer, rows, draft_max, **sampling):
    """(generations, decode passes) of replies decoded in one Batcher: `rows` of
    (prompt, spec, max_tokens), greedy unless `sampling` says otherwise."""
    batcher = Batcher(model, prefill_step=256, prefill_budget=4096)
    gens = []
    for i, (prompt, spec, max_tokens) in enumerate(rows):
        session = Session(id=f"s{i}", spec=spec, keyed=True, caches=make_cache(model, spec))
        params = SamplingParams(
            **{"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 2, **sampling}
        )
        gens.append(Generation(tokenizer, session, prompt, 0, params, draft_max=draft_max))
    passes, logprobs = 0, {id(g): [] for g in gens}
    while not all(g.done for g in gens):
        done = batcher.run([g for g in gens if not g.done])
        passes += done.decode_passes
        # one outcome per generation a round: the worker ends a request at the first Delta
        # that finishes it, so a second would reach a request already gone
        assert len({id(g) for g, _ in done.outcomes}) == len(done.outcomes)
        for g, delta in done.outcomes:
            assert not isinstance(delta, Exception), delta
            logprobs[id(g)] += [lp.logprob for lp in delta.logprobs]
    for g in gens:
        assert g.session.tokens == g.prompt + g.generated
        g.logprobs = logprobs[id(g)]
    return gens, passes


def document_prompt(tokenizer, essay_text: str) -> list[int]:
    """A prompt whose reply repeats a document: the lookup's best case."""
    text = essay_text[:1200]
    messages = [{"role": "user", "content": f"Copy this text exactly:\n\n{text}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def document_reply(default_model, essay_text: str) -> tuple[list[int], tuple]:
    """(the document prompt, its greedy reply without drafts under `full`: `decode`'s)."""
    model, tokenizer = default_model
    prompt = document_prompt(tokenizer, essay_text)
    return prompt, decode(model, tokenizer, prompt)


def feed_every_draft(monkeypatch) -> None:
    """The cost gate opened: every draft found is fed, so a test checks verification
    wherever the gate would have let few through."""
    monkeypatch.setattr(Acceptance, "pays", lambda self, *args, **kwargs: True)
