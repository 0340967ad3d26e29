"""Every model family the server serves, under every cache policy (issue 77).

Each family is built from mlx-lm's own classes at tiny random sizes (tests/families.py,
every layer kind it has). `full` must give stock mlx-lm's logits and greedy tokens over a
prompt and a decode; every bounded policy must run a prompt and decode that evicts, with
finite logits, or be refused up front with one line naming a policy that works. The
table of what works is docs/models.md's "Families x policies": this test measures it and
fails when the page says otherwise (H2O_WRITE_FAMILY_TABLE=1 rewrites the page).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import pytest
from families import FAMILIES, build
from mlx_lm.models.cache import make_prompt_cache

from cache.budget import Budget, fit_spec
from cache.factory import cache_usage, make_cache
from cache.router import uninstall_router
from config.policies import AUTO, POLICIES
from models.shape import PER_TOKEN, kv_shape, layer_plan

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
BEGIN, END = "<!-- families: begin -->", "<!-- families: end -->"
PROMPT = list(range(1, 41))  # 40 tokens: past max_kv and every tiny window
STEPS = 8
MAX_KV = 16

_RESULTS: dict[str, dict[str, str]] = {}  # family -> policy -> "works" / "refused: ..."


def _run(model, cache) -> list[mx.array]:
    """Last-position logits of the prompt, then of each greedy decode step."""
    logits = model(mx.array([PROMPT]), cache=cache)[:, -1]
    out = [logits]
    for _ in range(STEPS):
        token = mx.argmax(logits, axis=-1)
        logits = model(token[:, None], cache=cache)[:, -1]
        out.append(logits)
    mx.eval(out)
    return out


_MODELS: dict = {}


def _model(family: str):
    if family not in _MODELS:
        _MODELS[family] = build(family)
    return _MODELS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_full_is_stock_mlx_lm(family):
    model = _model(family)
    want = _run(model, make_prompt_cache(model))
    got = _run(model, make_cache(model, "full"))
    for a, b in zip(got, want, strict=True):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5), family
        assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_plan_holds_every_cache(family):
    model = _model(family)
    plan = layer_plan(model)
    assert len(plan) == len(make_prompt_cache(model))
    shape = kv_shape(model)
    assert shape.layers == sum(s.kind in PER_TOKEN for s in plan) > 0
    assert all(s.kv_heads > 0 and s.key_width > 0 for s in plan if s.kind in PER_TOKEN)
    assert all(s.layer is not None for s in plan), "every cache is tied to its layer"


@pytest.mark.parametrize("policy", [p for p in POLICIES if POLICIES[p].bounded])
@pytest.mark.parametrize("family", FAMILIES)
def test_bounded_policy_evicts_or_is_refused(family, policy):
    model = _model(family)
    try:
        caches = make_cache(model, policy, max_kv=MAX_KV, group_size=32)
    except ValueError as e:
        uninstall_router(model)
        message = str(e)
        assert "\n" not in message and re.search(r"use [\w-]+", message), message
        working = re.search(r"use ([\w-]+)", message).group(1)
        assert working in POLICIES and working != policy
        _RESULTS.setdefault(family, {})[policy] = f"refused: {message}"
        return
    try:
        out = _run(model, caches)
    finally:
        uninstall_router(model)
    assert all(bool(mx.all(mx.isfinite(x))) for x in out), (family, policy)
    seen, stored, _ = cache_usage(caches)
    assert seen == len(PROMPT) + STEPS and stored <= MAX_KV < seen, (family, policy, stored)
    _RESULTS.setdefault(family, {})[policy] = "works"


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_chooses_what_the_model_holds(family):
    """Under a budget too small for the whole context, auto's policy builds and runs."""
    model = _model(family)
    shape = kv_shape(model)
    spec = fit_spec(shape, Budget(200_000, 1), AUTO, group_size=64)
    try:
        caches = make_cache(model, spec)
        out = _run(model, caches)
    finally:
        uninstall_router(model)
    assert all(bool(mx.all(mx.isfinite(x))) for x in out)
    _RESULTS.setdefault(family, {})["auto"] = f"works: {spec.policy}"


