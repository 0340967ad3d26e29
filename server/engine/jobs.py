"""What handlers and the worker thread exchange: jobs, their sampling parameters and events.

Plain dataclasses, no MLX: the app imports this before MLX is loaded.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field

from config.cache_spec import CacheSpec


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0  # 0: off; else only the k likeliest tokens are drawn from (Anthropic's)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: off; k: the chosen token plus k alternatives
    prompt_logprobs: bool = False  # the prompt's tokens' logprobs too (completions echo)
    speculation: bool | None = None  # drafts verified in one pass; None: the server's choice
    prediction: str | None = None  # text the reply is expected to repeat: a draft source


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Started:
    session_id: str
    cached_tokens: int  # prompt tokens reused from the session's cache


@dataclass
class Delta:
    """What one step adds to the reply."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last delta: stop | length
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason stop)
    choice: int = 0  # which of the request's n choices it extends
    # The first delta of a reply that echoes its prompt's logprobs: one per prompt
    # token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    tokens: int = 1  # reply tokens it carries (several where a draft was taken)

    def join(self, later: Delta) -> Delta:
        """This delta followed by `later` (the same choice's next tokens), as one."""
        self.text += later.text
        self.logprobs += later.logprobs
        self.finish_reason, self.stop_sequence = later.finish_reason, later.stop_sequence
        self.tokens += later.tokens
        return self


def joined(first: Delta | None, later: Delta | None) -> Delta | None:
    """`first` followed by `later`, either of which may be missing: a round's one Delta
    (the worker ends a request at the first Delta that finishes it)."""
    if first is None or later is None:
        return first or later
    return first.join(later)


@dataclass
class Finished:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Speculative decoding: drafted tokens the model took, and ones it refused (OpenAI's
    # accepted/rejected_prediction_tokens).
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


@dataclass
class Failed:
    status: int
    message: str
    code: str | None = None
    param: str | None = None


Event = Started | Delta | Finished | Failed


class QueueFull(Exception):
    """Too many requests are waiting; the client should retry later."""


class ShuttingDown(Exception):
    """The server is draining after SIGTERM and takes no new requests."""


class SessionBusy(Exception):
    """The keyed session is serving another request; the job waits its turn."""


class SessionClaimed(Exception):
    """Another replica holds the session (server/sessions/claims.py); the job waits for the
    handover."""


class PromptTooLong(Exception):
    """More of the prompt than a request may prefill is missing from its session's cache."""

    def __init__(self, new_tokens: int):
        super().__init__(f"{new_tokens} prompt tokens to prefill")
        self.new_tokens = new_tokens


@dataclass(eq=False)
class Job:
    prompt: list[int]
    params: SamplingParams
    spec: CacheSpec
    session_key: str | None
    loop: asyncio.AbstractEventLoop
    owner: str = ""  # whose sessions it may use (server/api/auth.py)
    prompt_field: str = "messages"  # the request field holding the prompt (for errors)
    prefix_len: int = 0  # prompt tokens other conversations may share (its system prompt)
    grammar: str | None = None  # llguidance grammar the reply follows (server/api/structured.py)
    n: int = 1  # choices: the prompt is prefilled once, then its caches are forked n ways
    reuse: bool = True  # False: prefill the whole prompt (its logprobs are wanted)
    keep: bool = True  # False: a throwaway session (one of a batch of prompts)
    model: str = ""  # the model's catalog name (server/engine/catalog.py); "": the default
    keep_alive: float | None = None  # seconds its model stays loaded once idle (< 0: ever)
    claim_deadline: float | None = None  # waiting for another replica's session until then
    id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:12]}")  # for the logs
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""

    def cancel(self, reason: str) -> None:
        """Ask the worker to stop this job (any thread); the first reason given sticks."""
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    def emit(self, event: Event) -> None:
        """Called from the worker thread: hand the event to the handler's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)
