"""The chat page's serving: on by default on loopback, off by flag, local files only."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from config.settings import ServerSettings
from server.api.app import create_app
from server.api.ui import STATIC, ui_enabled
from server.cli import build_parser


@pytest.mark.parametrize(
    "host, ui, on",
    [
        ("127.0.0.1", None, True),
        ("localhost", None, True),
        ("::1", None, True),
        ("[::1]", None, True),
        ("0.0.0.0", None, False),
        ("192.168.1.5", None, False),
        ("0.0.0.0", True, True),
        ("127.0.0.1", False, False),
    ],
)
def test_ui_default_follows_the_host(host, ui, on):
    assert ui_enabled(ServerSettings(host=host, ui=ui)) is on


def test_flags_and_environment(monkeypatch):
    args = build_parser().parse_args(["serve", "--no-ui"])
    assert ServerSettings(ui=args.ui).ui is False
    args = build_parser().parse_args(["serve", "--ui", "true", "--host", "0.0.0.0"])
    assert ServerSettings(ui=args.ui, host=args.host).ui is True
    monkeypatch.setenv("H2O_UI", "false")
    assert ServerSettings().ui is False


def page_client(**settings) -> TestClient:
    """The app without its worker: serving files never touches the model."""
    return TestClient(create_app(ServerSettings(**settings), load_engine=None))


def test_page_and_files_are_served_with_a_strict_policy():
    client = page_client(api_key="k")
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
        r = client.get(asset)
        assert r.status_code == 200 and r.content, asset
    assert client.get("/v1/sessions").status_code == 401  # the API still needs the key


def test_nothing_is_loaded_from_elsewhere():
    """No CDN, no fonts, no remote scripts: every URL in the page's files is this server's."""
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), path.name
        assert "@import" not in text, path.name


def test_no_ui_serves_no_page():
    r = page_client(ui=False).get("/")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert page_client(host="0.0.0.0").get("/static/app.js").status_code == 404
