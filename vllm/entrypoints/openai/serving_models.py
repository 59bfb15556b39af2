# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The models a server answers to: the base model's names and the LoRA adapters (from
--lora-modules, or loaded at run time), each chosen by a request's `model` field."""

from __future__ import annotations

import itertools
import json
from typing import Any

from pydantic import BaseModel

from vllm.entrypoints.openai.protocol import ModelCard
from vllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries, `name=path` or JSON {"name", "path", "base_model_name"}."""
    out = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                out.append((str(d["name"]), str(d["path"]), d.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules {spec!r}: JSON needs 'name' and 'path' ({e})"
                ) from e
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        out.append((name, path, None))
    return out


class OpenAIServingModels:
    """Base model names and adapters by name; an unknown name is a 404 (vLLM's wording)."""

    def __init__(self, async_llm: Any, base_names: list[str]) -> None:
        self.llm = async_llm
        self.base_names = list(base_names)
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def is_known(self, model: str | None) -> bool:
        return model is None or model in self.base_names or model in self.loras

    def lora_for(self, model: str | None) -> LoRARequest | None:
        return None if model is None else self.loras.get(model)

    def cards(self) -> list[ModelCard]:
        mc = self.llm.model_config
        base = [
            ModelCard(id=n, root=mc.model, max_model_len=mc.max_model_len) for n in self.base_names
        ]
        return base + [self._lora_card(lr) for lr in self.loras.values()]

    def card(self, model: str) -> ModelCard | None:
        if model in self.loras:
            return self._lora_card(self.loras[model])
        if model in self.base_names:
            mc = self.llm.model_config
            return ModelCard(id=model, root=mc.model, max_model_len=mc.max_model_len)
        return None

    def _lora_card(self, lr: LoRARequest) -> ModelCard:
        parent = lr.base_model_name or self.base_names[0]
        return ModelCard(id=lr.lora_name, root=lr.lora_path, parent=parent)

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter after the engine's checks (ValueError naming the problem)."""
        if not name or not path:
            raise ValueError("both lora_name and lora_path must be provided")
        if name in self.loras or name in self.base_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lr = LoRARequest(name, next(self._ids), path, base_model_name)
        await self.llm.in_tokenizer_thread(self.llm.engine.check_lora, lr)
        if name in self.loras:  # a concurrent load of the same name won
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        self.loras[name] = lr
        return lr

    def add_static(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """A --lora-modules adapter, checked at start-up (a bad one stops the server)."""
        if name in self.loras or name in self.base_names:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice")
        lr = LoRARequest(name, next(self._ids), path, base_model_name)
        self.llm.engine.check_lora(lr)
        self.loras[name] = lr

    def unload(self, name: str) -> LoRARequest | None:
        """Forget an adapter (requests already running finish with it); None: unknown."""
        return self.loras.pop(name, None)


def add_lora_routes(router: Any, models: OpenAIServingModels) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    from fastapi.responses import PlainTextResponse

    from vllm.entrypoints.openai.errors import APIError

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            await models.load(request.lora_name, request.lora_path, request.base_model_name)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), 400, "lora_path") from e
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if models.unload(request.lora_name) is None:
            raise APIError(
                f"The lora adapter '{request.lora_name}' cannot be found.", 404, "lora_name"
            )
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )
