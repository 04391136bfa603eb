#!/usr/bin/env python3
"""omniprefix's CPU backend against PyTorch + transformers on one checkpoint, in one run.

The checkpoint is saved by transformers itself (`Qwen3ForCausalLM.save_pretrained`,
seeded random weights) in the shape of `omniprefix bench ttft`'s embedded model:
hidden 512, 8 layers, 8 query / 4 KV heads, head_dim 64, SwiGLU intermediate 1536,
vocabulary 151936, tied embeddings, RoPE theta 10000, RMSNorm eps 1e-6. On text the
embedded model's interleaved M-RoPE is plain RoPE, so this is the same network.
`--lm-head untied` gives the checkpoint its own lm_head (as Qwen3-Omni's thinker has):
another 151936 x 512 matrix that every decode step reads.

Measured, each engine on the same number of threads (default 2: `torch.set_num_threads`
and OMP/MKL_NUM_THREADS for torch, `RAYON_NUM_THREADS` and `--threads` for omniprefix):

  (a) uncached prefill of PREFIX + SUFFIX tokens (default 2048 + 256);
  (b) cached prefill: SUFFIX new tokens over a PREFIX-token prefix already in the cache
      (transformers: the prefix's `past_key_values`, deep-copied per run outside the clock);
  (c) greedy decode at batch 1 after a PROMPT-token prompt (default 256): tokens/s over
      DECODE tokens (default 64), counted as omniprefix counts it (the tokens after the
      first over the time from the first to the last).

Prefill figures are the whole call: omniprefix's `timings.total` of `bench ttft
--workloads prefix_repetition_long --no-capture` (submit to output: preprocess, schedule,
forward, last-row logits), transformers' wall time of `model(ids, use_cache=True,
logits_to_keep=1)`. Decode: `omniprefix generate --json`'s `decode_tokens_per_s`, and
transformers `generate(do_sample=False, min_new_tokens=max_new_tokens=DECODE)` timed per
token by a streamer. Every figure is a median over `--runs` after an untimed warm-up run;
both engines decode the same prompts, and the report says how many greedy tokens agree.

Each engine's side runs in its own processes: (a)+(b) in one, (c) in another; the peak
resident memory (max RSS, from wait4) of each process is reported. Prompts are random
ids below 151643 (Qwen's regular BPE ids).

`--dtype bf16` saves the checkpoint in bf16: transformers then runs in bf16 (weights and
activations), while omniprefix keeps the weight matrices in bf16 (`--dtype auto`, the
checkpoint's own), rounds each product's input to bf16 (`vdpbf16ps` where the CPU has
AVX512-BF16) and keeps everything else in f32, so greedy tokens need not agree. The machine
line names the CPU's flags and the build omniprefix ran (`omniprefix cpu-info`).

Setup: without `--venv` a venv at target/torch-venv is created if missing and torch,
transformers and safetensors are installed into it from PyPI (the Linux torch wheel pulls
the CUDA libraries; only the CPU is used). `--venv PATH` uses (or creates) that venv. The
script re-runs itself under the venv's interpreter.

Usage: python3 scripts/compare_torch.py [--venv PATH] [--omniprefix BIN] [--runs N]
       [--threads N] [--dtype f32|bf16] [--lm-head tied|untied] [--markdown] [--json FILE]
Without `--omniprefix` it runs `cargo build --release -p omniprefix-cli` and uses
$CARGO_TARGET_DIR/release/omniprefix (target/release/omniprefix without it).
"""

import argparse
import json
import os
import pathlib
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from cpuinfo import cpu_model_and_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
IN_VENV = "OMNIPREFIX_COMPARE_TORCH_IN_VENV"

# The embedded bench model of cli/src/ttft/mod.rs (`bench_model`).
MODEL = dict(
    vocab_size=151_936,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    max_position_embeddings=32_768,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
)
TEXT_ID_LIMIT = 151_643


# ---------------------------------------------------------------- setup


def venv_python(venv):
    return venv / "bin" / "python"


