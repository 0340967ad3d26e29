"""The models a server can serve: --model (each), --models and --models-dir, by name.

What a request's `model` names, and what `load_model` takes to load it. The first
--model is the default one (loaded at start, and what `default` names); every other
entry is loaded on demand (server/engine/registry.py).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from config.durations import keep_alive_seconds
from models.loading import DEFAULT_MODEL, served_model_id

if TYPE_CHECKING:  # pydantic-settings: the CLI's commands resolve names without it
    from config.settings import ServerSettings


@dataclass(frozen=True)
class ModelEntry:
    name: str  # the id /v1/models and replies give
    source: str  # what models.loading.load_model takes
    aliases: frozenset[str]  # every name a request may use for it (the id included)
    ttl: float | None = None  # its own --model-ttl (a models file's `ttl`)
    pin: bool = False  # never unloaded for another or for idling (--pin, a file's `pin`)
    # Its own draft model (a file's `draft_model`): a source, or "" for none; None: the
    # server's --draft-model.
    draft: str | None = None


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
    if settings.models_file:
        entries += file_models(Path(settings.models_file))
    if settings.models_dir:
        entries += folder_models(Path(settings.models_dir)) + hf_cache_models()
    kept, taken = [], set()
    for entry in entries:
        if entry.name in taken:
            continue
        kept.append(replace(entry, aliases=entry.aliases - taken))
        taken |= entry.aliases
    return kept


def source_of(name: str, models_dir: str | None = None) -> str:
    """What `load_model` takes for a name a server with this --models-dir serves (a
    folder's model by its name, the Hugging Face cache's by org/name); else `name` as
    given (an embedded model, a path, a repo id). The CLI's `generate` and `chat` use it."""
    found = folder_models(Path(models_dir)) if models_dir else []
    for entry in [*found, *hf_cache_models()]:
        if name in entry.aliases:
            return entry.source
    return name


MODEL_KEYS = {"source", "aliases", "ttl", "pin", "draft_model"}


def file_models(path: Path) -> list[ModelEntry]:
    """A models file (TOML): a table per model, named as requests name it:

    [coder]
    source = "/models/Qwen3-Coder-30B-A3B-4bit"  # what --model takes (required)
    aliases = ["claude-sonnet-4-5"]              # more names requests may use
    ttl = "1h"                                   # idle time before it unloads
    pin = true                                   # never unloaded
    draft_model = "/models/Qwen3-0.6B-4bit"      # its own --draft-model (false: none)
    """
    try:
        tables = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--models-file {path}: {e}") from None
    found = []
    for name, table in tables.items():
        where = f"--models-file {path}: [{name}]"
        if not isinstance(table, dict) or not isinstance(table.get("source"), str):
            raise ValueError(f'{where} needs source = "a path, repo id or embedded name"')
        if unknown := set(table) - MODEL_KEYS:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown)} (known: {sorted(MODEL_KEYS)})"
            )
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ValueError(f"{where}: aliases is a list of names")
        try:
            ttl = keep_alive_seconds(table.get("ttl"))
        except ValueError:
            raise ValueError(f"{where}: ttl is seconds or a duration such as '1h'") from None
        if not isinstance(pin := table.get("pin", False), bool):
            raise ValueError(f"{where}: pin is true or false")
        draft = table.get("draft_model")
        if draft is not None and not (isinstance(draft, str) and draft) and draft is not False:
            raise ValueError(f"{where}: draft_model is a source (a path, repo id or name) or false")
        draft = "" if draft is False else draft
        names = frozenset({name, table["source"], *aliases})
        found.append(ModelEntry(name, table["source"], names, ttl, pin, draft))
    return found


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
