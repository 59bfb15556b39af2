# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm serve --enable-lora --lora-modules` (two pipeline stages) with the real `openai`
client: adapters listed in /v1/models with their parent, chosen by the `model` field, equal to
the offline engine with that adapter; loaded and unloaded at run time behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING; unknown names 404, bad adapters 400, the server keeps
serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.testing.remote_server import RemoteServer, serving

PROMPT = "hello world, the"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora_serve")
    args = [
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--served-model-name",
        "base",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "-pp",
        "2",
        "--lora-modules",
        f"a1={llama_adapters[0]}",
        f'{{"name": "a2", "path": "{llama_adapters[1]}"}}',
    ]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "forkserver"}
    with serving({"s": RemoteServer(llama_dir, args, logs / "lora.log", env=env)}) as started:
        started["s"].wait_ready()
        yield started["s"]


@pytest.fixture(scope="module")
def reference(llama_dir, llama_adapters) -> dict[str | None, str]:
    llm = LLM(model=llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_loras=3)
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        loras = [None] + [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(llama_adapters)]
        outs = llm.generate([PROMPT] * len(loras), sp, lora_request=loras)
        return {
            None if lr is None else lr.lora_name: o.outputs[0].text for lr, o in zip(loras, outs)
        }
    finally:
        llm.shutdown()


def _complete(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].text


def test_adapters_over_http(server, reference, llama_adapters, llama_dir):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a1", "a2"}
    assert cards["a1"].parent == "base" and cards["a1"].root == llama_adapters[0]
    assert len(set(reference.values())) == 4
    assert _complete(client, "base") == reference[None]
    assert _complete(client, "a1") == reference["a1"]
    assert _complete(client, "a2") == reference["a2"]
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content is not None

    with pytest.raises(openai.NotFoundError):
        _complete(client, "a3")
    # run-time load (a bad adapter refused, naming the problem), use, unload
    bad = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": llama_dir}
    )
    assert bad.status_code == 400 and "not a PEFT LoRA adapter" in bad.text
    ok = httpx.post(
        server.url("/v1/load_lora_adapter"),
        json={"lora_name": "a3", "lora_path": llama_adapters[2]},
    )
    assert ok.status_code == 200, ok.text
    again = httpx.post(
        server.url("/v1/load_lora_adapter"),
        json={"lora_name": "a3", "lora_path": llama_adapters[2]},
    )
    assert again.status_code == 400
    assert "a3" in {m.id for m in client.models.list().data}
    assert _complete(client, "a3") == reference["a3"]
    r = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "a3"})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "a3"})
    assert r.status_code == 404
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a3")
    assert _complete(client, "a1") == reference["a1"]  # still serving
