"""Two real replicas behind the real nginx (deploy/nginx.conf) on loopback, one shared spill folder.

4 conversations x 4 turns through nginx, one at a time (batch size 1, so greedy
replies compare exactly with an uninterrupted run on one server). After turn 2 the
replica holding the most conversations is stopped: with SIGTERM it drains and
spills them, and the other restores them; with SIGKILL they are rebuilt from the
history, or, with --spill-idle-seconds, restored from what was spilled while idle.

The replica that survives is one server for the whole module (a server start is
several seconds): it first runs the uninterrupted conversations, then survives
each case beside a fresh victim. Each run names its conversations apart (a keyed
conversation is found by its key only, and no system prompt is long enough for the
prefix store), so no case finds another's cache.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections import Counter

import pytest
from nginx_harness import MISSING, NGINX, Nginx
from server_harness import MODEL, launch

pytestmark = [pytest.mark.skipif(NGINX is None, reason=MISSING), pytest.mark.slow(seconds=80)]

CONVERSATIONS, TURNS, KILL_AFTER = 4, 4, 2
TOPICS = ["rivers", "bread", "owls", "glass", "comets", "tea", "maps", "bees", "salt", "bells"]
FLAGS = ["--model", "default", "--policy", "h2o", "--max-sessions", "20", "--shutdown-timeout", "5"]


def question(conv: int, turn: int) -> str:
    topic = TOPICS[conv % len(TOPICS)]
    return [
        f"Conversation {conv}. Tell me one fact about {topic}.",
        "Say it again in other words.",
        "Why does that matter?",
        "Summarize in five words.",
    ][turn]


def ask(port: int, conv: int, key: str, messages: list[dict]) -> dict:
    """One turn through nginx: conversations with an even number name themselves in the body,
    odd ones in the X-Session-ID header. Four greedy tokens a reply: enough for replies that
    differ when a restored cache is wrong, and each conversation's history still grows."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    sent = {"Content-Type": "application/json"}
    if conv % 2:
        sent["X-Session-ID"] = key
    else:
        body["prompt_cache_key"] = key
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), sent)
        r = conn.getresponse()
        data = json.loads(r.read())
    finally:
        conn.close()
    out = {"status": r.status, "replica": r.getheader("X-H2O-Replica", "")}
    if r.status == 200:
        out["reply"] = data["choices"][0]["message"]["content"]
        out["cached"] = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        out["session"] = r.getheader("X-Session-ID")
    else:
        out["error"] = data
    return out


def run_turns(
    port: int, histories: list[list[dict]], turns: range, keys: list[str]
) -> list[list[dict]]:
    """Turns `turns` of every conversation, in order; histories grow with each reply."""
    results = [[] for _ in histories]
    for turn in turns:
        for conv, history in enumerate(histories):
            history.append({"role": "user", "content": question(conv, turn)})
            out = ask(port, conv, keys[conv], history)
            results[conv].append(out)
            history.append({"role": "assistant", "content": out.get("reply", "")})
    return results


@pytest.fixture(scope="module")
def survivor(tmp_path_factory):
    """The replica every case keeps running, on one shared spill folder (its `spill` attribute)."""
    tmp = tmp_path_factory.mktemp("survivor")
    server = launch(tmp, *FLAGS, "--spill-dir", str(tmp / "shared"))
    server.spill = tmp / "shared"
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="module")
def uninterrupted(survivor):
    """Every reply of an uninterrupted run on one server (no nginx: the port is the server's)."""
    histories = [[] for _ in range(CONVERSATIONS)]
    keys = [f"uninterrupted-{conv}" for conv in range(CONVERSATIONS)]
    results = run_turns(survivor.port, histories, range(TURNS), keys)
    assert all(r["status"] == 200 for conv in results for r in conv)
    return [[r["reply"] for r in conv] for conv in results]


