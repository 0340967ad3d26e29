"""How a scored layer attends: the one place that picks the path and the kernel backend.

A scored cache hands its stored K/V to attention as one or more parts, each with a
`KVFormat` (`kv_segments`): dense arrays, or mx.quantize's packed (words, scales,
biases) at some key/value width, either possibly Hadamard-rotated (the query is
rotated in and the output back once), or KVarN storage (kernels/kvarn.py; a decode
query on Metal/CUDA reads its tiles in the decode kernel, everything else takes the
reference). `ScoredAttention` runs each part through a kernel
from kernels/ (`sdpa_with_scores` for dense parts; for packed parts the fused
`quantized_sdpa_with_scores`, or mx.dequantize and the dense kernel when the
`dequantize` path is chosen) on the backend it was configured with, and merges
parts by log-sum-exp; one decode query over dense and mx.quantize parts on the
reference backend takes a single softmax over all their logits instead, and on a GPU
backend [dense | packed | dense] parts of one width go to one kernel call. A prompt
(more than one query) reads packed parts (either kind) dequantized once per call,
as one dense part, through the dense kernel: a matmul
kernel beats the packed one there (1024-token prefill of rotated h2o-q4 on CPU:
21 s -> 4.2 s, dense h2o 4.0 s). On a GPU a prompt over one dense part takes its
output from one fused mx.fast SDPA call and, under the `attn` rule, its scores from a
two-pass kernel over K (kernels/src/prompt_weights.body: no logits); other rules take a
logits-only pass in query blocks.
One instance, `ATTENTION`, serves the router; `configure` sets its backend (from
`--kernel` or H2O_KERNEL, read once) and quantized path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map

from kernels import (
    AUTO,
    available_backends,
    check_backend,
    get_backend,
    reference,
    select_backend,
    select_kvarn_backend,
    select_prompt_backend,
    select_weights_backend,
)
from kernels.hadamard import rotate
from kernels.kvarn import TileFormat, dequantize_storage, kvarn_sdpa_with_probs
from kernels.reference import bias_as_mask, expand_mask, packed_matmul

QUANTIZED_PATHS = ("fused", "dequantize")
QUERY_BLOCK = 128  # prompt queries attended at once by a scored layer (bounds its memory)
BACKEND_ENV = "H2O_KERNEL"


@dataclass(frozen=True)
class KVFormat:
    """How one part of a cache's K/V is stored: dense, or packed at these widths."""

    key_bits: int | None = None  # None: dense arrays
    value_bits: int | None = None
    group_size: int = 64
    rotated: bool = False  # stored Hadamard-rotated along the head dim (kernels/hadamard.py)
    tile: int | None = None  # KVarN storage [front, tiles, tail] (kernels/kvarn.py)

    @property
    def packed(self) -> bool:
        return self.key_bits is not None

    @property
    def tiles(self) -> TileFormat:
        """KVarN's tile layout (for `tile` formats)."""
        return TileFormat(self.tile, self.key_bits, self.value_bits, self.group_size)


DENSE = KVFormat()


def unrotated(fmt: KVFormat) -> KVFormat:
    return KVFormat(fmt.key_bits, fmt.value_bits, fmt.group_size)


