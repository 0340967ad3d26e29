"""`h2o-server eval ...` on tiny settings: output shape and sanity, no numbers as goals.

Each subcommand runs once in-process through `server.cli.main` on the default
model (samples of 24-64 tokens, 16-token caches, one sample) and the tests check
the records it printed.
"""

from __future__ import annotations

import json
import math

import pytest

from server.cli import main

pytestmark = pytest.mark.slow(seconds=60)

SEQ = 64
PPL_SEQ = 32  # the ppl grid's longest sample: token by token, 14 runs of it
PPL_KEYS = {
    "policy", "max_kv", "evict_batch", "seq_len", "score", "preset", "layers", "samples", "ppl",
    "mode", "prefill",
}  # fmt: skip
TP_KEYS = {
    "policy", "max_kv", "evict_batch", "score", "preset", "layers", "context", "rounds", "steps",
    "prefill_tps", "decode_tps", "prefill_ratio", "decode_ratio", "peak_mem_bytes",
    "rss_bytes", "cache_bytes",
}  # fmt: skip


def run_json(capsys, *argv: str) -> list[dict]:
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def find(records: list[dict], **fields) -> dict:
    hits = [r for r in records if all(r[k] == v for k, v in fields.items())]
    assert len(hits) == 1, (fields, hits)
    return hits[0]


@pytest.fixture
def ppl_run(capsys) -> list[dict]:
    return run_json(
        capsys, "ppl", "--policy", "full", "rotating", "h2o", "--max-kv", "16", str(PPL_SEQ),
        "--score", "attn", "ema", "--seq-len", "24", str(PPL_SEQ), "--samples", "1",
    )  # fmt: skip


def test_ppl_records(ppl_run, default_model, tmp_path):
    import mlx.core as mx

    from bench.plots import plot_all
    from bench.ppl import sample_windows, token_nll

    records = ppl_run
    assert all(set(r) == PPL_KEYS for r in records)
    assert {r["layers"] for r in records} == {None}  # even layers unless --layer-budgets says
    # full once; rotating per max_kv; h2o per max_kv x score; each at both lengths
    assert len(records) == 2 * (1 + 2 + 4)
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in records)
    assert {r["mode"] for r in records} == {"autoregressive"}

    # The full cache, token by token, equals one forward pass over the same tokens.
    model, tokenizer = default_model
    tokens = sample_windows(tokenizer, 1, PPL_SEQ)
    one_shot = math.exp(mx.mean(token_nll(model(tokens[:, :-1]), tokens[:, 1:])).item())
    full = find(records, policy="full", seq_len=PPL_SEQ)["ppl"]
    assert full == pytest.approx(one_shot, rel=1e-4)

    # A cache as large as the sample never evicts: it matches the full cache.
    for score in ("attn", "ema"):
        h2o = find(records, policy="h2o", max_kv=PPL_SEQ, score=score, seq_len=PPL_SEQ)
        assert h2o["ppl"] == pytest.approx(full, rel=1e-4)
    rotating = find(records, policy="rotating", max_kv=PPL_SEQ, seq_len=PPL_SEQ)
    assert rotating["ppl"] == pytest.approx(full, rel=1e-4)

    pngs = plot_all(records, tmp_path)
    assert {p.name for p in pngs} == {"ppl_vs_max_kv_32.png", "ppl_vs_seq_len_16.png",
                                      "ppl_vs_seq_len_32.png", "ppl_vs_max_kv_24.png"}  # fmt: skip
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_ppl_modes_are_labelled_and_full_matches(capsys):
    args = ("--policy", "full", "--seq-len", str(SEQ), "--samples", "1")
    auto = run_json(capsys, "ppl", *args)[0]
    one_shot = run_json(capsys, "ppl", *args, "--full-one-shot")[0]
    chunked = run_json(capsys, "ppl", *args, "--mode", "chunked", "--chunk", "16")[0]
    assert (one_shot["mode"], chunked["mode"]) == ("one-shot", "chunked-16")
    assert one_shot["ppl"] == pytest.approx(auto["ppl"], rel=1e-4)
    assert chunked["ppl"] == pytest.approx(auto["ppl"], rel=1e-4)


