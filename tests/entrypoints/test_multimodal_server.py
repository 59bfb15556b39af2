# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm serve` on a tiny Qwen3.5 VL checkpoint: chat messages with base64 image_url parts over
the openai client equal HF transformers' greedy output; bad images (corrupt, empty, huge, not a
data URL, remote without an allowed domain, over --limit-mm-per-prompt) are 400s naming the
field, and the server keeps serving; offline LLM.chat takes the same parts."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import openai
import pytest

from vllm.testing import qwen3_5_checkpoints as q35
from vllm.testing.remote_server import RemoteServer

MAX_TOKENS = 8


def _data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _png_header(w: int, h: int) -> bytes:
    """A PNG declaring a w x h image (no pixel data: only the header is read)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _messages(*urls: str, text: str = "what is in the picture?") -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _hf_reference(path: str, images: list, text: str) -> str:
    """HF's greedy answer to the same conversation (rendered by the tokenizer's template from
    the content parts, an image part as {"type": "image"}, as HF's processor renders them)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = q35.hf_vl_greedy(path, prompt, images, MAX_TOKENS)
    return tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return q35.make_qwen3_5_vl(tmp_path_factory.mktemp("vl_serve"))


@pytest.fixture(scope="module")
def server(vl_dir):
    args = [
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--limit-mm-per-prompt",
        '{"image": 2}',
    ]
    with RemoteServer(vl_dir, args) as srv:
        srv.wait_ready()
        yield srv


def _chat(client: openai.OpenAI, messages: list[dict]) -> str:
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].message.content or ""


def test_chat_with_images_matches_hf(server, vl_dir):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x")
    a, b = q35.make_test_image(0), q35.make_test_image(5, (40, 16))
    assert _chat(client, _messages(_data_url(a))) == _hf_reference(
        vl_dir, [a], "what is in the picture?"
    )
    two = _chat(client, _messages(_data_url(a), _data_url(b, "JPEG")))
    from PIL import Image

    b_jpeg = Image.open(io.BytesIO(base64.b64decode(_data_url(b, "JPEG").split(",", 1)[1])))
    assert two == _hf_reference(vl_dir, [a, b_jpeg], "what is in the picture?")


BAD = [
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "decoded"),
    ("data:image/png;base64,", "empty"),
    ("data:image/png;base64,@@@", "base64"),
    ("data:image/png;base64," + base64.b64encode(_png_header(20000, 20)).decode(), "limit"),
    ("http://example.com/cat.png", "remote image URLs are not fetched"),
    ("file:///etc/passwd", "data URL"),
]


@pytest.mark.parametrize("url,why", BAD)
def test_bad_images_are_400(server, url, why):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x")
    with pytest.raises(openai.BadRequestError, match=why):
        _chat(client, _messages(url))


def test_limit_per_prompt_and_still_serving(server, vl_dir):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x")
    url = _data_url(q35.make_test_image(3))
    with pytest.raises(openai.BadRequestError, match="limit of 2"):
        _chat(client, _messages(url, url, url))
    with pytest.raises(openai.BadRequestError, match="beam search"):
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=_messages(url),  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"use_beam_search": True, "n": 2},
        )
    # Nothing above reached a stage: the server still answers correctly.
    assert _chat(client, _messages(url)) == _hf_reference(
        vl_dir, [q35.make_test_image(3)], "what is in the picture?"
    )


def test_offline_chat_with_image_parts(vl_dir):
    from vllm import LLM, SamplingParams

    a = q35.make_test_image(0)
    llm = LLM(model=vl_dir, dtype="float32", max_model_len=256)
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        by_url = llm.chat(_messages(_data_url(a)), sp, use_tqdm=False)[0].outputs[0].text
        pil = [
            {"type": "image_pil", "image_pil": a},
            {"type": "text", "text": "what is in the picture?"},
        ]
        by_pil = llm.chat([{"role": "user", "content": pil}], sp, use_tqdm=False)
        with pytest.raises(ValueError, match="zero size"):
            llm.generate(
                {"prompt": q35.IMAGE_PLACEHOLDER, "multi_modal_data": {"image": _zero_image()}}
            )
    finally:
        llm.shutdown()
    assert (
        by_url == by_pil[0].outputs[0].text == _hf_reference(vl_dir, [a], "what is in the picture?")
    )


def _zero_image():
    from PIL import Image

    return Image.new("RGB", (0, 0))
