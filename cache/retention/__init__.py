"""Retention gates: a model's learned per-head weights for the `learned` score rule.

A gate is a linear function, per layer and KV head, of what an evicting cache holds for
each token: its key and value. Keys are stored after RoPE, so the gate reads what RoPE
leaves unchanged: the norm of each rotated pair of key channels, plus the channels RoPE
does not turn, the value itself, and the log norms of key and value; and the key turned
back to where it was before RoPE (by its position), read as a fixed query would read it
(`features`). Its output g is added to the log of the base rule's rank (`mean`),
i.e. the rank is multiplied by exp(g): a token whose key and value look like those the
model keeps needing stays longer (cache/scores/learned.py). How g is trained:
cache/retention/training.py; what it measured: docs/retention.md.

Weights are one small safetensors file per model (the array `w` [layers, kv_heads,
features], float32, and a JSON metadata record), found by a fingerprint of the model's
weights that does not depend on their dtype (`signature`): in the package
(cache/retention/, the embedded models') or in the user's folder, where
`h2o-server calibrate --retention` writes. A model with none ranks by the base rule
(make_cache says so once; the server lists it under `notices`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

log = logging.getLogger("h2o_server.retention")

PACKAGED = Path(__file__).parent  # the embedded models' gates ship beside this module
USER = Path.home() / ".cache" / "h2o-server" / "retention"
G_CLIP = 20.0  # |g| at most this: exp(g) stays finite in float32


@dataclass(frozen=True)
class RopeLayout:
    """How the model's RoPE pairs key channels: (i, i + dims/2) or, `traditional`,
    (2i, 2i + 1), over the first `dims` channels of the head."""

    dims: int
    traditional: bool = False


def _pairs(turned: mx.array, rope: RopeLayout) -> tuple[mx.array, mx.array]:
    """The two channels of each RoPE pair, [..., dims/2] each."""
    if rope.traditional:
        return turned[..., 0::2], turned[..., 1::2]
    half = rope.dims // 2
    return turned[..., :half], turned[..., half:]


def unrotated(keys: mx.array, positions: mx.array, turn: mx.array, rope: RopeLayout):
    """[..., n, dims/2] x 2: the turned channels of post-RoPE keys [..., n, D] as they were
    before RoPE turned them by positions [..., n] x `turn` (radians per position, per pair)."""
    a, b = _pairs(keys[..., : rope.dims], rope)
    angle = positions.astype(mx.float32)[..., None] * turn
    cos, sin = mx.cos(angle), mx.sin(angle)
    return a * cos + b * sin, b * cos - a * sin


def features(
    keys: mx.array,
    values: mx.array,
    rope: RopeLayout,
    positions: mx.array | None = None,
    turn: mx.array | None = None,
) -> mx.array:
    """[..., n, D] keys (post-RoPE) and values -> [..., n, F] gate inputs that RoPE leaves
    unchanged: rotated pairs' norms, unrotated key channels, the value, log norms; and with
    `turn` (and the keys' positions [..., n]) the key's turned channels before RoPE, its
    direction, which a linear gate reads as a fixed query would (expected attention)."""
    keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    a, b = _pairs(keys[..., : rope.dims], rope)
    parts = [mx.sqrt(a * a + b * b), keys[..., rope.dims :], values]
    k_norm = mx.sqrt((keys * keys).sum(axis=-1, keepdims=True))
    v_norm = mx.sqrt((values * values).sum(axis=-1, keepdims=True))
    parts.append(mx.log(mx.maximum(mx.concatenate([k_norm, v_norm], axis=-1), 1e-6)))
    if turn is not None:
        parts += unrotated(keys, positions, turn, rope)
    return mx.concatenate(parts, axis=-1)


def feature_count(head_dim: int, rope: RopeLayout, direction: bool = False) -> int:
    return rope.dims // 2 + (head_dim - rope.dims) + head_dim + 2 + (rope.dims if direction else 0)


def gate(
    keys: mx.array,
    values: mx.array,
    w: mx.array,
    b: mx.array,
    rope: RopeLayout,
    positions: mx.array | None = None,
    turn: mx.array | None = None,
):
    """g [B, H, n] of held keys and values [B, H, n, D] (at positions [B, H, n], read with
    `turn`) under one layer's weights w [H, F] and offsets b [H] (which centre g on the
    training tokens; a head's ranking ignores them)."""
    feats = features(keys, values, rope, positions, turn)
    g = (feats * w[None, :, None, :]).sum(axis=-1) + b[None, :, None]
    return mx.clip(g, -G_CLIP, G_CLIP)


def age_term(age: mx.array, positions: mx.array, seen, max_kv: int) -> mx.array:
    """[B, H, n]: per head a log(t - i) + c (t - i) / max_kv, `age` [H, 2] = (a, c), for
    tokens at `positions` [B, H, n] with `seen` tokens seen (t - i >= 1)."""
    since = mx.maximum(seen - positions, 1).astype(mx.float32)
    a, c = age[None, :, None, 0], age[None, :, None, 1]
    return a * mx.log(since) + c * (since / max_kv)


@dataclass(frozen=True)
class Retention:
    """A model's gates: `w` [layers, kv_heads, features], `b` [layers, kv_heads], and how
    they were made."""

    model: str  # the model it was trained on
    signature: str  # `signature(model)`
    rope: RopeLayout
    base: str  # the score rule whose rank the gate multiplies
    w: mx.array = field(repr=False)
    b: mx.array = field(repr=False)
    training: dict = field(default_factory=dict)  # text, windows, budgets, losses, seconds
    # [layers, kv_heads, 2]: per head, g also adds a log(t - i) + c (t - i) / max_kv (how
    # much the head prefers recent tokens); None: no age terms (older files).
    age: mx.array | None = field(default=None, repr=False)
    # [layers, dims/2]: each layer's RoPE angle per position per pair (`rope_turns`); with
    # it the gates read the key's direction before RoPE (`features`). None: older files.
    turn: mx.array | None = field(default=None, repr=False)

    def layer(self, i: int) -> tuple[mx.array, mx.array]:
        return self.w[i], self.b[i]

    def layer_age(self, i: int) -> mx.array | None:
        return None if self.age is None else self.age[i]

    def layer_turn(self, i: int) -> mx.array | None:
        return None if self.turn is None else self.turn[i]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "model": self.model,
            "signature": self.signature,
            "rope": asdict(self.rope),
            "base": self.base,
            "training": self.training,
        }
        arrays = {"w": self.w, "b": self.b}
        for name in ("age", "turn"):
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        # a whole file or none: a reader never sees half of it (write beside, then rename)
        partial = path.with_name(f".{path.stem}.partial.safetensors")
        mx.save_safetensors(str(partial), arrays, metadata={"retention": json.dumps(meta)})
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Retention:
        try:
            arrays, metadata = mx.load(str(path), return_metadata=True)
            mx.eval(arrays)  # read now: mx.load is lazy, and calibrate may rewrite the file
            meta = json.loads(metadata["retention"])
            return cls(
                meta["model"], meta["signature"], RopeLayout(**meta["rope"]), meta["base"],
                arrays["w"], arrays["b"], meta.get("training", {}), arrays.get("age"),
                arrays.get("turn"),
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a retention file ({e})") from e


def signature(model: nn.Module) -> str:
    """A fingerprint of a model's weights that float32 and half copies share: parameter
    names and shapes, and a sample of values at half precision."""
    digest = hashlib.sha256()
    for name, array in tree_flatten(model.parameters()):
        sample = array.reshape(-1)[:16].astype(mx.float16)
        mx.eval(sample)
        digest.update(f"{name}{array.shape}".encode())
        digest.update(bytes(memoryview(sample)))
    return digest.hexdigest()[:32]


def rope_layout(model: nn.Module) -> RopeLayout:
    """The RoPE pairing of the model's attention (its first layer with a `rope`)."""
    for layer in getattr(model, "layers", []):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        if rope is not None and hasattr(rope, "dims"):
            return RopeLayout(int(rope.dims), bool(getattr(rope, "traditional", False)))
    raise ValueError("no RoPE module found on the model's attention layers")


def rope_turns(model: nn.Module, rope: RopeLayout) -> mx.array:
    """[layers, dims/2]: the angle each layer's RoPE turns each key pair by per position,
    read off the module itself (turning a probe by one position), so scaled and per-layer
    bases (Llama 3's, Gemma 3's local and global layers) come out as the model applies them."""
    half = rope.dims // 2
    probe = mx.concatenate([mx.ones((half,)), mx.zeros((half,))])
    if rope.traditional:
        probe = mx.stack([mx.ones((half,)), mx.zeros((half,))], axis=-1).reshape(-1)
    turns = []
    for layer in model.layers:
        module = layer.self_attn.rope
        turned = module(mx.broadcast_to(probe, (1, 1, 2, rope.dims)), offset=0)[0, 0, 1]
        a, b = _pairs(turned.astype(mx.float32), rope)
        turns.append(mx.arctan2(b, a))
    return mx.stack(turns)


def folders() -> list[Path]:
    """Where retention files are looked for: the user's (calibrated) first, then the
    package's."""
    return [USER, PACKAGED]


_REGISTERED: dict[str, Retention] = {}  # by signature: gates made in this process


def register(retention: Retention) -> None:
    """Use these gates for models of their signature from now on (what `calibrate` just
    trained, tests): found before any file."""
    _REGISTERED[retention.signature] = retention
    forget()


@functools.cache
def _by_signature(sig: str, where: tuple[Path, ...]) -> Retention | None:
    for folder in where:
        for path in sorted(folder.glob("[!.]*.safetensors")):  # not one being written
            try:
                found = Retention.load(path)
            except ValueError as e:
                log.warning("%s", e)
                continue
            if found.signature == sig:
                return found
    return None


def find_retention(sig: str, where: list[Path] | None = None) -> Retention | None:
    """The retention gates for weights of this signature (registered, else a file), or
    None."""
    if sig in _REGISTERED:
        return _REGISTERED[sig]
    return _by_signature(sig, tuple(where or folders()))


def for_model(model: nn.Module) -> Retention | None:
    """The model's retention gates, found once per model object."""
    found = getattr(model, "_h2o_retention", False)
    if found is False:
        found = find_retention(signature(model))
        object.__setattr__(model, "_h2o_retention", found)
    return found


def forget(model: nn.Module | None = None) -> None:
    """Look again next time (a new file was written)."""
    _by_signature.cache_clear()
    from cache.scores.learned import forget_weights

    forget_weights()
    if model is not None and hasattr(model, "_h2o_retention"):
        object.__delattr__(model, "_h2o_retention")


def no_weights_notice(rule: str = "learned", base: str = "mean") -> str:
    return (
        f"score rule {rule}: no retention weights for this model, so it ranks by {base} "
        "(`h2o-server calibrate --retention` trains them)"
    )
