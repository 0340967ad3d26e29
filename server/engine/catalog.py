"""The models a server can serve: --model (each), --models and --models-dir, by name.

What a request's `model` names, and what `load_model` takes to load it. The first
--model is the default one (loaded at start, and what `default` names); every other
entry is loaded on demand (server/engine/registry.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from config.settings import ServerSettings
from models.loading import DEFAULT_MODEL, served_model_id


@dataclass(frozen=True)
class ModelEntry:
    name: str  # the id /v1/models and replies give
    source: str  # what models.loading.load_model takes
    aliases: frozenset[str]  # every name a request may use for it (the id included)


def split_alias(text: str) -> tuple[str | None, str]:
    """'qwen=/models/Qwen3' -> ('qwen', '/models/Qwen3'); a plain source has no alias."""
    name, sep, source = text.partition("=")
    if sep and name and "/" not in name and source:
        return name, source
    return None, text


def catalog(settings: ServerSettings) -> list[ModelEntry]:
    """Every model the settings name, the default one first; later duplicates dropped."""
    alias, source = split_alias(settings.model)
    if settings.served_model_name:  # the first is the id, every one a name requests use
        names = set(settings.served_model_name)
        first = ModelEntry(settings.served_model_name[0], source, frozenset(names))
    else:
        name = alias or served_model_id(source)
        first = ModelEntry(name, source, frozenset({name, source, DEFAULT_MODEL}))
    entries = [first]
    for given in settings.models:
        alias, source = split_alias(given)
        name = alias or served_model_id(source)
        entries.append(ModelEntry(name, source, frozenset({name, source})))
    if settings.models_dir:
        entries += folder_models(Path(settings.models_dir)) + hf_cache_models()
    kept, taken = [], set()
    for entry in entries:
        if entry.name in taken:
            continue
        kept.append(ModelEntry(entry.name, entry.source, entry.aliases - taken))
        taken |= entry.aliases
    return kept


def folder_models(folder: Path) -> list[ModelEntry]:
    """A models folder's MLX model folders (a config.json and weights) and .gguf files."""
    if not folder.is_dir():
        raise ValueError(f"--models-dir {folder} is not a folder")
    found = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and _mlx_folder(path):
            name = path.name
        elif path.is_file() and path.suffix == ".gguf":
            name = path.stem
        else:
            continue
        found.append(ModelEntry(name, str(path), frozenset({name, str(path)})))
    return found


def hf_cache_models() -> list[ModelEntry]:
    """MLX models in the local Hugging Face cache, as org/name, loaded from their newest
    snapshot (no network: the cache's own files)."""
    hub = Path(
        os.environ.get("HF_HUB_CACHE")
        or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    )
    found = []
    for repo in sorted(hub.glob("models--*--*")):
        snapshots = [s for s in (repo / "snapshots").glob("*") if _mlx_folder(s)]
        if not snapshots:
            continue
        newest = max(snapshots, key=lambda s: s.stat().st_mtime)
        name = re.sub(r"^models--", "", repo.name).replace("--", "/", 1)
        found.append(ModelEntry(name, str(newest), frozenset({name})))
    return found


def _mlx_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
