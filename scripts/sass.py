#!/usr/bin/env python3
"""SASS of one kernel, and its loops' instruction mix, on the development machine (no GPU).

The cubins come from the kernel cache that `calla cuda-compile --cache DIR` fills with NVRTC
(scripts/gpu_bundle.sh fills target/gpu-cache); the disassembler is NVIDIA's `cuobjdump` with
`nvdisasm`, installed from PyPI into target/sass-tools on first use (a newer disassembler reads
the sm_90a cubins of NVRTC 13.0).

    python3 scripts/sass.py qgemm_q4_tall_ln                 # loops and their instruction mix
    python3 scripts/sass.py qgemm_q4_tall_ln --dump out.sass # and the whole listing
    python3 scripts/sass.py router_dg_q4_p4 --cache target/gpu-cache

A loop is a backward branch; for each one it prints its address range, the static instructions
in that range (every side of every branch inside it), the local loads and stores (LDL / STL:
spills, or local arrays) and the opcodes by count. For a loop without branches inside (a GEMM's
main loop) that is what a warp executes per iteration; with branches a warp runs fewer. A back
edge from code laid out past a loop's end also shows up as a "loop" spanning both; read the
--dump listing to be sure. With several cubins of one kernel file in the cache (an edited
source compiled into the same folder) the newest is read, with a warning.
"""
import argparse
import collections
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "target", "sass-tools")
PACKAGES = ["nvidia-cuda-cuobjdump==13.5.37", "nvidia-cuda-nvdisasm==13.5.37"]


def tool_dir():
    """The folder holding cuobjdump and nvdisasm, installing them from PyPI if missing."""
    bin_dir = os.path.join(TOOLS, "nvidia", "cu13", "bin")
    if not (os.path.exists(os.path.join(bin_dir, "cuobjdump")) and os.path.exists(os.path.join(bin_dir, "nvdisasm"))):
        print(f"installing {', '.join(PACKAGES)} into {TOOLS}", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", TOOLS, *PACKAGES])
        if r.returncode != 0:
            sys.exit(f"pip could not install {', '.join(PACKAGES)} (exit status {r.returncode})")
    return bin_dir


def sass_of(kernel, cache):
    """The SASS listing of `kernel` from the newest cubin in `cache` that holds it."""
    cubins = sorted(glob.glob(os.path.join(cache, "*.cubin")), key=os.path.getmtime, reverse=True)
    if not cubins:
        sys.exit(f"no cubins in {cache}: run `calla cuda-compile --cache {cache}` (scripts/gpu_bundle.sh does)")
    bin_dir = tool_dir()
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    found, errors = [], []
    for cubin in cubins:
        out = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", "-fun", kernel, cubin],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:  # an unknown function is exit status 0 with a warning
            errors.append(f"{os.path.basename(cubin)}: {out.stderr.strip()}")
            continue
        # -fun matches by prefix too (router_dg_q4_p4 also lists router_dg_q4_p4_k2, ...): keep
        # the exact function's section
        for part in re.split(r"\n(?=\s*Function : )", out.stdout):
            m = re.match(r"\s*Function : (\S+)", part)
            if m and m.group(1) == kernel:
                found.append((cubin, part))
    if not found:
        detail = "".join(f"\n  cuobjdump failed on {e}" for e in errors)
        sys.exit(f"kernel {kernel} not found in the {len(cubins)} cubins of {cache}{detail}")
    if len(found) > 1:
        names = ", ".join(os.path.basename(c) for c, _ in found)
        print(f"note: {len(found)} cubins hold {kernel} ({names}); reading the newest", file=sys.stderr)
    return found[0]


def instructions(listing):
    """(address, text) of every instruction."""
    out = []
    for line in listing.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text):
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    return text.split()[0].split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", help="the kernel's (extern \"C\") name")
    ap.add_argument("--cache", default=os.path.join(ROOT, "target", "gpu-cache"), help="kernel cache folder (cubins)")
    ap.add_argument("--dump", help="also write the whole listing here")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = ap.parse_args()
    cubin, listing = sass_of(args.kernel, args.cache)
    if args.dump:
        try:
            with open(args.dump, "w") as f:
                f.write(listing)
        except OSError as e:
            sys.exit(f"cannot write {args.dump}: {e}")
    ins = instructions(listing)
    local = sum(1 for _, t in ins if opcode(t) in ("LDL", "STL"))
    print(f"{args.kernel}: {len(ins)} instructions (padding included), {local} local loads/stores ({os.path.basename(cubin)})")
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo = int(m.group(1), 16)
        body = [t for a, t in ins if lo <= a <= addr]
        mix = collections.Counter(opcode(t) for t in body)
        sp = mix.get("LDL", 0) + mix.get("STL", 0)
        top = ", ".join(f"{k} {v}" for k, v in mix.most_common(args.top))
        print(f"  loop {lo:#07x}..{addr:#07x}: {len(body):5d} instructions, {sp} local | {top}")


if __name__ == "__main__":
    main()
