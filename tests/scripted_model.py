"""A tiny model folder whose greedy replies are written in advance, for tests that need a
model to act (call a tool, then answer) through the real server and real clients.

A 1-layer llama whose attention and MLP add nothing: each position's logits pick
`after[token]` (one-hot embeddings, a permutation in the output head), so a greedy reply
is the chain that follows the prompt's last token. Replies are `phrases`: whole pieces
of text that are one token each wherever they occur (a tool call the model writes comes
back in the next prompt as the same tokens). The template decides which chain a prompt
gets by the token it ends with.
"""

from __future__ import annotations

from pathlib import Path


def write_chain_model(
    folder: Path,
    special: list[str],
    words: list[str],
    after: dict[str, str],
    eos: str,
    template: str,
    phrases: list[str] = (),
) -> dict[str, int]:
    """Write the model folder: vocabulary `special + words + phrases`; token t is followed
    by `after[t]` (anything else by `eos`). Returns the token ids."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model
    from word_tokenizer import save_word_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = [*special, *words, *phrases]
    v = len(vocab)
    hidden = 16 * ((v + 15) // 16)
    config = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
        "num_hidden_layers": 1, "vocab_size": v, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    }  # fmt: skip
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_map(lambda a: mx.zeros_like(a), model.parameters()))
    ids = {t: i for i, t in enumerate(vocab)}
    embed = mx.zeros((v, hidden)).at[mx.arange(v), mx.arange(v)].add(1.0)
    nxt = [ids[after.get(t, eos)] for t in vocab]
    head = mx.zeros((v, hidden)).at[mx.array(nxt), mx.arange(v)].add(10.0)
    norms = {k: mx.ones_like(a) for k, a in tree_flatten(model.parameters()) if "norm" in k}
    model.load_weights([("model.embed_tokens.weight", embed), ("lm_head.weight", head),
                        *norms.items()], strict=False)  # fmt: skip
    save_model(folder, model)
    save_config(config, folder / "config.json")
    save_word_tokenizer(folder, vocab, special, eos, template, list(phrases))
    return ids


def chain(*tokens: str) -> dict[str, str]:
    """`after` entries making `tokens` follow one another."""
    return dict(zip(tokens, tokens[1:], strict=False))
