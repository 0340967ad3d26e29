"""A word-level tokenizer saved into a tiny model's folder, as mlx_lm.load reads it."""

from __future__ import annotations

import json
from pathlib import Path


def save_word_tokenizer(
    folder: Path, vocab: list[str], special: list[str], eos: str, template: str
) -> dict[str, int]:
    """Write tokenizer files for `vocab` (ids in order; `special` among them, `[UNK]` the
    unknown token), whitespace-split, with a chat template; return the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(special)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token=eos, pad_token="[UNK]"
    )
    hf.chat_template = template
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[eos]}))
    return ids
