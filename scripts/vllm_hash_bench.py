#!/usr/bin/env python3
"""vLLM's own multimodal hashing against ``multi_modal_uuids`` from ``omniprefix.vllm_uuids``.

Workload: the Qwen3-Omni ``mixed`` request of ``fixtures/qwen3_omni.json`` (audio, image, video in
that order; 60 MB of raw media): seeded random content of exactly the shapes and dtypes vLLM
hashes (``items.<modality>.raw_input_hashed_by_vllm``): a 30 s 16 kHz float32 waveform
``(480000,)``, a 1280x720 RGB ``PIL.Image`` (vLLM hashes ``np.asarray(img)`` + mode), and
``(20, 720, 1280, 3)`` uint8 frames (the offline API's ndarray video).

Variants, timed in the same process, interleaved, ``--runs`` times (median, p10, p90):

* ``a_vllm``: vLLM hashing the items of a request WITHOUT uuids.
* ``b_uuids``: the same request WITH ``multi_modal_uuids``: ``np.asarray`` of the PIL image (the
  Item needs an array), building three ``omniprefix.Item`` (layouts from the fixture),
  ``omniprefix.vllm_uuids(items, key=...)``, ``parse_mm_uuids`` and vLLM's hashing of the uuid
  path, all inside the timer.
* ``c_uuids_t2``: as ``b_uuids`` with ``threads=2``.

The vLLM code called is the installed vLLM's own (no copy): the request's data go through the
Qwen3-Omni thinker's data parser (``Qwen2_5OmniThinkerMultiModalDataParser`` with what
``Qwen3OmniMoeThinkerProcessingInfo.get_data_parser`` gives it: ``spatial_merge_size=2``,
``target_sr=16000``, ``target_channels=1``), then the timer wraps the real
``ProcessorInputs.get_mm_hashes`` (vllm/multimodal/processing/inputs.py), which is all that
``BaseMultiModalProcessor._get_mm_hashes`` does. In vLLM 0.34.0
(vllm/multimodal/processing/processor.py):

    def _get_mm_hashes(self, inputs: ProcessorInputs) -> MultiModalHashes:
        \"\"\"Get each item's processor and encoder cache identity.\"\"\"
        return inputs.get_mm_hashes(
            self.info.model_id,
            self.info.ctx.get_mm_config().mm_hasher_algorithm,
        )

and in ``ProcessorInputs.get_mm_hashes`` (vllm/multimodal/processing/inputs.py), per item:

    if uuid_item is None or has_hash_factors:
        item = uuid_item if uuid_item is not None else item
        hashes.append(
            hasher.hash_kwargs(
                hash_algorithm,
                model_id=model_id,
                **{modality: item},
                **hash_factors,
            )
        )
    else:
        # If there are no extra kwargs, use the client-provided UUID.
        hashes.append(uuid_item)

Building a real processor object (``BaseMultiModalProcessor``) needs the model's HF config and
processor files (a download), so the script builds ``ProcessorInputs`` directly with the parsed
items, ``hf_processor_mm_kwargs={}`` (a request without ``mm_processor_kwargs``) and
``mm_hasher_algorithm`` at its default, ``"blake3"``. Parsing the request's data is common to both
paths and is outside the timers.

It also asserts what docs/vllm.md claims of vLLM's behaviour with uuids: two requests with equal
uuids get equal mm hashes (with and without processor kwargs), different uuids different hashes,
and vLLM does not look at the media behind a uuid.

Usage: python scripts/vllm_hash_bench.py [--runs 21] [--json docs/reports/vllm_hash_bench.json]
(scripts/vllm_hash_bench.sh makes the venv and runs it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from cpuinfo import cpu_model_and_flags

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "qwen3_omni.json"
#: A fixed fleet key (any 32 bytes); the benchmark's numbers do not depend on it.
KEY = bytes(range(32))


def load_workload() -> tuple[dict, list[str]]:
    fixture = json.loads(FIXTURE.read_text())
    return fixture, list(fixture["mixed"]["order"])


def make_media(fixture: dict, order: list[str], seed: int) -> dict[str, np.ndarray]:
    """Seeded random arrays of exactly the shapes/dtypes of ``raw_input_hashed_by_vllm``."""
    rng = np.random.default_rng(seed)
    media = {}
    for modality in order:
        raw = fixture["items"][modality]["raw_input_hashed_by_vllm"]
        shape, dtype = tuple(raw["shape"]), np.dtype(raw["dtype"])
        if dtype == np.uint8:
            array = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            array = (rng.standard_normal(shape) * 0.1).astype(dtype)
        assert array.nbytes == raw["nbytes"], (modality, array.nbytes, raw["nbytes"])
        media[modality] = array
    total = sum(a.nbytes for a in media.values())
    assert total == fixture["mixed"]["raw_bytes_hashed_by_vllm"], total
    return media


def layouts(fixture: dict) -> dict[str, dict]:
    """omniprefix layouts of the fixture's items (grids before the 2x2 merge)."""
    items = fixture["items"]
    video = items["video"]
    frames = video["raw_input_hashed_by_vllm"]["shape"][0]
    grid_t = video["processed"]["video_grid_thw"][0]
    fps = 2.0  # "10 s 1280x720 video sampled at 2 fps -> 20 frames"
    return {
        "image": {"kind": "image", "grid_thw": items["image"]["processed"]["image_grid_thw"]},
        "audio": {"kind": "audio", "mel_frames": items["audio"]["processed"]["mel_frames"]},
        "video": {
            "kind": "video",
            "grid_thw": video["processed"]["video_grid_thw"],
            "seconds_per_grid": frames / fps / grid_t,
        },
    }


