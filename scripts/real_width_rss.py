#!/usr/bin/env python3
"""Peak resident memory of the engine loading a real-width Qwen3-Omni thinker, against the file.

Writes (once, into DIR) a 2-layer bf16 checkpoint at the release's widths (hidden 2048, 32
heads of 128 over 4 KV heads, 128 experts of 768 top-8, vocabulary 151936, untied lm_head):
about 3.7 GB of seeded random weights, streamed to disk tensor by tensor. Then runs
``omniprefix generate`` on it (one 12-token prompt, 2 tokens) and reads the child's peak RSS
(``wait4``'s ``ru_maxrss``). Prints one JSON line: the file's bytes, the peak, their ratio and
the machine's CPU flags that matter.

    python3 scripts/real_width_rss.py [--dir DIR] [--bin target/release/omniprefix]

Needs numpy only. The checkpoint is kept in DIR (default /tmp/omniprefix-real-width) for reruns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, MOE_INTER = 128, 8, 768
VOCAB, LAYERS = 151936, 2


def text_config() -> dict:
    return {
        "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "intermediate_size": 768, "moe_intermediate_size": MOE_INTER,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "hidden_act": "silu",
        "attention_bias": False, "model_type": "qwen3_omni_moe_text",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                            "interleaved": True, "mrope_interleaved": True},
    }


def config() -> dict:
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
        "enable_audio_output": False,
        "thinker_config": {
            "model_type": "qwen3_omni_moe_thinker", "tie_word_embeddings": False, "text_config": text_config(),
            "audio_token_id": 151646, "image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653,
            "audio_start_token_id": 151669, "audio_end_token_id": 151670, "position_id_per_seconds": 13,
        },
    }


def tensors() -> list[tuple[str, list[int]]]:
    """Every thinker tensor's name and shape, in file order."""
    out = [("thinker.model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(LAYERS):
        p = f"thinker.model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", [HIDDEN]), (f"{p}.post_attention_layernorm.weight", [HIDDEN]),
                (f"{p}.self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN]),
                (f"{p}.self_attn.k_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN]),
                (f"{p}.self_attn.v_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN]),
                (f"{p}.self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM]),
                (f"{p}.self_attn.q_norm.weight", [HEAD_DIM]), (f"{p}.self_attn.k_norm.weight", [HEAD_DIM]),
                (f"{p}.mlp.gate.weight", [EXPERTS, HIDDEN])]
        for e in range(EXPERTS):
            out += [(f"{p}.mlp.experts.{e}.gate_proj.weight", [MOE_INTER, HIDDEN]),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", [MOE_INTER, HIDDEN]),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", [HIDDEN, MOE_INTER])]
    out += [("thinker.model.norm.weight", [HIDDEN]), ("thinker.lm_head.weight", [VOCAB, HIDDEN])]
    return out


def bf16(rng: np.random.Generator, shape: list[int], scale: float) -> bytes:
    """Seeded normal values rounded to bf16 (the high half of each f32), little-endian."""
    if len(shape) == 1:
        values = np.ones(shape, np.float32)
    else:
        values = rng.standard_normal(shape, dtype=np.float32) * scale
    return (values.view(np.uint32) >> 16).astype("<u2").tobytes()


def write_checkpoint(out: Path) -> int:
    """The checkpoint in ``out``, written unless already complete; returns the file's size."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    listing = tensors()
    header, offset = {}, 0
    for name, shape in listing:
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    total = 8 + len(head) + offset
    if not (path.is_file() and path.stat().st_size == total):
        rng = np.random.default_rng(0)
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, shape in listing:
                f.write(bf16(rng, shape, 0.02))
        partial.rename(path)
    (out / "config.json").write_text(json.dumps(config(), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645]}))
    return total


def cpu_flags() -> list[str]:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in set(flags) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/omniprefix-real-width"))
    p.add_argument("--bin", default=os.environ.get("OMNIPREFIX_BIN", "target/release/omniprefix"))
    args = p.parse_args()
    file_bytes = write_checkpoint(args.dir)
    request = args.dir / "request.json"
    request.write_text(json.dumps({"segments": [{"text": list(range(100, 112))}]}))
    cmd = [args.bin, "generate", "--model", str(args.dir), "--request", str(request), "--max-tokens", "2", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kib <= before:
        print("warning: an earlier child had a larger peak", file=sys.stderr)
    report = {"file_bytes": file_bytes, "peak_rss_bytes": peak_kib * 1024,
              "peak_over_file": round(peak_kib * 1024 / file_bytes, 3), "cpu": cpu_flags(),
              "bin": args.bin, "generate": json.loads(done.stdout.splitlines()[-1])}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