def family_table(results: dict[str, dict[str, str]]) -> str:
    """docs/models.md's table: one row per family, one column per bounded policy."""
    policies = [p for p in POLICIES if POLICIES[p].bounded]
    notes: dict[str, int] = {}
    rows = []
    for family in FAMILIES:
        cells = []
        for policy in policies:
            result = results[family][policy]
            if result == "works":
                cells.append("works")
            else:  # one note per reason, whichever policy and however many layers
                reason = result.removeprefix("refused: ").replace(f"policy {policy} ", "it ")
                reason = re.sub(r"^\d+ layer\(s\) of this model", "Layers of the model", reason)
                cells.append(f"refused ({notes.setdefault(reason, len(notes) + 1)})")
        auto = results[family]["auto"].removeprefix("works: ")
        layout = ", ".join(sorted({s.kind for s in layer_plan(_model(family))}))
        rows.append(f"| {family} | {layout} | {' | '.join(cells)} | {auto} |")
    head = f"| family | layer kinds | {' | '.join(policies)} | auto picks |"
    rule = "|" + "---|" * (len(policies) + 3)
    why = [f"{n}. {reason}" for reason, n in notes.items()]
    return "\n".join([head, rule, *rows, "", *why])


def test_docs_table_is_what_was_measured():
    wanted = [
        (f, p) for f in FAMILIES for p in [*POLICIES, "auto"] if p == "auto" or POLICIES[p].bounded
    ]
    missing = [fp for fp in wanted if fp[1] not in _RESULTS.get(fp[0], {})]
    if missing:
        pytest.skip(f"run with the rest of this file ({len(missing)} cells not measured here)")
    table = family_table(_RESULTS)
    text = DOC.read_text()
    before, _, rest = text.partition(BEGIN)
    _, _, after = rest.partition(END)
    if os.environ.get("H2O_WRITE_FAMILY_TABLE"):
        DOC.write_text(f"{before}{BEGIN}\n{table}\n{END}{after}")
    assert BEGIN in text and f"{BEGIN}\n{table}\n{END}" in DOC.read_text(), (
        "docs/models.md's family table differs from what this test measured: rerun with "
        "H2O_WRITE_FAMILY_TABLE=1 and review the change"
    )


@pytest.mark.parametrize("policy", ["h2o", "h2o-merge", "h2o-ada"])
def test_learned_sinks_reach_the_scored_attention(policy):
    """gpt-oss's sink logits (random here: mlx-lm starts them at zero) are applied by the
    scored attention: with nothing evicted, H2O gives stock mlx-lm's logits."""
    model = build("gpt_oss")
    for layer in model.layers:
        layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape) * 2
    want = _run(model, make_prompt_cache(model))
    try:
        got = _run(model, make_cache(model, policy, max_kv=len(PROMPT) + STEPS + 8))
    finally:
        uninstall_router(model)
    for a, b in zip(got, want, strict=True):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4), float(mx.max(mx.abs(a - b)))


def test_mla_reindexes_the_rope_part_only():
    """An MLA layer's H2O cache holds the latent as keys and the key's RoPE part as values:
    re-indexing positions turns the values and leaves the latent as it is."""
    from cache.policies.h2o import H2OKVCache, turn_keys

    model = build("deepseek_v3")
    try:
        caches = make_cache(model, "h2o", max_kv=16)
    finally:
        uninstall_router(model)
    assert all(isinstance(c, H2OKVCache) and c.rotated == "values" for c in caches)
    cache = caches[0]
    assert cache.rope is model.layers[0].self_attn.rope
    latent, rope_part = mx.random.normal((1, 1, 8, 64)), mx.random.normal((1, 1, 8, 32))
    cache.update_and_fetch(latent, rope_part)
    delta = mx.full((1, 1, 8), -3, dtype=mx.int32)
    cache._rerope_keys(delta)
    held_keys, held_values = cache.keys[:, :, :8], cache.values[:, :, :8]
    assert mx.array_equal(held_keys, latent)
    assert mx.allclose(held_values, turn_keys(cache.rope, rope_part, delta), atol=1e-6)
    assert not mx.allclose(held_values, rope_part, atol=1e-3)


def test_mla_outgrows_its_context():
    """Past a 64-token context, an MLA model's H2O caches re-index (the RoPE part) and the
    conversation goes on with finite logits."""
    model = build("deepseek_v3", max_position_embeddings=64)
    try:
        caches = make_cache(model, "h2o", max_kv=16)
        logits = None
        for chunk in range(0, 160, 8):
            logits = model(mx.array([[1 + (chunk + i) % 60 for i in range(8)]]), cache=caches)
            mx.eval(logits)
    finally:
        uninstall_router(model)
    assert bool(mx.all(mx.isfinite(logits)))
    assert all(c.shift > 0 and c.offset < 64 for c in caches), [(c.shift, c.offset) for c in caches]
