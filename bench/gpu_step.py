"""Counters a CPU can check for the GPU: MLX ops per decode step, host time to build it.

On a GPU a decode step is launch- and host-bound (docs/gpu.md): what it costs there is
the number of kernels it launches and the host time to build its graph, not the
arithmetic. Both can be counted on this CPU at every change:

- ops: MLX primitives the step evaluates (every `mx.eval`/`mx.async_eval` during the
  step, per-layer score evaluations included, and the step's own evaluation of its
  logits and every cache buffer it wrote), counted from the graph (`mx.export_to_dot`)
  before it runs; on a GPU each is a launch;
- build ms: host time from making the step's cache argument (a slab's: the batcher's
  `batch_caches`) until the model returns (the graph built, plus whatever the code
  waited for inside), with the previous step done (nothing else computing), the median
  over the steps; every case's sessions decode side by side and
  each step of each is timed in turn, its ratio to stock's in the same turn (a shared
  machine drifts over the minutes one case takes); each step's scores are evaluated with its
  tokens as the server's batcher does (one row also shows dense H2O without such an
  owner, as direct model calls run it: attention starts the scores layer by layer, unless
  its compiled decode made them part of the step's output);

for stock mlx-lm (its KVCache, no router), the sliding window, and each bounded policy,
one session alone and `--rows` sessions decoding together, grouped as the server's
batcher groups them (a slab per slab key two rows share: one H2OSlab, h2o-kvarn's
KVarNSlab per size held; else a part per session), each as a ratio to stock's step at
the same rows; `--stagger` gives each row a longer prompt, so sessions run out of step.
A prompt section counts the ops a scored prompt block adds per layer over stock's
attention.

    python -m bench.gpu_step --synthetic llama-1b --out docs/gpu_step.md

`--score mean learned` runs each policy under each rule (the default model, which has
retention gates: a synthetic model has none).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

STOCK = "stock mlx-lm (KVCache)"


def primitives(*arrays) -> int:
    """Primitives in the unevaluated graph behind `arrays` (evaluated ones are sources)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    leaves = [a for _, a in tree_flatten(list(arrays)) if isinstance(a, mx.array)]
    if not leaves:
        return 0
    dot = io.StringIO()
    mx.export_to_dot(dot, *leaves)
    return dot.getvalue().count("shape=rectangle")


@contextmanager
def counting_evals(counter: list[int]):
    """Every mx.eval / mx.async_eval counts the primitives it runs, then runs them (at
    once: an async evaluation's graph is detached only once it is done)."""
    import mlx.core as mx

    real_eval, real_async = mx.eval, mx.async_eval

    def counted(*args):
        counter[0] += primitives(*args)
        real_eval(*args)

    counted.real = real_eval  # for work that must not be counted (gpu_route's stand-ins)
    mx.eval, mx.async_eval = counted, counted
    try:
        yield
    finally:
        mx.eval, mx.async_eval = real_eval, real_async


def buffers(obj, seen: set | None = None) -> list:
    """Every MLX array a cache object holds (its attributes, lists and slab layers)."""
    import mlx.core as mx

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, list | tuple):
        return [a for x in obj for a in buffers(x, seen)]
    found = []
    for value in getattr(obj, "__dict__", {}).values():
        if isinstance(value, mx.array | list | tuple) or hasattr(value, "layers"):
            found += buffers(value, seen)
    return found


def eviction_period(model, spec) -> int:
    """Decode steps after which a policy's evictions repeat, and its packing: a dense
    tail's (packed every `tail` steps, cache/policies/quantized.py), KVarN's tiles."""
    import math

    from cache import make_cache

    c = make_cache(model, spec)[0]
    tail = getattr(c, "tail", None)
    packs = tail if isinstance(tail, int) and tail else getattr(c, "tile", None) or 1
    return math.lcm(getattr(c, "evict_batch", 1), packs)


