"""An agent's session through each API: 20 turns of a tool call and its result.

An agent as coding agents run one: a long system prompt (~4k tokens: instructions and
essay text as its reference material) with 10 tools; each turn the model calls a tool
(the call forced: `tool_choice` required / any) and the agent sends back a ~150-token
result. Through chat completions (the history resent), Responses (a
`previous_response_id` chain: only the result is sent) and Messages (the history
resent with tool_use / tool_result blocks), on this server under its default policy
(`auto`) and under `h2o` in a budget that evicts; and through chat completions on
`mlx_lm.server` with the same float32 weights. Each turn's time to its first streamed
token is recorded, then a second agent with the same system prompt starts (the prefix
store's fork). One server process at a time; the variants' order alternates by round.

    python -m bench.agent_session --out docs/agent_session.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.local_server import start_server, stop_server
from bench.mlx_folder import export_default
from bench.report import command, machine, publish
from bench.server_load import MLX_LM, OURS, Server, passages, start_mlx_lm

TOOLS = [
    ("read_file", "Read a file of the project", {"path": {"type": "string"}}),
    ("list_dir", "List a directory", {"path": {"type": "string"}}),
    ("grep", "Search the project for a pattern", {"pattern": {"type": "string"}}),
    ("run_tests", "Run the test suite", {"target": {"type": "string"}}),
    (
        "edit_file",
        "Replace text in a file",
        {"path": {"type": "string"}, "new": {"type": "string"}},
    ),
    ("git_diff", "Show the working tree's diff", {"path": {"type": "string"}}),
    ("git_log", "Show recent commits", {"count": {"type": "integer"}}),
    ("web_fetch", "Fetch a page", {"url": {"type": "string"}}),
    ("ask_user", "Ask the user a question", {"question": {"type": "string"}}),
    ("finish", "End the task with a summary", {"summary": {"type": "string"}}),
]
INSTRUCTIONS = (
    "You are a careful coding agent. Work step by step: call one tool at a time, read its "
    "result, then decide the next step. The project's notes follow.\n\n"
)
TASK = "Find where the essays discuss startups and summarize what the notes say about them."


def schema(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


@dataclass
class Agent:
    """One agent's conversation through one API; `turn()` sends the last tool result."""

    api: str
    client: object
    model: str
    system: str
    results: list[str]
    reply_tokens: int
    history: list = field(default_factory=list)
    previous: str | None = None  # Responses: the chain's last id

    def turn(self, i: int) -> dict:
        start = time.perf_counter()
        ttft, cached = getattr(self, f"_{self.api}")(i)
        return {"ttft": (ttft or time.perf_counter()) - start, "cached": cached}

    # -------------------------------------------------------- chat completions

    def _chat(self, i: int) -> tuple[float | None, int]:
        if i == 0:
            self.history = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": TASK},
            ]
        tools = [
            {"type": "function", "function": {"name": n, "description": d, "parameters": schema(p)}}
            for n, d, p in TOOLS
        ]
        forced = {"tool_choice": "required", "tools": tools} if self.model != MLX_LM else {}
        stream = self.client.chat.completions.create(
            model=self.model if self.model != MLX_LM else "default_model",
            messages=self.history,
            temperature=0,
            max_tokens=self.reply_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **forced,
        )
        first, text, calls, usage = None, "", {}, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content or c.delta.tool_calls:
                    first = first or time.perf_counter()
                text += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
        result = self.results[i]
        if calls:
            entries = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()
            ]  # fmt: skip
            self.history.append({"role": "assistant", "content": None, "tool_calls": entries})
            self.history += [
                {"role": "tool", "tool_call_id": e["id"], "content": result} for e in entries
            ]
        else:  # mlx_lm.server calls nothing: the result comes back as the next user turn
            self.history += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Tool result:\n{result}"},
            ]
        details = usage.prompt_tokens_details if usage else None
        return first, (details.cached_tokens or 0) if details else 0

    # -------------------------------------------------------- responses

    def _responses(self, i: int) -> tuple[float | None, int]:
        tools = [
            {"type": "function", "name": n, "description": d, "parameters": schema(p)}
            for n, d, p in TOOLS
        ]
        # Instructions are not carried over by previous_response_id (OpenAI's rule): sent
        # every turn, as the same text they render at the same place.
        kwargs = {"instructions": self.system}
        if i == 0:
            kwargs["input"] = TASK
        else:
            kwargs.update(previous_response_id=self.previous, input=self.history)
        stream = self.client.responses.create(
            model=self.model,
            tools=tools,
            tool_choice="required",
            temperature=0,
            max_output_tokens=self.reply_tokens,
            stream=True,
            **kwargs,
        )
        first, done = None, None
        for event in stream:
            if event.type.endswith(".delta"):
                first = first or time.perf_counter()
            if event.type in ("response.completed", "response.incomplete"):
                done = event.response
        self.previous = done.id
        calls = [item for item in done.output if item.type == "function_call"]
        self.history = [
            {"type": "function_call_output", "call_id": c.call_id, "output": self.results[i]}
            for c in calls
        ]
        return first, done.usage.input_tokens_details.cached_tokens

    # -------------------------------------------------------- messages

    def _messages(self, i: int) -> tuple[float | None, int]:
        if i == 0:
            self.history = [{"role": "user", "content": TASK}]
        tools = [{"name": n, "description": d, "input_schema": schema(p)} for n, d, p in TOOLS]
        first, content, usage = None, [], None
        with self.client.messages.stream(
            model=self.model,
            system=self.system,
            messages=self.history,
            tools=tools,
            tool_choice={"type": "any"},
            max_tokens=self.reply_tokens,
            extra_body={"temperature": 0},  # the SDK no longer types its sampling fields
        ) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    first = first or time.perf_counter()
            message = stream.get_final_message()
            content, usage = message.content, message.usage
        self.history.append({"role": "assistant", "content": [b.model_dump() for b in content]})
        uses = [b for b in content if b.type == "tool_use"]
        blocks = [
            {"type": "tool_result", "tool_use_id": b.id, "content": self.results[i]} for b in uses
        ] or [{"type": "text", "text": f"Tool result:\n{self.results[i]}"}]
        self.history.append({"role": "user", "content": blocks})
        return first, usage.cache_read_input_tokens or 0


