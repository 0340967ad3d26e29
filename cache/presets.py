"""Split a cache size (max_kv) into H2O's sink / heavy / recent segments."""

from __future__ import annotations

from dataclasses import dataclass

PRESETS = ("heavy", "balanced")
DEFAULT_SINK = 4


@dataclass(frozen=True)
class H2OBudget:
    """sink + heavy + recent == max_size; sinks and the recent window are always kept."""

    max_size: int
    sink: int
    heavy: int
    recent: int

    def __post_init__(self) -> None:
        if min(self.sink, self.heavy, self.recent) < 0:
            raise ValueError(f"negative H2O segment in {self}")
        if self.recent < 1:
            raise ValueError("the recent window must hold at least the newest token")
        if self.sink + self.heavy + self.recent != self.max_size:
            raise ValueError(
                f"sink ({self.sink}) + heavy ({self.heavy}) + recent ({self.recent}) "
                f"must equal max_kv ({self.max_size})"
            )


def split_budget(
    max_size: int,
    preset: str = "heavy",
    sink: int | None = None,
    heavy: int | None = None,
    recent: int | None = None,
) -> H2OBudget:
    """Presets: `heavy` (heavy = max/2, recent = max/2 - sink), `balanced` (heavy = max/4).

    Explicit sink/heavy/recent override the preset; when only some are given
    the rest of max_size goes to the recent window (or to heavy if recent is given).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    if max_size < 2:
        raise ValueError("max_kv must be at least 2")
    if sink is None:
        sink = min(DEFAULT_SINK, max_size // 4)
    if heavy is None and recent is None:
        heavy = max_size // 2 if preset == "heavy" else max_size // 4
    if heavy is None:
        heavy = max_size - sink - recent
    if recent is None:
        recent = max_size - sink - heavy
    return H2OBudget(max_size=max_size, sink=sink, heavy=heavy, recent=recent)
