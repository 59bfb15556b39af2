# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""How a chat template reads message content ("string" or "openai", vLLM's
--chat-template-content-format), read from the template's syntax tree, and what image parts
become in each format."""

from __future__ import annotations

import pytest

from vllm.multimodal.chat import detect_content_format, resolve_content_format, split_images
from vllm.testing.qwen3_5_checkpoints import IMAGE_PLACEHOLDER, VL_CHAT_TEMPLATE

STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)
# The content bound to a name first, then looped over.
ALIAS_TEMPLATE = (
    "{% for m in messages %}{% set parts = m['content'] %}"
    "{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}"
)
# A loop over something derived from the content (its lines) is not a loop over parts.
SPLIT_TEMPLATE = (
    "{% for m in messages %}{% for line in m.content.split('\\n') %}{{ line }}{% endfor %}"
    "{% endfor %}"
)


@pytest.mark.parametrize(
    "template,want",
    [
        (VL_CHAT_TEMPLATE, "openai"),
        (ALIAS_TEMPLATE, "openai"),
        (STRING_TEMPLATE, "string"),
        (SPLIT_TEMPLATE, "string"),
        (None, "string"),
        ("{% for x in %}", "string"),  # a syntax error is reported when it renders
    ],
)
def test_detect_content_format(template, want):
    assert detect_content_format(template) == want


def test_resolve_content_format():
    assert resolve_content_format("auto", VL_CHAT_TEMPLATE) == "openai"
    assert resolve_content_format("string", VL_CHAT_TEMPLATE) == "string"
    assert resolve_content_format("openai", STRING_TEMPLATE) == "openai"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        resolve_content_format("parts", VL_CHAT_TEMPLATE)


def test_image_parts_in_each_format():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": "IMG"},
                {"type": "text", "text": "what?"},
            ],
        },
        {"role": "assistant", "content": "a cat"},
    ]
    conv, images = split_images(messages, IMAGE_PLACEHOLDER, None, "string")
    assert images == ["IMG"]
    assert conv[0]["content"] == IMAGE_PLACEHOLDER + "\nwhat?"
    conv, images = split_images(messages, IMAGE_PLACEHOLDER, None, "openai")
    assert images == ["IMG"]
    assert conv[0]["content"] == [{"type": "image"}, {"type": "text", "text": "what?"}]
    assert conv[1]["content"] == "a cat"  # string content passes through either way
    with pytest.raises(ValueError, match="content format"):
        split_images(messages, IMAGE_PLACEHOLDER, None, "parts")
