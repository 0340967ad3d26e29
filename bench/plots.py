"""PNG plots of evaluation records, like the H2O paper's figures.

Each function takes the flat records `h2o-server eval ... --json` prints and
writes one PNG. From the shell:

    python -m bench.plots ppl.json throughput.json --out docs/
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20


def case_label(r: dict[str, Any]) -> str:
    """'full', 'rotating', 'h2o attn heavy', ... (max_kv is the plots' axis or title)."""
    return " ".join(str(r[k]) for k in ("policy", "score", "preset") if r.get(k) is not None)


def _series(records: Iterable[dict[str, Any]], x_key: str, y_key: str) -> dict[str, list]:
    lines: dict[str, list] = defaultdict(list)
    for r in records:
        if r.get(x_key) is not None and r.get(y_key) is not None:
            lines[case_label(r)].append((r[x_key], r[y_key]))
    return {label: sorted(points) for label, points in lines.items()}


def _finish(ax, fig, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    _style(ax, title, xlabel, ylabel)
    return _save(fig, path)


def _style(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ppl_vs_max_kv(records: list[dict[str, Any]], seq_len: int, path: Path) -> Path:
    """Perplexity against cache size at one sequence length; full as a horizontal line."""
    rows = [r for r in records if r["seq_len"] == seq_len]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        if r["policy"] == "full":
            ax.axhline(r["ppl"], color="black", linestyle="--", label=f"full ({r['ppl']:.2f})")
    for label, points in _series(rows, "max_kv", "ppl").items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    samples = rows[0]["samples"] if rows else "?"
    return _finish(
        ax, fig, path, f"Perplexity vs KV cache size ({seq_len}-token samples, n={samples})",
        "max_kv (tokens per layer)", "perplexity",
    )  # fmt: skip


def plot_ppl_vs_seq_len(records: list[dict[str, Any]], max_kv: int, path: Path) -> Path:
    """Perplexity against sequence length at one cache size (full cache included)."""
    rows = [r for r in records if r["max_kv"] in (None, max_kv)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in _series(rows, "seq_len", "ppl").items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label == "full" else "-")
    ax.set_xscale("log", base=2)
    return _finish(
        ax, fig, path, f"Perplexity vs sequence length (max_kv={max_kv})",
        "sequence length (tokens)", "perplexity",
    )  # fmt: skip


def _label_with_kv(r: dict[str, Any]) -> str:
    return case_label(r) + (f" {r['max_kv']}" if r.get("max_kv") else "")


def plot_tps_vs_context(records: list[dict[str, Any]], path: Path) -> Path:
    """Decode and prefill tok/s against context length, one line per cache."""
    panels = (("decode_tps", "decode speed"), ("prefill_tps", "prefill speed"))
    return _context_panels(records, panels, 1.0, "tokens / s", path)


def plot_memory_vs_context(records: list[dict[str, Any]], path: Path) -> Path:
    """KV cache bytes and MLX peak memory against context length, one line per cache."""
    panels = (
        ("cache_bytes", "KV cache size"),
        ("peak_mem_bytes", "MLX peak memory (weights incl.)"),
    )
    return _context_panels(records, panels, MIB, "MiB", path)


def _context_panels(
    records: list[dict[str, Any]],
    panels: tuple[tuple[str, str], ...],
    unit: float,
    ylabel: str,
    path: Path,
) -> Path:
    """One panel per (record key, title) against context length, one line per cache."""
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 4.2))
    for ax, (key, name) in zip(axes, panels, strict=True):
        lines: dict[str, list] = defaultdict(list)
        for r in records:
            lines[_label_with_kv(r)].append((r["context"], r[key] / unit))
        for label, points in lines.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        _style(ax, f"{name} vs context", "context (tokens)", ylabel)
    return _save(fig, path)


def plot_all(records: list[dict[str, Any]], out: Path) -> list[Path]:
    """Every plot the records support: ppl by max_kv / seq_len, throughput, memory."""
    written = []
    ppl = [r for r in records if "ppl" in r]
    tp = [r for r in records if "decode_tps" in r]
    for seq_len in sorted({r["seq_len"] for r in ppl}):
        if len({r["max_kv"] for r in ppl if r["seq_len"] == seq_len} - {None}) > 1:
            written.append(plot_ppl_vs_max_kv(ppl, seq_len, out / f"ppl_vs_max_kv_{seq_len}.png"))
    for max_kv in sorted({r["max_kv"] for r in ppl} - {None}):
        if len({r["seq_len"] for r in ppl if r["max_kv"] == max_kv}) > 1:
            written.append(plot_ppl_vs_seq_len(ppl, max_kv, out / f"ppl_vs_seq_len_{max_kv}.png"))
    if tp:
        written.append(plot_tps_vs_context(tp, out / "tps_vs_context.png"))
        written.append(plot_memory_vs_context(tp, out / "memory_vs_context.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="plot `h2o-server eval ... --json` records")
    p.add_argument("records", nargs="+", type=Path, help="JSON files of records")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the PNGs")
    args = p.parse_args(argv)
    records = [r for f in args.records for r in json.loads(f.read_text())]
    for path in plot_all(records, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
