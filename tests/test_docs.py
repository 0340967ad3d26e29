"""The docs name what the code has, and the README's commands are real.

Every flag of every `h2o-server` subcommand (read from the argparse parser) and every
route the FastAPI app mounts (read from the app, built without starting its worker) is
named in the README or a reference page of docs/ (the pages the README's documentation
table links to). README.md stays at most 250 lines; each `make X` it names is a Makefile
target, each `h2o-server ...` it runs names a subcommand and that subcommand's flags;
every relative link in README.md and docs/ resolves, anchors included; every `python -m
bench.X` a reference page names is a module of bench/. No model is loaded.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[str]:
    """The targets of a markdown file's links (images included), code spans left out."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def reference_pages() -> list[Path]:
    """README.md and the docs/ pages its documentation table links to."""
    block = README.read_text().split("## Documentation", 1)[1]
    pages = [(ROOT / target).resolve() for target in LINK.findall(block)]
    assert pages, "README.md has no documentation table"
    return [README, *pages]


def reference_text() -> str:
    return "\n".join(p.read_text() for p in reference_pages())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


# ---------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from server.cli import build_parser

    return build_parser()


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict:
    """{"serve": its parser, "eval ppl": ..., ...}: every (nested) subcommand."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found.update(subcommands(sub, f"{prefix}{name} "))
    return found


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag not in ("-h", "--help")
    }


def test_every_flag_of_every_subcommand_is_named(parser):
    text = reference_text()
    commands = subcommands(parser)
    assert {"serve", "generate", "chat", "calibrate"} <= set(commands)
    missing = [
        f"{name} {flag}"
        for name, sub in commands.items()
        for flag in sorted(flags(sub))
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    ]
    assert not missing, f"flags no reference page names: {missing}"


# ---------------------------------------------------------------------- the routes


def mounted_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app mounts, path parameters as `{}`; the chat
    page on, the worker built but not started (nothing loads)."""
    from config.settings import ServerSettings
    from server.api.app import create_app

    app = create_app(ServerSettings(ui=True), load_engine=lambda settings: None)
    return [(method, re.sub(r"\{[^}]*\}", "{}", path)) for method, path in _walk(app.routes, "")]


def _walk(routes, prefix: str) -> list[tuple[str, str]]:
    """(method, path) of routes, into included routers (FastAPI >= 0.16x keeps them as
    `_IncludedRouter` entries holding the router and its prefix; older ones flatten)."""
    found = []
    for route in routes:
        if hasattr(route, "original_router"):
            context = getattr(route, "include_context", None)
            inner = prefix + (getattr(context, "prefix", "") or "")
            found += _walk(route.original_router.routes, inner)
            continue
        methods = sorted(set(getattr(route, "methods", None) or ["ANY"]) - {"HEAD"})
        found += [(method, prefix + route.path) for method in methods]
    return found


def test_every_route_is_named():
    text = re.sub(r"\{[^}]*\}", "{}", reference_text())
    routes = mounted_routes()
    assert ("POST", "/v1/chat/completions") in routes
    missing = []
    for method, path in routes:
        if method == "ANY":  # a mount (the page's files): its folder, `/static/...`
            found = re.search(rf"(?<![\w/]){re.escape(path)}/", text)
        else:
            found = re.search(rf"{re.escape(f'{method} {path}')}(?![\w/{{}}.-])", text)
        if not found:
            missing.append(f"{method} {path}")
    assert not missing, f"routes no reference page names: {missing}"


# ---------------------------------------------------------------------- the README


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README.read_text()))
    assert {"serve", "test"} <= named
    assert named <= targets, f"README names make targets the Makefile lacks: {named - targets}"


def test_readme_h2o_server_commands_exist(parser):
    """Each `h2o-server SUB --flag ...` the README shows names a subcommand and its flags."""
    commands = subcommands(parser)
    runs = re.findall(r"(?:\.venv/bin/)?h2o-server ([a-z][^`\n#]*)", README.read_text())
    assert runs
    for run in runs:
        words = shlex.split(run)
        assert words[0] in commands, f"README runs `h2o-server {run}`: no such subcommand"
        given = {w.split("=")[0] for w in words[1:] if w.startswith("--")} - {"--help"}
        unknown = given - flags(commands[words[0]])
        assert not unknown, f"README runs `h2o-server {run}`: {words[0]} has no {unknown}"


# ---------------------------------------------------------------------- links


@pytest.mark.parametrize(
    "page",
    [README, *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"


def test_bench_modules_named_exist():
    named = set(re.findall(r"python -m bench\.([a-z_]+)", reference_text()))
    assert named
    missing = [m for m in sorted(named) if not (ROOT / "bench" / f"{m}.py").exists()]
    assert not missing, f"reference pages name bench modules that are gone: {missing}"
