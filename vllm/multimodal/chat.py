# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Chat messages with image parts (OpenAI's `image_url`, and offline `image_pil`): each image
part becomes the model's image placeholder in the message text, and the image itself one item
of the prompt's multi_modal_data. Images come as base64 data URLs (or PIL images offline);
an http(s) URL is fetched only when its host is in the allowed media domains (off by default:
nothing is fetched from the network), else it is refused naming the field."""

from __future__ import annotations

import urllib.parse
import urllib.request
from typing import Any

# A fetched remote image is read up to this many bytes (then refused).
MAX_REMOTE_IMAGE_BYTES = 20 * 2**20
REMOTE_TIMEOUT_S = 10.0


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
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with text content, the images in order). Text parts are joined by newlines;
    an image part becomes `placeholder` (None: the model takes no images, which a message with
    an image part is refused for)."""
    conversation: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        d = dict(m)
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                field = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    raise ValueError(f"{field}: a content part must be an object")
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
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
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = ""
        conversation.append(d)
    return conversation, images
