"""Reads `omniprefix bench serve --json` runs for the scripts that compare two settings
(scripts/prefill_policy.sh, scripts/encoder_stall.sh): the runs, a table of them with
chosen columns, and the median of a field over the runs that match."""

import json
import statistics

# field: (header, format of a value)
COLUMNS = {
    "prefill_cap": ("cap", "{:>5}"),
    "concurrency": ("c", "{:>2}"),
    "encoder_ms": ("encoder_ms", "{:>10}"),
    "cache": ("cache", "{:>5}"),
    "ttft_ms_p50": ("ttft p50", "{:>7.0f}ms"),
    "ttft_ms_p99": ("ttft p99", "{:>7.0f}ms"),
    "itl_ms_p50": ("itl p50", "{:>7.1f}ms"),
    "itl_ms_p99": ("itl p99", "{:>7.1f}ms"),
    "output_tokens_per_s": ("tok/s", "{:>7.1f}"),
    "encoder_calls": ("enc calls", "{:>9}"),
}


def load(path):
    """Every run of a JSON-lines report."""
    return [json.loads(line) for line in open(path) if line.strip()]


def print_table(rows, fields):
    """One line per run, the given fields in order."""
    def cell(field, value):
        header, fmt = COLUMNS[field]
        text = fmt.format("on" if value is True else "off" if value is False else value)
        return text.rjust(len(header))

    print(" ".join(COLUMNS[f][0].rjust(len(COLUMNS[f][1].format(0))) for f in fields))
    for r in rows:
        print(" ".join(cell(f, r[f]) for f in fields))


def median(rows, key, **where):
    """The median of `key` over the runs whose fields equal `where`."""
    return statistics.median(r[key] for r in rows if all(r[k] == v for k, v in where.items()))
