"""The Gemma 3 section of docs/RESULTS.md: full vs rotating vs h2o on a mixed-attention model.

bench/results.py runs `step` with the other steps and calls `gemma_section`. This step
alone (~20 minutes on a 2-core CPU box) rewrites just that section of an existing report:

    python -m bench.results_gemma --out docs/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from bench.report import eval_command, git_revision, run_eval

MODEL = "gemma3-270m"
HEADING = "## Gemma 3 270M"
# (max_kvs, seq_lens, samples) at full scale and for `--smoke`. 1024 tokens: twice the
# sliding window, so the sliding layers' choice matters for half of every sample.
GRID = {"full": (["64", "128", "256"], ["1024"], "4"), "smoke": (["8", "16"], ["48"], "1")}


def step(smoke: bool) -> tuple[str, str]:
    kvs, seqs, samples = GRID["smoke" if smoke else "full"]
    return (
        "gemma",
        # --score attn: the table's label (the run in docs/ predates main's default `mean`)
        f"eval ppl --model {MODEL} --policy full rotating h2o --score attn "
        f"--max-kv {' '.join(kvs)} --seq-len {' '.join(seqs)} --samples {samples} --full-one-shot",
    )


def _pct(x: float, base: float) -> str:
    return f"{100 * (x / base - 1):+.1f}%"


def _ppl(rows: list[dict], **fields) -> float:
    hits = [r for r in rows if all(r.get(k) == v for k, v in fields.items())]
    if len(hits) != 1:
        raise ValueError(f"expected one record for {fields}, found {len(hits)}")
    return hits[0]["ppl"]


def gemma_section(rows: list[dict], cmd: str) -> list[str]:
    seqs = sorted({r["seq_len"] for r in rows})
    kvs = sorted({r["max_kv"] for r in rows if r["max_kv"]})
    out = [
        f"{HEADING}: a model with sliding-window layers",
        "",
        "Gemma 3 270M base (`--model gemma3-270m`, the Q4_K_M GGUF dequantized to float32) "
        "has 18 layers: 15 attend over a sliding window of 512 tokens, every sixth is "
        "global. Under a bounded policy every layer holds at most max_kv tokens: global "
        "layers get the policy's cache; a sliding layer keeps its own window when that "
        "fits in max_kv, else gets H2O inside its window (`h2o`) or a window of max_kv "
        "tokens without sinks (`rotating`). Each sample starts with `<bos>`, as Gemma "
        f"saw in training. {rows[0]['samples']} samples per length, autoregressive as "
        "above.",
        "",
        f"`{cmd}`",
        "",
    ]
    for seq in seqs:
        full = _ppl(rows, policy="full", seq_len=seq)
        out += [
            f"{seq}-token samples, full cache {full:.3f}:",
            "",
            "| max_kv | rotating | h2o (attn, heavy) | rotating vs full | h2o vs full |",
            "|---|---|---|---|---|",
        ]
        losses = []
        for kv in kvs:
            rot = _ppl(rows, policy="rotating", max_kv=kv, seq_len=seq)
            h2o = _ppl(rows, policy="h2o", max_kv=kv, seq_len=seq)
            out.append(f"| {kv} | {rot:.3f} | {h2o:.3f} | {_pct(rot, full)} | {_pct(h2o, full)} |")
            if h2o >= rot:
                losses.append(str(kv))
        if losses:
            out.append(f"\n**H2O loses to the rotating window at max_kv {', '.join(losses)}.**")
        out.append("")
    return out


def splice(report: str, section: list[str]) -> str:
    """`report` with its Gemma section replaced, or inserted before the throughput section."""
    lines = report.split("\n")
    heads = [i for i, line in enumerate(lines) if line.startswith("## ")]
    mine = [i for i in heads if lines[i].startswith(HEADING)]
    if mine:
        start = mine[0]
        end = next((i for i in heads if i > start), len(lines))
    else:
        start = end = next((i for i in heads if lines[i].startswith("## (d)")), len(lines))
    return "\n".join(lines[:start] + section + lines[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the Gemma 3 step and rewrite its section")
    p.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"))
    p.add_argument("--smoke", action="store_true", help="tiny grid, to check the pipeline")
    args = p.parse_args(argv)
    name, step_argv = step(args.smoke)
    revision, t0 = git_revision(), time.time()
    rows = run_eval(step_argv.split())
    minutes = (time.time() - t0) / 60
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = gemma_section(rows, eval_command(step_argv.split())) + [
        f"(This step ran on its own, `python -m bench.results_gemma`: {minutes:.0f} minutes, "
        f"finished {when}, code revision {revision}.)",
        "",
    ]
    report = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(splice(report, section))
    print(f"{args.out}: {name} section, {minutes:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
