"""Perplexity under a bounded KV cache, measured as generation sees it.

Autoregressive mode (the H2O paper's protocol): each sample's first `prefill`
tokens go through the model in one forward pass, then every later token goes
through the cache one at a time, so eviction happens exactly as in
generation. Every token from position 1 on is predicted once (the prefill's
predictions included), and a sample's perplexity is exp(mean NLL).

Computation is causal: the cache state at token t depends only on tokens < t,
so the perplexity over the first L tokens of a longer sample equals that of a
run of length L. One run at the longest `seq_len` gives every shorter one.

Other modes, labelled as such in every record:
- `one-shot`: the full cache only; chunked forward passes through a plain
  KVCache, which is mathematically the autoregressive full-cache run (fast).
- `chunked-N`: N tokens per forward pass through the policy's cache; eviction
  only between chunks, so a cache briefly holds max_kv + N tokens. Faster but
  more lenient than generation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.text import essay_token_ids
from cache import make_cache
from config.cache_spec import POLICIES

DEFAULT_PREFILL = 32
ONE_SHOT_CHUNK = 512


@dataclass(frozen=True)
class CacheCase:
    """One cache configuration of a grid; fields that do not apply are None."""

    policy: str
    max_kv: int | None = None
    score: str | None = None
    preset: str | None = None
    evict_batch: int | None = None
    # A layer profile's shares (cache/layer_profiles.py); `layers` names where they came from.
    layer_shares: tuple[float | None, ...] | None = None
    layers: str | None = None

    def cache_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"policy": self.policy}
        for name in ("max_kv", "score", "preset", "evict_batch", "layer_shares"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def fields(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "max_kv": self.max_kv,
            "score": self.score,
            "preset": self.preset,
            "layers": self.layers,
        }

    def resolved_evict_batch(self, model) -> int | None:
        """Tokens an H2O cache evicts at once (its default when not set); None for others."""
        if not is_h2o(self.policy):
            return None
        caches = make_cache(model, **self.cache_kwargs())
        return next((c.evict_batch for c in caches if hasattr(c, "evict_batch")), 1)


def with_layer_profile(
    cases: list[CacheCase], profile, label: str, keep_uniform: bool = True
) -> list[CacheCase]:
    """`cases`, each followed by its twin under the profile's layer shares where its
    policy takes them (a LayerProfile; cache/layer_profiles.py); without `keep_uniform`
    the twin replaces it."""
    out = []
    for case in cases:
        shares = profile.shares(case.policy)
        if shares is None or case.max_kv is None:
            out.append(case)
            continue
        if keep_uniform:
            out.append(case)
        out.append(replace(case, layer_shares=shares, layers=label))
    return out


def is_h2o(policy: str) -> bool:
    """Policies that evict by score (h2o and its quantized variants) take rules and presets."""
    return POLICIES[policy].scored


def available_policies() -> list[str]:
    return list(POLICIES)


def grid_cases(
    policies: Iterable[str],
    max_kvs: Iterable[int],
    scores: Iterable[str],
    presets: Iterable[str],
    evict_batch: int | None = None,
) -> list[CacheCase]:
    """Expand a grid: full once, rotating per max_kv, H2O policies per max_kv x score x preset."""
    cases: list[CacheCase] = []
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; this build has {list(POLICIES)}")
        if not POLICIES[policy].bounded:
            cases.append(CacheCase(policy))
            continue
        for max_kv in max_kvs:
            if not is_h2o(policy):
                cases.append(CacheCase(policy, max_kv))
                continue
            for score in scores:
                for preset in presets:
                    cases.append(CacheCase(policy, max_kv, score, preset, evict_batch))
    return list(dict.fromkeys(cases))  # drop duplicates, keep order


def sample_windows(
    tokenizer,
    n: int,
    length: int,
    text_file: Path | None = None,
    stride: int | None = None,
    offset: int = 0,
) -> mx.array:
    """n windows of `length` tokens [n, length] starting every `stride` (default `length`)
    tokens after the first `offset`, from a file or the essays; a stride >= length keeps
    them non-overlapping.

    A tokenizer that starts every text with BOS (Gemma, Llama 2) gets BOS as each
    window's first token, as the model saw in training; the text fills the rest.
    """
    stride = stride or length
    if stride < length:
        raise ValueError(f"stride {stride} < sample length {length}: samples would overlap")
    bos = leading_bos(tokenizer)
    length -= len(bos)
    stride -= len(bos)
    needed = offset + (n - 1) * stride + length
    if text_file is None:
        ids = essay_token_ids(tokenizer, needed)
    else:
        ids = tokenizer.encode(Path(text_file).read_text(), add_special_tokens=False)
        if len(ids) < needed:
            raise ValueError(
                f"{text_file} has {len(ids)} tokens; {n} samples of {length} need {needed}"
            )
    windows = [bos + ids[offset + i * stride : offset + i * stride + length] for i in range(n)]
    return mx.array(windows, dtype=mx.int32)


def leading_bos(tokenizer) -> list[int]:
    """[BOS] when the tokenizer puts it in front of every encoded text, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or tokenizer.encode("a")[:1] != [bos]:
        return []
    return [bos]


