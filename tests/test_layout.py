"""The layout the docs describe is the layout in the tree, and imports go down the floors.

docs/architecture.md names every module of the product packages (and nothing that is
gone); docs/development.md's layout block names every top-level folder and server/'s
sub-packages; imports follow server -> cache -> {models, kernels} -> config, and bench/
has no cycle. tests/test_docs.py holds the rest of the docs to the code."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("config", "models", "kernels", "cache", "server")
# What each floor may import of the project (config is read by all).
MAY_IMPORT = {
    "config": {"config"},
    "models": {"config", "models"},
    "kernels": {"config", "kernels"},
    "cache": {"config", "models", "kernels", "cache"},
    "server": {"config", "models", "kernels", "cache", "server"},
}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:  # not a checkout (an sdist): the tree as it is
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]
    return out.stdout.split()


def modules() -> list[str]:
    return [
        f
        for f in tracked()
        if f.endswith(".py") and f.split("/")[0] in PRODUCT and not f.endswith("__init__.py")
    ]


def test_architecture_names_every_module_and_nothing_gone():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z0-9_]+(?:/[a-z0-9_]+)*(?:\.py|/))`", text))
    for path in named:
        assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which is gone"
    files = set(tracked())
    missing = [
        m
        for m in modules()
        if m not in named and not any(m.startswith(p) for p in named if p.endswith("/"))
    ]
    # `kernels/metal.py`, `kernels/cuda.py` style pairs count too
    pairs = set(re.findall(r"`([a-z0-9_/]+\.py)`, `([a-z0-9_/]+\.py)`", text))
    missing = [m for m in missing if not any(m in pair for pair in pairs)]
    assert not missing, f"docs/architecture.md does not say what these are: {missing}"
    assert all(m in files for m in modules())


def test_layout_block_names_every_top_level_folder():
    page = (ROOT / "docs" / "development.md").read_text()
    block = page.split("## Layout", 1)[1].split("```")[1]
    listed = set(re.findall(r"(?:^|; )([a-z]+)/", block, re.M))
    folders = {f.split("/")[0] for f in tracked() if "/" in f and not f.startswith(".")}
    assert folders - {"docs"} <= listed, folders - listed
    for name in listed:
        assert (ROOT / name).is_dir(), f"the layout block names {name}/, which is not there"
    for sub in re.findall(r"\b(api|engine|sessions)/", block):
        assert (ROOT / "server" / sub / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """Top-level project packages a module imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & {*PRODUCT, "bench"}


def test_imports_go_down_the_floors():
    wrong = []
    for module in modules():
        floor = module.split("/")[0]
        bad = _imports(ROOT / module) - MAY_IMPORT[floor]
        if bad:
            wrong.append(f"{module} imports {sorted(bad)}")
    assert not wrong, wrong


def test_bench_has_no_import_cycle():
    graph = {}
    for f in tracked():
        if f.startswith("bench/") and f.endswith(".py"):
            tree = ast.parse((ROOT / f).read_text())
            deps = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "bench":
                    deps |= {f"bench.{a.name}" for a in node.names}
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.startswith("bench.")}
            graph[f[:-3].replace("/", ".")] = deps

    def cycle_from(node, path):
        if node in path:
            return path[path.index(node) :] + [node]
        for dep in graph.get(node, ()):
            if found := cycle_from(dep, [*path, node]):
                return found
        return None

    for module in graph:
        assert (cycle := cycle_from(module, [])) is None, cycle