def vllm_parser():
    """The Qwen3-Omni thinker's data parser, as its ProcessingInfo.get_data_parser builds it."""
    from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerMultiModalDataParser

    return Qwen2_5OmniThinkerMultiModalDataParser(spatial_merge_size=2, target_sr=16000, target_channels=1)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def machine() -> dict:
    cpu, flags = cpu_model_and_flags()
    return {
        "cpu": cpu if cpu != "unknown" else platform.processor(),
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict:
    out = {}
    for dist in ["vllm", "omniprefix", "torch", "numpy", "blake3", "pillow"]:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["omniprefix_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["omniprefix_commit"] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-id", default="Qwen/Qwen3-Omni-30B-A3B-Instruct")
    ap.add_argument("--no-threads", action="store_true", help="skip variant (c), threads=2")
    ap.add_argument("--json", type=Path, help="write the report here (e.g. docs/reports/vllm_hash_bench.json)")
    args = ap.parse_args()

    import vllm  # noqa: F401  (the version check below reads its metadata)
    from PIL import Image
    from vllm.multimodal.parse import parse_mm_uuids
    from vllm.multimodal.processing.inputs import ProcessorInputs

    import omniprefix

    fixture, order = load_workload()
    media = make_media(fixture, order, args.seed)
    layout = layouts(fixture)
    prompt = list(fixture["mixed"]["token_ids_unexpanded"])
    algorithm = "blake3"  # MultiModalConfig.mm_hasher_algorithm's default in 0.34.0
    model_id = args.model_id
    parser = vllm_parser()

    def request_data(arrays: dict[str, np.ndarray]) -> dict:
        """multi_modal_data as a user sends it: waveform, PIL image, ndarray frames."""
        data = {}
        for modality in order:
            a = arrays[modality]
            data[modality] = Image.fromarray(a, "RGB") if modality == "image" else a
        return data

    def items_of(data: dict, params: dict | None = None) -> list:
        """omniprefix Items of the request's media, in its order (the image as an array)."""
        out = []
        for modality in order:
            content = np.asarray(data[modality]) if modality == "image" else data[modality]
            out.append(omniprefix.Item(modality, content, layout[modality], params=params))
        return out

    def vllm_hashes(mm_items, mm_uuids=None, kwargs=None) -> dict[str, list[str]]:
        inputs = ProcessorInputs(
            prompt=prompt,
            mm_data_items=mm_items,
            mm_uuid_items=None if mm_uuids is None else parse_mm_uuids(mm_uuids),
            hf_processor_mm_kwargs=kwargs or {},
        )
        return inputs.get_mm_hashes(model_id, algorithm)

    data = request_data(media)
    mm_items = parser.parse_mm_data(data)
    assert list(mm_items) == order, list(mm_items)

    # ---- what we claim of vLLM's behaviour with uuids (asserted, not assumed)
    uuids = omniprefix.vllm_uuids(items_of(data), key=KEY)
    assert list(uuids) == order and all(len(uuids[m]) == 1 and len(uuids[m][0]) == 64 for m in order)
    same = {m: np.array(media[m], order="F") for m in order}  # equal values, other strides, other objects
    same_items = parser.parse_mm_data(request_data(same))
    same_uuids = omniprefix.vllm_uuids(items_of(request_data(same)), key=KEY)
    assert same_uuids == uuids, "equal media, other strides: equal uuids"
    changed = {m: a.copy() for m, a in media.items()}
    changed["video"][19, 719, 1279, 2] ^= 1  # the last byte of the last frame
    changed_items = parser.parse_mm_data(request_data(changed))
    changed_uuids = omniprefix.vllm_uuids(items_of(request_data(changed)), key=KEY)
    assert changed_uuids["video"] != uuids["video"] and changed_uuids["image"] == uuids["image"]

    h_uuids = vllm_hashes(mm_items, uuids)
    assert h_uuids == uuids, "no processor kwargs: vLLM uses the uuid itself as the mm hash"
    assert vllm_hashes(same_items, same_uuids) == h_uuids, "equal uuids -> equal mm hashes"
    h_changed = vllm_hashes(changed_items, changed_uuids)
    assert h_changed["video"] != h_uuids["video"] and h_changed["audio"] == h_uuids["audio"], "different uuids -> different"
    kwargs = {"fps": 2.0}
    hk = vllm_hashes(mm_items, uuids, kwargs)
    assert hk != h_uuids and hk == vllm_hashes(same_items, same_uuids, kwargs), "kwargs: hash(uuid + kwargs), equal for equal uuids"
    assert vllm_hashes(changed_items, changed_uuids, kwargs)["video"] != hk["video"]
    # vLLM trusts a uuid: the changed media under the old uuids get the old hashes (no validation).
    assert vllm_hashes(changed_items, uuids) == h_uuids, "vLLM does not look at the media behind a uuid"
    h_plain = vllm_hashes(mm_items)
    assert h_plain == vllm_hashes(same_items) and h_plain["video"] != vllm_hashes(changed_items)["video"]
    assert all(len(h) == 64 for hs in h_plain.values() for h in hs)
    checks = [
        "equal media in other strides -> equal uuids -> equal vLLM mm hashes",
        "no mm_processor_kwargs: vLLM's mm hash is the uuid itself",
        "one byte of the video changed -> its uuid and vLLM mm hash change, the others' do not",
        "with mm_processor_kwargs: vLLM hashes uuid + kwargs; equal for equal uuids, different for different",
        "changed media sent under the old uuids -> vLLM gives the old mm hashes (it trusts the uuid)",
    ]

    # ---- timing
    machine_info = machine()
    def run_a() -> None:
        vllm_hashes(mm_items)

    def run_uuids(threads: int):
        def run() -> None:
            items = items_of(data)
            u = omniprefix.vllm_uuids(items, key=KEY, threads=threads)
            vllm_hashes(mm_items, u)

        return run

    def run_fp_only() -> None:
        omniprefix.vllm_uuids(items_of(data), key=KEY)

    variants = {"a_vllm": run_a, "b_uuids": run_uuids(1)}
    if not args.no_threads:
        variants["c_uuids_t2"] = run_uuids(2)
    variants["b_fingerprint_only"] = run_fp_only
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.runs):
        for name, fn in variants.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            dt = (time.perf_counter() - t0) * 1e3
            if i >= args.warmup:
                times[name].append(dt)

    machine_info["loadavg_at_end"] = list(os.getloadavg())
    stats = {
        name: {
            "median_ms": statistics.median(ts),
            "p10_ms": percentile(ts, 10),
            "p90_ms": percentile(ts, 90),
            "runs": len(ts),
        }
        for name, ts in times.items()
    }
    a = stats["a_vllm"]["median_ms"]
    for name, s in stats.items():
        s["ratio_to_a"] = s["median_ms"] / a
        # The same ratio run by run (variants are interleaved), less sensitive to load drift.
        s["paired_ratio_median"] = statistics.median(t / ta for t, ta in zip(times[name], times["a_vllm"]))
    target = 0.35
    labels = {
        "a_vllm": "(a) vLLM hashes the media (no uuids)",
        "b_uuids": "(b) omniprefix.vllm_uuids + vLLM, threads=1",
        "c_uuids_t2": "(c) omniprefix.vllm_uuids + vLLM, threads=2",
        "b_fingerprint_only": "    of which vllm_uuids alone, threads=1",
    }
    mb = fixture["mixed"]["raw_bytes_hashed_by_vllm"] / 1e6
    print(f"Qwen3-Omni mixed request: {mb:.1f} MB of media ({', '.join(order)}), {args.runs} runs, vllm {versions()['vllm']}")
    print(f"{'variant':<46} {'median ms':>10} {'p10':>8} {'p90':>8} {'/ (a)':>7}")
    for name, s in stats.items():
        print(f"{labels[name]:<46} {s['median_ms']:>10.2f} {s['p10_ms']:>8.2f} {s['p90_ms']:>8.2f} {s['ratio_to_a']:>7.3f}")
    ratio_b = stats["b_uuids"]["ratio_to_a"]
    verdict = "meets" if ratio_b <= target else "MISSES"
    paired = stats["b_uuids"]["paired_ratio_median"]
    print(f"(b)/(a) = {ratio_b:.3f} (median of per-run ratios {paired:.3f}): {verdict} the target <= {target}")
    for check in checks:
        print(f"checked: {check}")

    if args.json:
        report = {
            "bench": "vllm_hash_bench",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
            "workload": {
                "fixture": "fixtures/qwen3_omni.json#mixed",
                "order": order,
                "media_bytes": fixture["mixed"]["raw_bytes_hashed_by_vllm"],
                "shapes": {m: [list(media[m].shape), str(media[m].dtype)] for m in order},
                "image_as": "PIL.Image RGB",
                "seed": args.seed,
            },
            "vllm_path": {
                "called": "vllm.multimodal.processing.inputs.ProcessorInputs.get_mm_hashes(model_id, 'blake3')",
                "parser": "Qwen2_5OmniThinkerMultiModalDataParser(spatial_merge_size=2, target_sr=16000, target_channels=1)",
                "model_id": model_id,
                "hf_processor_mm_kwargs": {},
            },
            "versions": versions(),
            "machine": machine_info,
            "variants": stats,
            "ratio_b_over_a": ratio_b,
            "ratio_c_over_a": stats.get("c_uuids_t2", {}).get("ratio_to_a"),
            "target_b_over_a": target,
            "meets_target": ratio_b <= target,
            "checks": checks,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
