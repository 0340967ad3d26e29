"""Per-layer KV budgets: what eviction costs each layer, and the shares that follow.

Layers differ in what eviction costs them. On the default model, bounding one
layer's cache alone (all others full) raises perplexity by up to ~8% in layer 20 (at max_kv 32)
and by nothing measurable in a third of the layers (docs/layer_budgets.md). A
`LayerProfile` records that sensitivity per layer (the mean NLL increase, in nats
per token, when only that layer's cache is bounded at the calibration's max_kv) for
the policies it was measured under; `shares_from_sensitivity` turns it into
weights, and `CacheSpec.layer_shares` splits layers x max_kv tokens by them (as
many tokens in all as a uniform split: the same memory). A square root and a clip
to [0.75, 2] keep it modest: merging caches (h2o-merge) lose when a layer is cut to
half, and the measurement is noisy.

`calibrate` measures a profile on any text: every layer's one-layer-bounded run
goes as one row of a single batched forward pass, chunk by chunk (real caches,
real eviction), so a 512-token window costs about as much as prefilling 31 copies
of it. The server uses a profile whose weights fingerprint matches the model's
(`find_profile`, else one measured on the model of the same name; the embedded default
model's ships in cache/profiles/).
`h2o-server calibrate` makes one for another model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from cache.batching.batch import batch_caches
from cache.factory import make_cache
from config.policies import FULL, H2O, POLICIES
from models.shape import layer_windows

PROFILES = Path(__file__).parent / "profiles"
BASE_POLICY = H2O.name  # whose profile serves a policy that has none of its own (h2o-q8, ...)
SHARE_POWER, SHARE_MIN, SHARE_MAX = 0.5, 0.75, 2.0


@dataclass(frozen=True)
class LayerProfile:
    model: str  # the model it was measured on
    identity: str  # a fingerprint of its weights (server/sessions/spill.py model_identity)
    # policy -> per-layer NLL increase (nats/token); None for a sliding-window layer
    sensitivity: dict[str, list[float | None]]
    calibration: dict  # how it was measured: text, windows, tokens, max_kv, chunk

    def shares(self, policy: str) -> tuple[float | None, ...] | None:
        """Layer shares for `policy` (None: it cannot take them, or nothing was measured)."""
        if not POLICIES[policy].layer_budgeted:
            return None
        sensitivity = self.sensitivity.get(policy) or self.sensitivity.get(BASE_POLICY)
        return None if sensitivity is None else shares_from_sensitivity(sensitivity)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a layer profile ({e})") from e


def find_profile(
    identity: str, model: str, folder: Path = PROFILES
) -> tuple[LayerProfile, Path] | None:
    """The profile in `folder` measured on weights with this fingerprint, else one measured
    on the model of this name (the same weights in another dtype, e.g. float16 on a GPU)."""
    profiles = [(LayerProfile.load(path), path) for path in sorted(folder.glob("*.json"))]
    for match in (lambda p: p.identity == identity, lambda p: p.model == model):
        found = [(p, path) for p, path in profiles if match(p)]
        if found:
            return found[0]
    return None


def shares_from_sensitivity(
    sensitivity: list[float | None],
    power: float = SHARE_POWER,
    low: float = SHARE_MIN,
    high: float = SHARE_MAX,
) -> tuple[float | None, ...]:
    """Weights of mean 1 within [low, high], growing as sensitivity**power; None stays None.

    A layer measured as costing nothing (or less: noise) gets the floor; a small
    epsilon keeps the ranking among those near zero irrelevant.
    """
    measured = [max(0.0, s) for s in sensitivity if s is not None]
    if not measured:
        return tuple(sensitivity)
    eps = 0.05 * (sum(measured) / len(measured)) + 1e-12
    weights = [(s + eps) ** power for s in measured]
    shares = [w * len(weights) / sum(weights) for w in weights]
    for _ in range(100):  # clip, then rescale to mean 1, until the clip holds
        shares = [min(high, max(low, x)) for x in shares]
        mean = sum(shares) / len(shares)
        if abs(mean - 1) < 1e-9:
            break
        shares = [x / mean for x in shares]
    it = iter(shares)
    return tuple(None if s is None else round(next(it), 4) for s in sensitivity)


def calibrate(
    model,
    windows: list[list[int]],
    policy: str,
    max_kv: int,
    chunk: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> list[float | None]:
    """Per layer, the mean NLL increase (nats/token) over `windows` (token lists of one
    length) when only that layer's cache is `policy` at `max_kv` and every other is full.

    Prompts go `chunk` tokens per forward pass (eviction between chunks, as a
    server's prefill evicts between its chunks); sliding-window layers give None.
    """
    layer_kinds = layer_windows(model)
    global_layers = [i for i, w in enumerate(layer_kinds) if w is None]
    totals = [0.0] * len(global_layers)
    for n, window in enumerate(windows):
        tokens = mx.array(window)
        bounded = make_cache(model, policy, max_kv=max_kv)  # row k takes layer k's cache
        rows = []
        for layer in [*global_layers, None]:  # the last row bounds nothing: the reference
            caches = make_cache(model, FULL.name)
            if layer is not None:
                caches[layer] = bounded[layer]
            rows.append(caches)
        caches = batch_caches(rows)
        nll = mx.zeros((len(rows),))
        for start in range(0, tokens.size - 1, chunk):
            stop = min(start + chunk, tokens.size - 1)
            inputs = mx.broadcast_to(tokens[None, start:stop], (len(rows), stop - start))
            logits = model(inputs, cache=caches).astype(mx.float32)
            targets = mx.broadcast_to(tokens[None, start + 1 : stop + 1], inputs.shape)
            picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
            nll = nll + (mx.logsumexp(logits, axis=-1) - picked).sum(axis=1)
            mx.eval(nll)
        increase = ((nll[:-1] - nll[-1]) / (tokens.size - 1)).tolist()
        totals = [t + d for t, d in zip(totals, increase, strict=True)]
        if progress:
            progress(n + 1, len(windows))
    per_layer: list[float | None] = [None] * len(layer_kinds)
    for layer, total in zip(global_layers, totals, strict=True):
        per_layer[layer] = round(total / len(windows), 6)
    return per_layer


def calibration_windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens of Python's own reference documentation (the
    `pydoc_data` topics every CPython ships): prose and code, none of it evaluation text."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < count * length:
        raise ValueError(f"the calibration text has {len(ids)} tokens; {count} x {length} asked")
    return [ids[i * length : (i + 1) * length] for i in range(count)]
