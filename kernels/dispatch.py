"""Pick an attention backend per call: the preferred one where it fits, else the reference.

Order of preference under `auto`: metal, cuda, reference. A named backend that this
machine lacks raises ValueError (`check_backend`); a named GPU backend still hands
shapes it does not support (prefill chunks, odd head dims, split K/V widths) to the
reference, so a forced run never fails on them, and says so in one log line per kind
of call. Which backend to prefer is decided once, by the caller (cache/attention.py
holds that choice); nothing here is global but that log's memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from kernels import cuda, metal, reference
from kernels.kvarn import TileFormat, kvarn_sdpa_with_probs
from kernels.reference import Mask, QuantizedTensor

AUTO = "auto"
# The kinds of call a GPU backend takes, each withdrawn on its own (`withdraw`).
KINDS = ("dense", "quantized", "kvarn", "prompt", "decode_weights")

log = logging.getLogger("h2o_server.kernels")
_told: set[tuple[str, str]] = set()  # (forced backend, kind of call) already logged
# (backend, kind) pairs whose start-up check failed (cache/kernel_check.py): such calls
# take the reference as if the backend did not support them.
_withdrawn: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Backend:
    is_available: Callable[[], bool]
    # supports(q, k, mask, group_size=..., bits=...): k is the keys or the packed key words.
    supports: Callable[..., bool]
    dense: Callable[..., tuple[mx.array, mx.array]]
    quantized: Callable[..., tuple[mx.array, mx.array]]
    # supports_kvarn(q, keys, mask, fmt), kvarn(q, keys, values, scale, mask, fmt): KVarN
    # storage, keys/values [front, tiles, tail] (kernels/kvarn.py).
    supports_kvarn: Callable[..., bool]
    kvarn: Callable[..., tuple[mx.array, mx.array]]
    # supports_prompt(q, k, mask, held), prompt_weights(q, k, scale, mask, held): a prompt
    # block's summed softmax weight per key added to the held scores (no logits returned).
    supports_prompt: Callable[..., bool]
    prompt_weights: Callable[..., mx.array]
    # supports_decode_weights(scores, held), decode_weights(scores, held): a decode step's
    # summed softmax weight per key, from the logits its attention exported, added to the
    # held scores in one launch.
    supports_decode_weights: Callable[..., bool]
    decode_weights: Callable[..., mx.array]


def _reference_kvarn(q, keys, values, scale: float, mask: Mask, fmt: TileFormat):
    return kvarn_sdpa_with_probs(q, keys, values, scale, mask, fmt)[:2]


_BACKENDS: dict[str, Backend] = {
    **{
        name: Backend(
            gpu.is_available,
            gpu.supports,
            gpu.sdpa_with_scores,
            gpu.quantized_sdpa_with_scores,
            gpu.supports_kvarn,
            gpu.kvarn_sdpa_with_scores,
            gpu.supports_prompt,
            gpu.prompt_weights,
            gpu.supports_decode_weights,
            gpu.decode_weights,
        )
        for name, gpu in (("metal", metal), ("cuda", cuda))
    },
    "reference": Backend(
        lambda: True,
        lambda *args, **kwargs: True,
        reference.sdpa_with_scores,
        reference.quantized_sdpa_with_scores,
        lambda *args, **kwargs: True,
        _reference_kvarn,
        lambda *args, **kwargs: True,
        reference.prompt_weights,
        lambda *args, **kwargs: True,
        reference.decode_weights,
    ),
}
BACKEND_NAMES = (AUTO, *_BACKENDS)


def get_backend(name: str) -> Backend:
    """One backend's functions, called directly (benchmarks, tests); no fallback."""
    return _BACKENDS[check_backend(name, allow_auto=False)]


def available_backends() -> list[str]:
    return [name for name in _BACKENDS if _is_available(name)]


@cache
def _is_available(name: str) -> bool:
    # The device does not change while the process runs; decode asks once per layer.
    return _BACKENDS[name].is_available()


def withdraw(name: str, kind: str) -> None:
    """Send no more `kind` calls (one of KINDS) to GPU backend `name`: the reference takes
    them. For a kernel that failed its check against the reference on this device."""
    if name == "reference" or kind not in KINDS:
        raise ValueError(f"cannot withdraw {kind!r} from {name!r}")
    _withdrawn.add((name, kind))


def withdrawn() -> set[tuple[str, str]]:
    """The (backend, kind) pairs withdrawn so far."""
    return set(_withdrawn)


def check_backend(name: str, allow_auto: bool = True) -> str:
    """`name` if it is `auto` or a backend this machine has, else a ValueError saying why."""
    if name == AUTO and allow_auto:
        return name
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend {name!r}: known backends are {list(BACKEND_NAMES)}")
    if not _is_available(name):
        raise ValueError(
            f"kernel backend {name!r} is not available on this machine "
            f"(available: {available_backends()})"
        )
    return name


