"""Markdown reports of the benchmarks: machine line, exact command, table; printed and saved."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reproduces this run."""
    args = argv if argv is not None else sys.argv[1:]
    return " ".join(["python -m", module, *args])


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
