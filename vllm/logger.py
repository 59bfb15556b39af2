# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Package logger: one stream handler on the `vllm` logger, level from VLLM_LOGGING_LEVEL."""

from __future__ import annotations

import logging
import sys

from vllm import envs

_root = logging.getLogger("vllm")
if not _root.handlers:
    _h = logging.StreamHandler(sys.stderr)
    _h.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%H:%M:%S")
    )
    _root.addHandler(_h)
    _root.setLevel(envs.VLLM_LOGGING_LEVEL)
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """Return a logger under the package's root logger."""
    return logging.getLogger(name if name.startswith("vllm") else f"vllm.{name}")
