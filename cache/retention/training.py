"""Training retention gates against the frozen model, with the budget in the loop.

One full-cache forward pass per training window records, for every layer, what the
gate's loss needs: each token's gate inputs (cache/retention/__init__.py `features` of its key
and value), the values, and at some sampled query rows t the attention probabilities
p_ti, the attention output o_t, and `mean`'s rank of every key at that step (the
probability it drew from the queries before t, per query). The model is never run
again: each layer's gate is then fitted on its own, a few hundred Adam steps on those
arrays, the model's weights untouched.

The loss is eviction relaxed. Under a budget of max_kv tokens split as the cache splits
it (sinks, heavy, recent: config/cache_spec.split_segments), evictions happen every
`stride` tokens (and at every row), in order, and are permanent as in the cache: at
time e the sinks and the recent window are kept, and each middle key i has a margin
m_i = min over the evictions it went through of (r_ei - tau_e), r_ei = log(mean rank at
e) + g_i, its soft share sigmoid(m_i / temperature); tau_e is where the shares of the
keys still held sum to the heavy budget (Newton from the hard threshold, with its
implicit gradient). A key whose score rises after it was evicted stays out (with stride
0 each row chooses afresh from every middle key, by bisection: how the shipped gates
were trained, which let a key come back). At each sampled row t the kept attention
renormalised gives o'_t = sum_i keep_i p_ti v_i / sum_i keep_i p_ti; the loss is the
squared change it makes to the layer's output, ||W_o,h (o'_t - o_t)||^2 summed over query heads,
relative to the same loss at g = 0 (`mean` itself), averaged over budgets. The held-out
loss (printed by `h2o-server calibrate --retention`) is that ratio under hard eviction
(keep the top `heavy`) on windows kept out of training: below 1 the gates lose less
of each layer's attention output than `mean` does.

Deterministic: the rows are drawn from `seed`, the gates start at 0 (`mean`), and MLX's
CPU reductions run in a fixed order, so the same text and seed give the same weights.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from cache.retention import (
    Retention,
    RopeLayout,
    feature_count,
    features,
    rope_layout,
    rope_turns,
    signature,
)
from cache.router import tapped
from config.cache_spec import CacheSpec, split_segments


@dataclass(frozen=True)
class TrainConfig:
    budgets: tuple[int, ...] = (64, 128)  # max_kv the loss evicts at (each its segments)
    rows: int = 32  # query rows per window the loss reads
    # Tokens between the relaxation's evictions (and at every row): a key evicted at one
    # stays out, as in the cache; 0: each row chooses afresh from every middle key.
    stride: int = 16
    steps: int = 30  # Adam steps per layer
    check: int = 10  # steps between held-out checks (the best check's weights are kept)
    lr: float = 0.003
    temperature: float = 1.0  # of the soft keep, in log-rank units
    l2: float = 0.1  # on the standardised weights (the raw values overfit without it)
    seed: int = 0
    # Per head, g also takes a_h log(t - i) + c_h (t - i) / max_kv: how much the head
    # prefers recent tokens, learned (0, 0 is mean's own balance).
    age: bool = False
    # The gate also reads each key's direction before RoPE (cache/retention.features).
    direction: bool = False
    preset: str = "heavy"  # the segments the loss evicts under (config/cache_spec.PRESETS)


@dataclass
class LayerData:
    """One layer's recorded arrays over W windows (rows shared by every window)."""

    feats: mx.array  # [W, H, T, F] standardised gate inputs
    base: mx.array  # [W, H, E, T] log of mean's rank at each eviction time (-inf: unseen)
    probs: mx.array  # [W, H, G, R, T] attention probabilities, query heads grouped
    values: mx.array  # [W, H, T, D]
    out: mx.array  # [W, H, G, R, D] the full cache's attention output
    gram: mx.array  # [H, G, D, D] W_o's Gram per query head (its output change)


