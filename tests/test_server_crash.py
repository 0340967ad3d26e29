"""SIGKILL: what a crash leaves in --spill-dir is indexed or removed by the next start."""

from __future__ import annotations

import json
import shutil
import signal
import struct

from server_harness import MODEL, launch, running_server


def turn(api, history, key, text):
    history.append({"role": "user", "content": text})
    r = api.client.chat.completions.create(
        model=MODEL,
        messages=history,
        temperature=0,
        max_tokens=12,
        extra_body={"prompt_cache_key": key},
    )
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def with_model(path, identity: str, to):
    """A copy of a spill file whose header names another model (same arrays)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["0.model"] = json.dumps(identity)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    to.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_after_sigkill_the_next_start_indexes_or_removes_every_file(tmp_path):
    spill = tmp_path / "spill"
    flags = ["--spill-dir", str(spill), "--max-sessions", "1", "--kv-budget", "64MiB"]
    flags += ["--policy", "h2o"]
    crashed = launch(tmp_path, *flags)
    a, b = [], []
    try:
        turn(crashed, a, "a", "My code word is HERON-12. Please say hello.")
        turn(crashed, b, "b", "My code word is OTTER-40. Please say hello.")  # spills a
        assert crashed.sessions()["a"]["spilled"]
        with_model(spill / "a.safetensors", "another-model", spill / "foreign.safetensors")
        whole = (spill / "a.safetensors").read_bytes()
        (spill / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
        shutil.copy(spill / "a.safetensors", spill / ".partial" / "a.safetensors")  # mid-write
        crashed.process.send_signal(signal.SIGKILL)
        crashed.process.wait(timeout=10)
    finally:
        if crashed.process.poll() is None:
            crashed.process.kill()

    with running_server(tmp_path, *flags) as api:
        log = api.log_text()
        assert "foreign.safetensors refused: made by another model; removed" in log
        assert "cut.safetensors refused: truncated" in log
        assert "removing 1 spill(s) cut short by a crash" in log
        assert sorted(p.name for p in spill.rglob("*.safetensors")) == ["a.safetensors"]
        assert set(api.sessions()) == {"a"}  # b lived in memory only: lost with the process

        resumed = turn(api, a, "a", "What is my code word?")
        assert resumed.usage.prompt_tokens_details.cached_tokens > 0
        cold = api.client.chat.completions.create(
            model=MODEL, messages=a[:-1], temperature=0, max_tokens=12,
            extra_body={"prompt_cache_key": "a-cold"},
        )  # fmt: skip
        assert resumed.choices[0].message.content == cold.choices[0].message.content
        rebuilt = turn(api, b, "b", "What is my code word?")
        assert rebuilt.usage.prompt_tokens_details.cached_tokens == 0
        assert api.metrics()["h2o_sessions_restored_total"] == 1
