"""The best batch-1 dense knob setting of a `bench/cpu_experts.py --sweep` table, as NAME=VALUE
words for `export`: the fastest row if it is >= 5% faster than the first (the defaults), else the
first. Used by bench/cpu_session.sh."""

import sys


def pick(path: str, margin: float = 0.95) -> str:
    lines = [ln.strip() for ln in open(path) if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    names = [h for h in head if h.startswith("PYRT_")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]
    ms = {tuple(r[: len(names)]): float(r[len(names)].split()[0]) for r in rows}
    first = next(iter(ms))
    best = min(ms, key=ms.get)
    chosen = best if ms[best] < margin * ms[first] else first
    return " ".join(f"{n}={v}" for n, v in zip(names, chosen, strict=True))


if __name__ == "__main__":
    print(pick(sys.argv[1]))
