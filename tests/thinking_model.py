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
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model
    from word_tokenizer import save_word_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    v, hidden = len(VOCAB), 32
    config = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_hidden_layers": 1, "vocab_size": v, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }  # fmt: skip
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda a: mx.zeros_like(a), model.parameters()))
    ids = {t: i for i, t in enumerate(VOCAB)}
    embed, head = mx.zeros((v, hidden)), mx.zeros((v, hidden))
    embed = embed.at[mx.arange(v), mx.arange(v)].add(1.0)
    nxt = [ids[next_token()[t]] for t in VOCAB]
    head = head.at[mx.array(nxt), mx.arange(v)].add(10.0)
    norms = {k: mx.ones_like(a) for k, a in tree_flatten(model.parameters()) if "norm" in k}
    model.load_weights([("model.embed_tokens.weight", embed), ("lm_head.weight", head),
                        *norms.items()], strict=False)  # fmt: skip
    save_model(folder, model)
    save_config(config, folder / "config.json")

    template = TEMPLATE.replace("OPENS", "true" if opens else "false")
    save_word_tokenizer(folder, VOCAB, SPECIAL, "<|im_end|>", template)
    return folder
