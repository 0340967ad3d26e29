"""Where a chat prompt's shareable part ends: its leading system messages.

Programs start many conversations with the same long system prompt; the prefix store
(server/sessions/prefixes.py) keeps the caches at this boundary for the next ones.
Plain Python: the API floor imports no MLX.
"""

from __future__ import annotations

from collections.abc import Callable


def system_prefix_len(
    render: Callable[[list[dict]], list[int]],
    messages: list[dict],
    prompt: list[int],
    min_tokens: int,
) -> int:
    """Tokens of `prompt` that its leading system messages make up (0 if under `min_tokens`):
    the part other conversations may share.

    `render(messages)` is the chat template without a generation prompt. The boundary
    is where the rendering of the system messages alone stops agreeing with the prompt's
    tokens (a template that folds the system prompt into the first user turn agrees up to
    the system text's end).
    """
    lead = []
    for m in messages:
        if m["role"] != "system":
            break
        lead.append(m)
    if not lead or len(lead) == len(messages):
        return 0
    if sum(len(m["content"]) for m in lead) < min_tokens // 4:  # cheaper than rendering
        return 0
    try:
        tokens = render(lead)
    except Exception:  # a template that wants more than system messages: no boundary
        return 0
    n = 0
    for a, b in zip(tokens, prompt[:-1], strict=False):  # the last token starts the reply
        if a != b:
            break
        n += 1
    return n if n >= min_tokens else 0
