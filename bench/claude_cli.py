"""One `claude -p` turn (Claude Code, unmodified) against a server's /v1/messages.

Claude Code runs in a scratch HOME with the environment that keeps it to the server it
is pointed at (no telemetry, no attribution block, few retries) and talks to the server
through a small logging proxy in this process, which records each request's status,
time to its first token (the first `content_block_delta` of a stream), duration and
the prompt tokens the server cached (bench/recording_proxy.py).

    from bench.claude_cli import claude_turn
    turn = claude_turn("http://127.0.0.1:8000", "say hi", model="local-model")
    turn.exit_status, turn.stdout, [(r.path, r.status, r.ttft_s) for r in turn.requests]

    python -m bench.claude_cli http://127.0.0.1:8000 --prompt "say hi" --model local-model

Serve the default model so that Claude Code's ~20k-token first prompt fits: an evicting
policy and the names it sends, e.g. `h2o-server serve --policy h2o --max-prompt-tokens
32768 --served-model-name local-model` (docs/agents.md, "Claude Code").
Claude Code is an npm package (`@anthropic-ai/claude-code`); `claude` is found on PATH,
under $CLAUDE_NPM, or given as `claude=`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.recording_proxy import ProxiedRequest, RecordingProxy, SseNotes, run_cli

# Keeps Claude Code to the server: no telemetry or title requests, no per-prompt
# attribution block (it changes the system prompt's first tokens with every prompt, so
# no two conversations would share a prefix), and a short retry backoff.
QUIET_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "CLAUDE_CODE_MAX_RETRIES": "1",
}
# Claude Code aborts a stream after 300 s without an event other than `ping` (its idle
# timer skips pings; the variable can only raise it) and retries it from scratch: a CPU
# prefill of its ~20k-token first prompt can outlast that. API_TIMEOUT_MS bounds its
# non-streaming fallback the same way.
SLOW_PREFILL_ENV = {"CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000", "API_TIMEOUT_MS": "3600000"}


def _token(event: dict) -> str | None:
    if event.get("type") != "content_block_delta":
        return None
    delta = event.get("delta") or {}
    return delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""


def _usage(event: dict) -> tuple[int, int] | None:
    """Anthropic's input_tokens leaves out the cached ones: the prompt is the sum."""
    usage = (event.get("message") or {}).get("usage") or event.get("usage") or {}
    if "input_tokens" not in usage:
        return None
    read = usage.get("cache_read_input_tokens") or 0
    prompt = usage["input_tokens"] + read + (usage.get("cache_creation_input_tokens") or 0)
    return prompt, read


MESSAGES_EVENTS = SseNotes(_token, _usage)


@dataclass
class ClaudeTurn:
    exit_status: int
    stdout: str
    stderr: str
    seconds: float
    requests: list[ProxiedRequest] = field(default_factory=list)

    def all_ok(self) -> bool:
        """Exit status 0 and every request to the API answered 2xx (Claude Code's HEAD /
        reachability probe takes any status)."""
        api = [r for r in self.requests if r.path.startswith("/v1/")]
        return self.exit_status == 0 and bool(api) and all(200 <= r.status < 300 for r in api)


def find_claude() -> str:
    npm = os.environ.get("CLAUDE_NPM", "/tmp/agents/npm")
    for candidate in (shutil.which("claude"), f"{npm}/node_modules/.bin/claude"):
        if candidate and Path(candidate).exists():
            return candidate
    raise FileNotFoundError(
        "claude not found: npm install --prefix DIR @anthropic-ai/claude-code, CLAUDE_NPM=DIR"
    )


def claude_turn(
    base_url: str,
    prompt: str = "say hi",
    model: str = "local-model",
    small_model: str | None = None,
    timeout: float = 3600,
    api_key: str = "local",
    claude: str | None = None,
    extra_env: dict[str, str] | None = None,
    max_output_tokens: int | None = None,
    scratch: str | Path | None = None,
) -> ClaudeTurn:
    """Run `claude -p PROMPT` once against `base_url` (the server's root, no /v1).

    `max_output_tokens`: Claude Code's own cap on a reply (CLAUDE_CODE_MAX_OUTPUT_TOKENS;
    else it asks for 32000, which a small model at temperature 1 may fill); a reply that
    reaches it makes Claude Code exit 1, so keep it well above a turn's. `scratch`: a
    folder kept for HOME and the working directory; two turns in the same one send the
    same system prompt (it names the working directory), so the second finds the first's
    cache. Else a fresh temporary folder."""
    claude = claude or find_claude()
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="claude-cli-"))
        proxy = stack.enter_context(RecordingProxy(base_url, MESSAGES_EVENTS))
        home, work = Path(scratch, "home"), Path(scratch, "work")
        home.mkdir(parents=True, exist_ok=True)
        work.mkdir(exist_ok=True)
        capped = (
            {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)} if max_output_tokens else {}
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))},
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": proxy.url,
            "ANTHROPIC_AUTH_TOKEN": api_key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": small_model or model,
            **QUIET_ENV,
            **SLOW_PREFILL_ENV,
            **capped,
            **(extra_env or {}),
        }
        status, out, err, seconds = run_cli([claude, "-p", prompt], work, env, timeout)
        time.sleep(0.2)  # the proxy's last log line lands after the reply's last byte
        return ClaudeTurn(status, out, err, seconds, list(proxy.records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url", help="the server's root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--prompt", default="say hi")
    parser.add_argument("--model", default="local-model")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--scratch", default=None, help="HOME and cwd kept here (see claude_turn)")
    parser.add_argument("--turns", type=int, default=1, help="the same prompt again, in --scratch")
    args = parser.parse_args(argv)
    ok = True
    for _ in range(args.turns):
        turn = claude_turn(
            args.base_url,
            args.prompt,
            args.model,
            timeout=args.timeout,
            max_output_tokens=args.max_output_tokens,
            scratch=args.scratch,
        )
        _print(turn)
        ok = ok and turn.all_ok()
    return 0 if ok else 1


def _print(turn: ClaudeTurn) -> None:
    for r in turn.requests:
        ttft = f"{r.ttft_s:.1f} s" if r.ttft_s is not None else "-"
        size, cached = f"{r.request_bytes} B", f"cached {r.cached_tokens}/{r.input_tokens}"
        took = f"{r.seconds:.1f} s" if r.seconds is not None else "cut off"
        print(f"{r.method} {r.path} -> {r.status}  {size}  ttft {ttft}  {took}  {cached}")
    print(json.dumps({k: v for k, v in asdict(turn).items() if k != "requests"}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