def ensure_venv(venv):
    """A venv at `venv` with torch, transformers and safetensors (installed from PyPI when missing)."""
    py = venv_python(venv)
    if not py.exists():
        print(f"creating venv {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(py), "-c", "import torch, transformers, safetensors"], capture_output=True)
    if probe.returncode != 0:
        print(f"installing torch, transformers, safetensors into {venv} (PyPI)", file=sys.stderr)
        subprocess.run([str(py), "-m", "pip", "install", "--upgrade", "pip"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "torch", "transformers", "safetensors"], check=True)
    return py


def reexec_in_venv(args):
    venv = (args.venv or ROOT / "target" / "torch-venv").absolute()
    if os.environ.get(IN_VENV) == "1" or pathlib.Path(sys.prefix).resolve() == venv.resolve():
        return
    py = ensure_venv(venv)
    os.environ[IN_VENV] = "1"
    os.execv(str(py), [str(py), str(pathlib.Path(__file__).resolve()), *sys.argv[1:]])


def omniprefix_binary(args):
    if args.omniprefix:
        return args.omniprefix.resolve()
    subprocess.run(["cargo", "build", "--release", "-p", "omniprefix-cli"], cwd=ROOT, check=True)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    if not target.is_absolute():
        target = ROOT / target
    return target / "release" / "omniprefix"


def machine(binary):
    """The machine and the binary; torch's side comes from the save worker (the parent never imports torch)."""
    cpu, flags = cpu_model_and_flags()
    info = subprocess.run([str(binary), "cpu-info"], capture_output=True, text=True)
    # A binary older than `cpu-info` (to time an earlier commit) names no build.
    builds = json.loads(info.stdout) if info.returncode == 0 else {"simd_running": "unknown"}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "machine": platform.node(),
        "cpu": cpu,
        "cpu_flags": flags,
        "omniprefix_simd": builds["simd_running"],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "omniprefix": str(binary),
        "commit": commit,
    }


# ---------------------------------------------------------------- processes


def run_measured(cmd, env=None):
    """Runs `cmd`; returns (stdout, peak RSS in MiB) of that one process (wait4's rusage)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            sys.stderr.write(err.read().decode(errors="replace"))
            raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(map(str, cmd))}")
    return out.decode(), usage.ru_maxrss / 1024  # KiB on Linux


def thread_env(threads):
    env = dict(os.environ)
    for key in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[key] = str(threads)
    return env


def random_ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(TEXT_ID_LIMIT) for _ in range(n)]


def decode_prompt(seed, run, n):
    return random_ids(seed * 1000 + 500 + run, n)


# ---------------------------------------------------------------- checkpoint


def save_checkpoint(args):
    """Worker: saves the checkpoint; prints its size and torch's side of the machine as JSON."""
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**MODEL, "tie_word_embeddings": args.lm_head == "tied"})).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.to({"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]).save_pretrained(args.worker_ckpt)
    print(json.dumps({
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_mkldnn": torch.backends.mkldnn.is_available(),
        "transformers": transformers.__version__,
    }))


# ---------------------------------------------------------------- torch workers


def load_torch(ckpt, threads):
    import torch
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(threads)
    model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype="auto").eval()
    return torch, model


def torch_prefill(args):
    """(a) and (b) in one process; prints one JSON object."""
    import copy
    import inspect

    torch, model = load_torch(args.worker_ckpt, args.threads)
    prefix, suffix = args.prefix, args.suffix
    # transformers 5.24 renames `past_key_values` to `cache` (the old name warns until 5.40).
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    uncached, cached = [], []
    with torch.inference_mode():
        for run in range(1 + args.runs):
            ids = torch.tensor([random_ids(args.seed * 1000 + run, prefix + suffix)])
            t0 = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            shared = ids[:, :prefix]
            new = torch.tensor([random_ids(args.seed * 1000 + 100 + run, suffix)])
            out = model(shared, use_cache=True, logits_to_keep=1)
            past = copy.deepcopy(getattr(out, cache_name))
            del out
            t2 = time.perf_counter()
            model(new, use_cache=True, logits_to_keep=1, **{cache_name: past})
            t3 = time.perf_counter()
            if run > 0:  # run 0 is the warm-up
                uncached.append((t1 - t0) * 1e3)
                cached.append((t3 - t2) * 1e3)
    print(json.dumps({"uncached_ms": statistics.median(uncached), "cached_ms": statistics.median(cached),
                      "uncached_all_ms": uncached, "cached_all_ms": cached, "dtype": str(model.dtype)}))


def torch_decode(args):
    """(c): greedy generate of the same prompts omniprefix decodes; prints one JSON object."""
    from transformers.generation.streamers import BaseStreamer

    torch, model = load_torch(args.worker_ckpt, args.threads)

    class Clock(BaseStreamer):
        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if not self.prompt_seen:  # the first put is the prompt
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    rates, tokens = [], []
    n = args.decode_tokens
    with torch.inference_mode():
        for run in range(1 + args.runs):
            ids = torch.tensor([decode_prompt(args.seed, run, args.prompt)])
            clock = Clock()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n,
                                 max_new_tokens=n, eos_token_id=None, pad_token_id=0, streamer=clock)
            if run > 0:
                assert len(clock.times) == n, len(clock.times)
                rates.append((n - 1) / (clock.times[-1] - clock.times[0]))
                tokens.append(out[0, ids.shape[1]:].tolist())
    print(json.dumps({"decode_tokens_per_s": statistics.median(rates), "all_tokens_per_s": rates, "tokens": tokens}))


