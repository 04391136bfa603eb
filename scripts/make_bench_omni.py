#!/usr/bin/env python3
"""A bench-size full Qwen3-Omni checkpoint (random weights) for `scripts/ttfa_http_bench.py --model`.

Why: the tiny `omni_audio` fixture is sized for parity tests. Its requests take 20-150 ms, most of
it fixed costs, and a reply's audio is ~17 ms, so the HTTP bench's ratios (caching on against off,
c=8 against c=1) measure noise and overheads. This checkpoint has `bench ttfa`'s sizes
(`cli/src/ttfa.rs`, `omni_configs(Size::Bench)`): a dense thinker 512 wide x 8 layers (8 / 4 heads
of 64, MLP 1536); a talker 256 x 4 layers with 128 experts top-6 (expert 96, shared 192) and a
1-layer code predictor over the release's codec (2048 codes x 16 groups, talker vocabulary 3072,
the release's codec and speaker ids); code2wav 256 x 2 sliding-window layers (window 72), decoder
384 with the release's upsampling (8,5,4,3)x(2,2): 1920 samples (80 ms) a frame. The tokenizer,
chat template, processor files and the towers' shapes are the tiny fixture's (the towers' outputs
widened to the thinker's 512), so the same media and prompts work.

Weights are transformers' own initialisation (seeded); nothing here is a reference, and nothing
is committed: the default output is `target/bench_omni/` (~400 MB, float32).

    python scripts/make_bench_omni.py [OUT]
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny" / "omni_audio"
SEED = 20261207
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json",
          "preprocessor_config.json")
CODEBOOK = 2048  # the release's; its codec ids sit at these offsets from it (see make_omni_audio.py)
THINKER = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
               intermediate_size=1536, decoder_sparse_step=1)
TALKER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=1, head_dim=64, vocab_size=CODEBOOK + 1024, num_experts=128,
              num_local_experts=128, num_experts_per_tok=6, moe_intermediate_size=96,
              shared_expert_intermediate_size=192, mlp_only_layers=[])
CODE_PREDICTOR = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=CODEBOOK, layer_types=["full_attention"])
CODE2WAV = dict(codebook_size=CODEBOOK, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=768, sliding_window=72, decoder_dim=384,
                upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2])
MROPE = {"mrope_section": [12, 10, 10]}  # head_dim 64: 32 frequencies (the release's split of 64)


def bench_config(tiny: dict) -> dict:
    cfg = copy.deepcopy(tiny)
    thinker = cfg["thinker_config"]
    text = thinker["text_config"]
    text.update(THINKER, mlp_only_layers=list(range(THINKER["num_hidden_layers"])))
    text["rope_parameters"].update(MROPE)
    hidden = THINKER["hidden_size"]
    thinker["audio_config"]["output_dim"] = hidden
    thinker["vision_config"]["out_hidden_size"] = hidden
    talker = cfg["talker_config"]
    talker["text_config"].update(TALKER)
    talker["text_config"]["rope_parameters"].update(MROPE)
    talker["code_predictor_config"].update(CODE_PREDICTOR)
    talker["thinker_hidden_size"] = hidden
    talker["accept_hidden_layer"] = 3  # as bench ttfa: a middle layer of the thinker's 8
    shift = CODEBOOK - tiny["code2wav_config"]["codebook_size"]
    for key in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id",
                "codec_think_eos_id"):
        talker[key] += shift
    talker["speaker_id"] = {name: i + shift for name, i in talker["speaker_id"].items()}
    cfg["code2wav_config"].update(CODE2WAV)
    return cfg


def main(argv: list[str]) -> None:
    out = Path(argv[1]) if len(argv) > 1 else ROOT / "target" / "bench_omni"
    torch.manual_seed(SEED)
    config = Qwen3OmniMoeConfig.from_dict(bench_config(json.loads((TINY / "config.json").read_text())))
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for name in COPIED:
        shutil.copyfile(TINY / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"make_bench_omni: {params / 1e6:.1f} M parameters in {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
