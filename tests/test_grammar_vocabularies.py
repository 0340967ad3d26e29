"""The grammar engine on a vocabulary llguidance cannot read from tokenizer.json (a Fuse
decoder, as character- and word-level tokenizers have): it reads it token by token
(server/engine/grammar.py DecodedVocabulary), so a constrained reply is served, not a
500."""

from __future__ import annotations

import json


def test_a_fuse_decoder_vocabulary_takes_a_schema_reply(tmp_path):
    from llguidance import LLMatcher
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from server.engine.grammar import Grammars

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"[UNK]": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["[UNK]", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")

    class Wrapper:  # what Grammars reads of mlx-lm's TokenizerWrapper
        _tokenizer, eos_token_ids = hf, [1]

    grammars = Grammars(Wrapper(), len(vocab))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    constraint = grammars.constraint(LLMatcher.grammar_from_json_schema(schema))
    assert bool(constraint.allowed()[vocab["{"]]) and not bool(constraint.allowed()[vocab["x"]])
    text = json.dumps({"city": "Oslo"})
    for token in hf.encode(text, add_special_tokens=False):
        constraint.consume(token)
    assert constraint.matcher.is_accepting()