# ---------------------------------------------------------------- omniprefix


def omniprefix_prefill(binary, ckpt, args):
    cmd = [str(binary), "bench", "ttft", "--model", str(ckpt), "--workloads", "prefix_repetition_long",
           "--long-prefix", str(args.prefix), "--suffix", str(args.suffix), "--runs", str(args.runs), "--warmup", "1",
           "--no-capture", "--threads", str(args.threads), "--seed", str(args.seed), "--json"]
    out, rss = run_measured(cmd, thread_env(args.threads))
    report = json.loads(out.strip().splitlines()[-1])
    assert report["cached_tokens"] == args.prefix, report
    return report, rss, cmd


def omniprefix_decode(binary, ckpt, args, scratch):
    """One process per run, each with a warm-up request (another prompt) before the measured one."""
    rates, tokens, rss, cmd = [], [], 0.0, None
    blocks = 2 * (args.prompt + args.decode_tokens) // 16 + 8
    for run in range(1, 1 + args.runs):
        request, warm = scratch / f"decode_{run}.json", scratch / f"warm_{run}.json"
        request.write_text(json.dumps({"segments": [{"text": decode_prompt(args.seed, run, args.prompt)}]}))
        warm.write_text(json.dumps({"segments": [{"text": decode_prompt(args.seed, 0, args.prompt)}]}))
        cmd = [str(binary), "generate", "--model", str(ckpt), "--request", str(request), "--warm", str(warm),
               "--max-tokens", str(args.decode_tokens), "--ignore-eos", "--num-blocks", str(blocks), "--json"]
        out, peak = run_measured(cmd, thread_env(args.threads))
        report = json.loads(out.strip().splitlines()[-1])
        assert len(report["tokens"]) == args.decode_tokens, report
        rates.append(report["decode_tokens_per_s"])
        tokens.append(report["tokens"])
        rss = max(rss, peak)
    return {"decode_tokens_per_s": statistics.median(rates), "all_tokens_per_s": rates, "tokens": tokens}, rss, cmd


# ---------------------------------------------------------------- report


def agreeing_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rows_of(args, omni_pre, omni_pre_rss, torch_pre, torch_pre_rss, omni_dec, omni_dec_rss, torch_dec, torch_dec_rss):
    total = args.prefix + args.suffix
    common = {"dtype": args.dtype, "lm_head": args.lm_head, "threads": args.threads, "runs": args.runs}

    def prefill(part, what, tokens, omni_ms, torch_ms, omni_rss, torch_rss):
        return {"part": part, "what": what, "tokens": tokens, "omniprefix_ms": omni_ms, "torch_ms": torch_ms,
                "omniprefix_tok_s": tokens / omni_ms * 1e3, "torch_tok_s": tokens / torch_ms * 1e3,
                "ratio": omni_ms / torch_ms, "omniprefix_rss_mib": omni_rss, "torch_rss_mib": torch_rss, **common}

    agree = [agreeing_prefix(a, b) for a, b in zip(omni_dec["tokens"], torch_dec["tokens"])]
    o_rate, t_rate = omni_dec["decode_tokens_per_s"], torch_dec["decode_tokens_per_s"]
    return [
        prefill("a", f"uncached prefill, {total} tokens", total, omni_pre["ttft_uncached_ms"], torch_pre["uncached_ms"],
                omni_pre_rss, torch_pre_rss),
        prefill("b", f"cached prefill, {args.suffix} new over {args.prefix} cached", args.suffix,
                omni_pre["ttft_cached_ms"], torch_pre["cached_ms"], omni_pre_rss, torch_pre_rss),
        {"part": "c", "what": f"greedy decode, batch 1, {args.decode_tokens} tokens after a {args.prompt}-token prompt",
         "tokens": args.decode_tokens, "omniprefix_ms": 1e3 / o_rate, "torch_ms": 1e3 / t_rate,
         "omniprefix_tok_s": o_rate, "torch_tok_s": t_rate, "ratio": t_rate / o_rate,
         "omniprefix_rss_mib": omni_dec_rss, "torch_rss_mib": torch_dec_rss,
         "greedy_tokens_agreeing": agree, **common},
    ]


def table(rows, markdown):
    head = ["part", "what", "omniprefix ms", "torch ms", "omniprefix tok/s", "torch tok/s",
            "time omniprefix/torch", "RSS omniprefix MiB", "RSS torch MiB"]
    body = [[r["part"], r["what"], f"{r['omniprefix_ms']:.1f}", f"{r['torch_ms']:.1f}", f"{r['omniprefix_tok_s']:.0f}",
             f"{r['torch_tok_s']:.0f}", f"{r['ratio']:.3f}", f"{r['omniprefix_rss_mib']:.0f}", f"{r['torch_rss_mib']:.0f}"]
            for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(b) for b in body])


