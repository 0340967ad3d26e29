"""Speculative decoding (server/engine/speculation.py): drafts from the conversation and the
grammar, verified in one pass, change nothing but the number of passes.

Greedy replies of the real default model are token for token the ones decoded without
drafts (policy full), with the same logprobs, penalties and logit bias; a JSON-schema
reply takes its forced tokens as drafts; sampled replies keep the target's distribution
(a chi-square over a small vocabulary), a seeded one whatever the load; a draft model
drafts where nothing repeats; the server reports drafted tokens in usage and /metrics.
Each cache policy: tests/test_speculation_policies.py; each model family:
tests/test_speculation_families.py.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from decoding import FULL, decode, decode_together, document_prompt, document_reply
from mlx_lm.models.cache import make_prompt_cache

from models.loading import parameter_bytes
from server.engine.draft_model import DraftModel, DraftModelError
from server.engine.engine import load_draft_model
from server.engine.generation import RequestSampler
from server.engine.grammar import Grammars
from server.engine.speculation import Acceptance, Drafter, DraftLength, NgramIndex
from server.sessions.store import Session

pytestmark = pytest.mark.slow(seconds=120)


# ---------------------------------------------------------------------- drafts


def test_lookup_proposes_what_followed_the_latest_earlier_copy():
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert index.propose(3) == ([7, 8, 1], 3)  # the latest copy of (1, 2, 3) went on with 7, 8
    index.extend([7])
    assert index.propose(8)[0] == [8, 1, 2, 3, 7]  # as far as the history goes


def test_lookup_never_finds_its_own_suffix():
    index = NgramIndex()
    index.extend([5, 6, 7, 8])
    assert index.propose(4) == ([], 0)
    index.sync([5, 6, 7, 8, 5, 6])
    assert index.propose(4)[0] == [7, 8, 5, 6]
    index.sync([5, 6, 7, 8, 5, 6])  # nothing new: no change
    assert index.tokens == [5, 6, 7, 8, 5, 6]


def test_lookup_prefers_the_longest_suffix():
    index = NgramIndex(sizes=(3, 2))
    # (2, 3) last went on with 0, but (1, 2, 3) with 4
    index.extend([1, 2, 3, 4, 9, 2, 3, 0, 1, 2, 3])
    assert index.propose(1) == ([4], 3)  # found by its 3-token suffix


def test_draft_length_grows_shrinks_and_pauses():
    length = DraftLength(ceiling=12, k=4)
    length.took(4, 4)
    assert length.k == 8
    length.took(8, 8)
    assert length.k == 12  # the ceiling
    length.took(12, 3)
    assert length.k == 4  # what was taken, and one more
    length.took(4, 0)
    assert length.allows()  # one miss: still proposing
    length.took(2, 0)
    assert [length.allows() for _ in range(5)] == [False] * 4 + [True]  # paused 4 rounds
    length.took(2, 0)
    length.took(2, 0)
    assert sum(not length.allows() for _ in range(9)) == 8  # the next pause is twice as long
    length.took(2, 1)  # a draft taken in part: the pauses start short again
    length.took(2, 0)
    length.took(2, 0)
    assert sum(not length.allows() for _ in range(9)) == 4
    assert (length.proposed, length.accepted) == (40, 16)


def test_a_source_drafts_while_what_it_adds_beats_the_wider_pass():
    right, wrong = Acceptance(), Acceptance()
    assert right.pays(4) and wrong.pays(4)  # the prior: one in two taken
    for _ in range(3):
        right.update(4, 4)
        wrong.update(2, 0)
    assert right.pays(12) and right.rate > 0.9
    assert not wrong.pays(2)  # refused drafts: a plain round costs less
    # Not drafted, it drifts back to the prior and is tried again after a while.
    rounds = next(i for i in range(1, 500) if wrong.pays(2))
    assert 10 < rounds < 100


def test_a_refusal_that_costs_a_pass_more_needs_a_surer_source():
    """With recurrent layers a refused draft means feeding the kept tokens again: a
    source at the prior (one in two) no longer pays, one right 9 times in 10 still does."""
    prior, sure = Acceptance(), Acceptance(taken=9.0, tried=10.0)
    assert prior.pays(4) and not Acceptance().pays(4, replays=True)
    assert sure.pays(4, replays=True)


def test_a_drafter_keeps_each_suffix_lengths_own_record():
    drafter = Drafter(8)
    history = [1, 2, 3, 4, 5, 6, 9, 9, 5, 6]  # (5, 6) recurs: a 2-token match
    assert drafter.expects(history)
    for _ in range(4):
        drafts, _ = drafter.draft(history, None, 4)
        assert drafts and drafter._source == 2
        drafter.took(len(drafts), 0)
        drafter.length.pause = 0  # the length's own pauses aside
    assert not drafter.expects(history)  # 2-token matches were wrong here
    longer = [*history, 7, 1, 2, 3, 4]  # a 4-token match: its own record, the prior
    assert drafter.expects(longer) and drafter.sources[4].rate == 0.5


def test_a_predicted_reply_drafts_its_start_then_what_follows_the_history():
    drafter = Drafter(8, predicted=[10, 11, 12, 13, 14, 15])
    prompt = [1, 2, 3]
    assert drafter.draft(prompt, None, 4, opening=True) == ([10, 11, 12, 13], 0)
    # the reply went its own way for a token, then met the prediction again
    assert drafter.draft([*prompt, 10, 11, 99, 12, 13], None, 4) == ([14, 15], 0)
    assert drafter.draft([*prompt, 98, 99], None, 4) == ([], 0)  # nothing recurs
    # the conversation's own history comes first
    drafter = Drafter(8, predicted=[10, 11, 12, 13, 14, 15])
    assert drafter.draft([7, 12, 13, 40, 41, 12, 13], None, 2) == ([40, 41], 0)


# ---------------------------------------------------------------------- the accept rule


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("draft", [0, 4], ids=["likely-draft", "unlikely-draft"])
def test_sampled_tokens_keep_the_targets_distribution(draft):
    """With a point-mass draft, the first token drawn (the draft taken, or a draw from p
    without it) is distributed as p itself, and so is the token after a taken draft."""
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, -0.5], [0.0, 1.5, -1.0, 0.3, 0.7, 1.0]])
    temperature = 0.8
    target = mx.softmax(logits / temperature, axis=-1).tolist()
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = RequestSampler(temperature, 1.0, 0.0, seed=1234)
    first, second = [0] * 6, [0] * 6
    for _ in range(3000):
        taken, token = sampler.verify(logprobs, [draft])
        first[draft if taken else token.item()] += 1
        if taken:
            second[token.item()] += 1
    # 5 degrees of freedom: P(chi2 > 25.7) = 1e-4
    assert chi_square(first, target[0]) < 25.7, first
    assert chi_square(second, target[1]) < 25.7, second


def test_greedy_takes_drafts_while_they_are_the_argmax():
    logits = mx.array([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    sampler = RequestSampler(0.0, 1.0, 0.0, None)
    taken, token = sampler.verify(logits, [1, 0])
    assert (taken, token.item()) == (2, 2)
    taken, token = sampler.verify(logits, [1, 2])
    assert (taken, token.item()) == (1, 0)  # the argmax where the draft was refused


# ---------------------------------------------------------------------- replies


@pytest.fixture(scope="module")
def plain_reply(default_model, essay_text):
    return document_reply(default_model, essay_text)


def test_greedy_reply_is_the_same_in_fewer_passes(default_model, plain_reply):
    model, tokenizer = default_model
    prompt, (tokens, logprobs, passes, _) = plain_reply
    drafted, drafted_logprobs, drafted_passes, g = decode(model, tokenizer, prompt, draft_max=12)
    assert drafted == tokens
    assert drafted_logprobs == pytest.approx(logprobs, abs=1e-3)
    assert passes == len(tokens) + 1  # the prompt's last token, then each reply token
    assert drafted_passes < 0.7 * passes, (drafted_passes, passes)
    assert g.drafter.accepted > len(tokens) / 3
    finished = g.finished()
    assert finished.accepted_draft_tokens == g.drafter.accepted
    assert finished.rejected_draft_tokens == g.drafter.proposed - g.drafter.accepted
    # the session holds exactly its tokens: the refused drafts were trimmed away
    assert g.session.caches[0].offset == len(g.session.tokens)


def test_penalties_and_logit_bias_see_the_drafts(default_model, plain_reply):
    model, tokenizer = default_model
    prompt, _ = plain_reply
    bias = {tokenizer.encode(" the")[0]: -5.0}
    params = {"frequency_penalty": 0.4, "presence_penalty": 0.2, "logit_bias": bias}
    plain = decode(model, tokenizer, prompt, **params)
    drafted = decode(model, tokenizer, prompt, draft_max=12, **params)
    assert drafted[0] == plain[0]
    assert drafted[1] == pytest.approx(plain[1], abs=1e-3)
    assert drafted[3].drafter.proposed > 0


def test_stop_string_inside_a_draft_ends_the_reply_there(default_model, plain_reply):
    model, tokenizer = default_model
    prompt, (tokens, *_) = plain_reply
    stop = tokenizer.decode(tokens[20:22]).strip()
    plain = decode(model, tokenizer, prompt, stop=[stop])
    drafted = decode(model, tokenizer, prompt, draft_max=12, stop=[stop])
    assert drafted[0] == plain[0]
    assert drafted[3].finish_reason == plain[3].finish_reason == "stop"
    assert drafted[3].reply.text == plain[3].reply.text


def test_sampled_reply_is_reproducible_with_its_seed(default_model, plain_reply):
    model, tokenizer = default_model
    prompt, _ = plain_reply
    params = {"temperature": 0.7, "seed": 99, "max_tokens": 24}
    first = decode(model, tokenizer, prompt, draft_max=12, **params)
    again = decode(model, tokenizer, prompt, draft_max=12, **params)
    assert first[0] == again[0]
    assert first[3].drafter.proposed > 0


def test_a_seeded_reply_is_the_same_alone_and_in_a_batch(default_model, essay_text):
    """Whether a round drafts changes which random draws a sampled reply takes: a seeded
    request decides it from its own conversation alone, never from the rows beside it, so
    its reply is the one it gets alone whatever the load."""
    model, tokenizer = default_model
    prompt = document_prompt(tokenizer, essay_text)

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    seeded = {"temperature": 0.3, "seed": 7}
    alone = decode(model, tokenizer, prompt, draft_max=12, max_tokens=40, **seeded)
    rows = [(prompt, FULL, 40), (prompt, FULL, 40), (chat("Say hello."), FULL, 40)]
    together, _ = decode_together(model, tokenizer, rows, draft_max=12, **seeded)
    assert alone[3].drafter.accepted > 0
    assert together[0].generated == together[1].generated == alone[0]


def test_json_reply_takes_the_grammars_forced_tokens(default_model):
    model, tokenizer = default_model
    grammars = Grammars(tokenizer, model.args.vocab_size)
    schema = {
        "type": "object",
        "properties": {"temperature_in_celsius": {"type": "integer"},
                       "description_of_the_weather": {"type": "string", "maxLength": 20}},
        "required": ["temperature_in_celsius", "description_of_the_weather"],
        "additionalProperties": False,
    }  # fmt: skip
    from server.api.structured import compile_schema

    grammar = compile_schema(schema, "response_format")
    messages = [{"role": "user", "content": "The weather in Paris as JSON."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    plain = decode(model, tokenizer, prompt, constraint=grammars.constraint(grammar),
                   max_tokens=64)  # fmt: skip
    drafted = decode(model, tokenizer, prompt, draft_max=12,
                     constraint=grammars.constraint(grammar), max_tokens=64)  # fmt: skip
    assert drafted[0] == plain[0]
    assert drafted[2] < len(drafted[0]) - 5, (drafted[2], len(drafted[0]))
    assert drafted[3].drafter.forced >= 8  # the keys, spelled by the grammar


# ---------------------------------------------------------------------- a draft model


def test_a_draft_model_drafts_where_the_conversation_repeats_nothing(default_model):
    """Free chat has no n-gram to draft from; a draft model does. The target drafting for
    itself (claimed cheap) guesses every greedy token: the reply is the same in far fewer
    passes, and the draft cache holds the conversation, refused drafts trimmed."""
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    plain = decode(model, tokenizer, prompt, max_tokens=40)
    draft = DraftModel(model, tokenizer, tokenizer, cost=0.05)
    drafted = decode(model, tokenizer, prompt, draft_max=8, draft_model=draft, max_tokens=40)
    assert drafted[0] == plain[0]
    assert drafted[1] == pytest.approx(plain[1], abs=1e-3)
    g = drafted[3]
    assert g.drafter.sources["model"].rate > 0.8 and drafted[2] < 0.5 * plain[2], drafted[2]
    state = g.session.draft_state
    assert state.tokens == g.session.tokens[: len(state.tokens)]
    assert state.caches[0].offset == len(state.tokens) >= len(g.session.tokens) - 8


def test_a_draft_model_drafts_while_it_pays_for_its_passes():
    """The gate prices a draft model's passes: a guesser at 0.3 of a target pass drafts
    alone from its prior, not beside three other rows (every row's pass widens), and
    stops once its drafts are refused."""

    class Guesser:  # drafts 1s; what it is matters here only through its price
        cost = 0.3

        def propose(self, state, history, k):
            return [1] * k, state

    history = [5, 6, 7, 8]  # nothing recurs: no lookup draft
    crowded = Drafter(8, model=Guesser(), session=Session(id="s", spec=FULL, keyed=True))
    assert not crowded.expects(history, rows=4)
    drafter = Drafter(8, model=Guesser(), session=Session(id="s", spec=FULL, keyed=True))
    assert drafter.expects(history)
    assert drafter.draft(history, None, 8) == ([1, 1, 1, 1], 0) and drafter._source == "model"
    drafter.took(4, 0)
    drafter.took(2, 0)
    drafter.length.pause = 0  # the length's own pause aside
    assert not drafter.expects(history)


def test_a_draft_models_cache_follows_the_conversation_within_its_window(default_model):
    """Each draft is the draft model's greedy continuation of the conversation's tokens
    from its cache's start, whether the cache was synced (tokens added, an edit trimmed)
    or restarted from the recent half of its window."""
    model, tokenizer = default_model
    draft = DraftModel(model, tokenizer, tokenizer, cost=0.05, window=64)

    def greedy(tokens: list[int], k: int) -> list[int]:
        cache, out = make_prompt_cache(model), []
        for _ in range(k):
            logits = model(mx.array(out[-1:] if out else tokens)[None], cache=cache)
            out.append(mx.argmax(logits[0, -1]).item())
        return out

    history = tokenizer.encode("The quick brown fox jumps over the lazy dog, said Ann. " * 8)
    state = None
    for step in (history[:20], history[:28], [*history[:25], 7, 8, 9], history[:60], history):
        drafts, state = draft.propose(state, step, 4)
        assert drafts == greedy(step[state.start :], 4)
        assert state.tokens == step[state.start :] + drafts[:-1]
        assert state.caches[0].offset == len(state.tokens) <= 64
    assert state.start > 0  # restarted: the history is past the window


def test_a_draft_model_needs_the_same_tokenizer(default_model):
    model, tokenizer = default_model

    class Other:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(DraftModelError, match="tokenizer"):
        DraftModel(model, Other(), tokenizer, cost=0.1)
    # --draft-model as the server loads it: priced by its weights against the target's
    notices = []
    draft = load_draft_model("default", parameter_bytes(model), tokenizer, notices)
    assert draft.cost == pytest.approx(1.0) and not notices
    assert load_draft_model("default", parameter_bytes(model), Other(), notices) is None
    assert "not used" in notices[0]


# ---------------------------------------------------------------------- server


def test_server_reports_drafted_tokens(api, essay_text):
    text = essay_text[:800]
    messages = [{"role": "user", "content": f"Copy this text exactly:\n\n{text}"},
                {"role": "assistant", "content": text[:30]}]  # fmt: skip
    before = api.metrics()
    r = api.client.chat.completions.create(
        model="default", messages=messages, max_tokens=40, temperature=0
    )
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    after = api.metrics()
    drafted = after["h2o_draft_tokens_total"] - before["h2o_draft_tokens_total"]
    taken = after["h2o_accepted_draft_tokens_total"] - before["h2o_accepted_draft_tokens_total"]
    assert taken == details.accepted_prediction_tokens
    assert drafted == taken + details.rejected_prediction_tokens
    passes = after["h2o_decode_passes_total"] - before["h2o_decode_passes_total"]
    assert passes < r.usage.completion_tokens

    off = api.client.chat.completions.create(
        model="default", messages=messages, max_tokens=40, temperature=0,
        extra_body={"speculation": False},
    )  # fmt: skip
    assert off.choices[0].message.content == r.choices[0].message.content
    assert off.usage.completion_tokens_details is None
    assert math.isclose(api.metrics()["h2o_draft_tokens_total"], after["h2o_draft_tokens_total"])


def test_server_takes_a_predicted_reply(api, essay_text):
    """OpenAI's Predicted Outputs: the predicted text feeds the drafts; the reply is the
    one without it, and usage counts the predicted tokens taken and refused."""
    messages = [{"role": "user", "content": "Write one paragraph about cities."}]
    plain = api.client.chat.completions.create(
        model="default", messages=messages, max_tokens=40, temperature=0,
        extra_body={"speculation": False},
    )  # fmt: skip
    text = plain.choices[0].message.content
    predicted = text[:60] + " and then something else entirely. " + text[60:]
    r = api.client.chat.completions.create(
        model="default", messages=messages, max_tokens=40, temperature=0,
        prediction={"type": "content", "content": [{"type": "text", "text": predicted}]},
    )  # fmt: skip
    assert r.choices[0].message.content == text
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 20
    assert details.rejected_prediction_tokens > 0  # the inserted sentence

    bad = api.post(
        "/v1/chat/completions",
        {"model": "default", "messages": messages, "prediction": {"type": "text", "content": "x"}},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"].startswith("prediction")