def keys_on_both(port: int, victim: str, case: str) -> list[str]:
    """Conversation keys that nginx spreads over both replicas, the victim holding the most
    (at least as many as the survivor). Ketama places keys by the replicas' addresses, which
    are random ports here, so a fixed set of keys can all land on one; asking where each key
    goes (nginx names the replica on any reply, a 404 too) keeps the test about failover, not
    about luck."""
    for salt in range(100):
        keys = [f"{case}-{conv}-{salt}" for conv in range(CONVERSATIONS)]
        homes = Counter()
        for key in keys:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("GET", f"/v1/sessions/{key}")
                r = conn.getresponse()
                r.read()
                homes[r.getheader("X-H2O-Replica", "")] += 1
            finally:
                conn.close()
        if len(homes) == 2 and homes.most_common(1)[0][1] == homes[victim]:
            return keys
    raise AssertionError(f"no {CONVERSATIONS} keys in 100 tries spread over both replicas")


def counter(server, name: str) -> float:
    return server.metrics().get(f"h2o_{name}", 0.0)


@pytest.mark.parametrize(
    ("stop", "idle"),
    [(signal.SIGTERM, None), (signal.SIGKILL, None), (signal.SIGKILL, "1")],
    ids=["sigterm", "sigkill-rebuilt", "sigkill-idle-spilled"],
)
def test_conversations_stick_and_survive_a_replica_stopping(
    tmp_path, survivor, uninterrupted, stop, idle
):
    flags = [*FLAGS, "--spill-dir", str(survivor.spill)]
    flags += ["--spill-idle-seconds", idle] if idle else []
    victim = launch(tmp_path, *flags)
    replicas = [survivor, victim]
    by_addr = {f"127.0.0.1:{r.port}": r for r in replicas}
    nginx = Nginx([r.port for r in replicas], tmp_path / "nginx")
    try:
        histories = [[] for _ in range(CONVERSATIONS)]
        victim_addr = f"127.0.0.1:{victim.port}"
        keys = keys_on_both(nginx.port, victim_addr, f"{stop.name}-{idle}".lower())
        before = run_turns(nginx.port, histories, range(KILL_AFTER), keys)
        homes = [{r["replica"] for r in conv} for conv in before]
        assert all(len(h) == 1 for h in homes), homes  # each conversation on one replica
        load = Counter(next(iter(h)) for h in homes)
        assert set(load) == set(by_addr), load  # both replicas serve some
        assert all(conv[1]["cached"] > 0 for conv in before)

        assert load.most_common(1)[0][1] == load[victim_addr], load  # the victim holds the most
        moved = [c for c, h in enumerate(homes) if victim_addr in h]
        restored_before = counter(survivor, "sessions_restored_total")
        if idle:
            time.sleep(float(idle) + 1)  # the victim spills its idle sessions
        victim.process.send_signal(stop)  # turns go on at once: during the drain, too
        after = run_turns(nginx.port, histories, range(KILL_AFTER, TURNS), keys)
        victim.process.wait(timeout=60)

        results = [b + a for b, a in zip(before, after, strict=True)]
        statuses = Counter(r["status"] for conv in results for r in conv)
        assert statuses == {200: CONVERSATIONS * TURNS}, statuses  # 0 x 5xx, 0 x 4xx
        survivor_addr = f"127.0.0.1:{survivor.port}"
        assert all(r["replica"].endswith(survivor_addr) for conv in after for r in conv)
        replies = [[r["reply"] for r in conv] for conv in results]
        assert replies == uninterrupted  # greedy: as if nothing had happened
        turn3 = [results[c][KILL_AFTER]["cached"] for c in moved]
        if stop == signal.SIGTERM or idle:
            assert all(n > 0 for n in turn3), turn3  # restored from the shared folder
            restored = counter(survivor, "sessions_restored_total") - restored_before
            assert restored >= len(moved), restored
        else:
            assert all(n == 0 for n in turn3), turn3  # nothing was spilled: rebuilt
        assert all(conv[-1]["cached"] > 0 for conv in results)  # and cached again after
        if stop == signal.SIGTERM:
            # a clean drain: uvicorn re-raises the SIGTERM it caught once it has shut down
            assert victim.process.returncode in (0, -signal.SIGTERM)
            assert f"drained; {len(moved)} session(s) spilled" in victim.log_text()
    finally:
        nginx.stop()
        if victim.process.poll() is None:
            victim.process.kill()
            victim.process.wait()
