# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Chat messages with image parts (OpenAI's `image_url`, and offline `image_pil`): each image
part becomes the model's image placeholder in the message text, and the image itself one item
of the prompt's multi_modal_data. Images come as base64 data URLs (or PIL images offline);
an http(s) URL is fetched only when its host is in the allowed media domains (off by default:
nothing is fetched from the network), else it is refused naming the field."""

from __future__ import annotations

import functools
import urllib.parse
import urllib.request
from typing import Any

# A fetched remote image is read up to this many bytes (then refused).
MAX_REMOTE_IMAGE_BYTES = 20 * 2**20
REMOTE_TIMEOUT_S = 10.0
# How a chat template reads message content (vLLM's --chat-template-content-format values but
# "auto", which resolve_content_format turns into one of these).
CONTENT_FORMATS = ("string", "openai")


def _fetch(url: str, field: str, allowed: list[str] | None) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    if not allowed or host not in allowed:
        raise ValueError(
            f"{field}: remote image URLs are not fetched (host {host!r}); send the image as a "
            "base64 data URL (data:image/png;base64,...), or start the server with "
            "--allowed-media-domains naming the host"
        )
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as resp:
            data = resp.read(MAX_REMOTE_IMAGE_BYTES + 1)
    except Exception as e:  # noqa: BLE001 - any fetch failure is the request's
        raise ValueError(f"{field}: fetching {url!r} failed ({type(e).__name__}: {e})") from None
    if len(data) > MAX_REMOTE_IMAGE_BYTES:
        raise ValueError(f"{field}: the image at {url!r} exceeds {MAX_REMOTE_IMAGE_BYTES} bytes")
    return data


def split_images(
    messages: list[dict[str, Any]],
    placeholder: str | None,
    allowed_domains: list[str] | None = None,
    content_format: str = "string",
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, the images in order). An image part needs a model
    that takes images (`placeholder` not None), else it is refused naming the field.

    content_format "string" (templates that print `message.content` whole): text parts are
    joined by newlines and an image part becomes `placeholder`, as vLLM does for such
    templates. "openai" (templates that loop over the content parts, as Qwen-VL's do): the
    parts stay a list, `{"type": "text", "text": ...}` and `{"type": "image"}`, so the template
    itself places the image tokens exactly as HF's processor renders the same messages."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat template content format must be one of {CONTENT_FORMATS}")
    conversation: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        d = dict(m)
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                field = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    raise ValueError(f"{field}: a content part must be an object")
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                if kind not in ("image_url", "image_pil"):
                    raise ValueError(
                        f"{field}: unsupported content part type {kind!r} (text, image_url)"
                    )
                if placeholder is None:
                    raise ValueError(f"{field}: this model takes no images (only text parts)")
                if kind == "image_pil":
                    images.append(part.get("image_pil"))
                else:
                    ref = part.get("image_url")
                    url = ref.get("url") if isinstance(ref, dict) else ref
                    if not isinstance(url, str):
                        raise ValueError(f"{field}.image_url: expected {{'url': '...'}}")
                    if url.startswith(("http://", "https://")):
                        images.append(_fetch(url, f"{field}.image_url", allowed_domains))
                    elif url.startswith("data:"):
                        images.append(url)
                    else:
                        raise ValueError(
                            f"{field}.image_url: expected a base64 data URL "
                            "(data:image/...;base64,...)"
                        )
                texts.append(placeholder)
                parts.append({"type": "image"})
            d["content"] = parts if content_format == "openai" else "\n".join(texts)
        elif content is None:
            d["content"] = ""
        conversation.append(d)
    return conversation, images


@functools.lru_cache(maxsize=64)
def detect_content_format(template: str | None) -> str:
    """ "openai" when the chat template loops over a message's content (it renders list
    content parts itself), else "string". Read from the template's syntax tree, never by
    running it, so it is safe for request-supplied templates too."""
    if not template:
        return "string"
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # rendering will report the error

    def is_content(node: nodes.Node) -> bool:
        # message.content / message["content"] (the loop variable's name does not matter).
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return False

    # Names bound to a message's content ({% set content = message.content %}).
    aliases = {
        a.target.name
        for a in tree.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and is_content(a.node)
    }
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return "openai"
    return "string"


def resolve_content_format(value: str, template: str | None) -> str:
    """--chat-template-content-format: "auto" detects it from the template in use."""
    if value == "auto":
        return detect_content_format(template)
    if value not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be 'auto', 'string' or 'openai', got {value!r}"
        )
    return value


def template_text(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template text (its "default" one when it has several)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None
