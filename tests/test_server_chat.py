"""/v1/chat/completions and /v1/completions through the official openai SDK."""

from __future__ import annotations

from collections import Counter

from server_harness import MODEL

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a baker."}]


def test_models_and_health(api):
    assert [m.id for m in api.client.models.list().data] == [MODEL]
    assert api.get("/health").json()["status"] == "ok"


def test_chat_non_stream_answers_and_counts_usage(api):
    r = api.client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=20
    )
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 10
    assert 0 < u.completion_tokens <= 20
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_chat_stream_matches_non_stream(api):
    kwargs = dict(model=MODEL, messages=PARIS, temperature=0, max_tokens=20)
    whole = api.client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        api.client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_gives_length(api):
    r = api.client.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_completion_tokens=5
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_stop_string_cuts_the_reply(api):
    kwargs = dict(model=MODEL, messages=PARIS, temperature=0, max_tokens=20)
    full = api.client.chat.completions.create(**kwargs).choices[0].message.content
    assert " of " in full
    r = api.client.chat.completions.create(**kwargs, stop=[" of", "zzz"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(" of")]
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in api.client.chat.completions.create(**kwargs, stop=" of", stream=True)
    )
    assert streamed == full[: full.index(" of")]


def test_same_seed_same_text(api):
    kwargs = dict(model=MODEL, messages=STORY, temperature=1.0, top_p=0.9, max_tokens=24)
    a = api.client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    b = api.client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    c = api.client.chat.completions.create(**kwargs, seed=8).choices[0].message.content
    assert a == b
    assert a != c


def test_logprobs(api):
    r = api.client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5


def test_penalties_and_logit_bias_are_applied(api):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    plain = api.client.completions.create(**kwargs, logprobs=0).choices[0]
    forced = api.client.completions.create(**kwargs, logprobs=0, logit_bias={"1000": 100}).choices[
        0
    ]
    assert len(set(forced.logprobs.tokens)) == 1  # token 1000, every time
    assert forced.text != plain.text
    # A prompt greedy decoding keeps repeating: the penalties must break the repetition.
    echo = dict(kwargs, prompt="one one one one one one one one", max_tokens=8, logprobs=0)
    plain = api.client.completions.create(**echo).choices[0].logprobs.tokens
    penalties = {"presence_penalty": 2.0, "frequency_penalty": 2.0}
    penalized = api.client.completions.create(**echo, **penalties).choices[0].logprobs.tokens
    assert max(Counter(plain).values()) > max(Counter(penalized).values()), (plain, penalized)


def test_legacy_completions(api):
    r = api.client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    streamed = "".join(
        c.choices[0].text
        for c in api.client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
        )
    )
    assert streamed == r.choices[0].text