def select_backend(
    preference: str,
    q: mx.array,
    k: mx.array,
    mask: Mask = None,
    *,
    group_size: int | None = None,
    bits: int | None = None,
    value_bits: int | None = None,
    pools: Sequence[mx.array] = (),
) -> str:
    """The backend for this call (k: keys, or the packed key words when quantized; pools:
    the dense keys of a front and tail read with packed K/V in one call)."""
    storage = "dense" if bits is None else f"{bits}-bit"
    if value_bits not in (None, bits):  # the GPU kernels take one width for K and V
        return _fall_back(preference, q, f"{storage} keys, {value_bits}-bit values")
    pick = {"group_size": group_size, "bits": bits, "pools": pools}
    kind = "dense" if bits is None else "quantized"
    return _first(preference, kind, lambda b: b.supports(q, k, mask, **pick), q, storage)


def select_kvarn_backend(
    preference: str, q: mx.array, keys: list, mask: Mask, fmt: TileFormat
) -> str:
    """The backend for attention over one KVarN part (keys: [front, tiles, tail])."""
    storage = f"KVarN k{fmt.key_bits}v{fmt.value_bits}"
    supports = lambda b: b.supports_kvarn(q, keys, mask, fmt)  # noqa: E731
    return _first(preference, "kvarn", supports, q, storage)


def select_prompt_backend(
    preference: str, q: mx.array, k: mx.array, mask: Mask, held: mx.array
) -> str:
    """The backend that adds a prompt block's key weights to `held` (dense keys)."""
    supports = lambda b: b.supports_prompt(q, k, mask, held)  # noqa: E731
    return _first(preference, "prompt", supports, q, "dense (prompt weights)")


def select_weights_backend(preference: str, scores: mx.array, held: mx.array) -> str:
    """The backend that adds a decode step's key weights (from its logits) to `held`: the
    one whose attention kernel exported them, where it takes them (any decode shape it
    attends), else the reference (the attention's fallback already said so)."""
    supports = lambda b: b.supports_decode_weights(scores, held)  # noqa: E731
    return _preferred(preference, "decode_weights", supports) or "reference"


def _first(
    preference: str, kind: str, supports: Callable[[Backend], bool], q: mx.array, storage: str
) -> str:
    """The preferred backend (under auto: the first GPU one) present, not withdrawn from
    this kind of call and supporting it, else the reference."""
    return _preferred(preference, kind, supports) or _fall_back(preference, q, storage)


def _preferred(preference: str, kind: str, supports: Callable[[Backend], bool]) -> str | None:
    candidates = [n for n in _BACKENDS if n != "reference"] if preference == AUTO else [preference]
    for name in candidates:
        if _is_available(name) and (name, kind) not in _withdrawn and supports(_BACKENDS[name]):
            return name
    return None


def _fall_back(preference: str, q: mx.array, storage: str) -> str:
    """The reference; a backend the user named that does not take this call says so, once
    per kind of call (under auto the reference is the plan, not a fallback; described
    only then: decode asks per layer and step)."""
    if preference in (AUTO, "reference"):
        return "reference"
    queries = "decode" if q.shape[2] == 1 else "prompt"
    what = f"{queries} attention over {storage} K/V, head dim {q.shape[-1]}, {q.dtype}"
    if (preference, what) not in _told:
        _told.add((preference, what))
        log.warning(
            "kernel backend %s does not take %s: such calls run on the reference (MLX ops)",
            preference,
            what,
        )
    return "reference"


def sdpa_with_scores(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask = None, backend: str = AUTO
) -> tuple[mx.array, mx.array]:
    """Attention output and float32 pre-softmax scores [B, n_q_heads, L_q, L_k]."""
    name = select_backend(backend, q, k, mask)
    return _BACKENDS[name].dense(q, k, v, scale, mask)


def quantized_sdpa_with_scores(
    q: mx.array,
    k_q: QuantizedTensor,
    v_q: QuantizedTensor,
    scale: float,
    mask: Mask = None,
    group_size: int = 64,
    bits: int = 8,
    value_bits: int | None = None,
    backend: str = AUTO,
) -> tuple[mx.array, mx.array]:
    """`sdpa_with_scores` over K/V packed by `mx.quantize`; values may have their own width."""
    name = select_backend(
        backend, q, k_q[0], mask, group_size=group_size, bits=bits, value_bits=value_bits
    )
    if name == "reference":
        return reference.quantized_sdpa_with_scores(
            q, k_q, v_q, scale, mask, group_size, bits, value_bits=value_bits
        )
    return _BACKENDS[name].quantized(q, k_q, v_q, scale, mask, group_size, bits)