def token_nll(logits: mx.array, targets: mx.array) -> mx.array:
    """Negative log-likelihood [B, L] of `targets` [B, L] under `logits` [B, L, V], float32."""
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return mx.logsumexp(logits, axis=-1) - picked


def nll_chunked(
    model,
    tokens: mx.array,
    cache_kwargs: dict[str, Any],
    chunk: int,
    tick: Callable | None = None,
    caches: list | None = None,
) -> mx.array:
    """Per-token NLL [B, T-1], `chunk` tokens per forward pass through the policy's cache
    (or through `caches`, when given, which the caller can then inspect)."""
    B, T = tokens.shape
    caches = make_cache(model, **cache_kwargs) if caches is None else caches
    parts = []
    for start in range(0, T - 1, chunk):
        end = min(start + chunk, T - 1)
        logits = model(tokens[:, start:end], cache=caches)
        nll = token_nll(logits, tokens[:, start + 1 : end + 1])
        mx.eval(nll)
        parts.append(nll)
        if tick:
            tick(end - start)
    return mx.concatenate(parts, axis=1)


def nll_one_shot(model, tokens: mx.array, tick: Callable | None = None) -> mx.array:
    """Full-cache per-token NLL [B, T-1] in a few large forward passes (exact, not evicting)."""
    return nll_chunked(model, tokens, {"policy": "full"}, ONE_SHOT_CHUNK, tick)


def nll_autoregressive(
    model,
    tokens: mx.array,
    cache_kwargs: dict[str, Any],
    prefill: int = DEFAULT_PREFILL,
    tick: Callable | None = None,
) -> mx.array:
    """Per-token NLL [B, T-1]: `prefill` tokens in one pass, then one token per step."""
    return nll_stepped(model, tokens, make_cache(model, **cache_kwargs), prefill, tick)


def nll_stepped(
    model,
    tokens: mx.array,
    caches: list,
    prefill: int = DEFAULT_PREFILL,
    tick: Callable | None = None,
) -> mx.array:
    """nll_autoregressive through given per-layer caches (bench/sliding_layers.py mixes kinds)."""
    B, T = tokens.shape
    prefill = max(1, min(prefill, T - 1))
    logits = model(tokens[:, :prefill], cache=caches)
    parts = [token_nll(logits, tokens[:, 1 : prefill + 1])]
    mx.eval(parts[0])
    if tick:
        tick(prefill)
    for t in range(prefill, T - 1):
        logits = model(tokens[:, t : t + 1], cache=caches)
        nll = token_nll(logits, tokens[:, t + 1 : t + 2])
        mx.eval(nll)
        parts.append(nll)
        if tick:
            tick(1)
    return mx.concatenate(parts, axis=1)


def nll_cases_stepped(
    model,
    tokens: mx.array,
    cases: list[dict[str, Any]],
    prefill: int = DEFAULT_PREFILL,
    tick: Callable | None = None,
) -> mx.array:
    """nll_autoregressive for several caches at once [len(cases), B, T-1]: every (case,
    sample) is one session of a batched forward pass (cache/batching/batch.py, as the server
    batches conversations), so the weights are read once a step for all of them. Each
    row computes what it would alone."""
    from cache.batching.batch import batch_caches

    B, T = tokens.shape
    sessions = [make_cache(model, **kwargs) for kwargs in cases for _ in range(B)]
    rows = mx.concatenate([tokens] * len(cases), axis=0)
    prefill = max(1, min(prefill, T - 1))
    logits = model(rows[:, :prefill], cache=batch_caches(sessions))
    parts = [token_nll(logits, rows[:, 1 : prefill + 1])]
    mx.eval(parts[0])
    if tick:
        tick(prefill)
    for t in range(prefill, T - 1):
        logits = model(rows[:, t : t + 1], cache=batch_caches(sessions))
        nll = token_nll(logits, rows[:, t + 1 : t + 2])
        mx.eval(nll)
        parts.append(nll)
        if tick:
            tick(1)
    return mx.concatenate(parts, axis=1).reshape(len(cases), B, T - 1)


