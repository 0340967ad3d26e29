"""n choices in one request against n separate requests of the same prompt.

One request with `n` choices prefills its prompt once and decodes the choices as rows
of one batch from copies of that cache; the same prompt sent as n separate requests at
once (the way a client gets n samples from a server without `n`) prefills it n times,
in the same batched rounds. Per round, both variants on one server, in alternating
order; every prompt is a passage of the essays the server has not seen (a prompt
repeated would be found in a session's cache). /v1/completions, seeded sampling,
fixed-length replies; the wall time to the last token, the server's prefilled tokens
(`prefill_tokens_total` of /metrics) and its process CPU seconds.

    python -m bench.n_choices --out docs/n_choices.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from bench.local_server import start_server, stop_server
from bench.mlx_folder import export_default
from bench.report import command, machine, publish
from bench.server_load import OURS, Server, passages

ONE, SEPARATE = "n in one request", "n separate requests"


def prefilled(server: Server) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
    for line in text.splitlines():
        if line.split(" ")[0].endswith("prefill_tokens_total"):
            return float(line.split()[1])
    raise RuntimeError("the server's /metrics has no prefill_tokens_total")


def measure(server: Server, variant: str, prompt: str, n: int, reply: int, seed: int) -> dict:
    kwargs = dict(model="default", prompt=prompt, max_tokens=reply, temperature=1.0, seed=seed)
    # Whatever the model samples, every reply runs to max_tokens: no end-of-text token.
    kwargs["logit_bias"] = {"0": -100, "2": -100}
    cpu0, fed0, start = server.cpu_seconds(), prefilled(server), time.perf_counter()
    if variant == ONE:
        usage = server.client.completions.create(**kwargs, n=n).usage
        tokens = usage.completion_tokens
    else:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda _: server.client.completions.create(**kwargs), range(n)))
        tokens = sum(r.usage.completion_tokens for r in replies)
    return {
        "variant": variant,
        "wall_s": time.perf_counter() - start,
        "cpu_s": server.cpu_seconds() - cpu0,
        "prefilled": prefilled(server) - fed0,
        "completion_tokens": tokens,
    }


def run(args) -> list[dict]:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(export_default())
    texts = passages(tokenizer, 2 * args.rounds, args.prompt_tokens, 50000)
    process, port = start_server(["--model", "default", "--max-sessions", str(2 * args.n)])
    server = Server(OURS, process, port)
    records = []
    try:
        server.client.completions.create(model="default", prompt="warm up", max_tokens=4)
        for rnd in range(args.rounds):
            order = [ONE, SEPARATE] if rnd % 2 == 0 else [SEPARATE, ONE]
            for i, variant in enumerate(order):
                prompt = texts[2 * rnd + i]
                record = measure(server, variant, prompt, args.n, args.reply_tokens, rnd)
                records.append({"round": rnd, **record})
                print(records[-1], file=sys.stderr, flush=True)
    finally:
        stop_server(process)
    return records


def table(records: list[dict]) -> list[str]:
    rows = [
        "| variant | wall s (median) | CPU s | prompt tokens prefilled | completion tokens |",
        "|---|---|---|---|---|",
    ]
    for variant in (ONE, SEPARATE):
        mine = [r for r in records if r["variant"] == variant]
        cells = [statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "prefilled")]
        tokens = mine[0]["completion_tokens"]
        rows.append(f"| {variant} | {cells[0]:.2f} | {cells[1]:.1f} | {cells[2]:.0f} | {tokens} |")
    by_round = {}
    for r in records:
        by_round.setdefault(r["round"], {})[r["variant"]] = r
    walls = [v[ONE]["wall_s"] / v[SEPARATE]["wall_s"] for v in by_round.values()]
    cpus = [v[ONE]["cpu_s"] / v[SEPARATE]["cpu_s"] for v in by_round.values()]
    rows += [
        "",
        f"One request / separate requests, round by round: wall "
        f"{', '.join(f'{w:.2f}' for w in walls)} (median **{statistics.median(walls):.2f}x**); "
        f"CPU {', '.join(f'{c:.2f}' for c in cpus)} (median {statistics.median(cpus):.2f}x).",
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    records = run(args)
    publish(
        "n choices in one request against n separate requests",
        f"The same {args.prompt_tokens}-token prompt (an essay passage, new each time) as one "
        f"/v1/completions request with n = {args.n}, and as {args.n} requests sent at once; "
        f"replies of {args.reply_tokens} tokens each (seeded sampling, end of text masked), "
        f"default model on `h2o-server serve --model default --max-sessions {2 * args.n}`, "
        f"both variants on one server, {args.rounds} rounds in alternating order. Prefilled: "
        f"the server's `prefill_tokens_total` over the request(s). {machine()}.",
        command("bench.n_choices", argv),
        table(records),
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
