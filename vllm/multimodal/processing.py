# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Turning a prompt's images into engine inputs (Qwen3.5 / Qwen3-VL layout).

Each image of `multi_modal_data["image"]` (a PIL image, raw bytes, or a base64 data URL) is
checked (decodable, non-empty, within the size limits), run through the checkpoint's own image
processor (transformers' AutoImageProcessor on the model folder, never the hub), and its single
`<|image_pad|>` placeholder in the prompt is expanded to one token per merged patch group. The
multimodal rotary positions follow transformers' get_rope_index: text runs advance all three
axes by one per token; an image's run gets (start, start + row, start + col) over its merged
grid and advances the position by max(rows, cols)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

import numpy as np

from vllm.multimodal.inputs import MultiModalFeature, MultiModalInputs

# Largest accepted image side and area (pixels) before any resizing: a decompression bomb or a
# huge image is refused at the edge, never handed to a stage.
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 8192 * 8192


def _bad(msg: str) -> ValueError:
    return ValueError(f"multi_modal_data.image: {msg}")


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URL (ValueError otherwise)."""
    if not url.startswith("data:"):
        raise _bad("only base64 data URLs (data:image/...;base64,...) are accepted")
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad("a data URL must be base64-encoded (data:image/...;base64,...)")
    if not head[5:].startswith("image/"):
        raise _bad(f"the data URL's media type {head[5:-7]!r} is not an image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(f"the data URL's base64 payload does not decode ({e})") from None


def load_image(item: Any):
    """A checked RGB PIL image from a PIL image, bytes or a data URL."""
    from PIL import Image

    image: Image.Image
    if isinstance(item, str):
        item = decode_data_url(item)
    if isinstance(item, (bytes, bytearray)):
        if not item:
            raise _bad("the image is empty (0 bytes)")
        try:
            with Image.open(io.BytesIO(item)) as probe:
                size = probe.size
                _check_size(size)
                probe.verify()
            image = Image.open(io.BytesIO(item))
            image.load()
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for corrupt data
            raise _bad(f"the image cannot be decoded ({type(e).__name__}: {e})") from None
    elif isinstance(item, Image.Image):
        image = item
    else:
        raise _bad(f"expected a PIL image, bytes or a data URL, got {type(item).__name__}")
    _check_size(image.size)
    return image.convert("RGB") if image.mode != "RGB" else image


def _check_size(size: tuple[int, int]) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise _bad(f"the image has zero size ({w}x{h})")
    if w > MAX_IMAGE_SIDE or h > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
        raise _bad(
            f"the image is {w}x{h} pixels; the limit is {MAX_IMAGE_SIDE} per side and "
            f"{MAX_IMAGE_PIXELS} pixels"
        )


def image_hash(image) -> str:
    """Content hash of an RGB image (size and pixels): equal images hash equal whatever their
    encoding; different pixels never share prefix-cache blocks."""
    h = hashlib.sha256()
    h.update(f"image:{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def mrope_positions(
    ids: list[int], features: list[MultiModalFeature], merge: int
) -> tuple[np.ndarray, int]:
    """[3, len(ids)] positions and the delta of the positions after the prompt."""
    n = len(ids)
    out = np.zeros((3, n), dtype=np.int64)
    pos = 0
    cursor = 0
    for f in sorted(features, key=lambda f: f.offset):
        text = f.offset - cursor
        out[:, cursor : f.offset] = np.arange(pos, pos + text)
        pos += text
        t, h, w = f.grid_thw[0], f.grid_thw[1] // merge, f.grid_thw[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[0, f.offset : f.offset + f.length] = tt.reshape(-1) + pos
        out[1, f.offset : f.offset + f.length] = hh.reshape(-1) + pos
        out[2, f.offset : f.offset + f.length] = ww.reshape(-1) + pos
        pos += max(h, w)
        cursor = f.offset + f.length
    out[:, cursor:] = np.arange(pos, pos + n - cursor)
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta


class ImageProcessor:
    """The model's image inputs: placeholder token, its own image processor, the limits."""

    def __init__(
        self, model_path: str, hf_config: Any, limit_per_prompt: int, tokenizer: Any = None
    ) -> None:
        from transformers import AutoImageProcessor

        self.image_token_id = int(hf_config.image_token_id)
        # What a chat message's image part becomes in the prompt text.
        self.placeholder: str | None = None
        if tokenizer is not None:
            ids = [
                getattr(hf_config, "vision_start_token_id", None),
                self.image_token_id,
                getattr(hf_config, "vision_end_token_id", None),
            ]
            toks = [tokenizer.convert_ids_to_tokens(int(t)) for t in ids if t is not None]
            # A tokenizer without the vision tokens (a text checkpoint in the VL layout) has no
            # placeholder text: its chat messages cannot carry images.
            if all(isinstance(t, str) for t in toks):
                self.placeholder = "".join(toks)
        vision = hf_config.vision_config
        self.merge = int(vision.spatial_merge_size)
        self.limit = limit_per_prompt
        try:
            self.processor = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"the multimodal model {model_path!r} has no usable image processor "
                f"(preprocessor_config.json): {e}"
            ) from None

    def process(self, ids: list[int], data: Any) -> tuple[list[int], MultiModalInputs]:
        """Expanded prompt ids and the prompt's multimodal inputs (ValueError naming what is
        wrong: unknown modality, too many images, placeholder count, a bad image)."""
        if not isinstance(data, dict):
            raise TypeError(f"multi_modal_data must be a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modalities {unknown} (only 'image')")
        items = data.get("image")
        if items is None:
            items = []
        elif not isinstance(items, (list, tuple)):
            items = [items]
        if len(items) > self.limit:
            raise ValueError(
                f"multi_modal_data.image: {len(items)} images exceed the limit of {self.limit} "
                "per prompt (--limit-mm-per-prompt)"
            )
        images = [load_image(x) for x in items]
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"multi_modal_data.image: the prompt has {len(slots)} image placeholders "
                f"(<|image_pad|>, id {self.image_token_id}) for {len(images)} images"
            )
        features: list[MultiModalFeature] = []
        new_ids: list[int] = []
        cursor = 0
        for slot, image in zip(slots, images):
            try:
                out = self.processor(images=[image], return_tensors="np")
            except Exception as e:  # noqa: BLE001 - the processor's own checks (aspect ratio...)
                raise _bad(f"the image processor refused the image ({e})") from None
            grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
            length = grid[0] * grid[1] * grid[2] // self.merge**2
            new_ids.extend(ids[cursor:slot])
            features.append(
                MultiModalFeature(
                    modality="image",
                    identifier=image_hash(image),
                    offset=len(new_ids),
                    length=length,
                    pixel_values=np.asarray(out["pixel_values"], dtype=np.float32),
                    grid_thw=(grid[0], grid[1], grid[2]),
                )
            )
            new_ids.extend([self.image_token_id] * length)
            cursor = slot + 1
        new_ids.extend(ids[cursor:])
        positions, delta = mrope_positions(new_ids, features, self.merge)
        return new_ids, MultiModalInputs(features, positions, delta)
