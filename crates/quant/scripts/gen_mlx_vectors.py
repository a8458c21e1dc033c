#!/usr/bin/env python3
"""Writes crates/quant/testdata/mlx_affine_v1.bin: mx.quantize / mx.dequantize reference vectors.

Needs the PyPI `mlx` package; on Linux x86_64 the CPU wheel installs with
    python3 -m venv .venv-quant && .venv-quant/bin/pip install "mlx[cpu]" numpy
(the committed file was made with mlx 0.32.4, CPU backend). Deterministic (fixed seeds).

Format, all little-endian:
  magic b"MLXQ", u32 version (1), u32 n_cases, then per case:
  u32 bits, u32 group_size, u32 rows, u32 cols, u32 input_kind (0: bf16, 1: f32), u32 has_dequant
  input   rows*cols   u16 (bf16 bits) or u32 (f32 bits)
  packed  rows*cols*bits/32 u32          mx.quantize(w)[0]
  scales  rows*cols/group_size u16       bf16 bits (f32 input: mlx's f32 scale cast to bf16)
  biases  rows*cols/group_size u16       bf16 bits (likewise)
  dequant rows*cols u16 if has_dequant   mx.dequantize(...) output, bf16 bits
"""
import struct
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROWS, COLS = 2, 256


def groups_of(rng, dist, bits, gs):
    n = ROWS * COLS
    if dist == "normal":
        return rng.normal(0, 0.02, n)
    if dist == "uniform":
        return rng.uniform(-1, 1, n)
    if dist == "negative":
        return -np.abs(rng.normal(0, 0.05, n)) - 0.01
    if dist == "positive":
        return np.abs(rng.normal(0, 0.05, n)) + 0.01
    if dist == "constant":
        w = np.repeat(rng.normal(0, 1, n // gs), gs)
        w[: 2 * gs] = 0.0  # two all-zero groups
        return w
    if dist == "tiny":
        w = rng.normal(0, 1e-8, n)
        w[::3] = 0.0
        return w
    if dist == "outliers":
        w = rng.normal(0, 0.02, n)
        w[::41] = rng.choice([-1.5, 2.0, 0.75], size=w[::41].shape)
        w[::7] = 0.0
        return w
    if dist == "ties":
        # scale is an exact power of two, values sit on half steps: exercises ties-to-even
        nb = (1 << bits) - 1
        step = 0.125 if bits == 4 else 1.0 / 128
        w = np.empty(n)
        for g in range(n // gs):
            j = rng.integers(0, nb - 1, gs)
            v = -1.0 + (j + 0.5) * step
            v[0] = -1.0
            v[1] = -1.0 + nb * step
            w[g * gs:(g + 1) * gs] = v
        return w
    raise ValueError(dist)


def main(out: Path):
    cases = []
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for di, dist in enumerate(
                ["normal", "uniform", "negative", "positive", "constant", "tiny", "outliers", "ties"]
            ):
                rng = np.random.default_rng(1000 * bits + 10 * gs + di)
                w = groups_of(rng, dist, bits, gs).astype(np.float32).reshape(ROWS, COLS)
                cases.append((bits, gs, 0, w))
            rng = np.random.default_rng(7 * bits + gs)
            cases.append((bits, gs, 1, rng.normal(0, 0.02, (ROWS, COLS)).astype(np.float32)))

    blob = bytearray(b"MLXQ" + struct.pack("<II", 1, len(cases)))
    for bits, gs, kind, w in cases:
        if kind == 0:
            wm = mx.array(w).astype(mx.bfloat16)
        else:
            wm = mx.array(w)
        wq, s, b = mx.quantize(wm, group_size=gs, bits=bits)
        has_deq = 1 if kind == 0 else 0
        blob += struct.pack("<6I", bits, gs, ROWS, COLS, kind, has_deq)
        if kind == 0:
            blob += np.array(wm.view(mx.uint16)).astype("<u2").tobytes()
        else:
            blob += w.astype("<f4").tobytes()
        blob += np.array(wq).astype("<u4").tobytes()
        blob += np.array(s.astype(mx.bfloat16).view(mx.uint16)).astype("<u2").tobytes()
        blob += np.array(b.astype(mx.bfloat16).view(mx.uint16)).astype("<u2").tobytes()
        if has_deq:
            d = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
            assert d.dtype == mx.bfloat16
            blob += np.array(d.view(mx.uint16)).astype("<u2").tobytes()
    out.write_bytes(bytes(blob))
    print(f"wrote {out}: {len(cases)} cases, {len(blob)} bytes, mlx {mx.__version__}, {mx.default_device()}")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent.parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "testdata" / "mlx_affine_v1.bin")
