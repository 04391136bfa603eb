"""The machine's CPU as every report names it beside its figures: the model name and the
/proc/cpuinfo flags that decide which kernels omniprefix and torch run. One reader for
compare_torch.py, cpu_report.sh, vllm_hash_bench.py and ttfa_http_bench.py."""

from __future__ import annotations

import pathlib

# The /proc/cpuinfo flags that decide which kernels either engine runs.
CPU_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FLAGS it has (sorted), from /proc/cpuinfo
    (``"unknown"`` and none where it cannot be read)."""
    cpu, flags = "unknown", []
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = sorted(f for f in line.split(":", 1)[1].split() if f in CPU_FLAGS)
    except OSError:
        pass
    return cpu, flags
