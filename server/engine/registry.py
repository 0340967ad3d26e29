"""The loaded models: each an Engine and its Batcher, loaded on demand, unloaded when idle.

Lives on the worker thread (loading and unloading touch MLX); handlers only read which
models are loaded and mark one used. The default model (the first --model) is loaded
at start. Loading one more than --max-loaded-models unloads the least recently used
idle, unpinned one first; --model-ttl (or a request's keep_alive) unloads a model idle
past it. An unloaded model's sessions are spilled to its folder under --spill-dir (and
restored when a conversation comes back to it), else dropped.

--kv-budget covers every loaded model: each model's sessions get an equal share
(`--kv-budget / min(--max-loaded-models, models)`), so the total holds whichever load.
--memory-budget covers what the loaded models hold together, each its weights and its
KV share: a model that would pass it unloads the least recently used idle ones first
(sized by its files until it has been loaded once, then by its weights as loaded, and
checked again once loaded); one that cannot fit even alone is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from config.settings import ServerSettings
from models.loading import weight_file_bytes
from server.engine.batcher import Batcher
from server.engine.catalog import ModelEntry, catalog
from server.engine.engine import kv_budget_bytes, memory_budget_bytes

log = logging.getLogger("h2o_server.models")


class ModelTooLarge(ValueError):
    """A model whose weights and KV share alone pass --memory-budget."""


@dataclass
class Loaded:
    engine: object  # server/engine/engine.Engine
    batcher: Batcher
    used: float  # time.monotonic() of its last request
    keep_until: float | None = None  # a request's keep_alive: unload when idle after this


class ModelRegistry:
    def __init__(self, settings: ServerSettings, load_engine: Callable[[ServerSettings], object]):
        self.settings = settings
        self.entries = catalog(settings)
        self.default = self.entries[0].name
        self.loaded: dict[str, Loaded] = {}
        # Session counters of unloaded models' stores: /metrics' counters never go back.
        self.retired_counts: Counter[str] = Counter()
        self._leaving: list[weakref.ref] = []  # unloaded models not yet freed
        self._load_engine = load_engine
        self.memory_budget = memory_budget_bytes(settings.memory_budget)  # 0: none
        self._weights: dict[str, int] = {}  # each model's weights as loaded, once it has been
        self._pins = {entry.name for name in settings.pin if (entry := self.find(name))}
        self._pins |= {entry.name for entry in self.entries if entry.pin}
        unknown = [name for name in settings.pin if self.find(name) is None]
        if unknown:
            raise ValueError(f"--pin names models not served here: {', '.join(unknown)}")

    # ----------------------------------------------------------------- any thread

    def find(self, name: str) -> ModelEntry | None:
        """The model a request's name means (its id or any alias)."""
        for entry in self.entries:
            if name in entry.aliases:
                return entry
        return None

    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    def snapshot(self) -> list[Loaded]:
        """The loaded models now: handlers read it while the worker thread loads and
        unloads (list() copies the dict's values without running Python code between)."""
        return list(self.loaded.values())

    def engine(self, name: str):
        """The model's Engine while it is loaded, else None."""
        loaded = self.loaded.get(name)
        return loaded.engine if loaded else None

    def touch(self, name: str, keep_alive: float | None = None) -> None:
        """A request used the model now; keep_alive (seconds, < 0: forever) sets how long
        it stays once idle, in place of --model-ttl."""
        loaded = self.loaded.get(name)
        if loaded is None:
            return
        loaded.used = time.monotonic()
        if keep_alive is not None:
            loaded.keep_until = float("inf") if keep_alive < 0 else loaded.used + keep_alive

    def state(self, name: str) -> str:
        return "loaded" if name in self.loaded else "unloaded"

    def pinned(self, name: str) -> bool:
        return name in self._pins

    def _entry(self, name: str) -> ModelEntry:
        return next(e for e in self.entries if e.name == name)

    def weight_bytes(self, name: str) -> int | None:
        """Its weights' bytes as loaded (None before it has been loaded once)."""
        return self._weights.get(name)

    def memory_in_use(self) -> int:
        """What the loaded models hold under --memory-budget: weights and KV shares."""
        return sum(m.engine.weight_bytes + m.engine.kv_budget for m in self.snapshot())

    def footprint(self, name: str) -> int:
        """What loading the model adds: its weights (as last loaded, else its files) and
        its KV share."""
        weights = self._weights.get(name) or weight_file_bytes(self._entry(name).source)
        return weights + self.kv_share()

    def kv_share(self) -> int:
        """Each loaded model's share of --kv-budget."""
        total = kv_budget_bytes(self.settings.kv_budget)
        return total // min(self.settings.max_loaded_models, len(self.entries))

    def over_budget(self, adding: int = 0) -> bool:
        return bool(self.memory_budget) and self.memory_in_use() + adding > self.memory_budget

    # ----------------------------------------------------------------- worker thread

    def load(self, name: str, busy: Iterable[str] = ()) -> Loaded:
        """The model loaded (if it is not), making room under --max-loaded-models and
        --memory-budget first; ModelTooLarge where it cannot fit even alone (the default
        model loads anyway, with a warning: the server has nothing else to serve)."""
        if name in self.loaded:
            return self.loaded[name]
        busy = set(busy)  # read twice: before the load and after
        entry = self._entry(name)
        adding = self.footprint(name)
        if self.memory_budget and adding > self.memory_budget and name != self.default:
            raise ModelTooLarge(self._too_large(name, adding))
        self._make_room(name, busy, adding)
        started = time.monotonic()
        engine = self._load_engine(self.model_settings(entry))
        engine.name = entry.name
        self._weights[name] = engine.weight_bytes
        alone = engine.weight_bytes + engine.kv_budget
        if self.memory_budget and alone > self.memory_budget:
            if name != self.default:  # its files understated it: known now, refused
                engine.store.close()
                del engine
                gc.collect()
                mx.clear_cache()
                _trim_heap()
                raise ModelTooLarge(self._too_large(name, alone))
            log.warning("%s", self._too_large(name, alone) + "; the default model loads anyway")
        batcher = Batcher(
            engine.model,
            self.settings.prefill_step,
            self.settings.prefill_budget,
            engine.store.make_caches,
        )
        loaded = self.loaded[name] = Loaded(engine, batcher, time.monotonic())
        log.info("model %s loaded in %.1f s", name, time.monotonic() - started)
        self._make_room(name, busy)  # its weights as loaded may be more than its files
        return loaded

    def _make_room(self, name: str, busy: Iterable[str], adding: int = 0) -> None:
        """Unload the least recently used idle models (never `name`) while the loaded ones
        pass --max-loaded-models or --memory-budget (with `adding` bytes about to load)."""
        slots = self.settings.max_loaded_models - (name not in self.loaded)
        while len(self.loaded) > slots or self.over_budget(adding):
            victim = self._least_recent(busy, but=name)
            if victim is None:  # all busy or pinned: over until one idles (tick)
                log.warning(
                    "%s loaded past --max-loaded-models %d / --memory-budget %s: every "
                    "other loaded model is busy or pinned",
                    name,
                    self.settings.max_loaded_models,
                    self.settings.memory_budget,
                )
                return
            self.unload(victim)

    def _too_large(self, name: str, needs: int) -> str:
        mib = 2**20
        return (
            f"model {name!r} needs {needs / mib:.0f} MiB (weights and its KV share), over "
            f"--memory-budget {self.memory_budget / mib:.0f} MiB"
        )

    def unload(self, name: str) -> bool:
        """Unload a model (its sessions spilled or dropped); False if it was not loaded."""
        loaded = self.loaded.pop(name, None)
        if loaded is None:
            return False
        spilled = loaded.engine.store.spill_all()
        loaded.engine.store.close()
        self.retired_counts.update(loaded.engine.store.counts)
        # A request's handler may still hold the Engine for a moment: its memory is given
        # back when the model's last reference goes (now, or at a later tick).
        self._leaving.append(weakref.ref(loaded.engine.model))
        del loaded
        gc.collect()  # the model's arrays go with their last reference
        self._give_back()
        log.info("model %s unloaded; %d session(s) spilled", name, spilled)
        return True

    def _give_back(self) -> None:
        """Once an unloaded model is gone, return its memory to the system."""
        gone = [ref for ref in self._leaving if ref() is None]
        if gone:
            self._leaving = [ref for ref in self._leaving if ref() is not None]
            mx.clear_cache()
            _trim_heap()

    def tick(self, busy: Iterable[str]) -> None:
        """Unload every idle model past its keep_alive, else its own ttl (a models file's),
        else --model-ttl."""
        self._give_back()
        now, busy = time.monotonic(), set(busy)
        for name, loaded in list(self.loaded.items()):
            if name in busy or name in self._pins:
                continue
            ttl = self._entry(name).ttl
            ttl = self.settings.model_ttl if ttl is None else ttl
            if loaded.keep_until is not None:
                due = loaded.keep_until
            elif ttl > 0:
                due = loaded.used + ttl
            else:  # 0: until another needs its place
                continue
            if now >= due:
                self.unload(name)
        # Loaded past a limit while the others were busy: the least recent idle ones go
        # (never the last one: a default model over the budget alone stays, as it loaded).
        while len(self.loaded) > self.settings.max_loaded_models or (
            self.over_budget() and len(self.loaded) > 1
        ):
            victim = self._least_recent(busy)
            if victim is None:
                break
            self.unload(victim)

    def close(self) -> None:
        for loaded in self.loaded.values():
            loaded.engine.store.close()

    def _least_recent(self, busy: Iterable[str], but: str | None = None) -> str | None:
        busy = {*busy, but}
        idle = [
            (loaded.used, name)
            for name, loaded in self.loaded.items()
            if name not in busy and name not in self._pins
        ]
        return min(idle)[1] if idle else None

    def model_settings(self, entry: ModelEntry) -> ServerSettings:
        """The settings one model's Engine loads with: its source and id, its share of
        --kv-budget, its own spill folder (the default model's is --spill-dir itself), its
        own draft model where its models-file table names one."""
        update: dict = {"model": entry.source}
        if entry.draft is not None:
            update["draft_model"] = entry.draft or None
        if entry.name != self.default or not self.settings.served_model_name:
            update["served_model_name"] = [entry.name]
        if min(self.settings.max_loaded_models, len(self.entries)) > 1:
            update["kv_budget"] = str(self.kv_share())
        if self.settings.spill_dir and entry.name != self.default:
            folder = re.sub(r"[^A-Za-z0-9._-]+", "_", entry.name)
            update["spill_dir"] = str(Path(self.settings.spill_dir) / "models" / folder)
        return self.settings.model_copy(update=update)


def _trim_heap() -> None:
    """Give freed memory back to the system (glibc): after a model has been loaded once,
    malloc serves its smaller weights from heaps it keeps, so RSS would stay put."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):  # glibc only (macOS returns memory itself)
        libc.malloc_trim(0)