def _probabilities(q, k, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) [B, n_q, L, T], query heads of a KV head together."""
    B, n_q, L, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    qg = q.astype(mx.float32).reshape(B, n_kv, n_q // n_kv, L, D)
    logits = (qg * scale) @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    logits = logits.reshape(B, n_q, L, T)
    if isinstance(mask, str) or mask is None:
        causal = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        logits = mx.where(causal, logits, -mx.inf)
    elif mask.dtype == mx.bool_:
        logits = mx.where(mask, logits, -mx.inf)
    else:
        logits = logits + mask
    return mx.softmax(logits, axis=-1, precise=True)


def _o_proj_weight(layer: nn.Module) -> mx.array | None:
    proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
    if proj is None:
        return None
    if hasattr(proj, "scales"):  # a quantized Linear
        return mx.dequantize(
            proj.weight, proj.scales, getattr(proj, "biases", None), proj.group_size, proj.bits
        )
    return proj.weight


_RECORDED = ("feats", "base", "probs", "values", "out")  # what `record` keeps, per window


def record(
    model: nn.Module,
    windows: list[list[int]],
    rows: np.ndarray,
    rope: RopeLayout,
    tick: Callable[[], None] | None = None,
    times: np.ndarray | None = None,
    turns: mx.array | None = None,
) -> list[dict]:
    """Per layer, the per-window arrays (lists) the loss reads; `rows`: the sampled query
    positions (ascending), `times`: where `mean`'s rank is read (the relaxation's
    evictions; default the rows); `turns` (`rope_turns`): the gate reads the keys'
    direction too. `tick()` after each window."""
    per_layer: list[dict] = []
    r = mx.array(rows)
    e = mx.array(rows if times is None else times)
    for window in windows:
        calls: list[tuple] = []
        tokens = mx.array([int(t) for t in window])[None]

        def tap(q, k, v, scale, mask, calls=calls):
            p = _probabilities(q, k, scale, mask)[0]  # [n_q, T, T]
            n_q, n_kv, T = p.shape[0], k.shape[1], p.shape[-1]
            grouped = p.reshape(n_kv, n_q // n_kv, T, T)
            before = mx.cumsum(grouped.sum(axis=1), axis=1)[:, e - 1]  # queries < t: [H, E, T]
            age = (e[:, None] - mx.arange(T)[None]).astype(mx.float32)  # t - i
            seen = age > 0
            base = mx.where(seen, mx.log(mx.maximum(before / mx.maximum(age, 1), 1e-30)), -mx.inf)
            vals = v[0].astype(mx.float32)
            at_rows = grouped[:, :, r]  # [H, G, R, T]
            out = at_rows @ vals[:, None]
            turn = None if turns is None else turns[len(calls)]
            feats = features(k[0], vals, rope, mx.arange(T), turn)
            mx.eval(base, at_rows, out, feats)
            calls.append((feats, base, at_rows, vals, out))

        with tapped(model, tap):
            mx.eval(model(tokens, cache=make_prompt_cache(model)))
        if not per_layer:
            per_layer = [{name: [] for name in _RECORDED} for _ in calls]
        for store, arrays in zip(per_layer, calls, strict=True):
            for name, a in zip(_RECORDED, arrays, strict=True):
                store[name].append(a)
        if tick:
            tick()
    return per_layer


def _stack(store: dict, gram: mx.array, mu: mx.array, sigma: mx.array) -> LayerData:
    feats = (mx.stack(store["feats"]) - mu) / sigma
    return LayerData(
        feats, mx.stack(store["base"]), mx.stack(store["probs"]), mx.stack(store["values"]),
        mx.stack(store["out"]), gram,
    )  # fmt: skip


def _segments(budget: int, times: np.ndarray, T: int, preset: str = "heavy") -> tuple:
    """(middle [E, T]: keys at stake at each eviction time, heavy: how many of them stay,
    ages [2, E, T]: log(t - i) and (t - i) / budget, the age terms' inputs)."""
    seg = split_segments(budget, preset)
    i = np.arange(T)[None]
    middle = (i >= seg.sink) & (i < times[:, None] - seg.recent)
    age = np.maximum(times[:, None] - i, 1).astype(np.float32)
    ages = mx.array(np.stack([np.log(age), age / budget]))
    return mx.array(middle), seg.heavy, ages


def _output_loss(data: LayerData, keep: mx.array) -> mx.array:
    """||W_o (o' - o)||^2 per window and row, with keys weighted by `keep` [W, H, R, T]."""
    weights = data.probs * keep[:, :, None]
    kept = weights.sum(axis=-1, keepdims=True)
    approx = (weights @ data.values[:, :, None]) / mx.maximum(kept, 1e-30)
    err = approx - data.out  # [W, H, G, R, D]
    projected = err @ data.gram  # e^T (W^T W) e, per query head
    return (projected * err).sum(axis=-1).sum(axis=2)  # [W, H, R]


BISECTIONS = 24  # steps of the soft threshold's search (rows chosen afresh)
NEWTON_STEPS = 4  # the same under permanent evictions, from the hard threshold


def _keep(
    data: LayerData, g: mx.array, middle: mx.array, heavy: int, temperature: float | None,
    aged: mx.array | None = None, at_rows: tuple[int, ...] | None = None,
):  # fmt: skip
    """Soft (temperature) or hard (None) keep shares [W, H, R, T] under gate values g (and
    the age terms `aged` [H, E, T]): the sinks and recent window 1, the middle keys
    `heavy` in all (a row with no more middle keys than that keeps them all). With
    `at_rows` (which eviction times are the rows) evictions are permanent (`_surviving`);
    without, each row chooses afresh from every middle key."""
    score = data.base + g[:, :, None, :]
    if aged is not None:
        score = score + aged[None]
    if at_rows is not None:
        return _surviving(score, middle, heavy, temperature, at_rows)
    crowded = middle.sum(axis=-1, keepdims=True) > heavy  # [R, 1]: eviction has to choose
    if temperature is None:
        top = mx.topk(mx.where(middle, score, -mx.inf), heavy, axis=-1).min(axis=-1, keepdims=True)
        inside = (score >= top) | ~crowded
        return mx.where(middle, inside.astype(mx.float32), 1.0)
    tau = _soft_threshold(score, None, middle, heavy, temperature)
    soft = mx.where(crowded, mx.sigmoid((score - tau) / temperature), 1.0)
    return mx.where(middle, soft, 1.0)


UNSEEN = 1e4  # margin of a key no eviction has judged yet: kept for sure


def _surviving(
    score: mx.array, middle: mx.array, heavy: int, temperature: float | None,
    at_rows: tuple[int, ...],
):  # fmt: skip
    """Keep shares [W, H, R, T] when every eviction time e (in order) keeps `heavy` of the
    middle keys still held: a key evicted once stays out, as in the cache. Soft, a key's
    margin is the lowest (score_e - tau_e) over the evictions it went through, its share
    sigmoid(margin / temperature); hard, the survivors of topk at every time."""
    W, H, E, T = score.shape
    rows = set(at_rows)
    kept: dict[int, mx.array] = {}
    margin = mx.full((W, H, T), UNSEEN) if temperature is not None else None
    alive = mx.ones((W, H, T), dtype=mx.bool_) if temperature is None else None
    for e in range(E):
        s, mid = score[:, :, e], middle[e]
        if temperature is None:
            held = mid & alive
            crowded = held.sum(axis=-1, keepdims=True) > heavy
            top = mx.topk(mx.where(held, s, -mx.inf), heavy, axis=-1).min(axis=-1, keepdims=True)
            alive = mx.where(mid & crowded, held & (s >= top), alive)
            share = alive.astype(mx.float32)
        else:
            held = mx.where(mid, mx.sigmoid(mx.stop_gradient(margin) / temperature), 0.0)
            crowded = held.sum(axis=-1, keepdims=True) > heavy
            tau = _soft_threshold(s, margin, mid, heavy, temperature)
            margin = mx.where(mid & crowded, mx.minimum(margin, s - tau), margin)
            share = mx.sigmoid(margin / temperature)
        if e in rows:
            kept[e] = mx.where(mid, share, 1.0)
    return mx.stack([kept[e] for e in at_rows], axis=2)


def _soft_threshold(
    score: mx.array, margin: mx.array | None, middle: mx.array, heavy: int, temperature: float
):  # fmt: skip
    """tau [..., 1] at which the middle keys' soft shares sigmoid(min(margin, score - tau)
    / temperature) sum to `heavy` (margin None: no earlier evictions): found by bisection,
    its gradient the implicit one, so a step of the gates swaps who is kept and cannot
    keep more."""
    fixed = mx.stop_gradient(score)
    held = None if margin is None else mx.stop_gradient(margin)

    def shares(tau):
        inner = fixed - tau if held is None else mx.minimum(held, fixed - tau)
        return mx.sigmoid(inner / temperature)

    if held is None:  # round 1's search, as it was: --stride 0 trains its gates again
        masked = mx.where(middle, fixed, -mx.inf)
        lo = mx.topk(masked, heavy + 1, axis=-1).min(axis=-1, keepdims=True) - 8 * temperature
        hi = masked.max(axis=-1, keepdims=True) + 8 * temperature
        lo = mx.where(mx.isfinite(lo), lo, hi - 16 * temperature)
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            count = mx.where(middle, shares(mid), 0.0).sum(-1, True)
            lo, hi = mx.where(count > heavy, mid, lo), mx.where(count > heavy, hi, mid)
        tau0 = (lo + hi) / 2
    else:  # every stride: Newton from the hard threshold (between the heavy-th and the
        # next best key still held)
        best = mx.topk(mx.where(middle & (held > 0), fixed, -mx.inf), heavy + 1, axis=-1)
        best = mx.sort(best, axis=-1)
        last, next_ = best[..., 1:2], best[..., 0:1]
        tau0 = mx.where(mx.isfinite(next_), (last + next_) / 2, last - temperature)
        tau0 = mx.where(mx.isfinite(tau0), tau0, 0.0)
        for _ in range(NEWTON_STEPS):
            share = mx.where(middle, shares(tau0), 0.0)
            binds = middle & (fixed - tau0 < held)
            slope = mx.where(binds, share * (1 - share), 0.0).sum(-1, True) / temperature
            step = (share.sum(-1, True) - heavy) / mx.maximum(slope, 1e-6)
            tau0 = tau0 + mx.clip(step, -4 * temperature, 4 * temperature)
    share = shares(tau0)
    slope = mx.where(middle, share * (1 - share), 0.0)
    # d tau: each key moves the count through whichever of its terms binds
    binds = middle if held is None else middle & (fixed - tau0 < held)
    moved = mx.where(binds, score - fixed, 0.0)  # 0, with score's gradient
    if margin is not None:
        moved = moved + mx.where(middle & ~binds, margin - held, 0.0)
    bound = mx.where(binds, slope, 0.0).sum(-1, True)
    return tau0 + (slope * moved).sum(-1, True) / mx.maximum(bound, 1e-12)


def _gate_values(data: LayerData, w: mx.array) -> mx.array:
    return (data.feats * w[None, :, None, :]).sum(axis=-1)  # [W, H, T]


def _aged(age: mx.array | None, ages: mx.array) -> mx.array | None:
    """The age terms [H, R, T] of per-head coefficients `age` [H, 2] (None: none)."""
    if age is None:
        return None
    return (age[:, :, None, None] * ages[None]).sum(axis=1)


def layer_loss(
    data: LayerData, params: dict, cuts: list, reference: list, temperature: float | None,
    at_rows: tuple[int, ...] | None = None,
) -> mx.array:  # fmt: skip
    """The mean over budgets of the output loss relative to `reference` (g = 0's)."""
    g = _gate_values(data, params["w"])
    total = mx.array(0.0)
    for (middle, heavy, ages), ref in zip(cuts, reference, strict=True):
        aged = _aged(params.get("age"), ages)
        keep = _keep(data, g, middle, heavy, temperature, aged, at_rows)
        loss = _output_loss(data, keep).mean()
        total = total + loss / ref
    return total / len(cuts)


def _references(
    data: LayerData, cuts: list, temperature: float | None, at_rows: tuple[int, ...] | None
) -> list[mx.array]:  # fmt: skip
    g = _gate_values(data, mx.zeros(data.feats.shape[1::2]))
    refs = []
    for middle, heavy, _ in cuts:
        loss = _output_loss(data, _keep(data, g, middle, heavy, temperature, None, at_rows))
        refs.append(mx.maximum(loss.mean(), 1e-12))
    return refs


@functools.cache
def _objective(
    heavies: tuple[int, ...], temperature: float, l2: float, at_rows: tuple[int, ...] | None
) -> Callable:  # fmt: skip
    """(params, the layer's arrays, middles, ages, refs) -> (loss, its gradient), compiled
    once per budget split: every layer of a model has the same shapes."""

    def objective(params, feats, base, probs, values, out, gram, middles, ages, refs):
        data = LayerData(feats, base, probs, values, out, gram)
        cuts = list(zip(middles, heavies, ages, strict=True))
        w = params["w"]
        return layer_loss(data, params, cuts, refs, temperature, at_rows) + l2 * (w * w).sum()

    return mx.compile(mx.value_and_grad(objective))


def fit_layer(
    data: LayerData, cuts: list, config: TrainConfig, held: LayerData | None = None,
    at_rows: tuple[int, ...] | None = None,
) -> tuple[mx.array, float | None]:  # fmt: skip
    """(standardised weights [H, F] of one layer's gates, their held-out loss): Adam from
    0 (`mean`). With `held`, the weights kept are those of the check (every `check` steps,
    and 0 itself) with the lowest held-out loss: a layer whose gates do not carry over
    keeps `mean`."""
    refs = _references(data, cuts, config.temperature, at_rows)
    step = _objective(tuple(h for _, h, _ in cuts), config.temperature, config.l2, at_rows)
    arrays = (data.feats, data.base, data.probs, data.values, data.out, data.gram)
    middles, ages = [m for m, _, _ in cuts], [a for _, _, a in cuts]
    H = data.feats.shape[1]
    params = {"w": mx.zeros(data.feats.shape[1::2])}
    if config.age:
        params["age"] = mx.zeros((H, 2))
    opt = optim.Adam(learning_rate=config.lr)
    best, best_loss = params, None
    if held is not None:
        held_refs = _references(held, cuts, None, at_rows)
        best_loss = 1.0  # g = 0 is mean itself: the ratio 1 by definition
    for n in range(1, config.steps + 1):
        _, grad = step(params, *arrays, middles, ages, refs)
        params = opt.apply_gradients(grad, params)
        mx.eval(params, opt.state)
        if held is not None and (n % config.check == 0 or n == config.steps):
            loss = layer_loss(held, params, cuts, held_refs, None, at_rows).item()
            if loss < best_loss:
                best, best_loss = params, loss
    return (params if held is None else best), best_loss


def train_retention(
    model: nn.Module,
    windows: list[list[int]],
    held_out: list[list[int]],
    model_name: str,
    config: TrainConfig = TrainConfig(),
    text: str = "",
    progress: Callable[[int, int], None] | None = None,
    layer_shares: tuple[float | None, ...] | None = None,
) -> Retention:
    """Gates for every layer of `model` from `windows` (token lists of one length), their
    held-out loss measured on `held_out` (see the module doc). `progress(done, total)`:
    after each window recorded and each layer fitted. `layer_shares` (a layer profile's):
    each layer's loss evicts at its own share of each budget, as the cache will."""
    began = time.time()
    T = len(windows[0])
    sizes = [
        CacheSpec("h2o", budget, layer_shares=layer_shares).layer_sizes()
        if layer_shares is not None else [budget] * len(model.layers)
        for budget in config.budgets
    ]  # fmt: skip
    low = max(max(s) for s in sizes) + 16  # rows where every layer's budget is full
    # stride > 0: evictions every `stride` tokens, the rows some of them; 0: the rows alone
    times = np.arange(config.stride, T, config.stride) if config.stride else np.arange(T)
    candidates = times[times >= low]
    if len(candidates) < config.rows:
        raise ValueError(
            f"windows of {T} tokens hold too few rows past layer budgets up to {low - 16} "
            f"(at a stride of {config.stride})"
        )
    rng = np.random.RandomState(config.seed)
    rows = np.sort(rng.choice(candidates, size=config.rows, replace=False)).astype(np.int32)
    times = times.astype(np.int32) if config.stride else rows
    at_rows = tuple(int(i) for i in np.searchsorted(times, rows)) if config.stride else None
    rope = rope_layout(model)
    turns = rope_turns(model, rope) if config.direction else None
    cut_cache: dict = {}

    def cuts_of(layer: int) -> list:
        budgets = tuple(s[layer] for s in sizes)
        if budgets not in cut_cache:
            cut_cache[budgets] = [_segments(b, times, T, config.preset) for b in budgets]
        return cut_cache[budgets]

    total = len(windows) + len(held_out) + len(model.layers)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress:
            progress(done[0], total)

    train = record(model, windows, rows, rope, tick, times, turns)
    held = record(model, held_out, rows, rope, tick, times, turns) if held_out else None
    n_features = feature_count(train[0]["values"][0].shape[-1], rope, config.direction)
    w_all, b_all, held_losses, ages = [], [], [], []
    for n, store in enumerate(train):
        weight = _o_proj_weight(model.layers[n])
        H = store["values"][0].shape[0]
        G = store["probs"][0].shape[1]
        D = store["values"][0].shape[-1]
        if weight is None:
            gram = mx.broadcast_to(mx.eye(D), (H, G, D, D))
        else:
            wo = weight.astype(mx.float32).reshape(weight.shape[0], H, G, D)
            gram = mx.einsum("ohgd,ohge->hgde", wo, wo)
        stacked = mx.stack(store["feats"])  # [W, H, T, F]
        mu = stacked.mean(axis=(0, 2))[None, :, None]
        sigma = mx.maximum(mx.sqrt(((stacked - mu) ** 2).mean(axis=(0, 2))), 1e-6)[None, :, None]
        data = _stack(store, gram, mu, sigma)
        hdata = None if held is None else _stack(held[n], gram, mu, sigma)
        fitted, held_loss = fit_layer(data, cuts_of(n), config, hdata, at_rows)
        w_std = fitted["w"]
        ages.append(fitted.get("age", mx.zeros((H, 2))))
        w = w_std / sigma[0, :, 0]  # g = ((f - mu) / sigma) . w_std = f . w + b
        b = -(mu[0, :, 0] * w).sum(axis=-1)
        w_all.append(w)
        b_all.append(b)
        if held_loss is not None:
            held_losses.append(held_loss)
            held[n] = None
        del data, store, hdata
        train[n] = None
        tick()
    w = mx.stack(w_all)
    assert w.shape[-1] == n_features
    training = {
        "text": text,
        "windows": len(windows),
        "held_out_windows": len(held_out),
        "tokens": T,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
        "held_out_loss": round(float(np.mean(held_losses)), 5) if held_losses else None,
        "held_out_loss_per_layer": [round(x, 4) for x in held_losses],
        "layer_budgets": [list(s) for s in sizes] if layer_shares is not None else None,
        "seconds": round(time.time() - began, 1),
    }
    age = mx.stack(ages) if config.age else None
    b = mx.stack(b_all)
    return Retention(model_name, signature(model), rope, "mean", w, b, training, age, turns)