def mode_label(case: CacheCase, mode: str, chunk: int, full_one_shot: bool) -> str:
    if case.policy == "full" and full_one_shot:
        return "one-shot"
    return f"chunked-{chunk}" if mode == "chunked" else "autoregressive"


def case_nll(
    model,
    tokens: mx.array,
    case: CacheCase,
    label: str,
    prefill: int,
    chunk: int,
    tick: Callable | None = None,
) -> mx.array:
    if label == "one-shot":
        return nll_one_shot(model, tokens, tick)
    if label.startswith("chunked"):
        return nll_chunked(model, tokens, case.cache_kwargs(), chunk, tick)
    return nll_autoregressive(model, tokens, case.cache_kwargs(), prefill, tick)


def run_ppl_grid(
    model,
    tokenizer,
    cases: list[CacheCase],
    seq_lens: list[int],
    samples: int,
    text_file: Path | None = None,
    prefill: int = DEFAULT_PREFILL,
    mode: str = "autoregressive",
    chunk: int = 64,
    full_one_shot: bool = False,
    batch: int = 8,
    stride: int | None = None,
    progress: Callable[[int, str], Any] | None = None,
    offset: int = 0,
    cases_per_pass: int = 1,
) -> list[dict[str, Any]]:
    """One record per case x seq_len; every case runs once at the longest seq_len.

    `batch` samples share each forward pass (H2O caches evict per sample and head).
    `cases_per_pass` > 1: autoregressive cases go that many at a time through one batched
    pass, each (case, sample) a session (`nll_cases_stepped`; the same numbers, the weights
    read once a step for all of them). `progress(total, None)` is called once, then
    `progress(n, description)` per step.
    """
    if mode not in ("autoregressive", "chunked"):
        raise ValueError(f"unknown mode {mode!r}")
    seq_lens = sorted(set(seq_lens))
    if seq_lens[0] < 2:
        raise ValueError("seq_len must be at least 2")
    tokens = sample_windows(tokenizer, samples, seq_lens[-1], text_file, stride, offset)
    batches = [tokens[i : i + batch] for i in range(0, samples, batch)]
    if progress:
        progress(len(cases) * samples * (seq_lens[-1] - 1), None)

    labels = [mode_label(case, mode, chunk, full_one_shot) for case in cases]
    stepped = [c for c, label in zip(cases, labels, strict=True) if label == "autoregressive"]
    together: dict[CacheCase, mx.array] = {}  # cases_per_pass: their NLL, run in groups
    if cases_per_pass > 1:
        for g in range(0, len(stepped), cases_per_pass):
            group = stepped[g : g + cases_per_pass]
            n_cases = len(group)
            desc = f"{len(group)} cases: " + ", ".join(
                " ".join(str(v) for v in c.fields().values() if v is not None) for c in group
            )

            def tick(n: int, rows: int = 1, desc: str = desc) -> None:
                if progress:
                    progress(n * rows, desc)

            nll = mx.concatenate(
                [
                    nll_cases_stepped(
                        model, b, [c.cache_kwargs() for c in group], prefill,
                        lambda n, r=b.shape[0] * n_cases: tick(n, r),
                    )
                    for b in batches
                ],
                axis=1,
            )  # fmt: skip
            together.update({c: nll[i] for i, c in enumerate(group)})

    records = []
    for case, label in zip(cases, labels, strict=True):
        evict_batch = case.resolved_evict_batch(model)
        desc = " ".join(str(v) for v in case.fields().values() if v is not None)

        def tick(n: int, rows: int = 1, desc: str = desc) -> None:
            if progress:
                progress(n * rows, desc)

        nll = together.get(case)
        if nll is None:
            nll = mx.concatenate(
                [
                    case_nll(
                        model, b, case, label, prefill, chunk, lambda n, r=b.shape[0]: tick(n, r)
                    )
                    for b in batches
                ],
                axis=0,
            )
        for seq_len in seq_lens:
            mean = mx.mean(nll[:, : seq_len - 1]).item()
            records.append(
                {
                    **case.fields(),
                    "evict_batch": evict_batch,
                    "seq_len": seq_len,
                    "samples": samples,
                    "ppl": math.exp(mean),
                    "mode": label,
                    "prefill": prefill if label == "autoregressive" else None,
                }
            )
    return records