class ScoredAttention:
    """Attention for layers whose cache scores keys: the output, with the scores folded in."""

    def __init__(
        self,
        backend: str = AUTO,
        quantized_path: str = "fused",
        block: int = QUERY_BLOCK,
        fused_prefill: bool | None = None,
        eager_scores: bool = True,
        compiled_decode: bool = True,
    ):
        self.backend = AUTO
        self.quantized_path = "fused"
        self.block = block
        # Each call's scores computed with it (`start_scores`); False leaves them lazy, as
        # before stop 45 (`bench.decode_parts --compare scores` measures both).
        self.eager_scores = eager_scores
        # A prompt's output from one mx.fast SDPA call, its scores in a separate pass of
        # query blocks. None: on a GPU, where that prefills 1.09-1.47x faster at the same
        # peak (docs/gpu.md, H200); on the CPU the plain matmuls win (bench.prefill_paths).
        self.fused_prefill = fused_prefill
        # A cache with a fixed-shape decode (an H2O slab's dense rows) attends and scores in
        # one compiled call; False takes the op-by-op path (tests compare the two).
        self.compiled_decode = compiled_decode
        self.configure(backend, quantized_path)

    def configure(self, backend: str | None = None, quantized_path: str | None = None) -> None:
        """Set the kernel backend (auto, reference, metal, cuda) and the quantized path."""
        if backend is not None:
            self.backend = check_backend(backend)  # raises for one this machine lacks
        if quantized_path is not None:
            if quantized_path not in QUANTIZED_PATHS:
                raise ValueError(
                    f"quantized attention path {quantized_path!r}: choose from {QUANTIZED_PATHS}"
                )
            self.quantized_path = quantized_path

    def attend_scored(
        self, queries: mx.array, keys, values, cache, scale: float, mask=None, bias=None, sinks=None
    ):
        """The layer's output; its scores go to `cache` (which evicts when it overflows).

        A prompt chunk longer than `block` goes block of queries by block, each
        block's scores folded into the cache and evaluated before the next, so only
        one block's logits (block x keys per head) exist at a time. `bias`: an
        additive logit per stored key, [B, n_kv_heads, keys] (cache/policies/merging.py).
        `sinks`: a learned logit per query head that weighs no value (gpt-oss), applied
        to the output from the logits (`with_sinks`), so the fused paths that return no
        logits are passed by.
        """
        L = queries.shape[2]
        if cache.pending_store is not None:  # update_and_fetch left the token to this call
            if L == 1 and bias is None and sinks is None:
                how = (self.backend, self.quantized_path)  # what `attend_parts` reads
                return cache.store_and_attend(queries, scale, mask, self.attend_parts, how)
            keys, values = cache.store_pending()
        mask = cache.attention_mask(queries.shape[1], L, mask)  # its slots may need their own
        archive = cache.archive_part(L)  # cache/policies/recall.py: a prompt reads evicted tokens
        cache.observe(queries, scale)
        parts = cache.kv_segments(keys, values)
        # KVarN caches take a block's scores over every stored key, not a prefix.
        scores_prefix = all(fmt.tile is None for _, _, fmt in parts)
        if L > 1:  # many queries: the dense kernel is the fast one, so unpack once per call
            parts = unpacked(parts)
            if (
                not cache.keeps_scores
                and bias is None
                and archive is None
                and sinks is None
                and self._fuses_prefill()
            ):
                # No scores wanted: the fused kernel, no float32 logits. (MLX's CPU
                # fallback holds a whole chunk's logits at once: a kvarn 4k prompt peaked
                # 758 MiB vs 674 in blocks, for 10% less CPU time; the CPU keeps blocks.)
                [(k, v, _)] = parts
                k, v = (x.astype(queries.dtype) for x in (k, v))
                return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        fusable = archive is None and sinks is None
        if L == 1 and fusable and self._fuses_decode(cache, queries, parts, mask):
            how = (self.backend, self.quantized_path)  # what `attend_parts` reads
            # Its output depends on the new scores (cache/compiled_decode.py): evaluating the
            # step evaluates them, so they need no start here.
            return cache.attend_decode(queries, parts, scale, mask, self.attend_parts, how, bias)
        # The one dense part (unpacked) holds a chunk's slots in arrival order: a block
        # sees exactly the first n_keys - L + stop of them, causally, and scores only those.
        prefix = scores_prefix and (mask is None or isinstance(mask, str))  # None or "causal"
        if L > 1 and prefix and bias is None and fusable and self._fuses_prefill():
            kernel = self._prompt_weights_kernel(cache, queries, parts[0][0], mask)
            if kernel is not None or L > self.block:
                return self._fused_prompt(queries, parts[0], cache, scale, mask, kernel)
        if L <= self.block:
            out, logits, probs = self.attend_parts(queries, parts, scale, mask, bias)
            out = with_sinks(out, logits, sinks)
            if not self._decode_weights(cache, logits, probs):
                cache.update_scores(logits, probs)
            if self.eager_scores:
                start_scores(cache)
            return self._with_archive(queries, out, logits, archive, scale)
        n_keys = cache.size()
        outs = []
        for start in range(0, L, self.block):
            stop = min(start + self.block, L)
            q = queries[:, :, start:stop]
            if prefix:
                seen = n_keys - L + stop
                k, v, fmt = parts[0]
                k, v = (tree_map(lambda a, n=seen: a[:, :, :n], x) for x in (k, v))
                b = None if bias is None else bias[..., :seen]
                out, logits, probs = self.attend_parts(q, [(k, v, fmt)], scale, mask, b)
            else:
                rows = _mask_rows(mask, L, n_keys, start, stop)
                out, logits, probs = self.attend_parts(q, parts, scale, rows, bias)
            out = with_sinks(out, logits, sinks)
            cache.add_scores(logits, probs)
            out = self._with_archive(q, out, logits, archive, scale)
            # Evaluated now, this block's logits and probabilities are freed.
            mx.eval([x for x in (out, cache.scores) if x is not None])
            outs.append(out)
        cache.evict_if_full()
        return mx.concatenate(outs, axis=2)

    def stores_with_decode(self, cache) -> bool:
        """Whether a cache with a fixed-shape decode leaves its token's store to the compiled
        call that attends and scores (`store_and_attend`): where its step's owner runs the
        model whole (`scores_with_step`: nothing reads what update_and_fetch returned but
        this attention) and the reference kernel serves every decode (a GPU kernel attends
        in one launch; its store stays a call of its own)."""
        if not (self.compiled_decode and cache.scores_with_step):
            return False
        return self.backend == "reference" or (self.backend == AUTO and _reference_only())

    def _fuses_decode(self, cache, queries: mx.array, parts: list, mask) -> bool:
        """Whether a decode query goes to the cache's own compiled attend-and-score
        (`attend_decode`: an H2O slab's rows, a lone H2O cache): where the reference kernel
        serves every part (a GPU kernel is one launch already)."""
        wanted = self.compiled_decode and cache.fused_decode
        # The mask spans every part: a part alone is probed without it (the GPU kernels
        # take any decode mask of the whole call), or a packed cache's pools and slots, one
        # GPU kernel call (`_packed_with_pools`), would be compiled as the reference's.
        probe = mask if len(parts) == 1 else None
        return wanted and self._on_reference(queries, parts, probe)

    def _fuses_prefill(self) -> bool:
        if self.fused_prefill is not None:
            return self.fused_prefill
        return mx.default_device() == mx.gpu

    def _fused_prompt(
        self, queries: mx.array, part, cache, scale: float, mask, kernel: Callable | None
    ) -> mx.array:
        """A prompt chunk's output from one fused attention call over the dense part; its
        scores from the prompt-weights `kernel` when given, else from query blocks of
        logits alone (no block of them times V)."""
        k, v, _ = part
        out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        if kernel is not None:
            # Two launches over K for the whole chunk; no logits, no synchronisation here.
            cache.scores = kernel(queries, k, scale, mask, cache.scores)
            cache.evict_if_full()
            return out
        L, n_keys = queries.shape[2], seq_length(k)
        for start in range(0, L, self.block):
            stop = min(start + self.block, L)
            seen = n_keys - L + stop
            q = queries[:, :, start:stop]
            logits, probs = reference.logits_and_probs(q, k[:, :, :seen], scale, mask)
            cache.add_scores(logits, probs)
            # Evaluated now, this block's logits and probabilities are freed.
            mx.eval([x for x in (None if start else out, cache.scores) if x is not None])
        cache.evict_if_full()
        return out

    def _prompt_weights_kernel(self, cache, queries: mx.array, keys: mx.array, mask):
        """A GPU kernel that adds a prompt chunk's key weights to the cache's scores
        (kernels/src/prompt_weights.body), where its rule sums them and one takes the call;
        None: the reference's blocks of logits."""
        if not cache.sums_probabilities or cache.scores is None:
            return None
        if getattr(cache, "held", None) is not None:  # a draft's scores wait for its verdict
            return None
        name = select_prompt_backend(self.backend, queries, keys, mask, cache.scores)
        return None if name == "reference" else get_backend(name).prompt_weights

    def _decode_weights(self, cache, logits: mx.array, probs) -> bool:
        """A GPU decode's scores in one launch of the kernel that adds its key weights to the
        held scores (kernels/src/decode_weights.body), instead of the rule's softmax, sums
        and accumulation, where the cache's rule sums them; False: `update_scores`."""
        if probs is not None or not cache.sums_probabilities:
            return False  # the reference's own probabilities serve the rule
        name = select_weights_backend(self.backend, logits, cache.scores)  # decode shapes
        if name == "reference":
            return False
        kernel = get_backend(name).decode_weights
        return cache.update_weights(functools.partial(kernel, logits))

    def _with_archive(self, queries, out, logits, archive, scale: float) -> mx.array:
        """`out` merged with attention over `archive` (keys, values, format), every key of
        which is older than the queries: the output as if those keys were held too."""
        if archive is None:
            return out
        out_a, logits_a, _ = self.attend_part(queries, *archive, scale)
        return merge_parts([(out_a, logits_a), (out, logits)], queries.dtype)[0]

    def attend(self, queries: mx.array, keys, values, cache, scale: float, mask=None, bias=None):
        """(out, float32 logits [B, n_q, L_q, L_k], probs or None) over the cache's parts."""
        if cache.pending_store is not None:  # `keys`, `values` are from before the store
            keys, values = cache.store_pending()
        mask = cache.attention_mask(queries.shape[1], queries.shape[2], mask)
        return self.attend_parts(queries, cache.kv_segments(keys, values), scale, mask, bias)

    def attend_parts(self, queries: mx.array, parts: list, scale: float, mask=None, bias=None):
        """`attend` over parts [(keys, values, KVFormat)] in slot order."""
        if len(parts) == 1:
            k, v, fmt = parts[0]
            return self.attend_part(queries, k, v, fmt, scale, mask, bias)
        if bias is None and self._joint_softmax(queries, parts):
            return _joint_decode(queries, parts, scale, mask)
        if bias is None and (pooled := self._packed_with_pools(queries, parts, scale, mask)):
            return pooled
        full = expand_mask(mask, queries.shape[2], sum(seq_length(k) for k, _, _ in parts))
        results, start = [], 0
        for k, v, fmt in parts:
            n = seq_length(k)
            m = None if full is None else full[..., start : start + n]
            b = None if bias is None else bias[..., start : start + n]
            results.append(self.attend_part(queries, k, v, fmt, scale, m, b)[:2])
            start += n
        return (*merge_parts(results, queries.dtype), None)

    def _packed_with_pools(self, queries: mx.array, parts: list, scale: float, mask):
        """[dense | mx.quantize-packed | dense] parts (a packed H2O cache's sink pool, packed
        slots and dense tail) in ONE call of a GPU decode kernel, which reads them in slot
        order: a launch, not one per part plus the log-sum-exp merge (the GPU decode is
        launch-bound, docs/gpu.md). Rotated storage: the pools are rotated alike, so the
        query goes in and the output out once. None where no GPU backend takes them."""
        i = next((j for j, (_, _, fmt) in enumerate(parts) if fmt.packed), None)
        if i is None or i > 1 or len(parts) - i > 2 or self.quantized_path != "fused":
            return None
        keys, values, fmt = parts[i]
        pools = [part for j, part in enumerate(parts) if j != i]
        if any(f != DENSE for _, _, f in pools) or (fmt.value_bits or fmt.key_bits) != fmt.key_bits:
            return None
        front = parts[0][:2] if i == 1 else None
        tail = parts[i + 1][:2] if i + 1 < len(parts) else None
        pick = {"group_size": fmt.group_size, "bits": fmt.key_bits}
        pool_keys = [k for k, _, _ in pools]
        name = select_backend(self.backend, queries, keys[0], mask, **pick, pools=pool_keys)
        if name == "reference":
            return None
        if fmt.rotated:
            queries = rotate(queries)
            front, tail = (None if p is None else tuple(map(rotate, p)) for p in (front, tail))
        kernel = get_backend(name).quantized
        out, logits = kernel(queries, keys, values, scale, mask, **pick, front=front, tail=tail)
        return (rotate(out) if fmt.rotated else out), logits, None

    def _joint_softmax(self, queries: mx.array, parts: list) -> bool:
        """Whether one query row over these parts goes through `_joint_decode`: every part
        dense or mx.quantize-packed, each on the reference backend, the fused path."""
        if queries.shape[2] != 1 or self.quantized_path != "fused":
            return False
        return self._on_reference(queries, parts, None)

    def _on_reference(self, queries: mx.array, parts: list, mask) -> bool:
        """Whether the reference kernel (MLX ops, which a compiled call can hold) serves
        every part."""
        return all(self._backend(queries, keys, fmt, mask) == "reference" for keys, _, fmt in parts)

    def _backend(self, queries: mx.array, keys, fmt: KVFormat, mask) -> str:
        """The kernel backend for one part: dense, mx.quantize- or KVarN-packed."""
        if self.backend == AUTO and _reference_only():  # asked per part, layer and step
            return "reference"
        if fmt.tile is not None:
            if self.quantized_path == "dequantize":
                return "reference"
            return select_kvarn_backend(self.backend, queries, keys, mask, fmt.tiles)
        if not fmt.packed:
            return select_backend(self.backend, queries, keys, mask)
        v_bits = fmt.value_bits or fmt.key_bits
        pick = {"group_size": fmt.group_size, "bits": fmt.key_bits, "value_bits": v_bits}
        return select_backend(self.backend, queries, keys[0], mask, **pick)

    def __call__(self, queries: mx.array, keys, values, cache, scale: float, mask=None):
        """(out, logits): attention over the cache's parts, scores not folded in."""
        return self.attend(queries, keys, values, cache, scale, mask)[:2]

    def attend_part(self, queries, keys, values, fmt: KVFormat, scale: float, mask=None, bias=None):
        """One part, dense or packed in `fmt`: (out, logits, probs or None).

        The reference kernels (KVarN's too) hand back their probabilities; the GPU
        decode kernels export logits only (rules take a softmax there). Only
        the dense reference kernel takes `bias` itself; for the others it is folded
        into the mask.
        """
        if bias is not None:
            dense = not fmt.packed and fmt.tile is None and not fmt.rotated
            if not dense or self._backend(queries, keys, fmt, mask) != "reference":
                L_q, L_k = queries.shape[2], seq_length(keys)
                mask = bias_as_mask(mask, bias, queries.shape[1], L_q, L_k)
                bias = None
        if fmt.tile is not None:  # KVarN: rotates the query in and the output back itself
            name = self._backend(queries, keys, fmt, mask)
            if name == "reference":
                dequantize = self.quantized_path == "dequantize"
                return kvarn_sdpa_with_probs(
                    queries, keys, values, scale, mask, fmt.tiles, dequantize
                )
            out, logits = get_backend(name).kvarn(queries, keys, values, scale, mask, fmt.tiles)
            return out, logits, None
        if fmt.rotated:  # any backend's kernel on rotated storage: rotate in, rotate out once
            out, logits, probs = self.attend_part(
                rotate(queries), keys, values, unrotated(fmt), scale, mask
            )
            return rotate(out), logits, probs
        if not fmt.packed:
            name = self._backend(queries, keys, fmt, mask)
            if name == "reference":
                return reference.sdpa_with_probs(queries, keys, values, scale, mask, bias)
            return (*get_backend(name).dense(queries, keys, values, scale, mask), None)
        gs, k_bits, v_bits = fmt.group_size, fmt.key_bits, fmt.value_bits or fmt.key_bits
        if self.quantized_path == "dequantize":
            [(k, v, _)] = unpacked([(keys, values, fmt)])
            return self.attend_part(queries, k, v, DENSE, scale, mask)
        name = self._backend(queries, keys, fmt, mask)  # a GPU kernel only where k_bits == v_bits
        if name == "reference":
            return reference.quantized_sdpa_with_probs(
                queries, keys, values, scale, mask, gs, k_bits, v_bits
            )
        out, logits = get_backend(name).quantized(queries, keys, values, scale, mask, gs, k_bits)
        return out, logits, None


