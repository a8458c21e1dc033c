#!/usr/bin/env python3
"""Per-SM view of a `calla cuda-bench --timeline --timeline-raw PATH` record file.

The records are 64 bytes each, eight little-endian u64 words, as `step_timeline` in
crates/calla/src/cuda_cmd.rs writes them: gridid, smid << 32 | block, mark, done, trigger,
before-wait, after-wait (all %globaltimer ns, 0 when not stamped), blocks in the grid. Grids
are kernel nodes of the step graph in launch order; the first replay's records of a grid are
its `blocks` earliest ones.

Prints, for the first launches of the first replay, the release (earliest return from the wait,
us after the first record) and how many blocks shared an SM; then, for each launch of
`--before` blocks followed by one of `--after` blocks (by default the GDN step, 128 blocks, and
the output projection, 128), when the second one's blocks became resident after the first
one's last trigger, by how many of the first one's blocks sat on the same SM.

    scripts/timeline_raw.py crates/cuda/results/2026-12-02-s20-timeline-out-proj-c88s3-raw.0.bin.xz
"""
import argparse
import collections
import lzma
import struct


def load(path):
    data = lzma.open(path).read() if path.endswith(".xz") else open(path, "rb").read()
    if len(data) % 64:
        raise SystemExit(f"{path}: {len(data)} bytes is not a whole number of 64-byte records")
    keys = ("grid", "smblock", "mark", "done", "trigger", "pre", "post", "blocks")
    recs = [dict(zip(keys, struct.unpack_from("<8Q", data, i))) for i in range(0, len(data), 64)]
    for r in recs:
        r["sm"], r["block"] = r["smblock"] >> 32, r["smblock"] & 0xFFFFFFFF
    return recs


def first_replay(recs):
    grids = collections.defaultdict(list)
    for r in recs:
        grids[r["grid"]].append(r)
    seq = []
    for g in sorted(grids):
        rs = sorted(grids[g], key=lambda r: r["pre"])
        seq.append(rs[: rs[0]["blocks"]])
    return seq


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--launches", type=int, default=14, help="launches listed one by one")
    ap.add_argument("--before", type=int, default=128, help="blocks of the first launch of a pair")
    ap.add_argument("--after", type=int, default=128, help="blocks of the second launch of a pair")
    ap.add_argument("--pairs", type=int, default=3)
    a = ap.parse_args()
    seq = first_replay(load(a.raw))
    t0 = min(r["pre"] for rs in seq for r in rs)
    us = lambda ns: ns / 1e3
    for i, rs in enumerate(seq[: a.launches]):
        per_sm = collections.Counter(r["sm"] for r in rs)
        shared = dict(sorted(collections.Counter(per_sm.values()).items()))
        rel = min(r["post"] for r in rs)
        print(f"launch {i:3d}: {len(rs):4d} blocks on {len(per_sm):3d} SMs, release {us(rel - t0):8.2f} us, SMs by blocks on them {shared}")
    pairs = 0
    for i in range(len(seq) - 1):
        first, second = seq[i], seq[i + 1]
        if len(first) != a.before or len(second) != a.after or pairs >= a.pairs:
            continue
        trig = [r["trigger"] for r in first if r["trigger"]]
        if not trig:
            continue
        pairs += 1
        last_trigger = max(trig)
        per_sm = collections.Counter(r["sm"] for r in first)
        rel2 = min(r["post"] for r in second)
        print(f"launches {i}, {i + 1}: the second released {us(rel2 - last_trigger):.2f} us after the first's last trigger")
        by = collections.defaultdict(list)
        for r in second:
            by[per_sm.get(r["sm"], 0)].append(us(r["pre"] - last_trigger))
        for k in sorted(by):
            v = sorted(by[k])
            print(f"  on SMs holding {k} of the first's blocks: {len(v):3d} blocks resident {v[0]:.2f} / {v[len(v) // 2]:.2f} / {v[-1]:.2f} us (min / median / max) after that trigger")


if __name__ == "__main__":
    main()
