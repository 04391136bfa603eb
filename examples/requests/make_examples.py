#!/usr/bin/env python3
"""Writes the example requests for the tiny checkpoints in fixtures/tiny (the README's quick start).

    python3 examples/requests/make_examples.py

Standard library only (no numpy, no safetensors package), seeded, so it writes the same bytes on
every machine. Files, next to this script (the format: docs/request-format.md):

* text.json: text only, ids below 240 (every tiny checkpoint's vocabulary is 256 ids);
* image_text.json: text, an image, text, for fixtures/tiny/omni_thinker: `vision_start`, the image
  as one item segment (the engine expands it to the image's tokens), `vision_end`;
* image.safetensors: that image's tensors: `pixels` (u8 `[56, 84, 3]`, what the fingerprint covers)
  and `embeddings` (f32 `[6, 64]`, the stand-in encoder output: one row per image token, the
  checkpoint's hidden size).
"""

import json
import pathlib
import random
import struct

HERE = pathlib.Path(__file__).resolve().parent
SEED = 2026
HIDDEN = 64  # fixtures/tiny/omni_thinker: thinker_config.text_config.hidden_size
VISION_START, VISION_END = 250, 251  # its thinker_config.vision_{start,end}_token_id
GRID_THW = [1, 4, 6]  # patch grid before the 2x2 merge: 4 * 6 / 4 = 6 tokens
IMAGE_TOKENS = GRID_THW[0] * GRID_THW[1] * GRID_THW[2] // 4
PIXELS_HWC = [GRID_THW[1] * 14, GRID_THW[2] * 14, 3]  # 14-pixel patches


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """The safetensors layout: u64 LE header length, JSON header (padded to 8 bytes), the data."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data for _, _, data in tensors.values())


def write_json(name: str, segments: list[dict]) -> None:
    """One segment per line (an item's fields one per line), as docs/request-format.md shows them."""
    def segment(s: dict) -> str:
        if "item" not in s:
            return "    " + json.dumps(s)
        fields = ",\n".join(f"              {json.dumps(k)}: {json.dumps(v)}" for k, v in s["item"].items())
        return '    {"item": {' + fields.lstrip() + "}}"
    lines = ",\n".join(segment(s) for s in segments)
    (HERE / name).write_text('{\n  "segments": [\n' + lines + "\n  ]\n}\n")


def main() -> None:
    rng = random.Random(SEED)
    count = PIXELS_HWC[0] * PIXELS_HWC[1] * PIXELS_HWC[2]
    pixels = bytes(rng.randrange(256) for _ in range(count))
    rows = [rng.gauss(0.0, 1.0) for _ in range(IMAGE_TOKENS * HIDDEN)]
    (HERE / "image.safetensors").write_bytes(safetensors_bytes({
        "embeddings": ("F32", [IMAGE_TOKENS, HIDDEN], struct.pack(f"<{len(rows)}f", *rows)),
        "pixels": ("U8", PIXELS_HWC, pixels),
    }))

    system = [10, 11, 12, 13, 14, 15, 16, 17]
    write_json("text.json", [{"text": system + [30, 31, 32, 33]}])
    image = {
        "modality": "image",
        "layout": {"kind": "image", "grid_thw": GRID_THW},
        "content": {"file": "image.safetensors", "tensor": "pixels"},
        "embeddings": {"file": "image.safetensors", "tensor": "embeddings"},
    }
    write_json("image_text.json", [
        {"text": system + [VISION_START]},
        {"item": image},
        {"text": [VISION_END, 20, 21, 22, 23]},
    ])


if __name__ == "__main__":
    main()
