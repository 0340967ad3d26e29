"""Markdown reports of the benchmarks: machine line, exact command, table; printed and saved."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reproduces this run."""
    args = argv if argv is not None else sys.argv[1:]
    return " ".join(["python -m", module, *args])


def eval_command(argv: list[str]) -> str:
    """The `h2o-server eval` line of an evaluation step."""
    return "h2o-server " + " ".join(argv)


def run_eval(argv: list[str]) -> list[dict]:
    """One `h2o-server eval` step in this process: its records."""
    from bench.eval_cli import eval_records
    from server.cli import build_parser

    return eval_records(build_parser().parse_args(argv))


def git_revision() -> str:
    """The checked-out revision, and whether the tree differs from it."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return rev + (" (with uncommitted changes in the working tree)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    import mlx.core as mx

    return (
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
        f"MLX {mx.__version__}, device {mx.default_device()}"
    )


def publish(title: str, intro: str, command_line: str, body: list[str], out: Path | None) -> str:
    """Print the report and write it to `out` (when given)."""
    report = "\n".join([f"# {title}", "", intro, "", f"Command: `{command_line}`", "", *body, ""])
    print(report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return report