def buffers_holders(held: list) -> list:
    """The layer caches (or slab layers) a session list or slab holds."""
    out = []
    for x in held:
        if hasattr(x, "layers"):  # an H2OSlab
            out += x.layers
        elif isinstance(x, list):
            out += x
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic", default=None, help="a llama shape (bench.decode_speed)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=300, help="prompt tokens per session")
    p.add_argument("--max-kv", type=int, default=128)
    p.add_argument(
        "--steps", type=int, default=24, help="decode steps counted and timed (0: prompt only)"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every case")
    p.add_argument(
        "--rows", type=int, default=16, help="sessions decoding together (1: alone only)"
    )
    p.add_argument(
        "--prompt", type=int, default=4096, help="prompt tokens of the prompt part (0: none)"
    )
    p.add_argument(
        "--stagger", type=int, default=0,
        help="row r's prompt is context + r * stagger tokens: sessions out of step",
    )  # fmt: skip
    p.add_argument("--policies", nargs="+", default=None, help="bounded policies (all)")
    p.add_argument(
        "--score", nargs="+", default=None,
        help="score rules, each policy under each ('h2o learned'; default: its own)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.decode_speed import SHAPES, synthetic_model
    from bench.report import command, machine, publish
    from cache import install_router, make_cache, uninstall_router
    from cache.batching.batch import batch_caches, open_h2o_slab
    from cache.batching.h2o_slab import slab_key
    from cache.contract import step_scores
    from config.cache_spec import CacheSpec
    from config.policies import POLICIES

    if args.synthetic:
        model = synthetic_model(args.synthetic, getattr(mx, args.dtype))
        vocab = SHAPES[args.synthetic][-1]
        about = f"Synthetic `{args.synthetic}` (random weights, {args.dtype})"
    else:
        from models.loading import load_model

        model, _ = load_model("default")
        vocab = model.args.vocab_size
        about = "Default model (SmolLM2-135M-Instruct, float32)"
    policies = args.policies or [n for n, p in POLICIES.items() if p.bounded and p.scored]
    longest = args.context + (args.rows - 1) * args.stagger
    ids = mx.random.randint(0, vocab, (args.rows, longest), key=mx.random.key(0))
    batching: dict[tuple, str] = {}  # (policy, rows): how the rows decoded together

    def sessions(policy: str | None, rows: int, with_step: bool):
        """(each step's cache argument, what it holds, the next tokens) after every row's
        prompt; `with_step`: scores evaluated with the step, as the server's batcher does."""
        if policy is None:  # stock: one KVCache over the rows, mlx-lm as it ships
            uninstall_router(model)
            caches = make_prompt_cache(model)
            logits = model(ids[:rows, : args.context], cache=caches)
            return (lambda: caches), [caches], mx.argmax(logits[:, -1], axis=-1)[:, None]
        install_router(model)
        name, *rule = policy.split()  # "h2o learned": the policy under a score rule
        spec = CacheSpec(name, args.max_kv, **({"score": rule[0]} if rule else {}))
        made = [make_cache(model, spec, scores_with_step=with_step) for _ in range(rows)]
        prompts = [ids[r : r + 1, : args.context + r * args.stagger] for r in range(rows)]
        lasts = [model(x, cache=c)[:, -1] for x, c in zip(prompts, made, strict=True)]
        if rows == 1:
            tokens = mx.argmax(mx.concatenate(lasts), axis=-1)[:, None]
            return (lambda: made[0]), made, tokens
        # As the server's batcher groups them: a slab per key shared by two rows or more
        # (an h2o-kvarn key holds the rows' size), the rest alone; slab rows lead the pass.
        groups: dict = {}
        for n, caches in enumerate(made):
            key = slab_key(caches) if spec.info.slab else None
            groups.setdefault(n if key is None else key, []).append((n, caches))
        slabs, alone = [], []
        for key, group in groups.items():
            if len(group) == 1:
                alone += group
                continue
            slabs.append(open_h2o_slab(key))
            slabs[-1].join(group)
        order = [n for slab in slabs for n in slab.members] + [n for n, _ in alone]
        tokens = mx.argmax(mx.concatenate([lasts[n] for n in order]), axis=-1)[:, None]
        kinds = sorted({type(s).__name__ for s in slabs})
        how = f"{len(slabs)} {'/'.join(kinds)}" if slabs else ""
        how += (", " if slabs and alone else "") + (f"{len(alone)} alone" if alone else "")
        batching[policy, rows] = how.replace("1 ", "one ", 1) if how.startswith("1 ") else how
        sessions_alone = [c for _, c in alone]
        return (lambda: batch_caches(sessions_alone, *slabs)), [*slabs, *sessions_alone], tokens

    def started(
        policy: str | None, rows: int, with_step: bool, count: bool, on_gpu: bool = False
    ) -> dict:
        """A case's sessions after their prompts and, `count`, its counted steps (every
        evaluation in a step): {"ops" per step (their mean), what a timed step needs}.
        `on_gpu`: the ops of a GPU's route (`gpu_route`)."""
        caches, held, token = sessions(policy, rows, with_step)
        mx.eval(token, buffers(held))
        ops = [0]
        for _ in range(args.steps if count else 0):
            with counting_evals(ops), gpu_route(ops, on_gpu):
                logits = model(token, cache=caches())
                token = mx.argmax(logits[:, -1], axis=-1)[:, None]
                mx.eval(token, buffers(held))
        scored = buffers_holders(held)
        return dict(ops=ops[0] / args.steps, policy=policy, caches=caches, held=held,
                    scored=scored, token=token)  # fmt: skip

    def timed_step(case: dict) -> tuple[float, float]:
        """(host s to build one step of `case`, the host thread's CPU s in it), with nothing
        else computing; then the step evaluated as the server's batcher does."""
        (uninstall_router if case["policy"] is None else install_router)(model)
        start, start_cpu = time.perf_counter(), time.thread_time()
        logits = model(case["token"], cache=case["caches"]())  # batch_caches is the step's
        build, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        case["token"] = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(case["token"], step_scores(case["scored"]))  # what the batcher launches
        mx.eval(buffers(case["held"]))
        return build, cpu

    # No step owner evaluates the scores (a direct model call, make_cache's default):
    # attention starts them layer by layer unless its compiled decode ties them to the output.
    no_owner = "h2o, no step owner (direct model calls)"
    ruled = [f"{p} {s}" for p in policies for s in args.score] if args.score else policies
    cases = [(STOCK, None), ("rotating", "rotating"), *((p, p) for p in ruled)]
    if "h2o" in policies:
        cases.append((no_owner, "h2o"))
    row_counts = sorted({1, args.rows}) if args.steps else []  # --steps 0: the prompt only
    ops = {}  # ops per step, counted once
    gpu_ops = {}  # ops on a GPU's route (stand-in kernels counted as their launches)
    build_ratios, cpu_ratios = {}, {}  # per timed step: its build over stock's in that turn
    build_ms = {}  # every timed build, for the median ms
    for r in range(args.rounds):
        for rows in row_counts:
            running = {}
            for label, policy in cases:
                with_step = label != no_owner
                running[label] = started(policy, rows, with_step, count=r == 0)
                ops.setdefault((label, rows), running[label]["ops"])
                if r == 0:
                    gpu_ops[label, rows] = started(policy, rows, with_step, True, True)["ops"]
            # Every case's step in turn, step by step (the order reversed every other
            # step): a shared machine's drift hits each case alike, and each ratio is to
            # stock's build in the same turn.
            for s in range(args.steps):
                order = cases if s % 2 == 0 else cases[::-1]
                turn = {label: timed_step(running[label]) for label, _ in order}
                for label, (build, cpu) in turn.items():
                    build_ms.setdefault((label, rows), []).append(build * 1e3)
                    build_ratios.setdefault((label, rows), []).append(build / turn[STOCK][0])
                    cpu_ratios.setdefault((label, rows), []).append(cpu / turn[STOCK][1])
            del running
            for label, _ in cases:
                ms = statistics.median(build_ms[label, rows][-args.steps :])
                print(f"round {r}: {label} x{rows}: {ms:.2f} ms", file=sys.stderr)

    got = {key: (ops[key], statistics.median(build_ms[key])) for key in ops}
    periods = {p: eviction_period(model, CacheSpec(p, args.max_kv)) for p in policies}
    uneven = [p for p, n in periods.items() if args.steps % n]
    period_note = ", ".join(f"{p} {n}" for p, n in periods.items())
    uneven_note = f"; not whole for {', '.join(uneven)}" if uneven else ""

    columns = (
        "cache | rows | ops per step | x stock | build ms per step | x stock | "
        "build CPU x stock | ops, GPU route | x stock | how it batches"
    )
    rule = "|---" * 10 + "|"
    lines = [f"| {columns} |", rule] if row_counts else []
    for rows in row_counts:
        for label, policy in cases:
            n, ms = got[label, rows]
            how = "one KVCache" if policy is None else "alone"
            if rows > 1 and policy is not None:
                how = batching[policy, rows].replace(f"{rows} alone", "a part per session")
            on_gpu = gpu_ops[label, rows]
            lines.append(
                f"| {label} | {rows} | {n:.0f} | {n / ops[STOCK, rows]:.2f}x | {ms:.2f} | "
                f"{statistics.median(build_ratios[label, rows]):.2f}x | "
                f"{statistics.median(cpu_ratios[label, rows]):.2f}x | {on_gpu:.0f} | "
                f"{on_gpu / gpu_ops[STOCK, rows]:.2f}x | {how} |"
            )
    if args.prompt:
        prompt = prompt_section(args, model, vocab, policies)
        lines = [*lines, "", *prompt] if lines else prompt
    title = "A decode step's ops and host time, stock mlx-lm against every bounded policy"
    summary = (
        f"{about}; {args.context}-token prompts, max_kv {args.max_kv}, {args.steps} decode "
        f"steps counted and {args.steps} timed per case (after the prompt, so bounded caches "
        f"evict). Ops: MLX primitives evaluated per step (launches on a GPU), the mean over "
        f"the steps (evictions amortized over whole periods of steps: {period_note}"
        f"{uneven_note}). Build: host ms from making the step's cache argument until the "
        f"model call returns, the median over the timed steps of {args.rounds} rounds; the "
        f"cases' sessions decode side by side, "
        f"every case's step timed in turn (the order reversed every other step), and each "
        f"ratio is to stock's build in the same turn, then the median over every step, so a "
        f"shared machine's drift hits every case alike; build CPU: the same for the host "
        f"thread's CPU time in the build. GPU route: the ops of the same "
        f"steps where a GPU backend takes what its kernels take (decode attention over dense, "
        f"mx.quantize- and KVarN-packed parts, the `attn` rule's key weights: kernels/src), "
        f"each kernel counted as its launches, their values computed here outside the count. "
        f"Machine: {machine()}."
    )
    if not args.steps:
        title = "A scored prompt's ops, stock mlx-lm against bounded policies"
        summary = f"{about}. Machine: {machine()}."
    publish(title, summary, command("bench.gpu_step", argv), lines, args.out)
    install_router(model)
    return 0


def prompt_section(args, model, vocab: int, policies: list[str]) -> list[str]:
    """Ops of one `args.prompt`-token prompt, scored caches against stock's, per layer and
    128-query block (the block a scored layer attends at once): on this machine's route
    (on a CPU, blocks of logits through the reference), and on a GPU's (one fused SDPA call,
    the `attn` scores from the prompt-weights kernel, counted as its two launches)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from cache import install_router, make_cache, uninstall_router
    from cache.attention import ATTENTION

    ids = mx.random.randint(0, vocab, (1, args.prompt), key=mx.random.key(1))

    def prompt_ops(policy: str | None, on_gpu: bool = False) -> int:
        if policy is None:
            uninstall_router(model)
            caches = make_prompt_cache(model)
        else:
            install_router(model)
            caches = make_cache(model, policy, max_kv=args.prompt + 1)  # nothing evicted
        ops = [0]
        with counting_evals(ops), gpu_route(ops, on_gpu):
            logits = model(ids, cache=caches)
            mx.eval(logits, buffers(caches))
        return ops[0]

    stock = {"here": prompt_ops(None), "GPU": prompt_ops(None, on_gpu=True)}
    layers, blocks = len(model.layers), -(-args.prompt // ATTENTION.block)
    lines = [
        f"A {args.prompt}-token prompt in one chunk, nothing evicted: ops against stock's on "
        f"the same route ({stock['here']} here, {stock['GPU']} on a GPU's), per layer and "
        f"{ATTENTION.block}-query block ({layers} layers x {blocks} blocks). Route here: what "
        "this machine runs (on a CPU, blocks of logits through the reference). GPU route: "
        "what a GPU backend runs (the output from one fused SDPA call, the `attn` scores from "
        "the prompt-weights kernel over the whole chunk, kernels/src/prompt_weights.body; "
        "its two passes counted as two launches and mx.fast's SDPA, stock's too, as one, "
        "their values computed here outside the count).",
        "",
        "| cache | route | ops | extra ops per layer | extra ops per layer and block |",
        "|---|---|---|---|---|",
    ]
    for policy in [p for p in policies if p in ("h2o", "h2o-q8")]:
        for route in ("here", "GPU"):
            ops = prompt_ops(policy, on_gpu=route == "GPU")
            extra = ops - stock[route]
            lines.append(
                f"| {policy} | {route} | {ops} | {extra / layers:.1f} | "
                f"{extra / (layers * blocks):.2f} |"
            )
    install_router(model)
    return lines


@contextmanager
def gpu_route(counter: list[int], on: bool):
    """Within: attention takes a GPU's route. A stand-in GPU backend takes the calls a GPU
    kernel would (decode attention over dense and mx.quantize-packed parts with their
    pools and over KVarN's tiles, a decode's key weights, a prompt's key weights; prompts
    fused as on a GPU), and mx.fast's SDPA (stock's attention, and a fused prompt's) is one
    launch as on a GPU; each adds its launches to `counter`, its values computed by the
    reference (or MLX's own SDPA) outside the count, after counting the pending ops of its
    inputs (which that evaluation runs early)."""
    if not on:
        yield
        return
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from cache import attention
    from cache.attention import ATTENTION
    from kernels import dispatch, reference
    from kernels.src import launch

    real_eval = getattr(mx.eval, "real", mx.eval)  # never counted_evals' own count

    def run(inputs: list, compute, launches: int):
        # Nested parts ([front, tiles, tail]); a mask may be None or a str.
        inputs = [x for _, x in tree_flatten(inputs) if isinstance(x, mx.array)]
        counter[0] += primitives(*inputs)
        real_eval(*inputs)
        result = compute()
        real_eval(result)
        counter[0] += launches
        return result

    def decode_launches(q: mx.array, L_k: int) -> int:
        """Pass 1, and the block merge when the keys are split over blocks."""
        B, n_q, L_q, _ = q.shape
        return 1 + (launch.choose_blocks(B * n_q * L_q, L_k) > 1)

    def dense(q, k, v, scale, mask=None, n_blocks=None):
        attend = lambda: reference.sdpa_with_scores(q, k, v, scale, mask)  # noqa: E731
        return run([q, k, v, mask], attend, decode_launches(q, k.shape[2]))

    def quantized(q, k_q, v_q, scale, mask, group_size, bits, front=None, tail=None):
        def attend():
            packed = [mx.dequantize(*x, group_size=group_size, bits=bits) for x in (k_q, v_q)]
            k, v = (
                mx.concatenate([p[i] for p in (front, packed, tail) if p is not None], axis=2)
                for i in (0, 1)
            )
            return reference.sdpa_with_scores(q, k, v, scale, mask)

        inputs = [q, *k_q, *v_q, mask, *(front or ()), *(tail or ())]
        L_k = k_q[0].shape[2] + sum(p[0].shape[2] for p in (front, tail) if p is not None)
        return run(inputs, attend, decode_launches(q, L_k))

    def kvarn(q, keys, values, scale, mask, fmt):
        """The query rotated in, the decode kernel over [front, tiles, tail], the output
        rotated back: the kernel's launches plus the two rotations."""
        from kernels.kvarn import kvarn_sdpa_with_probs

        attend = lambda: kvarn_sdpa_with_probs(q, keys, values, scale, mask, fmt)[:2]  # noqa: E731
        inputs = [q, mask, keys, values]
        L_k = launch.kvarn_length(keys, fmt.tile)
        return run(inputs, attend, decode_launches(q, L_k) + 2)

    def prompt_weights(q, k, scale, mask, held):
        weights = lambda: reference.prompt_weights(q, k, scale, mask, held)  # noqa: E731
        return run([q, k, held], weights, 2)  # row max and sum, then column sums

    def decode_weights(scores, held):
        return run([scores, held], lambda: reference.decode_weights(scores, held), 1)

    real_sdpa = mx.fast.scaled_dot_product_attention

    def fused_sdpa(q, k, v, *, scale: float, mask=None, **kwargs):
        """One launch on a GPU; on a CPU MLX builds it from several ops (stock's too)."""
        attend = lambda: real_sdpa(q, k, v, scale=scale, mask=mask, **kwargs)  # noqa: E731
        return run([q, k, v, mask], attend, 1)

    def never(*_, **__) -> bool:
        return False

    stand_in = dispatch.Backend(
        lambda: True, launch.supports, dense, quantized, launch.supports_kvarn, kvarn,
        launch.supports_prompt, prompt_weights, launch.supports_decode_weights, decode_weights,
    )  # fmt: skip
    saved = dispatch._BACKENDS["metal"], ATTENTION.fused_prefill

    def forget_devices() -> None:
        dispatch._is_available.cache_clear()
        attention._reference_only.cache_clear()

    dispatch._BACKENDS["metal"], ATTENTION.fused_prefill = stand_in, True
    mx.fast.scaled_dot_product_attention = fused_sdpa
    forget_devices()
    try:
        yield
    finally:
        dispatch._BACKENDS["metal"], ATTENTION.fused_prefill = saved
        mx.fast.scaled_dot_product_attention = real_sdpa
        forget_devices()


if __name__ == "__main__":
    sys.exit(main())
