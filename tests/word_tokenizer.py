"""A word- or character-level tokenizer saved into a tiny model's folder, as mlx_lm.load
reads it."""

from __future__ import annotations

import json
from pathlib import Path

# Printable ASCII and newline as byte-level BPE writes them (space is U+0120, newline U+010A).
CHARS = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]


def save_word_tokenizer(
    folder: Path,
    vocab: list[str],
    special: list[str],
    eos: str,
    template: str,
    phrases: list[str] = (),
) -> dict[str, int]:
    """Write tokenizer files for `vocab` (ids in order; `special` among them, `[UNK]` the
    unknown token), with a chat template; return the ids. Whitespace-split words; or, when
    `vocab` holds byte-level characters (CHARS), one token per byte as a byte-level BPE
    without merges, which spells any text (and any JSON a grammar forces). `phrases`
    (in `vocab` too): whole pieces of text, each one token wherever it occurs (added
    tokens), read back as written (no spaces put between tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {t: i for i, t in enumerate(vocab)}
    if set(CHARS) <= set(vocab):
        tok = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.Fuse() if phrases else decoders.WordPiece(prefix="##")
    tok.add_special_tokens(special)
    tok.add_tokens(list(phrases))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token=eos, pad_token="[UNK]"
    )
    hf.chat_template = template
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[eos]}))
    return ids


def word_level(vocab_size: int):
    """An in-memory word-level tokenizer over `vocab_size` tokens `t0` ... (no EOS), as
    mlx-lm wraps one: for a random-weight model whose ids are all words."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0"))
