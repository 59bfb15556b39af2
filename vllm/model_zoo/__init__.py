# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Models that ship with (or are built by) the package, by name: `zoo_path(name)` gives a local
folder `LLM(model=...)` and `speculative_config["model"]` accept; `vllm zoo NAME` prints it."""

from __future__ import annotations

from pathlib import Path

from vllm.model_zoo.smollm2 import convert_smollm2, find_smollm2_gguf, smollm2_path

ZOO_DIR = Path(__file__).resolve().parent
TINY_DEEPSEEK_MTP_DIR = ZOO_DIR / "tiny-deepseek-mtp"
SMOLLM2_EAGLE3_DIR = ZOO_DIR / "smollm2-135m-eagle3"

_BUNDLED = {
    "tiny-deepseek-mtp": TINY_DEEPSEEK_MTP_DIR,
    "smollm2-135m-eagle3": SMOLLM2_EAGLE3_DIR,
}
_BUILT = {"smollm2-135m-instruct": smollm2_path}


def zoo_names() -> list[str]:
    return sorted([*_BUNDLED, *_BUILT])


def zoo_path(name: str) -> str:
    """Local folder of a zoo model; built ones (SmolLM2 from its GGUF) convert on first use."""
    if name in _BUNDLED:
        path = _BUNDLED[name]
        if not (path / "config.json").is_file():
            raise ValueError(f"the bundled model {name!r} is missing at {path}")
        return str(path)
    if name in _BUILT:
        return _BUILT[name]()
    raise ValueError(f"unknown zoo model {name!r}; known: {zoo_names()}")


__all__ = [
    "SMOLLM2_EAGLE3_DIR",
    "TINY_DEEPSEEK_MTP_DIR",
    "convert_smollm2",
    "find_smollm2_gguf",
    "smollm2_path",
    "zoo_names",
    "zoo_path",
]
