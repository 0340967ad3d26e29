"""The default model's float32 weights saved as an MLX model folder, for anchors that load one.

`mlx_lm.server` and `mlx_lm.generate` load folders (config.json, safetensors,
tokenizer files), not our GGUF path; saving the exact weights this server
serves, with mlx-lm's own save helpers, makes every comparison run the same
weights. The folder is written once and reused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

DEFAULT_FOLDER = Path("/tmp/h2o_bench/smollm2-135m-f32")


def export_default(folder: Path = DEFAULT_FOLDER, name: str = "default") -> Path:
    """Write (or reuse) the default model (or the embedded model `name`, such as
    gemma3-270m) as an MLX folder; return its path."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    from mlx_lm.utils import save_config, save_model

    from models.loading import load_model

    model, tokenizer = load_model(name)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    config = dataclasses.asdict(model.args)
    save_config(config, folder / "config.json")
    tokenizer._tokenizer.save_pretrained(str(folder))  # tokenizer.json + the chat template
    # mlx-lm stops generation at the model's eos ids: carry the GGUF's into the folder.
    generation = {"eos_token_id": sorted(tokenizer.eos_token_ids)}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def export_embedded(name: str) -> Path:
    """An embedded model's folder (`default`: the default's), written once."""
    if name == "default":
        return export_default()
    return export_default(DEFAULT_FOLDER.parent / f"{name}-f32", name)
