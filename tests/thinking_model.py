"""A tiny model folder with a thinking chat template whose replies are known in advance.

A 1-layer llama whose attention and MLP add nothing: each position's logits pick
NEXT[token] (one-hot embeddings, a permutation in the output head), so a greedy reply
after the generation prompt is always the same: "<think> hmm let me see </think> The
answer is four." then <|im_end|>. The template is Qwen3's shape: with
`enable_thinking` false it writes an empty thinking block itself, so the reply starts
after it ("The answer is four."); `opens=True` makes a template that opens the block in
the prompt (DeepSeek-R1's shape), so the reply starts inside it.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "[UNK]"]
WORDS = ["system", "user", "assistant", "developer", "tool", "hmm", "let", "me", "see", "The",
         "answer", "is", "four."]  # fmt: skip
VOCAB = SPECIAL + WORDS
REPLY = ["<think>", "hmm", "let", "me", "see", "</think>", "The", "answer", "is", "four."]
REASONING, CONTENT = "hmm let me see", "The answer is four."

TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %} <think> </think>"
    "{%- elif OPENS %} <think>{%- endif %}{%- endif %}"
)


def next_token() -> dict[str, str]:
    """What follows each token: the reply after "assistant", the end after it; anything
    else ends the reply at once."""
    chain = ["assistant", *REPLY, "<|im_end|>"]
    table = {t: "<|im_end|>" for t in VOCAB}
    table.update(zip(chain, chain[1:], strict=False))
    return table


def write_thinking_model(folder: Path, opens: bool = False) -> Path:
    """Write the model folder (config, weights, tokenizer, template); return it."""
    from scripted_model import write_chain_model

    template = TEMPLATE.replace("OPENS", "true" if opens else "false")
    write_chain_model(folder, SPECIAL, WORDS, next_token(), "<|im_end|>", template)
    return folder
