"""Builds OpenAI response bodies and stream chunks from the worker's events.

One builder per request; `kind` is "chat" (chat.completion[.chunk]) or "text"
(text_completion, the legacy /v1/completions shape).
"""

from __future__ import annotations

from server.generation import Delta, TokenLogprob
from server.protocol import new_id, now


class ReplyBuilder:
    def __init__(self, kind: str, model: str, tokenizer, include_usage: bool, echo: str = ""):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.include_usage = include_usage
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = now()
        self.echo = echo  # /v1/completions with echo: the prompt leads the text
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None

    # ------------------------------------------------------------------ whole reply

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason

    def response(self, finished) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text, "refusal": None},
                "logprobs": self._chat_logprobs(self.logprobs),
                "finish_reason": self.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": self.echo + self.text,
                "logprobs": self._text_logprobs(self.logprobs),
                "finish_reason": self.finish_reason,
            }
            obj = "text_completion"
        return {**self._envelope(obj), "choices": [choice], "usage": finished.usage}

    # ------------------------------------------------------------------ stream

    def first_chunk(self) -> dict:
        if self.kind == "chat":
            return self._chunk({"role": "assistant", "content": ""}, None, [])
        return self._chunk(self.echo, None, [])

    def chunk(self, delta: Delta) -> dict:
        self.add(delta)
        content = {"content": delta.text} if self.kind == "chat" else delta.text
        return self._chunk(content, None, delta.logprobs)

    def final_chunks(self, finished) -> list[dict]:
        last = self._chunk({} if self.kind == "chat" else "", self.finish_reason, [])
        if not self.include_usage:
            return [last]
        return [
            last,
            {**self._envelope(self._chunk_object()), "choices": [], "usage": finished.usage},
        ]

    # ------------------------------------------------------------------ parts

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _chunk(self, content, finish_reason: str | None, logprobs: list[TokenLogprob]) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "delta": content,
                "logprobs": self._chat_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": content,
                "logprobs": self._text_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        chunk = {**self._envelope(self._chunk_object()), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _entry(self, token: int, logprob: float) -> dict:
        text = self._token(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if not logprobs:
            return None
        content = [
            {**self._entry(lp.token, lp.logprob), "top_logprobs": [self._entry(*t) for t in lp.top]}
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}

    def _text_logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if not logprobs:
            return None
        tokens = [self._token(lp.token) for lp in logprobs]
        offsets, at = [], len(self.echo)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }
