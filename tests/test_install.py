"""A fresh machine runs what was tested (issue 76): the lock matches pyproject.toml, and the
project's own top-level packages win over an installed distribution of the same name.

The foreign package here stands in for Hugging Face's `kernels` (pulled in by
transformers >= 5.25): a `kernels` package with its own dist-info, put ahead of the
editable install on PYTHONPATH, which is where site-packages puts the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from openai import OpenAI
from server_harness import MODEL

from bench.local_server import SERVE, start_server, stop_server

REPO = Path(__file__).resolve().parent.parent
# Every top-level package the distribution installs, as pyproject.toml lists them.
PACKAGES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
TOP_LEVEL = sorted({name.split(".")[0] for name in PACKAGES})
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
NO_UV = "uv is not installed in this environment (make setup installs it)"


@pytest.fixture(scope="module")
def foreign_kernels(tmp_path_factory) -> Path:
    """A folder holding a foreign `kernels` package and its distribution's metadata."""
    root = tmp_path_factory.mktemp("shadow")
    (root / "kernels").mkdir()
    (root / "kernels" / "__init__.py").write_text(
        '"""Not h2o-server\'s kernels."""\nFOREIGN = True\n'
    )
    info = root / "fake_hub_kernels-0.19.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-hub-kernels\nVersion: 0.19.1\n"
    )
    (info / "top_level.txt").write_text("kernels\n")
    return root


def _python(code: str, cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_top_level_package_resolves_inside_the_project():
    from server import own_packages

    assert sorted(own_packages.TOP_LEVEL) == TOP_LEVEL
    for name in TOP_LEVEL:
        origin = own_packages.origin_of(name)
        assert origin is not None and origin.is_relative_to(REPO), (name, origin)


def test_the_project_packages_win_over_a_foreign_distribution(tmp_path, foreign_kernels):
    code = (
        "import importlib, json, server\n"
        f"print(json.dumps({{n: importlib.import_module(n).__file__ for n in {TOP_LEVEL}}}))"
    )
    # Without the project's `server` first, the foreign package is what Python finds: the
    # situation the claim exists for.
    bare = _python("import kernels; print(kernels.__file__)", tmp_path, foreign_kernels)
    assert bare.stdout.strip() == str(foreign_kernels / "kernels" / "__init__.py")
    done = _python(code, tmp_path, foreign_kernels)
    assert done.returncode == 0, done.stderr
    origins = json.loads(done.stdout)
    assert sorted(origins) == TOP_LEVEL
    for name, origin in origins.items():
        assert Path(origin).resolve().is_relative_to(REPO), (name, origin)


def test_a_foreign_package_imported_first_stops_with_one_line(tmp_path, foreign_kernels):
    done = _python("import kernels\nimport server", tmp_path, foreign_kernels)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # the message, never a traceback
    assert "fake-hub-kernels" in lines[0] and "'kernels'" in lines[0]
    assert str(foreign_kernels) in lines[0]


@pytest.mark.skipif(
    SERVE[0] == sys.executable, reason="the h2o-server console script is not installed"
)
def test_console_script_serves_from_outside_the_repository(tmp_path, foreign_kernels):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        try:
            process, port = start_server(
                ["--model", "default"],
                stdout=out,
                cwd=tmp_path,
                env={"PYTHONPATH": str(foreign_kernels)},
            )
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log.read_text()[-3000:]}")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content
    finally:
        stop_server(process)


@pytest.mark.skipif(UV is None, reason=NO_UV)
def test_lock_matches_pyproject():
    done = _uv_lock_check(REPO)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(UV is None, reason=NO_UV)
def test_lock_check_sees_a_dependency_the_lock_lacks(tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '    "tqdm>=4.66",' in pyproject
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('    "tqdm>=4.66",', ""))
    shutil.copy(REPO / "uv.lock", tmp_path / "uv.lock")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    # Offline, uv answers a stale lock by trying to resolve again, which fails either way.
    assert _uv_lock_check(tmp_path).returncode != 0


def _uv_lock_check(project: Path) -> subprocess.CompletedProcess:
    """uv's own consistency check: does uv.lock hold what pyproject.toml asks for?"""
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    return subprocess.run(
        [UV, "lock", "--check", "--offline"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