def variants(apis: list[str], policies: list[str]) -> list[tuple[str, str, list[str]]]:
    """(name, API, server flags) of every run; None flags: mlx_lm.server."""
    out = []
    evicting = ["--policy", "h2o", "--kv-budget", "512MiB", "--prefix-share", "0.3"]
    for policy, flags in (("auto", []), ("h2o", evicting)):
        if policy in policies:
            out += [(f"{OURS} {policy} {api}", api, flags) for api in apis]
    return [*out, (f"{MLX_LM} chat", "chat", None)]


def run_variant(name: str, api: str, flags, folder: Path, system: str, results, args) -> list:
    if flags is None:
        server = start_mlx_lm(folder)
        model = MLX_LM
    else:
        process, port = start_server(["--model", "default", "--max-sessions", "4", *flags])
        server, model = Server(OURS, process, port), "default"
    if api == "messages":
        import anthropic

        client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{server.port}", api_key="-", max_retries=0, timeout=3600
        )
    else:
        client = server.client
    records = []
    try:
        for agent_no in (1, 2):  # the second agent: the same system prompt, a new session
            agent = Agent(api, client, model, system, results, args.reply_tokens)
            cpu0 = server.cpu_seconds()
            for i in range(args.turns if agent_no == 1 else 1):
                record = {"variant": name, "agent": agent_no, "turn": i + 1, **agent.turn(i)}
                records.append(record)
                print(json.dumps(record), file=sys.stderr, flush=True)
            records[-1]["cpu_s"] = server.cpu_seconds() - cpu0
    finally:
        stop_server(server.process)
    return records


def table(records: list[dict], turns: int) -> list[str]:
    def ttft(variant: str, turn: int, agent: int = 1) -> float:
        return statistics.median(
            r["ttft"] for r in records
            if r["variant"] == variant and r["turn"] == turn and r["agent"] == agent
        )  # fmt: skip

    names = list(dict.fromkeys(r["variant"] for r in records))
    rows = [
        "| variant | turn 1 s | turn 2 s | turn 10 s | turn 20 s | turn 20 / turn 2 | "
        "cached at turn 20 | 2nd agent turn 1 s | 2nd / 1st agent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    last = turns
    for name in names:
        cached = [r["cached"] for r in records if r["variant"] == name and r["turn"] == last]
        cells = [ttft(name, t) for t in (1, 2, min(10, last), last)]
        second = ttft(name, 1, agent=2)
        rows.append(
            f"| {name} | "
            + " | ".join(f"{c:.2f}" for c in cells)
            + f" | **{cells[3] / cells[1]:.2f}x** | {statistics.median(cached):.0f} | "
            f"{second:.2f} | **{second / cells[0]:.2f}x** |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--system-tokens",
        type=int,
        default=3600,
        help="the system prompt's essay text (with the instructions and tools ~4k tokens; "
        "20 turns then stay inside the 8k context a full cache has)",
    )
    p.add_argument("--result-tokens", type=int, default=150)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--apis", nargs="+", default=["chat", "responses", "messages"])
    p.add_argument(
        "--policies", nargs="+", choices=["auto", "h2o"], default=["auto", "h2o"],
        help="this server's variants (auto: the default policy; h2o: a budget that evicts)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from mlx_lm.utils import load_tokenizer

    folder = export_default()
    tokenizer = load_tokenizer(folder)
    system = INSTRUCTIONS + passages(tokenizer, 1, args.system_tokens, 0)[0]
    results = passages(tokenizer, args.turns, args.result_tokens, 120000)
    records = []
    runs = variants(args.apis, args.policies)
    for rnd in range(args.rounds):
        for name, api, flags in runs if rnd % 2 == 0 else runs[::-1]:
            records += run_variant(name, api, flags, folder, system, results, args)
    publish(
        "An agent's session through each API",
        f"{args.turns} turns of one agent: a system prompt of {args.system_tokens} tokens "
        f"(instructions and essay text) with {len(TOOLS)} tools; each turn a forced tool "
        f"call (at most {args.reply_tokens} tokens, greedy, streamed) and a "
        f"{args.result_tokens}-token result sent back; then a second agent with the same "
        "system prompt starts. TTFT: seconds to the first streamed token. This server: "
        "`serve --model default --max-sessions 4` (auto), and with `--policy h2o "
        "--kv-budget 512MiB --prefix-share 0.3` (a cache that evicts inside the session); "
        "mlx_lm.server: the "
        "same float32 weights through chat completions (no tool_choice: its replies are "
        f"text, the result comes back as a user turn). {args.rounds} round(s), one server at "
        f"a time. {machine()}.",
        command("bench.agent_session", argv),
        table(records, args.turns),
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
