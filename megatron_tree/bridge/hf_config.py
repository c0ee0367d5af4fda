"""Reading a Hugging Face checkpoint's config before any rank starts (no Bridge, no transformers import
for a local directory)."""
from __future__ import annotations

import json
import os

__all__ = ["hf_config_value"]


def hf_config_value(path: str, key: str):
    """``config.json[key]`` of a local HF checkpoint directory, else ``transformers.AutoConfig``'s
    attribute (a hub id). A missing directory, file or key is a ValueError naming it."""
    cfg = os.path.join(str(path), "config.json")
    if os.path.isdir(str(path)):
        if not os.path.isfile(cfg):
            raise ValueError(f"--hf-model {path}: no config.json there (a Hugging Face checkpoint directory holds one)")
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
        value = data.get(key, (data.get("text_config") or {}).get(key))
    else:
        from transformers import AutoConfig

        value = getattr(AutoConfig.from_pretrained(str(path)), key, None)
    if value is None:
        raise ValueError(f"--hf-model {path}: its config has no {key!r}")
    return value