def unpacked(parts: list) -> list:
    """Packed parts (mx.quantize or KVarN storage) dequantized and rotated back, joined
    into one dense part: the same attention, through the dense kernel."""
    dense = []
    for keys, values, fmt in parts:
        if fmt.tile is not None:
            keys, values = (rotate(x) for x in dequantize_storage(keys, values, fmt.tiles))
            fmt = DENSE
        elif fmt.packed:
            gs, v_bits = fmt.group_size, fmt.value_bits or fmt.key_bits
            keys = mx.dequantize(*keys, group_size=gs, bits=fmt.key_bits)
            values = mx.dequantize(*values, group_size=gs, bits=v_bits)
            if fmt.rotated:  # the Hadamard rotation is its own inverse
                keys, values = rotate(keys), rotate(values)
            fmt = DENSE
        dense.append((keys, values, fmt))
    if len(dense) == 1:
        return dense
    keys, values = (mx.concatenate([part[i] for part in dense], axis=2) for i in (0, 1))
    return [(keys, values, DENSE)]


def _joint_decode(queries: mx.array, parts: list, scale: float, mask=None):
    """One decode query over several parts (e.g. packed caches' dense sinks and packed
    rest): each part's logits, ONE softmax over all of them, each part's values weighted
    by its probabilities. Per part and merged by log-sum-exp costs a softmax per part
    and the merge (~15% of a packed layer's attention on CPU), and exports no
    probabilities, so the score rule would take a softmax again. `mask`: over the parts'
    keys in order, boolean or additive (an H2O slab's [rows, 1, 1, keys])."""
    B, n_q, L, D = queries.shape
    n_kv = _leading(parts[0][0]).shape[1]
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, (n_q // n_kv) * L, D)
    logits = []
    for keys, _, fmt in parts:
        q_part = rotate(q) if fmt.rotated else q  # q.k is unchanged by rotating both
        if fmt.packed:
            logits.append(packed_matmul(q_part, keys, True, fmt.group_size, fmt.key_bits))
        else:
            logits.append(q_part @ keys.astype(mx.float32).swapaxes(-1, -2))
    scores = mx.concatenate(logits, axis=-1)
    if isinstance(mask, mx.array):  # a str ("causal") hides nothing from one query
        m = mx.broadcast_to(mask, (B, n_q, L, scores.shape[-1])).reshape(scores.shape)
        scores = mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m
    probs = mx.softmax(scores, axis=-1, precise=True)
    out, start = None, 0
    for (_, values, fmt), part_logits in zip(parts, logits, strict=True):
        p = probs[..., start : start + part_logits.shape[-1]]
        start += part_logits.shape[-1]
        if fmt.packed:
            o = packed_matmul(p, values, False, fmt.group_size, fmt.value_bits or fmt.key_bits)
        else:
            o = p @ values.astype(mx.float32)
        o = rotate(o) if fmt.rotated else o  # the rotation is its own inverse
        out = o if out is None else out + o
    shape = (B, n_q, L, scores.shape[-1])
    out = out.reshape(B, n_q, L, D).astype(queries.dtype)
    return out, scores.reshape(shape), probs.reshape(shape)


def with_sinks(out: mx.array, logits: mx.array, sinks: mx.array | None) -> mx.array:
    """Attention whose softmax also spans one learned logit per query head that weighs no
    value (gpt-oss's sinks): the output over the keys shrinks by Z / (Z + e^sink), Z the
    keys' summed e^logit. From the exported logits, so after any kernel; None: `out`."""
    if sinks is None:
        return out
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    keep = mx.sigmoid(lse - sinks.astype(mx.float32).reshape(1, -1, 1, 1))
    return (out * keep).astype(out.dtype)


@functools.cache
def _reference_only() -> bool:
    """No GPU backend on this machine (it does not change while the process runs)."""
    return available_backends() == ["reference"]


def start_scores(cache) -> None:
    """Start computing a cache's new scores now, while the next layers' graph is built,
    unless the step's owner evaluates them with the step (`scores_with_step`).

    No output depends on them, so left lazy each step's scores hold that step's
    probabilities until an eviction reads them: a chain of evict_batch steps (140 MB over
    64 steps at max_kv 2048 on the default model, where the cache is 94 MB). Started per
    layer and step, memory stays flat, and this CPU decodes 1.06-1.08x faster at max_kv
    256 (0.98x at 2048, within noise; docs/score_chain.md), but the host waits at every
    layer: building a step of dense H2O took 19x stock mlx-lm's time (docs/gpu_step.md).
    Evaluated with the step, memory stays flat too, and the host builds the step whole.
    A compiled decode (`attend_decode`) needs neither: its output depends on its scores.
    """
    if cache.scores is not None and not cache.scores_with_step:
        mx.async_eval(cache.scores)


def _mask_rows(mask, L: int, n_keys: int, start: int, stop: int):
    """Rows [start, stop) of the mask of an L-query chunk over n_keys keys."""
    if mask is None:
        return None
    if isinstance(mask, str):  # causal, bottom-right aligned: query i sees keys <= n_keys - L + i
        rows = mx.arange(n_keys - L + start, n_keys - L + stop)[:, None]
        return rows >= mx.arange(n_keys)[None]
    return mask[..., start:stop, :] if mask.shape[-2] == L else mask


def backend_from_env() -> str:
    return os.environ.get(BACKEND_ENV, AUTO)


ATTENTION = ScoredAttention(backend_from_env())


def configure(backend: str | None = None, quantized_path: str | None = None) -> None:
    """Configure the attention every scored layer uses (see ScoredAttention.configure)."""
    ATTENTION.configure(backend, quantized_path)


def seq_length(x) -> int:
    """Sequence length of dense keys or packed key parts (0 for None)."""
    return 0 if x is None else _leading(x).shape[2]


def _leading(x) -> mx.array:
    """Dense keys, or packed keys' words: either is [B, n_kv_heads, L, ...]."""
    return x[0] if isinstance(x, (list, tuple)) else x


def merge_parts(parts: list[tuple[mx.array, mx.array]], dtype: mx.Dtype):
    """Combine attention over disjoint key sets: weight each by its share of the softmax mass."""
    lses = [mx.logsumexp(scores, axis=-1, keepdims=True) for _, scores in parts]
    total = lses[0]
    for lse in lses[1:]:
        total = mx.logaddexp(total, lse)
    out = None
    for (o, _), lse in zip(parts, lses, strict=True):
        w = mx.exp(lse - total)
        # A row that sees no key of a part has w = 0 and a NaN output there.
        term = mx.where(w > 0, w * o.astype(mx.float32), 0.0)
        out = term if out is None else out + term
    return out.astype(dtype), mx.concatenate([scores for _, scores in parts], axis=-1)
