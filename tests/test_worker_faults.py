"""A fault in a worker round outside any one request's own handling (a bug) ends the
requests that round held with a 500; the server goes on serving the next ones, where the
worker thread used to die and leave every request hanging."""

from fastapi.testclient import TestClient

from config.settings import ServerSettings
from server.api.app import create_app
from server.engine.batcher import Batcher


def test_a_failed_round_fails_its_request_and_the_server_goes_on(monkeypatch):
    real, rounds = Batcher.decode, []

    def faulty(self, gens):
        rounds.append(len(gens))
        if len(rounds) == 3:  # mid-reply
            raise KeyError("a bug in the round")
        return real(self, gens)

    monkeypatch.setattr(Batcher, "decode", faulty)
    app = create_app(ServerSettings(model="default", max_sessions=2), load_engine=None)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    with TestClient(app) as client:
        failed = client.post("/v1/chat/completions", json=body)
        assert failed.status_code == 500
        assert "KeyError" in failed.json()["error"]["message"]
        served = client.post("/v1/chat/completions", json=body)
        assert served.status_code == 200
        assert served.json()["usage"]["completion_tokens"] > 0
        assert client.get("/health").status_code == 200
