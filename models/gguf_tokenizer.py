"""Tokenizers from GGUF metadata: byte-level BPE ('gpt2') and SentencePiece-style ('llama').

A GGUF has no tokenizer.json; it stores the vocabulary (and for byte-level BPE
the merges) under llama.cpp's keys. Both kinds are rebuilt as `tokenizers` BPE
models:
- 'gpt2': byte-level BPE with the file's merges and the pre-tokenizer its
  `tokenizer.ggml.pre` names (only those listed in BYTE_LEVEL_PRE are known).
- 'llama': SentencePiece BPE (Llama 2, Gemma). The file has no merges; a piece
  is merged from two pieces when both are in the vocabulary, ranked by the
  merged piece's score (SentencePiece merges the best-scoring pair first).
  Spaces become U+2581, unknown characters fall back to byte tokens <0xNN>.
Control tokens (type 3) are special; user-defined tokens (type 4, e.g. Gemma's
runs of spaces and newlines) are matched whole, as llama.cpp does.

A file without a chat template gets one chosen by the turn markers its
vocabulary has (Gemma's <start_of_turn>, ChatML's <|im_start|>), else a plain
"Role: text" layout.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # llama.cpp token types
SPIECE_SPACE = "\u2581"
# llama.cpp pre-tokenizer names -> tokenizers pre-tokenizer (byte-level BPE).
BYTE_LEVEL_PRE = {
    # digits one by one, then the GPT-2 regex (SmolLM, StarCoder)
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}
BYTE_LEVEL_PRE["starcoder"] = BYTE_LEVEL_PRE["smollm"]
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")

GEMMA_TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{ '<start_of_turn>model\n' + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- else -%}"
    "{{ '<start_of_turn>user\n' + ns.system + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)
CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}"
)
PLAIN_TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif -%}"
    "{%- for m in messages -%}{{ m['role'] | capitalize + ': ' + m['content'] + '\n\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ 'Assistant:' }}{% endif -%}"
)


class TokenizerError(ValueError):
    """A GGUF vocabulary this loader cannot turn into a tokenizer."""


def gguf_tokenizer(meta: dict[str, Any]) -> TokenizerWrapper:
    """The tokenizer (with a chat template, and end-of-turn ids as EOS) a GGUF describes."""
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if kind == "gpt2":
        backend, detokenizer = byte_level_bpe(meta, tokens), BPEStreamingDetokenizer
    elif kind == "llama":
        backend = sentencepiece_bpe(meta, tokens, types)
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=prefix)
    else:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported ('gpt2', 'llama')")
    _add_marked_tokens(backend, tokens, types)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None else None

    bos = token("bos_token_id")
    if kind == "llama" and bos and meta.get("tokenizer.ggml.add_bos_token", True):
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        backend.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
    )
    hf.chat_template = meta.get("tokenizer.chat_template") or fallback_chat_template(tokens)
    return TokenizerWrapper(hf, detokenizer, eos_token_ids=end_of_turn_ids(meta, tokens, types))


def byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in BYTE_LEVEL_PRE:
        raise TokenizerError(
            f"byte-level BPE pre-tokenizer {pre!r} is not supported ({sorted(BYTE_LEVEL_PRE)})"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    bpe.pre_tokenizer = BYTE_LEVEL_PRE[pre]()
    bpe.decoder = decoders.ByteLevel()
    return bpe


def sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise TokenizerError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_from_scores(tokens, [float(s) for s in scores], types),
            byte_fallback=True,
            fuse_unk=True,
            unk_token=tokens[int(unk)] if unk is not None else None,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPIECE_SPACE)] if prefix else []
    bpe.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)])
    decode = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    bpe.decoder = decoders.Sequence(decode)
    return bpe


def merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """Every (left, right) pair whose concatenation is a normal piece, best score first."""
    known = set(tokens)
    ranked = []
    for piece, score, kind in zip(tokens, scores, types, strict=True):
        if kind != NORMAL or len(piece) < 2:
            continue
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in known and right in known:
                ranked.append((-score, left, right))
    ranked.sort(key=lambda r: r[0])  # stable: ties keep vocabulary order
    return [(left, right) for _, left, right in ranked]


def _add_marked_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special tokens; user-defined ones matched whole in raw text."""
    marked = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in marked if k == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in marked if k == USER_DEFINED]
    )


def fallback_chat_template(tokens: list[str]) -> str:
    """A chat template for a file without one, picked by the turn markers in its vocabulary."""
    known = set(tokens)
    if {"<start_of_turn>", "<end_of_turn>"} <= known:
        return GEMMA_TEMPLATE
    if {"<|im_start|>", "<|im_end|>"} <= known:
        return CHATML_TEMPLATE
    return PLAIN_TEMPLATE


def end_of_turn_ids(meta: dict[str, Any], tokens: list[str], types: list[int]) -> list[int]:
    """EOS plus the end-of-turn tokens a chat may end with (e.g. Gemma's <end_of_turn>)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = {int(meta[k]) for k in keys if k in meta}
    for i, (t, k) in enumerate(zip(tokens, types, strict=True)):
        if k == CONTROL and t in END_OF_TURN_TOKENS:
            ids.add(i)
    return sorted(ids)
