# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Dependencies point one way: model layers use the attention backends (kernels, metadata, the
sparse MLA impls and their registry); no backend imports a model layer or a model."""

from __future__ import annotations

import subprocess
import sys


def test_backends_import_nothing_from_model_executor() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import vllm.attention.backends as b\n"
        "names = [m.name for m in pkgutil.walk_packages(b.__path__, b.__name__ + '.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names))\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm.model_executor')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, upward = out.stdout.strip().splitlines()
    assert int(count) >= 6  # torch_paged, gdn_attn, registry, mla/{torch, sparse, triton} ...
    assert upward == "[]"
