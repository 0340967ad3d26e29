"""The real coding-agent CLIs, unmodified, against one server on the default model:
Codex CLI through /v1/responses, Claude Code through /v1/messages.

Each runs a first turn cold, a second turn of the same conversation (Codex: `codex exec
resume --last`; its whole history resent under its prompt_cache_key) and a new
conversation with the same system prompt and tools (Codex: a new session in the same
CODEX_HOME; Claude Code: `claude -p` again in the same folder), which the prefix store
serves. Every request's status, time to first token and the prompt tokens the server
had cached come from a recording proxy (bench/codex_cli.py, bench/claude_cli.py).

    python -m bench.agents --npm DIR --out docs/agents_measured.md

The CLIs are npm packages: `--npm DIR` is where they are (installed there at the
versions below when missing; npm's registry is the only network this needs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.claude_cli import claude_turn
from bench.codex_cli import run_codex_session
from bench.local_server import start_server, stop_server
from bench.recording_proxy import ProxiedRequest
from bench.report import command, machine, publish

PACKAGES = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.197"}
MODEL = "local-model"
# Both prompts pass the default model's 8k context: an evicting policy serves them, in a
# budget that gives each of 4 conversations ~4000 tokens a layer on average (the layer
# profile's shares; it also bounds each decode step's reads) and keeps 30% for the
# system prompts new conversations fork.
SERVE = [
    "--model", "default", "--policy", "h2o", "--kv-budget", "1GiB", "--max-sessions", "4",
    "--prefix-share", "0.3", "--max-prompt-tokens", "32768", "--served-model-name", MODEL,
]  # fmt: skip
# Neither CLI sends a temperature. At 1.0 the default model rambles on Codex's prompt
# until the reply budget ends the response as incomplete (Codex: exit 1); greedy, it
# loops on Claude Code's until Claude Code's own cap (exit 1). Each CLI is served as it
# ends its turns.
TEMPERATURE = {"codex": ["--default-temperature", "0"], "claude": []}
# A reply that reaches Claude Code's own cap makes `claude -p` exit 1; this one bounds
# a reply that loops at CPU decode speed without cutting a normal turn.
CLAUDE_MAX_OUTPUT = 4096


def binaries(npm: Path) -> dict[str, str]:
    """The CLIs under `npm`, installed there when missing."""
    found = {name: npm / "node_modules" / ".bin" / name for name in PACKAGES}
    missing = [PACKAGES[name] for name, path in found.items() if not path.exists()]
    if missing:
        subprocess.run(["npm", "install", "--prefix", str(npm), *missing], check=True)
    return {name: str(path) for name, path in found.items()}


def rows(cli: str, turn: str, exit_status: int, requests: list[ProxiedRequest]) -> list[dict]:
    return [
        {
            "cli": cli,
            "turn": turn,
            "exit": exit_status,
            "request": f"{r.method} {r.path}",
            "status": r.status,
            "bytes": r.request_bytes,
            "prompt_tokens": r.input_tokens,
            "cached_tokens": r.cached_tokens,
            "ttft_s": r.ttft_s,
            "seconds": r.seconds,
        }
        for r in requests
    ]


def run_codex(base_url: str, codex: str, scratch: Path, prompts: list[str]) -> list[dict]:
    home, out = scratch / "codex-home", []
    session = run_codex_session(
        f"{base_url}/v1", prompts, MODEL, codex=codex, home=home, workdir=scratch / "codex-work"
    )
    for n, turn in enumerate(session, 1):
        out += rows("codex", f"session 1, turn {n}", turn.exit_status, turn.requests)
    (turn,) = run_codex_session(  # a new session in the same project
        f"{base_url}/v1", prompts[:1], MODEL, codex=codex, home=home, workdir=scratch / "codex-work"
    )
    return out + rows("codex", "session 2, turn 1", turn.exit_status, turn.requests)


def run_claude(base_url: str, claude: str, scratch: Path, prompt: str) -> list[dict]:
    out = []
    for n in (1, 2):  # the same folder: the same system prompt, a new conversation
        turn = claude_turn(
            base_url, prompt, MODEL, claude=claude, max_output_tokens=CLAUDE_MAX_OUTPUT,
            scratch=scratch / "claude",
        )  # fmt: skip
        out += rows("claude", f"session {n}, turn 1", turn.exit_status, turn.requests)
    return out


def table(records: list[dict]) -> list[str]:
    def num(v, fmt="{:.1f}"):
        return "" if v is None else fmt.format(v)

    lines = [
        "| CLI | turn | request | status | body | prompt tokens | cached | TTFT s | took s "
        "| exit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        cells = [
            r["cli"], r["turn"], f"`{r['request']}`", r["status"], f"{r['bytes']:,} B",
            num(r["prompt_tokens"], "{:,}"), num(r["cached_tokens"], "{:,}"),
            num(r["ttft_s"]), num(r["seconds"]), r["exit"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--npm", type=Path, required=True, help="where the CLIs' npm packages are")
    p.add_argument("--cli", choices=["codex", "claude"], action="append", help="default: both")
    p.add_argument("--prompt", default="Say hi.")
    p.add_argument("--again", default="Say it again.", help="the second turn's prompt")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="the records, as JSON")
    args = p.parse_args(argv)
    found = binaries(args.npm)
    clis = args.cli or ["codex", "claude"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run stops its server
    records, began, cpu = [], time.time(), os.times()
    with tempfile.TemporaryDirectory(prefix="agents-") as scratch:
        for cli in clis:  # one server each, started fresh: each CLI's first turn is cold
            log = open(Path(scratch, f"server-{cli}.log"), "w")
            process, port = start_server([*SERVE, *TEMPERATURE[cli]], stdout=log, timeout=300)
            base = f"http://127.0.0.1:{port}"
            try:
                if cli == "codex":
                    prompts = [args.prompt, args.again]
                    records += run_codex(base, found["codex"], Path(scratch), prompts)
                else:
                    records += run_claude(base, found["claude"], Path(scratch), args.prompt)
            finally:
                stop_server(process)
    children = os.times()
    server_cpu = (children.children_user + children.children_system) - (
        cpu.children_user + cpu.children_system
    )
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    ok = all(
        r["exit"] == 0 and 200 <= r["status"] < 300 for r in records if r["request"] != "HEAD /"
    )
    intro = (
        f"{machine()}. For each CLI a fresh server, `h2o-server serve {' '.join(SERVE)}` "
        f"(Codex: with `{' '.join(TEMPERATURE['codex'])}`); Codex CLI "
        f"{PACKAGES['codex'].rsplit('@', 1)[1]} and Claude Code "
        f"{PACKAGES['claude'].rsplit('@', 1)[1]}, unmodified, each in a scratch home, "
        f"prompts {args.prompt!r} then {args.again!r}. {time.time() - began:.0f} s wall, "
        f"{server_cpu:.0f} s CPU of the processes this run started. Every request 2xx and "
        f"every exit 0: **{'yes' if ok else 'no'}**. Cached: prompt tokens the server "
        "reused from its caches (a conversation's own, or the prefix store's copy of the "
        "system prompt and tools); Claude Code's `HEAD /` is its reachability probe."
    )
    publish("Coding agents against this server", intro, command("bench.agents", argv),
            table(records), args.out)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
