"""Replicas sharing one spill folder, without a model server: claims, handover, idle spill.

Each SessionStore here stands for one replica (flock locks belong to an open file,
so two stores in one process contend like two processes); the crash test uses a
real second process, since only the kernel can show a dead holder's lock going away.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import mlx.core as mx
import pytest
from tiny import tiny

from cache import make_cache
from config.cache_spec import CacheSpec
from server.engine.jobs import SessionClaimed
from server.sessions.claims import PARTIAL, Claims
from server.sessions.spill import model_identity
from server.sessions.store import SessionStore

H2O = CacheSpec("h2o", 64)
PROMPT = list(range(1, 41))


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture
def replicas(model, tmp_path):
    opened = []

    def build(max_sessions=2) -> SessionStore:
        store = SessionStore(
            lambda spec: make_cache(model, spec),
            max_sessions,
            tmp_path / "shared",
            model_identity=model_identity(model),
        )
        opened.append(store)
        return store

    yield build
    for store in opened:
        store.close()


def turn(store, model, key, prompt, borrow=False):
    session, reused = store.acquire(key, prompt, H2O, borrow=borrow)
    logits = model(mx.array([prompt[reused:]]), cache=session.caches)[0, -1]
    session.tokens.extend(prompt[reused:])
    store.release(session)
    mx.eval(logits)
    return session, reused, logits


def cold_logits(model, prompt):
    return model(mx.array([prompt]), cache=make_cache(model, H2O))[0, -1]


def test_a_replica_restores_what_another_spilled(replicas, model):
    a, b = replicas(), replicas()
    turn(a, model, "chat", PROMPT)
    assert a.tick(idle_seconds=0) == 1  # idle past the limit: spilled, claim released
    longer = PROMPT + [3, 4, 5]
    session, reused, logits = turn(b, model, "chat", longer)
    assert reused == len(PROMPT) and b.counts["restored"] == 1
    assert mx.allclose(logits, cold_logits(model, longer), atol=1e-4)
    assert list(b.spill.path.glob("*.safetensors")) == []  # restored: the file is b's now
    with pytest.raises(SessionClaimed):
        a.acquire("chat", longer + [6], H2O)  # a followed the folder: b owns it
    assert {s["id"] for s in a.snapshot()} == set()


def test_an_anonymous_session_is_found_by_prefix_on_another_replica(replicas, model):
    a, b = replicas(), replicas()
    first, _, _ = turn(a, model, None, PROMPT[:20])
    a.spill_all()
    session, reused, _ = turn(b, model, None, PROMPT[:20] + [9, 9])
    assert session.id == first.id and reused == 20


def test_a_held_session_is_handed_over_when_idle(replicas, model):
    a, b = replicas(), replicas()
    turn(a, model, "chat", PROMPT)
    with pytest.raises(SessionClaimed):
        b.acquire("chat", PROMPT + [7], H2O)  # a holds it: b asks for it
    held, _ = a.acquire("chat", PROMPT + [7], H2O)
    assert a.tick(idle_seconds=None) == 0  # busy: never handed over mid-turn
    a.release(held)
    assert a.tick(idle_seconds=None) == 1 and a.counts["handed_over"] == 1
    _, reused, _ = turn(b, model, "chat", PROMPT + [7, 8])
    assert reused == len(PROMPT)  # what a held when it handed it over


def test_a_session_spilled_after_the_folder_was_read_is_still_restored(replicas, model):
    a, b = replicas(), replicas()
    turn(a, model, "chat", PROMPT)
    b._sync()  # b looks before a spills ...
    a.spill_all()
    b._sync = lambda: None  # ... and not again: the claim must still find the file
    _, reused, _ = turn(b, model, "chat", PROMPT + [7])
    assert reused == len(PROMPT) and b.counts["restored"] == 1


def test_past_the_wait_a_turn_is_served_with_a_throwaway_cache(replicas, model):
    a, b = replicas(), replicas()
    turn(a, model, "chat", PROMPT)
    session, reused, logits = turn(b, model, "chat", PROMPT + [7], borrow=True)
    assert session.borrowed and reused == 0 and b.counts["borrowed"] == 1
    assert mx.allclose(logits, cold_logits(model, PROMPT + [7]), atol=1e-4)
    assert b.snapshot() == [] and session.caches is None  # nothing of it stays on b
    _, reused, _ = turn(a, model, "chat", PROMPT + [1])
    assert reused == len(PROMPT)  # a still owns its cache, untouched


def test_no_idle_limit_keeps_sessions_in_memory(replicas, model):
    a = replicas()
    turn(a, model, "chat", PROMPT)
    assert a.tick(idle_seconds=None) == 0 and a.tick(idle_seconds=3600) == 0
    assert a.tick(idle_seconds=0) == 1


def test_a_killed_holder_releases_its_sessions(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from server.sessions.claims import Claims\n"
            "c = Claims(Path(sys.argv[1])).claim('chat'); print(c is not None, flush=True)\n"
            "time.sleep(60)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        claims = Claims(folder)
        assert claims.claim("chat") is None
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        claim = claims.claim("chat")
        assert claim is not None  # the kernel dropped the dead process's lock
        claim.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_starting_replica_keeps_the_others_writes_in_progress(replicas, model):
    a = replicas()
    in_progress = a.spill.partial / "half.safetensors"
    in_progress.write_bytes(b"\0" * 64)
    crashed = a.spill.path / PARTIAL / "crashed"  # a folder whose writer is gone (no lock)
    crashed.mkdir()
    (crashed / "cut.safetensors").write_bytes(b"\0" * 64)
    b = replicas()
    assert in_progress.exists() and b.spill.partial != a.spill.partial
    assert not crashed.exists()


def test_claims_are_exclusive_and_reusable(tmp_path):
    one, two = Claims(tmp_path), Claims(tmp_path)
    first = one.claim("s")
    assert first is not None and two.claim("s") is None
    two.want("s")
    assert one.wanted("s")
    first.release()
    second = two.claim("s")
    assert second is not None and not one.wanted("s")  # a claim clears the request
    second.release()
