"""One reply decoded through the server's batcher, as its worker runs it: the helper the
speculation tests compare replies with."""

from __future__ import annotations

from cache import make_cache
from config.cache_spec import CacheSpec
from server.engine.batcher import Batcher
from server.engine.generation import Generation
from server.engine.jobs import SamplingParams
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
