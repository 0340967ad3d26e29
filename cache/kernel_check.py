"""Each GPU kernel the server will use checks itself on the device at start-up.

The Metal kernels had never run on Apple hardware when they shipped, and a driver or an
MLX release can change what a kernel computes. `check_kernels(preference)` runs one
small case of every kind of call (kernels.KINDS: dense and quantized decode attention,
KVarN decode attention, a prompt's and a decode's key weights) on each GPU backend the
preference can reach, against the reference (MLX ops) on the same inputs. A kind that
raises, or differs beyond TOLERANCE, is withdrawn from that backend (kernels.withdraw):
its calls take the reference from then on. Each withdrawal is one notice (logged by the
caller and shown by /health); nothing runs where only the reference exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from cache.policies.kvarn_tiles import encode_keys, encode_values
from kernels import AUTO, KINDS, available_backends, get_backend, reference, withdraw
from kernels.dispatch import Backend
from kernels.kvarn import TileFormat, kvarn_sdpa_with_probs

log = logging.getLogger("h2o_server.kernels")

# |got - want| <= TOLERANCE * (1 + |want|). Loose enough for a GPU's TF32 matmuls in the
# reference, far below what a wrong kernel gives (errors of order one).
TOLERANCE = 2e-3
D, N_KV, GQA, L_K, SCALE = 64, 2, 2, 48, 64**-0.5
KVARN = TileFormat(tile=32, key_bits=4, value_bits=2, group_size=32)

Pairs = list[tuple[mx.array, mx.array]]  # (from the kernel, from the reference)


def _inputs(L_q: int = 1, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, N_KV * GQA, L_q, D), dtype=np.float32)
    k, v = (rng.standard_normal((1, N_KV, L_K, D), dtype=np.float32) for _ in range(2))
    return mx.array(q), mx.array(k), mx.array(v)


def _dense(b: Backend) -> Pairs | None:
    q, k, v = _inputs()
    if not b.supports(q, k, None):
        return None
    want = reference.sdpa_with_scores(q, k, v, SCALE)
    return list(zip(b.dense(q, k, v, SCALE, None), want, strict=True))


def _quantized(b: Backend) -> Pairs | None:
    q, k, v = _inputs(seed=1)
    k_q, v_q = (mx.quantize(x, group_size=64, bits=8) for x in (k, v))
    if not b.supports(q, k_q[0], None, group_size=64, bits=8):
        return None
    got = b.quantized(q, k_q, v_q, SCALE, None, 64, 8)
    want = reference.quantized_sdpa_with_scores(q, k_q, v_q, SCALE, None, 64, 8)
    return list(zip(got, want, strict=True))


def _kvarn(b: Backend) -> Pairs | None:
    """[dense front | one packed tile | dense tail], as an h2o-kvarn cache hands it over."""
    q, k, v = _inputs(seed=2)
    front, tile = 4, KVARN.tile
    sides = []
    for x, encode in ((k, encode_keys), (v, encode_values)):
        tiles = encode(x[:, :, front : front + tile].reshape(1, N_KV, 1, tile, D), KVARN)
        sides.append([x[:, :, :front], tiles, x[:, :, front + tile :]])
    keys, values = sides
    if not b.supports_kvarn(q, keys, None, KVARN):
        return None
    want = kvarn_sdpa_with_probs(q, keys, values, SCALE, None, KVARN)[:2]
    return list(zip(b.kvarn(q, keys, values, SCALE, None, KVARN), want, strict=True))


def _prompt(b: Backend) -> Pairs | None:
    q, k, _ = _inputs(L_q=8, seed=3)
    held = mx.array(np.random.default_rng(3).random((1, N_KV, L_K), dtype=np.float32))
    if not b.supports_prompt(q, k, "causal", held):
        return None
    want = reference.prompt_weights(q, k, SCALE, "causal", held)
    return [(b.prompt_weights(q, k, SCALE, "causal", held), want)]


def _decode_weights(b: Backend) -> Pairs | None:
    q, k, v = _inputs(seed=4)
    _, logits = reference.sdpa_with_scores(q, k, v, SCALE)
    held = mx.array(np.random.default_rng(4).random((1, N_KV, L_K), dtype=np.float32))
    if not b.supports_decode_weights(logits, held):
        return None
    return [(b.decode_weights(logits, held), reference.decode_weights(logits, held))]


CASES: dict[str, Callable[[Backend], Pairs | None]] = {
    "dense": _dense,
    "quantized": _quantized,
    "kvarn": _kvarn,
    "prompt": _prompt,
    "decode_weights": _decode_weights,
}
assert tuple(CASES) == KINDS


def mismatch(pairs: Pairs) -> str | None:
    """What differs between the kernel's arrays and the reference's, or None."""
    for i, (got, want) in enumerate(pairs):
        a, e = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        if a.shape != e.shape:
            return f"output {i}: shape {a.shape}, reference {e.shape}"
        finite = np.isfinite(e)
        if not np.array_equal(finite, np.isfinite(a)):
            return f"output {i}: non-finite values where the reference has none (or the reverse)"
        err = np.abs(a[finite] - e[finite]) / (1 + np.abs(e[finite]))
        if err.size and err.max() > TOLERANCE:
            return f"output {i}: off by up to {err.max():.3g} (tolerance {TOLERANCE:g})"
    return None


def check_kernels(preference: str) -> list[str]:
    """Check every kind of call on each GPU backend `preference` can reach; withdraw the
    kinds that fail and return one notice for each."""
    gpus = [n for n in available_backends() if n != "reference"]
    names = gpus if preference == AUTO else [n for n in gpus if n == preference]
    notices = []
    for name in names:
        backend = get_backend(name)
        for kind, case in CASES.items():
            try:
                pairs = case(backend)
                problem = None if pairs is None else mismatch(pairs)
            except Exception as e:  # a kernel that fails to build or launch
                problem = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if problem is None:
                log.info("kernel check: %s %s matches the reference", name, kind)
                continue
            withdraw(name, kind)
            notices.append(
                f"{name} kernel for {kind.replace('_', ' ')} calls failed its start-up check "
                f"against the reference ({problem}): those calls run on the reference"
            )
    return notices
