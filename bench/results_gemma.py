"""The Gemma 3 section of docs/RESULTS.md: full vs rotating vs h2o on a mixed-attention model.

bench/results.py runs STEP with the other steps and calls `gemma_section`.
"""

from __future__ import annotations

MODEL = "gemma3-270m"
# (max_kvs, seq_lens, samples) at full scale and for `--smoke`
GRID = {"full": (["64", "128", "256"], ["512", "1024"], "4"), "smoke": (["8", "16"], ["48"], "1")}


def step(smoke: bool) -> tuple[str, str]:
    kvs, seqs, samples = GRID["smoke" if smoke else "full"]
    return (
        "gemma",
        f"eval ppl --model {MODEL} --policy full rotating h2o --max-kv {' '.join(kvs)} "
        f"--seq-len {' '.join(seqs)} --samples {samples} --full-one-shot",
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
        "## Gemma 3 270M: a model with sliding-window layers",
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