# ---------------------------------------------------------------- main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=pathlib.Path, help="venv with torch + transformers (default: target/torch-venv, created when missing)")
    parser.add_argument("--omniprefix", type=pathlib.Path, help="the omniprefix binary (default: cargo build --release)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per figure (medians), after one warm-up run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32", help="checkpoint dtype")
    parser.add_argument("--lm-head", choices=["tied", "untied"], default="tied", help="lm_head shared with the embedding table, or its own")
    parser.add_argument("--prefix", type=int, default=2048, help="cached prefix of (b); (a) is prefix + suffix")
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256, help="prompt of the decode run (c)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=pathlib.Path, help="save the checkpoint here (kept) instead of a temp dir")
    parser.add_argument("--json", type=pathlib.Path, help="write the rows (and a machine line) as JSON lines here")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--worker", choices=["save", "prefill", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-ckpt", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_tokens < 2 or args.runs < 1:
        parser.error("--decode-tokens must be at least 2 and --runs at least 1")
    return args


def main():
    args = parse_args()
    if args.worker:
        return {"save": save_checkpoint, "prefill": torch_prefill, "decode": torch_decode}[args.worker](args)
    reexec_in_venv(args)
    binary = omniprefix_binary(args)
    info = {**machine(binary), "threads": args.threads, "dtype": args.dtype, "lm_head": args.lm_head, "runs": args.runs}
    info["loadavg_before"] = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="compare_torch_") as tmp:
        scratch = pathlib.Path(tmp)
        ckpt = args.keep or scratch / "qwen3"
        worker = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker-ckpt", str(ckpt),
                  "--threads", str(args.threads), "--runs", str(args.runs), "--prefix", str(args.prefix),
                  "--suffix", str(args.suffix), "--prompt", str(args.prompt), "--dtype", args.dtype, "--lm-head", args.lm_head,
                  "--decode-tokens", str(args.decode_tokens), "--seed", str(args.seed)]
        env = thread_env(args.threads)
        # Each engine's side in its own process, spawned from this one, which never
        # imports torch: Linux carries the parent's peak RSS into a child's.
        out, _ = run_measured(worker + ["--worker", "save"], env)
        info.update(json.loads(out.strip().splitlines()[-1]))
        print("omniprefix: prefill ...", file=sys.stderr)
        omni_pre, omni_pre_rss, pre_cmd = omniprefix_prefill(binary, ckpt, args)
        print("torch: prefill ...", file=sys.stderr)
        out, torch_pre_rss = run_measured(worker + ["--worker", "prefill"], env)
        torch_pre = json.loads(out.strip().splitlines()[-1])
        print("omniprefix: decode ...", file=sys.stderr)
        omni_dec, omni_dec_rss, dec_cmd = omniprefix_decode(binary, ckpt, args, scratch)
        print("torch: decode ...", file=sys.stderr)
        out, torch_dec_rss = run_measured(worker + ["--worker", "decode"], env)
        torch_dec = json.loads(out.strip().splitlines()[-1])
        info["self_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Another busy process on the machine skews both sides (torch's OpenMP waits most).
    info["loadavg_after"] = os.getloadavg()
    rows = rows_of(args, omni_pre, omni_pre_rss, torch_pre, torch_pre_rss, omni_dec, omni_dec_rss, torch_dec, torch_dec_rss)
    info["omniprefix_commands"] = [" ".join(pre_cmd), " ".join(dec_cmd)]
    info["samples"] = {"omniprefix_decode_tok_s": omni_dec["all_tokens_per_s"], "torch_decode_tok_s": torch_dec["all_tokens_per_s"],
                       "torch_uncached_ms": torch_pre["uncached_all_ms"], "torch_cached_ms": torch_pre["cached_all_ms"]}
    print(f"{info['cpu']} ({info['usable_cpus']} of {info['logical_cpus']} CPUs usable; {' '.join(info['cpu_flags'])}), "
          f"{args.threads} threads each, omniprefix's {info['omniprefix_simd']} kernels; "
          f"torch {info['torch']} ({info['torch_cpu_capability']}), transformers {info['transformers']}; "
          f"checkpoint {args.dtype}, {args.lm_head} lm_head, {info['parameters'] / 1e6:.1f} M parameters; medians of {args.runs} runs")
    print(table(rows, args.markdown))
    agree = rows[2]["greedy_tokens_agreeing"]
    print(f"greedy tokens agreeing before the first difference, per decode run: {agree} of {args.decode_tokens}")
    load = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
    print(f"load average (1/5/15 min) before: {load(info['loadavg_before'])}, after: {load(info['loadavg_after'])}")
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in [*rows, info]))


if __name__ == "__main__":
    main()
