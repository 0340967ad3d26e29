"""One `codex exec` turn of the real Codex CLI against a Responses API base URL.

Codex runs in a scratch CODEX_HOME (a provider pointed at a recording proxy, analytics
and plugins off, so nothing else is contacted) and a scratch working folder; the proxy
(bench/recording_proxy.py) passes every request through unchanged and notes its status,
when its first token came (the first output delta of its stream), when it ended and the
tokens the server cached.
`run_codex_turn` and `run_codex_session` (turns resumed with `codex exec resume
--last`) are what bench/agents.py composes; `python -m bench.codex_cli --base-url URL
[--prompt P ...]` runs them.

Codex is not installed by `make setup`: `npm install --prefix DIR @openai/codex`, then
pass `--codex DIR/node_modules/.bin/codex` (or put `codex` on PATH). Serve a model name
Codex does not know as OpenAI's (`--served-model-name local-model`): for one it knows
it sends its tools in another shape. Its first prompt is ~10k tokens, past the default
model's 8k context: serve it under a policy that evicts (`--policy h2o
--max-prompt-tokens 32768`). Codex sends no temperature: at OpenAI's 1.0 the default
model rambles until its reply budget ends the response as incomplete, which Codex takes
as an error (exit 1); `--default-temperature 0` keeps its replies short.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.recording_proxy import ProxiedRequest, RecordingProxy, SseNotes, run_cli

# The events that carry the reply's tokens.
FIRST_TOKEN = (
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
)


def _token(event: dict) -> str | None:
    return event.get("delta", "") if event.get("type") in FIRST_TOKEN else None


def _usage(event: dict) -> tuple[int, int] | None:
    usage = (event.get("response") or {}).get("usage") or {}
    if not usage:
        return None
    return usage.get("input_tokens"), (usage.get("input_tokens_details") or {}).get("cached_tokens")


RESPONSES_EVENTS = SseNotes(_token, _usage)


@dataclass
class CodexTurn:
    exit_status: int
    stdout: str
    stderr: str
    seconds: float
    requests: list[ProxiedRequest] = field(default_factory=list)

    @property
    def all_2xx(self) -> bool:
        return bool(self.requests) and all(200 <= r.status < 300 for r in self.requests)


def codex_config(base_url: str, model: str, idle_timeout_ms: int | None = None) -> str:
    lines = [
        f'model = "{model}"',
        'model_provider = "local"',
        "[model_providers.local]",
        'name = "Local"',
        f'base_url = "{base_url}"',
        'wire_api = "responses"',
    ]
    if idle_timeout_ms is not None:
        lines.append(f"stream_idle_timeout_ms = {idle_timeout_ms}")
    lines += ["[analytics]", "enabled = false", "[features]", "plugins = false"]
    return "\n".join(lines) + "\n"


def find_codex(codex: str | None = None) -> str:
    found = codex or os.environ.get("CODEX_BIN") or shutil.which("codex")
    if not found:
        raise FileNotFoundError(
            "Codex CLI not found: npm install --prefix DIR @openai/codex, then pass "
            "codex=DIR/node_modules/.bin/codex (or set CODEX_BIN)"
        )
    return found


def run_codex_turn(
    base_url: str,
    prompt: str = "Say hi.",
    model: str = "local-model",
    timeout: float = 900,
    codex: str | None = None,
    idle_timeout_ms: int | None = None,
) -> CodexTurn:
    """One `codex exec` turn against `base_url` (the server's, ending in /v1): its exit
    status, stdout (the answer), stderr and every request's status and TTFT."""
    return run_codex_session(base_url, [prompt], model, timeout, codex, idle_timeout_ms)[0]


def run_codex_session(
    base_url: str,
    prompts: list[str],
    model: str = "local-model",
    timeout: float = 900,
    codex: str | None = None,
    idle_timeout_ms: int | None = None,
    home: str | Path | None = None,
    workdir: str | Path | None = None,
) -> list[CodexTurn]:
    """A session of turns in one CODEX_HOME: `codex exec` with the first prompt, then
    `codex exec resume --last` with each next one (Codex resends the whole history under
    the same prompt_cache_key: the server's cache of it serves the next turn). Stops
    after a turn that fails. `timeout`: seconds per turn.

    `home`, `workdir`: folders to use (default: scratch ones, removed after). Codex's
    system prompt names its CODEX_HOME, so sessions share their system prompt (the
    server's prefix store) only under one `home`, as a user's ~/.codex is."""
    binary = find_codex(codex)
    turns: list[CodexTurn] = []
    with (
        RecordingProxy(base_url.rstrip("/").removesuffix("/v1"), RESPONSES_EVENTS) as recorder,
        tempfile.TemporaryDirectory(prefix="codex-home-") as scratch_home,
        tempfile.TemporaryDirectory(prefix="codex-work-") as scratch_work,
    ):
        proxied = f"{recorder.url}/v1"
        home, work = home or scratch_home, workdir or scratch_work
        Path(home).mkdir(parents=True, exist_ok=True)
        Path(work).mkdir(parents=True, exist_ok=True)
        Path(home, "config.toml").write_text(codex_config(proxied, model, idle_timeout_ms))
        for i, prompt in enumerate(prompts):
            command = [binary, "exec", "--skip-git-repo-check"]
            command += ["resume", "--last", prompt] if i else [prompt]
            before = len(recorder.records)
            env = {**os.environ, "CODEX_HOME": str(home)}
            status, out, err, seconds = run_cli(command, work, env, timeout)
            turns.append(CodexTurn(status, out, err, seconds, recorder.records[before:]))
            if status != 0:
                break
    return turns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument(
        "--prompt", action="append", help="a turn's prompt; several: a session (default: Say hi.)"
    )
    p.add_argument("--model", default="local-model")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--codex", default=None, help="the codex binary (default: CODEX_BIN, PATH)")
    p.add_argument("--home", default=None, help="CODEX_HOME to use (default: a scratch one)")
    p.add_argument("--workdir", default=None, help="the folder Codex works in (default: scratch)")
    args = p.parse_args()
    prompts = args.prompt or ["Say hi."]
    turns = run_codex_session(
        args.base_url,
        prompts,
        args.model,
        args.timeout,
        args.codex,
        home=args.home,
        workdir=args.workdir,
    )
    print(json.dumps([{**asdict(t), "all_2xx": t.all_2xx} for t in turns], indent=1))
    return max(t.exit_status for t in turns)


if __name__ == "__main__":
    raise SystemExit(main())
