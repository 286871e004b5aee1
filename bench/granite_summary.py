"""Summary of an interleaved decode log (bench/granite_session.sh): per variant, the median step
(ms/token) of each of its runs, the median of those, the % of floor of each run (its own DRAM
read test) and the attention / ffn / output parts (ms, means per step); ratios against OLD.

    python bench/granite_summary.py OUT/decode-granite.txt
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict

HEADER = re.compile(r"^== (\S+) round (\d+)")
DECODE = re.compile(r"decode: median ([\d.]+) ms/token .*= ([\d.]+)% of the floor")
DRAM = re.compile(r"DRAM read .*median ([\d.]+) GB/s")
PAIRED = re.compile(r"^paired: median ([\d.]+)% of the floor")
PART = re.compile(r"^\s+(attention|ffn|output)\s+([\d.]+) ms")


def parse(path: str) -> dict[str, list[dict[str, float]]]:
    """Runs by variant, in log order; a run without a decode line (crash, timeout) is left out."""
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    name, run = None, {}
    for line in open(path, encoding="utf-8", errors="replace"):
        if m := HEADER.match(line):
            if name is not None and "ms" in run:
                runs[name].append(run)
            name, run = m.group(1), {}
        elif m := DECODE.search(line):
            run["ms"], run["pct"] = float(m.group(1)), float(m.group(2))
        elif m := PAIRED.match(line):
            run["paired"] = float(m.group(1))
        elif m := DRAM.search(line):
            run["dram"] = float(m.group(1))
        elif m := PART.match(line):
            run[m.group(1)] = float(m.group(2))
    if name is not None and "ms" in run:
        runs[name].append(run)
    return runs


def main() -> None:
    runs = parse(sys.argv[1])
    old = statistics.median(r["ms"] for r in runs["OLD"]) if runs.get("OLD") else None
    for name, rs in runs.items():
        med = statistics.median(r["ms"] for r in rs)
        ratio = f" = {med / old:.3f} x OLD" if old else ""
        pct = statistics.median(r["pct"] for r in rs)
        paired = [r["paired"] for r in rs if "paired" in r]
        paired_txt = (
            f", paired (each segment against the read test right before it) "
            f"{statistics.median(paired):.1f}%"
            if paired
            else ""
        )
        print(
            f"{name}: median {med:.2f} ms/token{ratio} over {len(rs)} runs; median of the runs' "
            f"% of floor: against each run's read tests {pct:.1f}%{paired_txt}"
        )
        for r in rs:
            parts = " ".join(
                f"{k} {r.get(k, float('nan')):.2f}" for k in ("attention", "ffn", "output")
            )
            print(
                f"    {r['ms']:.2f} ms, {r['pct']:.1f}% of floor, paired "
                f"{r.get('paired', float('nan')):.1f}% "
                f"(DRAM {r.get('dram', float('nan')):.1f} GB/s); {parts}"
            )


if __name__ == "__main__":
    main()
