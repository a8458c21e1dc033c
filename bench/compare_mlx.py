#!/usr/bin/env python3
"""Compare two MLX-layout folders tensor by tensor (e.g. `calla convert` against `mlx_lm.convert` of
the same bf16 snapshot). Run with the MLX venv's python (WORKDIR/venv-mlx/bin/python).

    compare_mlx.py A B [--max-report 20]

Reports: tensors only in one folder, shape / dtype differences, how many tensors are bitwise equal,
and for quantized modules that differ, the max |dequantized A - dequantized B| relative to the
module's max |weight|; also the difference of the config.json `quantization` sections.
Exit status 0 when every tensor is present in both with the same shape and dtype.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import mlx.core as mx


def load(folder):
    out = {}
    for fn in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(mx.load(fn))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--max-report", type=int, default=20)
    a = p.parse_args()
    ta, tb = load(a.a), load(a.b)
    ca = json.load(open(os.path.join(a.a, "config.json")))
    cb = json.load(open(os.path.join(a.b, "config.json")))
    qa, qb = ca.get("quantization", {}), cb.get("quantization", {})
    only_a = sorted(set(ta) - set(tb))
    only_b = sorted(set(tb) - set(ta))
    print(f"{len(ta)} tensors in A, {len(tb)} in B; {len(only_a)} only in A, {len(only_b)} only in B")
    for n in only_a[: a.max_report]:
        print(f"  only A: {n} {ta[n].shape} {ta[n].dtype}")
    for n in only_b[: a.max_report]:
        print(f"  only B: {n} {tb[n].shape} {tb[n].dtype}")
    bad = 0
    equal = 0
    differ = []
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.shape != y.shape or x.dtype != y.dtype:
            bad += 1
            if bad <= a.max_report:
                print(f"  shape/dtype: {n}: A {x.shape} {x.dtype}  B {y.shape} {y.dtype}")
            continue
        if mx.array_equal(x, y).item():
            equal += 1
        else:
            differ.append(n)
    print(f"{equal} bitwise equal, {len(differ)} differ, {bad} with another shape or dtype")
    # dequantized comparison per quantized module
    reported = 0
    for n in differ:
        if not n.endswith(".weight") or n[:-7] + ".scales" not in ta:
            if reported < a.max_report:
                d = mx.max(mx.abs(ta[n].astype(mx.float32) - tb[n].astype(mx.float32))).item()
                print(f"  {n}: max |A-B| = {d:.3g}")
                reported += 1
            continue
        base = n[:-7]
        qc = qa.get(base, qa) if isinstance(qa.get(base), dict) else qa
        bits, gs = qc.get("bits", 4), qc.get("group_size", 64)
        wa = mx.dequantize(ta[n], ta[base + ".scales"], ta.get(base + ".biases"), group_size=gs, bits=bits)
        wb = mx.dequantize(tb[n], tb[base + ".scales"], tb.get(base + ".biases"), group_size=gs, bits=bits)
        d = mx.max(mx.abs(wa - wb)).item()
        m = mx.max(mx.abs(wa)).item()
        frac = mx.mean((ta[n] != tb[n]).astype(mx.float32)).item()
        if reported < a.max_report:
            print(f"  {base}: {bits}-bit g{gs}: {100 * frac:.3f}% of packed words differ, "
                  f"max |deq A - deq B| = {d:.3g} ({100 * d / m if m else 0:.2f}% of max |w|)")
            reported += 1
    keys = sorted(set(qa) | set(qb))
    qdiff = [k for k in keys if qa.get(k) != qb.get(k)]
    print(f"quantization sections: {len(qa)} vs {len(qb)} keys, {len(qdiff)} differ")
    for k in qdiff[: a.max_report]:
        print(f"  {k}: A {qa.get(k)}  B {qb.get(k)}")
    return 1 if (only_a or only_b or bad) else 0


if __name__ == "__main__":
    sys.exit(main())
