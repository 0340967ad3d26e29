"""Long multi-turn chat recall, through the real server.

Each trial is one conversation sent to `/v1/chat/completions` of an in-process
`h2o-server` (uvicorn on a free local port, the same app `serve` runs), with
`prompt_cache_key` naming the conversation, so the session store finds its
cache, prefills only the new turn and evicts as it would for any client. Turn 1
states a fact (a name and a 4-digit number), filler turns paste essay
passages until the conversation is many times max_kv long, and the last turn
asks for the number. A trial scores 1 when the reply contains it (exact match
of the digits). Every policy sees the same facts and passages (seeded per
trial); replies are greedy.

`document` trials measure the cache rather than the model: SmolLM2-135M loses
the fact in chats even with a full cache (0-2 of 8 in a probe, scripted replies
or its own). Each turn appends a note or a passage to one plain-text document
sent to `/v1/completions` under the same `prompt_cache_key` (one token
generated per turn, so every turn runs through the session and evicts as a chat
does), and the last turn ends in "Answer: <name>'s secret number is": copying
it, the model scores 10 of 10 with a full cache at 220-400 tokens.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.request
import uuid
from typing import Any

from bench.local_server import free_port

NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Ivan", "Jun")
FACT_REPLY_TOKENS = 16
FILLER_REPLY_TOKENS = 4
ANSWER_TOKENS = 16


class LocalServer:
    """`h2o-server serve` in this process, on a free port; a context manager."""

    def __init__(self, model: str, kv_budget: str = "4GiB", max_sessions: int = 2):
        import uvicorn

        from config.settings import ServerSettings
        from server.api.app import create_app

        # Even layers: every case is the max_kv it names (eval recall takes no --layer-budgets)
        settings = ServerSettings(
            model=model, kv_budget=kv_budget, max_sessions=max_sessions, layer_budgets="uniform"
        )
        self.port = free_port()
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="recall-server", daemon=True)

    def __enter__(self) -> LocalServer:
        self.thread.start()
        deadline = time.time() + 300  # loading the model
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the recall server did not start")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def chat(self, messages: list[dict], key: str, max_tokens: int, kv_cache: dict) -> dict:
        return self.post("chat/completions", {"messages": messages}, key, max_tokens, kv_cache)

    def complete(self, prompt: str, key: str, max_tokens: int, kv_cache: dict) -> dict:
        return self.post("completions", {"prompt": prompt}, key, max_tokens, kv_cache)

    def post(self, route: str, body: dict, key: str, max_tokens: int, kv_cache: dict) -> dict:
        body = {
            "model": "default",
            **body,
            "max_tokens": max_tokens,
            "temperature": 0,
            "prompt_cache_key": key,
            "kv_cache": kv_cache,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/{route}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())


def trial_script(
    tokenizer, trial: int, turns: int, filler_tokens: int, document: bool = False
) -> tuple[list[str], str]:
    """(user messages, or a document's turns, and the number to recall) of one trial;
    passages differ per trial."""
    from bench.text import essay_token_ids

    rng = random.Random(trial)
    number = str(rng.randint(1000, 9999))
    name = rng.choice(NAMES)
    ids = essay_token_ids(tokenizer, (trial + 1) * turns * filler_tokens)
    start = trial * turns * filler_tokens
    passages = [
        tokenizer.decode(ids[start + i * filler_tokens : start + (i + 1) * filler_tokens])
        for i in range(turns)
    ]
    if document:
        parts = [f"Note: {name}'s secret number is {number}.\n\n"]
        parts += [p.strip() + "\n\n" for p in passages]
        question = f"Question: what is {name}'s secret number?\n"
        parts.append(f"{question}Answer: {name}'s secret number is")
        return parts, number
    # Plain passages as user turns and a short question: the phrasing SmolLM2-135M
    # answered best with a full cache in a small probe (it often fails anyway).
    users = [f"My name is {name}. My secret number is {number}. Please remember it."]
    users += [p.strip() for p in passages]
    users.append("What is my secret number?")
    return users, number


def run_document_trial(server: LocalServer, parts: list[str], number: str, kv_cache: dict):
    """One document grown a part per request; the last request's completion is the answer."""
    key = f"recall-{uuid.uuid4().hex[:12]}"
    text, cached, prompt = "", 0, 0
    for i, part in enumerate(parts):
        text += part
        last = i == len(parts) - 1
        reply = server.complete(text, key, ANSWER_TOKENS if last else 1, kv_cache)
        usage = reply["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    answer = reply["choices"][0]["text"] or ""
    return {
        "hit": number in answer,
        "answer": answer,
        "tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "cached_share": cached / max(1, prompt),
    }


def run_trial(server: LocalServer, users: list[str], number: str, kv_cache: dict) -> dict:
    key = f"recall-{uuid.uuid4().hex[:12]}"
    messages: list[dict] = []
    cached = prompt = 0
    for i, text in enumerate(users):
        messages.append({"role": "user", "content": text})
        last = i == len(users) - 1
        max_tokens = ANSWER_TOKENS if last else FACT_REPLY_TOKENS if i == 0 else FILLER_REPLY_TOKENS
        reply = server.chat(messages, key, max_tokens, kv_cache)
        usage = reply["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        content = reply["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": content})
    return {
        "hit": number in content,
        "answer": content,
        "tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "cached_share": cached / max(1, prompt),
    }


def run_recall(args, cases: list, progress=None) -> list[dict[str, Any]]:
    """One record per cache case: recall over `args.samples` trials (see module doc)."""
    from models.loading import load_model

    longest_kv = max((c.max_kv for c in cases if c.max_kv), default=256)
    filler = args.filler_tokens
    turns = args.turns or math.ceil(args.conversation_factor * longest_kv / filler)
    _, tokenizer = load_model(args.model)  # the client's copy, for the essay passages only
    document = getattr(args, "document", False)
    scripts = [trial_script(tokenizer, t, turns, filler, document) for t in range(args.samples)]
    trial = run_document_trial if document else run_trial
    if progress:
        progress(len(cases) * args.samples, None)

    records = []
    with LocalServer(args.model) as server:
        for case in cases:
            kv_cache = {k: v for k, v in case.cache_kwargs().items() if k != "evict_batch"}
            results = []
            for users, number in scripts:
                results.append(trial(server, users, number, kv_cache))
                if progress:
                    progress(1, " ".join(str(v) for v in case.fields().values() if v is not None))
            records.append(
                {
                    **case.fields(),
                    "samples": args.samples,
                    "turns": turns + 2,
                    "conversation_tokens": round(sum(r["tokens"] for r in results) / len(results)),
                    "hits": sum(r["hit"] for r in results),
                    "recall": sum(r["hit"] for r in results) / len(results),
                    "cached_share": sum(r["cached_share"] for r in results) / len(results),
                    "answers": " | ".join(r["answer"].strip() for r in results),
                    "numbers": " | ".join(number for _, number in scripts),
                }
            )
    return records
