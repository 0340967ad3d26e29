"""Which layer profile a served model uses (`--layer-budgets`), and making one.

`auto`: the shipped profile measured on these weights (cache/profiles/, matched by the
weights' fingerprint or the model's name), else every layer gets max_kv. `uniform`: always the
latter. A path: that profile file (`h2o-server calibrate` writes one).
"""

from __future__ import annotations

import logging
from pathlib import Path

from cache.layer_profiles import LayerProfile, find_profile
from server.sessions.spill import model_identity

log = logging.getLogger("h2o_server.layer_budgets")

AUTO, UNIFORM = "auto", "uniform"


def load_layer_profile(setting: str, model, name: str) -> tuple[LayerProfile | None, str]:
    """(the profile, or None for uniform budgets; a line saying which and why) for the
    model served as `name`."""
    if setting == UNIFORM:
        return None, "uniform (--layer-budgets uniform)"
    if setting != AUTO:
        profile = LayerProfile.load(setting)  # ValueError naming the file
        _check_layers(profile, model, setting)
        return profile, f"profiled ({setting})"
    found = find_profile(model_identity(model), name)
    if found is None:
        return None, "uniform (no profile for these weights: `h2o-server calibrate` makes one)"
    profile, path = found
    _check_layers(profile, model, path)
    return profile, f"profiled ({path.name}, measured on {profile.model})"


def _check_layers(profile: LayerProfile, model, where: str | Path) -> None:
    layers = len(model.layers)
    for policy, per_layer in profile.sensitivity.items():
        if len(per_layer) != layers:
            raise ValueError(
                f"{where}: the {policy} profile has {len(per_layer)} layers; the model has {layers}"
            )


def calibrate_profile(
    model,
    tokenizer,
    model_name: str,
    policies: list[str],
    windows: int,
    tokens: int,
    max_kv: int,
    chunk: int,
) -> LayerProfile:
    """Measure a LayerProfile of `model` on the calibration text (see cache/layer_profiles.py)."""
    from cache.layer_profiles import calibrate, calibration_windows

    text = calibration_windows(tokenizer, windows, tokens)
    sensitivity = {}
    for policy in policies:
        sensitivity[policy] = calibrate(
            model,
            text,
            policy,
            max_kv,
            chunk,
            progress=lambda n, total, p=policy: log.info("%s: window %d of %d", p, n, total),
        )
    calibration = {
        "text": "pydoc_data topics (Python's reference documentation)",
        "windows": windows,
        "tokens": tokens,
        "max_kv": max_kv,
        "chunk": chunk,
        "measure": "mean NLL increase (nats/token) with only this layer's cache bounded",
    }
    return LayerProfile(model_name, model_identity(model), sensitivity, calibration)