def test_throughput_records(capsys, tmp_path):
    from bench.plots import plot_memory_vs_context, plot_tps_vs_context

    records = run_json(
        capsys, "throughput", "--policy", "rotating", "h2o", "--max-kv", "16",
        "--context", "32", "64", "--steps", "2", "--rounds", "1",
    )  # fmt: skip
    assert all(set(r) == TP_KEYS for r in records)
    # full is always measured as the baseline
    assert [(r["policy"], r["context"]) for r in records] == [
        (p, c) for p in ("full", "rotating", "h2o") for c in (32, 64)
    ]
    for r in records:
        for key in TP_KEYS - {"policy", "max_kv", "evict_batch", "score", "preset", "layers"}:
            assert r[key] > 0, (key, r)
    assert all(
        r["decode_ratio"] == 1 == r["prefill_ratio"] for r in records if r["policy"] == "full"
    )
    for plot in (plot_tps_vs_context, plot_memory_vs_context):
        png = plot(records, tmp_path / f"{plot.__name__}.png")
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_recall_goes_through_the_server_sessions(capsys):
    records = run_json(
        capsys, "recall", "--policy", "full", "h2o", "--max-kv", "32", "--samples", "1",
        "--filler-tokens", "40", "--turns", "2",
    )  # fmt: skip
    assert [r["policy"] for r in records] == ["full", "h2o"]
    for r in records:
        assert r["turns"] == 4 and r["samples"] == 1
        # recall is the share of answers that contain their trial's number
        numbers, answers = r["numbers"].split(" | "), r["answers"].split(" | ")
        hits = [n in a for n, a in zip(numbers, answers, strict=True)]
        assert r["recall"] == sum(hits) / len(hits)
        assert r["conversation_tokens"] > 32  # longer than the H2O cache
        # later turns found their session: the stored history was not prefilled again
        assert 0 < r["cached_share"] < 1


def test_unknown_policy_is_a_usage_error(capsys):
    assert main(["eval", "ppl", "--policy", "nope", "--seq-len", "8"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_gemma_results_section_from_records():
    """bench.results' Gemma 3 section: its command and a table per length from eval records."""
    from bench import results_gemma

    name, argv = results_gemma.step(smoke=False)
    assert name == "gemma" and "--model gemma3-270m" in argv and "--max-kv 64 128 256" in argv
    rows = [{"policy": "full", "max_kv": None, "seq_len": 1024, "ppl": 20.0, "samples": 4}]
    for kv, rot, h2o in ((64, 30.0, 25.0), (128, 24.0, 24.5)):
        rows.append({"policy": "rotating", "max_kv": kv, "seq_len": 1024, "ppl": rot})
        rows.append({"policy": "h2o", "max_kv": kv, "seq_len": 1024, "ppl": h2o})
    text = "\n".join(results_gemma.gemma_section(rows, "h2o-server " + argv))
    assert "| 64 | 30.000 | 25.000 | +50.0% | +25.0% |" in text
    assert "H2O loses to the rotating window at max_kv 128" in text
    assert f"`h2o-server {argv}`" in text


def test_gemma_section_spliced_into_an_existing_report():
    """bench.results_gemma alone: its section goes before (d), and replaces itself later."""
    from bench.results_gemma import splice

    report = "# R\n\n## (c) x\n\nc\n\n## (d) Throughput\n\nd\n"
    once = splice(report, ["## Gemma 3 270M: one", "", "a", ""])
    assert once == "# R\n\n## (c) x\n\nc\n\n## Gemma 3 270M: one\n\na\n\n## (d) Throughput\n\nd\n"
    assert splice(once, ["## Gemma 3 270M: two", ""]) == once.replace("one\n\na\n", "two\n")


def test_results_rule_grid_section_from_records():
    """bench.results' table (e): both grid commands parse, and each rule's ratio to rotating."""
    from bench import results
    from server.cli import build_parser

    steps = dict(results.plan(long_chunked=False))
    for name in ("rules", "rules_merge"):
        build_parser().parse_args(steps[name])  # a typo in a step would cost a whole run
    assert "--layer-budgets" in steps["rules_merge"] and "h2o-merge" in steps["rules_merge"]
    rows = [{"policy": "full", "score": None, "max_kv": None, "seq_len": 1024, "ppl": 20.0,
             "samples": 3}]  # fmt: skip
    rows += [
        {"policy": "rotating", "score": None, "max_kv": 64, "seq_len": 1024, "ppl": 30.0},
        {"policy": "h2o", "score": "attn", "max_kv": 64, "seq_len": 1024, "ppl": 27.0},
        {"policy": "h2o-merge", "score": "mean", "layers": "profiled", "max_kv": 64,
         "seq_len": 1024, "ppl": 23.0},
    ]  # fmt: skip
    text = "\n".join(results.rules_section(rows, ["h2o-server eval ppl x"]))
    # rotating +50%; h2o +35% is 0.70 of it, h2o-merge +15% is 0.30
    assert "| 64 | 1024 | 16x | +50.0% | +35.0% (0.70) | +15.0% (0.30) |" in text
    assert "max_kv 64, 1024 tokens (16x): h2o-merge mean profiled, 0.30" in text
