"""A thinker stage streaming hidden states into a stand-in talker, over a 3-round conversation.

The thinker is an ``omniprefix.Engine`` on the tiny Qwen3-Omni thinker checkpoint of this
repository (``fixtures/tiny/omni_thinker``; ``--random`` uses random weights of the same
shape instead). Each round re-sends the whole history (earlier user turns, their images and
the thinker's replies) plus a new user turn, the way a chat server does, and streams the reply:
every step yields the sampled token and that position's hidden rows, which a talker consumes
as they arrive. The prefix cache makes every round after the first reuse every position that
already ran, and the hidden rows it returns are the same as without the cache.

    python python/examples/thinker_stage.py [--model DIR | --random] [--max-tokens N]

Per round it prints ``prompt_len``, ``num_cached_tokens``, the tokens, and the time to the
first token (measured here around the stream, and as the engine reports it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import omniprefix

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_MODEL = REPO / "fixtures" / "tiny" / "omni_thinker"


class Talker:
    """Stand-in for a talker stage (Qwen3-Omni's speech decoder reads the thinker's hidden states).

    It consumes one ``(token, rows)`` per step: the thinker's embedding row (``hidden.0``) and
    final hidden state (``hidden.final``) at the position that produced the token, projected by
    a fixed random matrix to the logits of a 64-entry codebook, of which it keeps the argmax.
    """

    def __init__(self, hidden: int, codebook: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.projection = (rng.standard_normal((2 * hidden, codebook)) / np.sqrt(2 * hidden)).astype(np.float32)
        self.codes: list[int] = []

    def consume(self, token: int, rows: dict[str, np.ndarray]) -> int:
        features = np.concatenate([rows["hidden.0"], rows["hidden.final"]])
        code = int(np.argmax(features @ self.projection))
        self.codes.append(code)
        return code


class VisionEncoder:
    """Stand-in for a vision encoder: a fixed random projection of the image's mean colour per
    merged patch. The engine calls it only when an image is not in its encoder cache."""

    def __init__(self, hidden: int, seed: int = 1):
        self.hidden = hidden
        self.weights = np.random.default_rng(seed).standard_normal((3, hidden)).astype(np.float32)
        self.calls = 0

    def __call__(self, item: omniprefix.Item) -> np.ndarray:
        self.calls += 1
        pixels = np.asarray(item.content, dtype=np.float32) / 255.0  # [H, W, 3]
        cells = np.array_split(pixels.reshape(-1, 3), item.num_tokens)
        return np.stack([cell.mean(axis=0) @ self.weights for cell in cells]).astype(np.float32)


def open_thinker(args) -> omniprefix.Engine:
    # 16-token blocks; the talker reads the embedding row and the final hidden state.
    if args.random:
        with open(DEFAULT_MODEL / "config.json") as f:
            return omniprefix.Engine.random(json.load(f), args.seed, block_size=16, capture=[0, "final"])
    return omniprefix.Engine.from_dir(str(args.model), block_size=16, capture=[0, "final"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint folder")
    parser.add_argument("--random", action="store_true", help="random weights of the tiny Omni thinker's shape")
    parser.add_argument("--max-tokens", type=int, default=12, help="reply length per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    thinker = open_thinker(args)
    encoder = VisionEncoder(thinker.hidden_size)
    talker = Talker(thinker.hidden_size)

    # The tiny checkpoint's special ids (its config.json); text ids are random below them.
    vision_start, image_pad, vision_end = 250, 254, 251
    # Placeholder and wrapper ids are never text: a reply that samples one ends there (the tiny
    # random checkpoint has no eos), like an end-of-turn token.
    specials = list(range(249, 256))
    rng = np.random.default_rng(args.seed)

    def text(n: int) -> list[int]:
        return rng.integers(0, 240, size=n).tolist()

    def image_turn(seed: int):
        pixels = np.random.default_rng(100 + seed).integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
        item = omniprefix.Item("image", pixels, {"kind": "image", "grid_thw": [1, 4, 6]})
        return text(5) + [vision_start, image_pad, vision_end] + text(4), [item]

    system = text(24)
    turn1, items1 = image_turn(1)
    turns = [
        (turn1, items1),  # round 1: a question about an image
        (text(9), []),  # round 2: a text follow-up
        image_turn(2),  # round 3: another image
    ]

    history: list[int] = list(system)
    items: list[omniprefix.Item] = []
    previous_ran = None
    for round_no, (turn, new_items) in enumerate(turns, start=1):
        prompt = history + turn
        items = items + new_items  # every image of the history is sent again
        start = time.perf_counter()
        stream = thinker.stream(
            prompt, items, max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=round_no, stop=specials, encoder=encoder
        )
        ttft_ms = None
        for token, rows in stream:
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - start) * 1000.0
            talker.consume(token, rows)
        reply = stream.generation  # the finished Generation, once the stream is exhausted
        assert reply is not None
        tokens = reply.tokens
        expected = "-" if previous_ran is None else str(previous_ran)  # every position the previous round ran
        print(
            f"round {round_no}: prompt_len={reply.prompt_len} num_cached_tokens={reply.num_cached_tokens} "
            f"expected_cached={expected} tokens={tokens} finish={reply.finish_reason} ttft_ms={ttft_ms:.2f} "
            f"engine_ttft_ms={reply.timings['ttft']:.2f} talker_codes={talker.codes[-len(tokens):]}"
        )
        # The history keeps the reply; a trailing stop id is not text and is dropped. Either way
        # every position that ran (the prompt and all tokens but the last) is a prefix of the next round.
        # (Items stay one placeholder each in the history: the engine expands them again.)
        history = prompt + (tokens[:-1] if reply.finish_reason == "stop" else tokens)
        previous_ran = reply.prompt_len + len(tokens) - 1

    stats = thinker.stats()
    print(
        f"summary: encoder_calls={encoder.calls} talker_codes={len(talker.codes)} "
        f"hit_tokens={stats['hit_tokens']} encoder_cache_hits={stats['encoder_cache_hits']}"
    )


if __name__ == "__main__":
    main()
