"""Reading a Hugging Face checkpoint's config before any rank starts (no Bridge, no transformers import
for a local directory)."""
from __future__ import annotations

import json
import os

__all__ = ["hf_config_value", "remote_code_error"]


def hf_config_value(path: str, key: str, *, trust_remote_code: bool = False):
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

        value = getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code), key, None)
    if value is None:
        raise ValueError(f"--hf-model {path}: its config has no {key!r}")
    return value


def remote_code_error(path: str, trust_remote_code: bool):
    """None, or why ``--hf-model path`` cannot load without running its own code: a local checkpoint whose
    config.json names code of its own (``auto_map``) is asked of ``transformers.AutoConfig`` as the Bridge
    will ask it, and transformers' refusal is returned as it says it (a model type transformers knows
    natively loads without that code, as transformers decides)."""
    cfg = os.path.join(str(path), "config.json")
    if trust_remote_code or not os.path.isfile(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        if "auto_map" not in json.load(f):
            return None
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except ValueError as e:
        return (f"--hf-model {path}: its config.json names code of its own (auto_map), and transformers says: "
                f"{' '.join(str(e).split())} -- pass --trust-remote-code to run that code")
    return None
