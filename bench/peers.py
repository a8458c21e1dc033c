#!/usr/bin/env python3
"""calla against its peers on the CPU, in one run, on the same synthetic weights.

    bench/peers.sh --layers 4 --bits 4 --prompt-tokens 512 --gen-tokens 64 --workdir /tmp/calla-bench

Steps (each logged to WORKDIR/logs/, products cached in WORKDIR and reused when their recipe is
unchanged; --force redoes them):
  1. `calla synth --bits 16` -> the published bf16 Hugging Face layout (full width, all experts);
     `calla convert --bits B` -> the MLX affine layout (group 64) of the same weights.
  2. llama.cpp, pinned via PyPI's llama-cpp-python sdist (which vendors llama.cpp, its converter
     and gguf-py): build llama-bench + llama-quantize (cmake, Release, GGML_NATIVE, CPU only),
     convert the bf16 folder with convert_hf_to_gguf.py (--outtype bf16 --no-mtp), quantize to the
     GGUF type of the same bits per weight (Q4_0 for 4-bit, Q8_0 for 8-bit; --pure so the LM head
     and embeddings are not bumped to Q6_K, as MLX keeps them at B bits too), run llama-bench.
  3. MLX-LM on CPU (pinned mlx / mlx-cpu / mlx-lm in a venv under WORKDIR) on the MLX folder,
     with a capped prompt and generation (its quantized MoE is very slow on CPU).
  4. `calla bench` on the MLX folder.
  5. A side-by-side table, ratios, WORKDIR/results/peers-*.json and one line appended to
     bench/results/cpu.jsonl.

Only the Python standard library is needed to run this script; the converter runs under
--convert-python (default: the repository's .venv-fixtures, which has torch + transformers).
See docs/BENCH.md.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")

# Pinned peers. llama-cpp-python 0.3.36 is the newest release (2026-11) and its vendored llama.cpp
# (commit 0c1e570) registers Qwen3_5MoeForConditionalGeneration -> arch qwen35moe.
PINS = {
    "llama-cpp-python": "0.3.36",
    "mlx": "0.32.4",
    "mlx-cpu": "0.32.4",
    "mlx-lm": "0.32.2",
    "cmake": "4.4.5",
    "ninja": "1.13.2",
}
LLAMA_TARGETS = ["llama-bench", "llama-quantize"]
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
# bits per weight of the formats (weights only): MLX affine = B + 2*16/64 (bf16 scale + bias per 64);
# GGUF Q4_0 = 18 bytes / 32 weights, Q4_1 = 20 / 32, Q8_0 = 34 / 32.
NOMINAL_BPW = {"mlx4": 4.5, "mlx8": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q5_0": 5.5, "Q5_1": 6.0}

T0 = time.time()


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------

def log(msg: str):
    print(f"[peers {time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


class StepError(RuntimeError):
    pass


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# CPU share other processes took during the last run(measure_rss=True): (busy CPU time of the whole
# machine from /proc/stat - the child's user+sys time) / (cores x wall time).
LAST = {"others": None}


def cpu_ticks():
    """(busy, total) jiffies of all CPUs from /proc/stat (busy excludes idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def busy_fraction(seconds=1.0):
    """Fraction of all cores busy over `seconds` (while this script itself sleeps: other processes)."""
    t0 = cpu_ticks()
    time.sleep(seconds)
    t1 = cpu_ticks()
    if not t0 or not t1 or t1[1] <= t0[1]:
        return None
    return (t1[0] - t0[0]) / (t1[1] - t0[1])


def wait_idle(a, what: str):
    """Before a timed run: wait (up to --idle-wait s) until other processes use at most
    --idle-threshold of the CPU. Returns the busy fraction seen last."""
    if a.idle_wait <= 0:
        return None
    start = time.time()
    frac = busy_fraction()
    told = False
    while frac is not None and frac > a.idle_threshold and time.time() - start < a.idle_wait:
        if not told:
            log(f"  waiting for other processes ({100 * frac:.0f}% of the CPU) to quiet down before {what}")
            told = True
        time.sleep(4)
        frac = busy_fraction()
    return frac


def run(cmd, logfile, *, cwd=None, env=None, timeout=None, nice=0, check=True, measure_rss=False):
    """Run cmd (list), stdout+stderr to logfile. Returns (rc, seconds, peak_rss_bytes or None)."""
    cmd = [str(c) for c in cmd]
    prog = os.path.basename(cmd[0]) if cmd[0] != "sh" else "sh"
    if measure_rss and os.path.exists("/usr/bin/time"):
        rss_file = logfile + ".time"
        cmd = ["/usr/bin/time", "-f", "%M %e %U %S", "-o", rss_file] + cmd
    else:
        rss_file = None
    if nice:
        cmd = ["nice", "-n", str(nice)] + cmd
    os.makedirs(os.path.dirname(logfile), exist_ok=True)
    ticks0 = cpu_ticks()
    t = time.time()
    with open(logfile, "w") as lf:
        lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        lf.flush()
        try:
            rc = subprocess.call(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
            lf.write(f"\n[peers] timed out after {timeout}s\n")
    dt = time.time() - t
    ticks1 = cpu_ticks()
    rss = None
    LAST["others"] = None
    if rss_file and os.path.exists(rss_file):
        try:
            f = open(rss_file).read().split()
            rss = int(f[0]) * 1024
            child_cpu = float(f[2]) + float(f[3])
            if ticks0 and ticks1 and dt > 0:
                others = (ticks1[0] - ticks0[0]) / CLK_TCK - child_cpu
                LAST["others"] = max(0.0, others / ((os.cpu_count() or 1) * dt))
        except (ValueError, IndexError):
            pass
    if check and rc != 0:
        tail = "".join(open(logfile, errors="replace").readlines()[-25:])
        raise StepError(f"{prog} failed (rc {rc}, log {logfile}):\n{tail}")
    return rc, dt, rss


def stamp_ok(path: str, recipe: dict, force: bool) -> bool:
    st = os.path.join(path, ".peers-recipe.json") if os.path.isdir(path) else path + ".recipe.json"
    if force or not os.path.exists(st) or not os.path.exists(path):
        return False
    try:
        return json.load(open(st)) == recipe
    except (OSError, ValueError):
        return False


def stamp_write(path: str, recipe: dict):
    st = os.path.join(path, ".peers-recipe.json") if os.path.isdir(path) else path + ".recipe.json"
    with open(st, "w") as f:
        json.dump(recipe, f, indent=1)


def rm(path: str):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    for extra in (path + ".recipe.json",):
        if os.path.exists(extra):
            os.remove(extra)


def file_id(path: str) -> list:
    st = os.stat(path)
    return [st.st_size, int(st.st_mtime)]


def sh_out(cmd, cwd=None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    lscpu = sh_out(["lscpu"])
    model = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", lscpu, re.M)
    simd = sorted({f for f in (flags.group(1).split() if flags else [])
                   if f.startswith(("avx", "fma", "f16c", "amx", "neon", "asimd", "sve"))})
    mem = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "simd": simd,
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "hostname": platform.node(),
        "loadavg_start": list(os.getloadavg()),
    }


def git_info() -> dict:
    commit = sh_out(["git", "rev-parse", "HEAD"], cwd=REPO)
    dirty = bool(sh_out(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO))
    return {"commit": commit, "dirty": dirty}


# --------------------------------------------------------------------------------------------------
# file formats: parameter and byte counts straight from the headers (no numpy)
# --------------------------------------------------------------------------------------------------

def safetensors_tensors(folder: str) -> dict:
    """name -> (dtype, shape, nbytes) over every *.safetensors file of a folder."""
    out = {}
    for fn in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(fn, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            hdr = json.loads(f.read(n))
        for k, v in hdr.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            out[k] = (v["dtype"], v["shape"], b - a)
    return out


def prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def hf_text_params(folder: str) -> int:
    """Parameters of the text model (what both GGUF with --no-mtp and MLX keep): no vision, no MTP."""
    return sum(prod(s) for k, (_, s, _) in safetensors_tensors(folder).items()
               if not k.startswith(("model.visual.", "mtp.", "model.mtp.")))


GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_tensors(path: str) -> tuple[dict, dict]:
    """Minimal GGUF reader: returns (metadata subset, name -> (ggml_type, shape, nbytes)).
    nbytes comes from the offsets (the padding to the alignment, at most 31 bytes, is counted)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))

        def rstr():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def rval(t):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                if et in GGUF_SCALAR:
                    f.seek(struct.calcsize(GGUF_SCALAR[et]) * n, 1)
                else:
                    for _ in range(n):
                        rval(et)
                return f"<array {n}>"
            fmt = GGUF_SCALAR[t]
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        meta = {}
        for _ in range(n_kv):
            k = rstr()
            (t,) = struct.unpack("<I", f.read(4))
            v = rval(t)
            if not (isinstance(v, str) and v.startswith("<array")):
                meta[k] = v
        infos = []
        for _ in range(n_tensors):
            name = rstr()
            (nd,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack("<" + "Q" * nd, f.read(8 * nd))
            gt, off = struct.unpack("<IQ", f.read(12))
            infos.append((name, gt, list(dims), off))
        align = int(meta.get("general.alignment", 32))
        data_start = (f.tell() + align - 1) // align * align
    size = os.path.getsize(path)
    infos.sort(key=lambda x: x[3])
    out = {}
    for i, (name, gt, dims, off) in enumerate(infos):
        end = infos[i + 1][3] if i + 1 < len(infos) else size - data_start
        out[name] = (gt, dims, end - off)
    return meta, out


GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
                   11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


def decode_bytes_gguf(tensors: dict, top_k: int, n_experts: int) -> int:
    """Weight bytes one decode token reads (batch 1): every matrix and vector, top_k/n_experts of each
    routed-expert tensor, one row of token_embd."""
    b = 0
    for name, (_, dims, nb) in tensors.items():
        if name.startswith("token_embd."):
            b += nb // dims[1]
        elif "_exps." in name:
            b += nb * top_k // n_experts
        else:
            b += nb
    return b


def decode_bytes_mlx(tensors: dict, top_k: int, n_experts: int) -> int:
    """The same for an MLX folder: weight + scales + biases of each module."""
    b = 0
    for name, (_, shape, nb) in tensors.items():
        if ".embed_tokens." in name:
            b += nb // shape[0]
        elif ".switch_mlp." in name or ".experts." in name:
            b += nb * top_k // n_experts
        else:
            b += nb
    return b


# --------------------------------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------------------------------

class Ctx:
    def __init__(self, a):
        self.a = a
        self.wd = os.path.abspath(a.workdir)
        self.logs = os.path.join(self.wd, "logs")
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []
        os.makedirs(self.logs, exist_ok=True)

    def logf(self, name):
        return os.path.join(self.logs, name + ".log")

    def timed(self, key, seconds):
        self.timings[key] = round(seconds, 2)


def venv(ctx: Ctx, name: str, packages: list[str]) -> str:
    """Create WORKDIR/<name> with the pinned packages (reused when the pins match). Returns its python."""
    path = os.path.join(ctx.wd, name)
    py = os.path.join(path, "bin", "python")
    recipe = {"packages": packages, "python": sys.version.split()[0]}
    if stamp_ok(path, recipe, ctx.a.force_venvs) and os.path.exists(py):
        return py
    rm(path)
    log(f"creating {name}: pip install {' '.join(packages)}")
    _, dt1, _ = run([sys.executable, "-m", "venv", path], ctx.logf(f"{name}-create"))
    _, dt2, _ = run([py, "-m", "pip", "install", "--disable-pip-version-check", "-q"] + packages,
                    ctx.logf(f"{name}-pip"), timeout=3600)
    ctx.timed(f"{name}_install_s", dt1 + dt2)
    stamp_write(path, recipe)
    return py


def step_calla_binary(ctx: Ctx) -> str:
    a = ctx.a
    binary = a.calla or os.path.join(REPO, "target", "release", "calla")
    if a.build_calla or not os.path.exists(binary):
        log("building calla: cargo build --release -p calla")
        _, dt, _ = run(["cargo", "build", "--release", "-p", "calla"], ctx.logf("calla-build"), cwd=REPO,
                       nice=a.nice, timeout=7200)
        ctx.timed("calla_build_s", dt)
    if not os.path.exists(binary):
        raise StepError(f"no calla binary at {binary}")
    # a private copy, so a rebuild by someone else during the run does not change the binary under us
    snap = os.path.join(ctx.wd, "bin", "calla")
    os.makedirs(os.path.dirname(snap), exist_ok=True)
    shutil.copy2(binary, snap)
    return snap


def step_synth(ctx: Ctx, calla: str) -> tuple[str, str]:
    a = ctx.a
    tag = f"L{a.layers}-E{a.experts or 'all'}-s{a.seed}"
    if a.hf:
        hf = os.path.abspath(a.hf)
    else:
        hf = os.path.join(ctx.wd, f"hf-bf16-{tag}")
        # keyed on the arguments only (random weights; --force after changing synth's format)
        recipe = {"cmd": "synth", "layers": a.layers, "experts": a.experts, "seed": a.seed}
        if not stamp_ok(hf, recipe, a.force):
            rm(hf)
            cmd = [calla, "synth", "--out", hf, "--layers", a.layers, "--bits", 16, "--seed", a.seed]
            if a.experts:
                cmd += ["--experts", a.experts]
            log(f"calla synth --bits 16 -> {hf}")
            _, dt, _ = run(cmd, ctx.logf("calla-synth"), nice=a.nice)
            ctx.timed("calla_synth_s", dt)
            stamp_write(hf, recipe)
        else:
            log(f"reusing {hf}")
    if a.mlx:
        mlx = os.path.abspath(a.mlx)
    elif a.skip_calla and a.skip_mlx:
        mlx = None
    else:
        mlx = os.path.join(ctx.wd, f"mlx-{a.bits}bit-{tag}" if not a.hf else f"mlx-{a.bits}bit-{os.path.basename(hf)}")
        src_stamp = os.path.join(hf, ".peers-recipe.json")
        recipe = {"cmd": "convert", "bits": a.bits, "in": hf, "by": a.mlx_converter,
                  "src": json.load(open(src_stamp)) if os.path.exists(src_stamp) else None,
                  "calla": file_id(calla) if a.mlx_converter == "calla" else None}
        if not stamp_ok(mlx, recipe, a.force):
            rm(mlx)
            if a.mlx_converter == "calla":
                log(f"calla convert --bits {a.bits} -> {mlx}")
                _, dt, _ = run([calla, "convert", "--in", hf, "--out", mlx, "--bits", a.bits],
                               ctx.logf("calla-convert"), nice=a.nice)
            else:
                py = mlx_python(ctx)
                log(f"mlx_lm convert -q --q-bits {a.bits} --q-group-size 64 -> {mlx}")
                _, dt, _ = run([py, "-m", "mlx_lm", "convert", "--hf-path", hf, "--mlx-path", mlx, "-q",
                                "--q-bits", a.bits, "--q-group-size", 64], ctx.logf("mlx-lm-convert"), nice=a.nice)
            ctx.timed("mlx_convert_s", dt)
            stamp_write(mlx, recipe)
        else:
            log(f"reusing {mlx}")
    return hf, mlx


def llama_source(ctx: Ctx) -> str:
    """Download and unpack the pinned llama-cpp-python sdist; return vendor/llama.cpp."""
    ver = ctx.a.llama_cpp_python
    src = os.path.join(ctx.wd, "src")
    tree = os.path.join(src, f"llama_cpp_python-{ver}")
    lc = os.path.join(tree, "vendor", "llama.cpp")
    if os.path.exists(os.path.join(lc, "CMakeLists.txt")):
        return lc
    os.makedirs(src, exist_ok=True)
    sdist = os.path.join(src, f"llama_cpp_python-{ver}.tar.gz")
    if not os.path.exists(sdist):
        log(f"pip download llama-cpp-python=={ver} (sdist)")
        # --no-binary only for this package: ':all:' would also build the build backend's own
        # dependencies (cmake!) from source just to prepare the metadata.
        _, dt, _ = run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", "llama-cpp-python", f"llama-cpp-python=={ver}", "-d", src],
                       ctx.logf("llama-download"), timeout=1800)
        ctx.timed("llama_download_s", dt)
    with tarfile.open(sdist) as t:
        try:
            t.extractall(src, filter="data")
        except TypeError:  # Python without extraction filters
            t.extractall(src)
    if not os.path.exists(os.path.join(lc, "CMakeLists.txt")):
        raise StepError(f"{sdist} does not vendor llama.cpp at vendor/llama.cpp")
    return lc


def llama_supports_qwen35moe(lc: str) -> bool:
    files = [os.path.join(lc, "convert_hf_to_gguf.py")] + glob.glob(os.path.join(lc, "conversion", "*.py"))
    reg = any("Qwen3_5MoeForConditionalGeneration" in open(f, errors="replace").read() for f in files)
    arch = os.path.exists(os.path.join(lc, "gguf-py", "gguf", "constants.py")) and \
        '"qwen35moe"' in open(os.path.join(lc, "gguf-py", "gguf", "constants.py")).read()
    return reg and arch


def step_llama_build(ctx: Ctx, lc: str) -> str:
    a = ctx.a
    build = os.path.join(ctx.wd, f"llama-build-{a.llama_cpp_python}")
    binaries = [os.path.join(build, "bin", t) for t in LLAMA_TARGETS]
    recipe = {"flags": LLAMA_CMAKE_FLAGS, "targets": LLAMA_TARGETS, "version": a.llama_cpp_python}
    if stamp_ok(build, recipe, a.force_build) and all(os.path.exists(b) for b in binaries):
        return os.path.join(build, "bin")
    cmake = shutil.which("cmake")
    env = dict(os.environ)
    if not cmake or not shutil.which("ninja"):
        py = venv(ctx, "venv-tools", [f"cmake=={PINS['cmake']}", f"ninja=={PINS['ninja']}"])
        env["PATH"] = os.path.dirname(py) + os.pathsep + env["PATH"]
        cmake = os.path.join(os.path.dirname(py), "cmake")
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=env["PATH"]) else []
    log(f"building llama.cpp ({', '.join(LLAMA_TARGETS)}) with -j{a.jobs}; this takes a while on 2 cores")
    _, dt1, _ = run([cmake, "-S", lc, "-B", build] + gen + LLAMA_CMAKE_FLAGS, ctx.logf("llama-cmake"), env=env)
    _, dt2, _ = run([cmake, "--build", build, "--config", "Release", "-j", a.jobs, "--target"] + LLAMA_TARGETS,
                    ctx.logf("llama-build"), env=env, nice=a.nice, timeout=7200)
    ctx.timed("llama_build_s", dt1 + dt2)
    stamp_write(build, recipe)
    return os.path.join(build, "bin")


def convert_python(ctx: Ctx, lc: str) -> str:
    a = ctx.a
    probe = "import torch, transformers, numpy, yaml, tqdm, safetensors"
    cands = [a.convert_python] if a.convert_python else [os.path.join(REPO, ".venv-fixtures", "bin", "python")]
    for py in cands:
        if py and os.path.exists(py) and subprocess.call([py, "-c", probe], stdout=subprocess.DEVNULL,
                                                         stderr=subprocess.DEVNULL) == 0:
            return py
    if a.convert_python:
        raise StepError(f"--convert-python {a.convert_python} lacks torch/transformers/numpy/pyyaml/tqdm")
    # Fallback: a venv with the converter's needs. The converter's own requirements pin
    # transformers 4.57.6, which cannot read a folder without tokenizer_config.json whose
    # model_type is qwen3_5_moe, so a transformers 5 release is used.
    return venv(ctx, "venv-convert", ["torch", "transformers==5.24.0", "numpy", "safetensors", "pyyaml", "tqdm",
                                      "requests", "sentencepiece", "protobuf"])


def prepare_llama(ctx: Ctx, hf: str, results: dict) -> list[dict]:
    """Source, build, convert and quantize; returns one entry per GGUF type (not yet measured)."""
    a = ctx.a
    lc = llama_source(ctx)
    ok = llama_supports_qwen35moe(lc)
    results["llama_cpp_supports_qwen35moe"] = ok
    if not ok:
        raise StepError(f"llama.cpp vendored by llama-cpp-python {a.llama_cpp_python} does not know "
                        "Qwen3_5MoeForConditionalGeneration / qwen35moe; pick a newer --llama-cpp-python")
    bindir = step_llama_build(ctx, lc)
    py = convert_python(ctx, lc)
    tag = os.path.basename(hf.rstrip("/"))
    gdir = os.path.join(ctx.wd, "gguf")
    os.makedirs(gdir, exist_ok=True)
    bf16 = os.path.join(gdir, f"{tag}-bf16.gguf")
    src_stamp = os.path.join(hf, ".peers-recipe.json")
    src = json.load(open(src_stamp)) if os.path.exists(src_stamp) else {"path": hf, "mtime": os.path.getmtime(hf)}
    recipe = {"src": src, "llama": a.llama_cpp_python, "outtype": "bf16", "no_mtp": True}
    qpaths = {gt: os.path.join(gdir, f"{tag}-{gt}{'-pure' if a.pure else ''}.gguf") for gt in a.gguf_types}
    qrecipes = {gt: {"src": recipe, "type": gt, "pure": a.pure} for gt in a.gguf_types}
    need_bf16 = any(not stamp_ok(qpaths[gt], qrecipes[gt], a.force) for gt in a.gguf_types)
    if need_bf16 and not stamp_ok(bf16, recipe, a.force):
        rm(bf16)
        log(f"convert_hf_to_gguf.py --outtype bf16 --no-mtp -> {bf16}")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        _, dt, _ = run([py, os.path.join(lc, "convert_hf_to_gguf.py"), hf, "--outtype", "bf16", "--no-mtp",
                        "--outfile", bf16], ctx.logf("llama-convert"), env=env, nice=a.nice)
        ctx.timed("llama_convert_s", dt)
        stamp_write(bf16, recipe)
    elif need_bf16:
        log(f"reusing {bf16}")
    params = hf_text_params(hf)
    entries = []
    for gt in a.gguf_types:
        qpath, qrecipe = qpaths[gt], qrecipes[gt]
        if not stamp_ok(qpath, qrecipe, a.force):
            rm(qpath)
            log(f"llama-quantize {'--pure ' if a.pure else ''}{gt} -> {qpath}")
            _, dt, _ = run([os.path.join(bindir, "llama-quantize")] + (["--pure"] if a.pure else []) +
                           [bf16, qpath, gt, a.threads], ctx.logf(f"llama-quantize-{gt}"), nice=a.nice)
            ctx.timed(f"llama_quantize_{gt}_s", dt)
            stamp_write(qpath, qrecipe)
        meta, tens = gguf_tensors(qpath)
        n_exp = int(meta.get("qwen35moe.expert_count", 0)) or 1
        top_k = int(meta.get("qwen35moe.expert_used_count", 0)) or 1
        tensor_bytes = sum(nb for _, _, nb in tens.values())
        types: dict[str, int] = {}
        for _, (t, dims, nb) in tens.items():
            k = GGML_TYPE_NAMES.get(t, str(t))
            types[k] = types.get(k, 0) + prod(dims)
        entries.append({
            "engine": "llama.cpp", "format": f"GGUF {gt}{' --pure' if a.pure else ''}", "gguf_type": gt,
            "file": qpath, "file_bytes": os.path.getsize(qpath), "tensor_bytes": tensor_bytes,
            "params": params, "bpw": tensor_bytes * 8 / params, "bpw_file": os.path.getsize(qpath) * 8 / params,
            "params_by_type": types, "decode_weight_bytes_per_token": decode_bytes_gguf(tens, top_k, n_exp),
            "llama_cpp_python": a.llama_cpp_python, "bench": os.path.join(bindir, "llama-bench"),
            "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
            "decode_depth": a.prompt_tokens if a.llama_depth < 0 else a.llama_depth,
            "samples": {"pp": [], "tg": []}, "llama_bench": {"pp": [], "tg": []}, "rss": [],
            "others": {"pp": [], "tg": []}, "idle_before": [],
        })
    if not a.keep_bf16_gguf and os.path.exists(bf16):
        rm(bf16)  # 2 bytes/weight; reconverted (a minute or two) only when a new GGUF type is asked for
    results["llama_cpp"] = entries
    return entries


def measure_llama_once(ctx: Ctx, e: dict, rep: int):
    """One llama-bench prefill run and one decode run (-r 1 each; llama-bench warms up first).
    Prefill: P tokens from an empty context; decode: G tokens after a P-token context (-d P), which
    is what calla bench and MLX-LM measure (decode right after the prompt)."""
    a = ctx.a
    for what, extra in (("pp", ["-p", a.prompt_tokens, "-n", 0]),
                        ("tg", ["-p", 0, "-n", a.gen_tokens, "-d", e["decode_depth"]])):
        lf = ctx.logf(f"llama-bench-{e['gguf_type']}-{what}-{rep}")
        jf = lf[:-4] + ".json"
        cmd = [e["bench"], "-m", e["file"], "-t", a.threads, "-r", 1, "-o", "json"] + extra
        e["idle_before"].append(wait_idle(a, f"llama.cpp {what}"))
        run(["sh", "-c", " ".join(shlex.quote(str(c)) for c in cmd) + " > " + shlex.quote(jf)],
            lf, measure_rss=True, timeout=a.timeout)
        rss = None
        if os.path.exists(lf + ".time"):
            try:
                rss = int(open(lf + ".time").read().split()[0]) * 1024
            except (ValueError, IndexError):
                pass
        d = json.load(open(jf))[0]
        e["samples"][what] += d["samples_ts"]
        e["llama_bench"][what].append(d)
        e["rss"].append(rss)
        e["others"][what].append(LAST["others"])
    log(f"  llama.cpp {e['gguf_type']} #{rep + 1}: prefill {e['samples']['pp'][-1]:.2f} tok/s, "
        f"decode {e['samples']['tg'][-1]:.2f} tok/s; others used {pct(e['others']['pp'][-1])} / "
        f"{pct(e['others']['tg'][-1])} of the CPU")


def finish_llama(e: dict):
    pp, tg = e["samples"]["pp"], e["samples"]["tg"]
    first = e["llama_bench"]["pp"][0] if e["llama_bench"]["pp"] else {}
    e.update({
        "prefill_tps": median(pp), "prefill_tps_best": max(pp) if pp else None,
        "decode_tps": median(tg), "decode_tps_best": max(tg) if tg else None,
        "ttft_s": e["prompt_tokens"] / median(pp) if pp else None,
        "peak_rss_bytes": max([r for r in e["rss"] if r] or [0]) or None,
        "threads": first.get("n_threads"), "build_commit": first.get("build_commit"),
        "model_n_params_gguf": first.get("model_n_params"), "repack": first.get("repack"),
        "flash_attn": first.get("flash_attn"), "n_ubatch": first.get("n_ubatch"), "cpu_info": first.get("cpu_info"),
    })


def pct(x):
    return "?" if x is None else f"{100 * x:.0f}%"


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def mlx_python(ctx: Ctx) -> str:
    a = ctx.a
    return venv(ctx, "venv-mlx", [f"mlx=={a.mlx_version}", f"mlx-cpu=={a.mlx_version}", f"mlx-lm=={a.mlx_lm_version}"])


def step_mlx(ctx: Ctx, mlx: str, results: dict):
    a = ctx.a
    py = mlx_python(ctx)
    jf = os.path.join(ctx.logs, "mlx-lm-bench.json")
    if os.path.exists(jf):
        os.remove(jf)
    wait_idle(a, "MLX-LM")
    log(f"MLX-LM on CPU: prompt {a.mlx_prompt_tokens}, gen {a.mlx_gen_tokens}, {a.mlx_trials} trial(s) "
        f"(capped; timeout {a.mlx_timeout}s)")
    rc, dt, rss = run([py, os.path.join(BENCH, "mlx_bench.py"), "--model", mlx, "--prompt-tokens",
                       a.mlx_prompt_tokens, "--gen-tokens", a.mlx_gen_tokens, "--trials", a.mlx_trials, "--json", jf],
                      ctx.logf("mlx-lm-bench"), timeout=a.mlx_timeout, measure_rss=True, check=False)
    ctx.timed("mlx_bench_wall_s", dt)
    if rc != 0 or not os.path.exists(jf):
        tail = "".join(open(ctx.logf("mlx-lm-bench"), errors="replace").readlines()[-15:])
        raise StepError(f"MLX-LM bench failed (rc {rc}{', timed out' if rc == 124 else ''}):\n{tail}")
    d = json.load(open(jf))
    d["peak_rss_bytes"] = rss or d.get("peak_rss_bytes")
    d["capped"] = (a.mlx_prompt_tokens, a.mlx_gen_tokens) != (a.prompt_tokens, a.gen_tokens)
    d["others"] = LAST["others"]
    d["prefill_tps_best"] = max(t["prompt_tps"] for t in d["trials"])
    d["decode_tps_best"] = max(t["generation_tps"] for t in d["trials"])
    results["mlx_lm"] = d
    log(f"MLX-LM: prefill {d['prefill_tps']:.3f} tok/s, decode {d['decode_tps']:.3f} tok/s")


def calla_prompts(ctx: Ctx) -> list[int]:
    a = ctx.a
    prompts = [a.prompt_tokens]
    if not a.skip_mlx and a.mlx_prompt_tokens not in prompts:
        prompts.append(a.mlx_prompt_tokens)  # so calla/MLX-LM compares at the same prompt length
    return prompts


def measure_calla_once(ctx: Ctx, calla: str, mlx: str, results: dict, rep: int):
    a = ctx.a
    prompts = calla_prompts(ctx)
    jf = os.path.join(ctx.logs, f"calla-bench-{rep}.json")
    idle = wait_idle(a, "calla bench")
    _, dt, rss = run([calla, "bench", "--model", mlx, "--prompt-tokens", ",".join(map(str, prompts)),
                      "--gen-tokens", a.gen_tokens, "--json", jf], ctx.logf(f"calla-bench-{rep}"),
                     timeout=a.timeout, measure_rss=True)
    d = json.load(open(jf))
    c = results.setdefault("calla", {"runs": [], "per_prompt": {}, "rss": [], "others": [], "idle_before": []})
    c["runs"].append(d)
    c["others"].append(LAST["others"])
    c["idle_before"].append(idle)
    c["rss"].append(rss or d.get("peak_rss_bytes"))
    for r in d.get("results", []):
        pp = c["per_prompt"].setdefault(str(r["prompt_tokens"]), {
            "prompt_tokens": r["prompt_tokens"], "gen_tokens": r.get("gen_tokens"), "prefill": [], "decode": [],
            "ttft_ms": [], "bytes_per_token": r.get("bytes_per_token"), "bandwidth_pct": []})
        pp["prefill"].append(r.get("prefill_tok_s"))
        pp["decode"].append(r.get("decode_tok_s"))
        pp["ttft_ms"].append(r.get("ttft_ms"))
        pp["bandwidth_pct"].append(r.get("bandwidth_pct"))
    main = next((r for r in d.get("results", []) if r["prompt_tokens"] == a.prompt_tokens), {})
    log(f"  calla #{rep + 1}: prefill {main.get('prefill_tok_s', 0):.2f} tok/s, decode "
        f"{main.get('decode_tok_s', 0):.2f} tok/s (P={a.prompt_tokens}); bandwidth "
        f"{d.get('memory_bandwidth_gb_s', 0):.1f} GB/s; others used {pct(LAST['others'])} of the CPU")


def finish_calla(c: dict):
    runs = c["runs"]
    c["memory_bandwidth_gb_s"] = max((r.get("memory_bandwidth_gb_s") or 0) for r in runs) or None
    c["memory_bandwidth_gb_s_runs"] = [r.get("memory_bandwidth_gb_s") for r in runs]
    c["peak_rss_bytes"] = max([x for x in c["rss"] if x] or [0]) or None
    for v in c["per_prompt"].values():
        v["prefill_tps"], v["prefill_tps_best"] = median(v["prefill"]), max(v["prefill"])
        v["decode_tps"], v["decode_tps_best"] = median(v["decode"]), max(v["decode"])
        v["ttft_s"] = median(v["ttft_ms"]) / 1e3


# --------------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------------

def fmt(x, spec=".2f", none="-"):
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def ratio(x, y):
    return x / y if x and y else None


def summarize(ctx: Ctx, results: dict, hf: str, mlx: str) -> dict:
    a = ctx.a
    params = hf_text_params(hf) if hf and os.path.isdir(hf) else None
    mlx_t = safetensors_tensors(mlx) if mlx and os.path.isdir(mlx) else {}
    cfg = {}
    if mlx and os.path.exists(os.path.join(mlx, "config.json")):
        cfg = json.load(open(os.path.join(mlx, "config.json")))
    tc = cfg.get("text_config", cfg)
    n_exp, top_k = tc.get("num_experts", 1), tc.get("num_experts_per_tok", 1)
    mlx_bytes = sum(nb for _, _, nb in mlx_t.values())
    mlx_bpw = mlx_bytes * 8 / params if params and mlx_bytes else None
    mlx_dec = decode_bytes_mlx(mlx_t, top_k, n_exp) if mlx_t else None
    cal = results.get("calla")
    bw = cal.get("memory_bandwidth_gb_s") if cal else None

    def eff(dec_bytes, tps):
        if dec_bytes is None or not tps:
            return None, None
        gbs = dec_bytes * tps / 1e9
        return gbs, (100 * gbs / bw if bw else None)

    rows = []
    calla_pp = {int(k): v for k, v in (cal or {}).get("per_prompt", {}).items()}
    for p, v in sorted(calla_pp.items(), key=lambda kv: (kv[0] != a.prompt_tokens, kv[0])):
        gbs, pct = eff(mlx_dec, v["decode_tps"])
        rows.append({
            "engine": "calla", "format": f"MLX {a.bits}-bit g64", "bpw": mlx_bpw, "prompt": p, "gen": v["gen_tokens"],
            "n": len(v["prefill"]), "prefill_tps": v["prefill_tps"], "prefill_tps_best": v["prefill_tps_best"],
            "ttft_s": v["ttft_s"], "decode_tps": v["decode_tps"], "decode_tps_best": v["decode_tps_best"],
            "weight_bytes_per_token": mlx_dec, "eff_gb_s": gbs, "pct_bw": pct,
            "calla_bytes_per_token": v.get("bytes_per_token"), "calla_pct_bw": median(v["bandwidth_pct"]),
            "peak_rss_bytes": cal.get("peak_rss_bytes"), "others": median(cal.get("others", [])),
        })
    for e in results.get("llama_cpp", []):
        if e.get("decode_tps") is None and e.get("prefill_tps") is None:
            continue
        gbs, pct = eff(e["decode_weight_bytes_per_token"], e["decode_tps"])
        rows.append({
            "engine": "llama.cpp", "format": e["format"], "bpw": e["bpw"], "prompt": e["prompt_tokens"],
            "gen": e["gen_tokens"], "n": len(e["samples"]["pp"]), "prefill_tps": e["prefill_tps"],
            "prefill_tps_best": e["prefill_tps_best"], "ttft_s": e["ttft_s"], "decode_tps": e["decode_tps"],
            "decode_tps_best": e["decode_tps_best"], "weight_bytes_per_token": e["decode_weight_bytes_per_token"],
            "eff_gb_s": gbs, "pct_bw": pct, "peak_rss_bytes": e["peak_rss_bytes"],
            "others": median(e["others"]["pp"] + e["others"]["tg"]),
        })
    m = results.get("mlx_lm")
    if m:
        gbs, pct = eff(mlx_dec, m["decode_tps"])
        rows.append({
            "engine": "MLX-LM" + (" (capped)" if m.get("capped") else ""), "format": f"MLX {a.bits}-bit g64",
            "bpw": mlx_bpw, "prompt": m["prompt_tokens"], "gen": m["gen_tokens"], "n": len(m["trials"]),
            "prefill_tps": m["prefill_tps"], "prefill_tps_best": m["prefill_tps_best"], "ttft_s": m["ttft_s"],
            "decode_tps": m["decode_tps"], "decode_tps_best": m["decode_tps_best"],
            "weight_bytes_per_token": mlx_dec, "eff_gb_s": gbs, "pct_bw": pct, "peak_rss_bytes": m.get("peak_rss_bytes"),
            "others": m.get("others"),
        })

    ratios = {}
    main = calla_pp.get(a.prompt_tokens)
    if main:
        for e in results.get("llama_cpp", []):
            if e.get("prefill_tps") is None:
                continue
            ratios[f"calla/llama.cpp {e['gguf_type']}"] = {
                "prompt_tokens": a.prompt_tokens,
                "prefill": ratio(main["prefill_tps"], e["prefill_tps"]),
                "decode": ratio(main["decode_tps"], e["decode_tps"]),
                "prefill_best": ratio(main["prefill_tps_best"], e["prefill_tps_best"]),
                "decode_best": ratio(main["decode_tps_best"], e["decode_tps_best"]),
            }
    if m and calla_pp.get(m["prompt_tokens"]):
        cm = calla_pp[m["prompt_tokens"]]
        ratios["calla/MLX-LM"] = {
            "prompt_tokens": m["prompt_tokens"],
            "prefill": ratio(cm["prefill_tps"], m["prefill_tps"]),
            "decode": ratio(cm["decode_tps"], m["decode_tps"]),
            "prefill_best": ratio(cm["prefill_tps_best"], m["prefill_tps_best"]),
            "decode_best": ratio(cm["decode_tps_best"], m["decode_tps_best"]),
            "note": f"calla decodes {a.gen_tokens} tokens, MLX-LM {m['gen_tokens']}",
        }
    return {"rows": rows, "ratios": ratios, "params": params, "mlx_tensor_bytes": mlx_bytes,
            "mlx_bpw": mlx_bpw, "memory_bandwidth_gb_s": bw, "experts": n_exp, "top_k": top_k}


def print_table(summary: dict, run_info: dict):
    rows = summary["rows"]
    hdr = ["engine", "format", "bits/w", "prompt", "prefill tok/s", "(best)", "TTFT s", "gen", "decode tok/s",
           "(best)", "runs", "weight MB/tok", "GB/s", "% BW", "peak RSS GB", "others"]
    lines = [hdr]
    for r in rows:
        lines.append([
            r["engine"], r["format"], fmt(r["bpw"], ".3f"), str(r["prompt"]), fmt(r["prefill_tps"], ".2f"),
            fmt(r["prefill_tps_best"], ".2f"), fmt(r["ttft_s"], ".2f"), str(r["gen"]), fmt(r["decode_tps"], ".2f"),
            fmt(r["decode_tps_best"], ".2f"), str(r["n"]),
            fmt(r["weight_bytes_per_token"] / 1e6 if r["weight_bytes_per_token"] else None, ".1f"),
            fmt(r["eff_gb_s"], ".2f"), fmt(r["pct_bw"], ".1f"),
            fmt(r["peak_rss_bytes"] / 1e9 if r["peak_rss_bytes"] else None, ".2f"),
            pct(r.get("others")) if r.get("others") is not None else "-",
        ])
    w = [max(len(l[i]) for l in lines) for i in range(len(hdr))]
    out = []
    for i, l in enumerate(lines):
        out.append("  ".join(c.ljust(w[j]) if j < 2 else c.rjust(w[j]) for j, c in enumerate(l)))
        if i == 0:
            out.append("  ".join("-" * x for x in w))
    m = run_info["machine"]
    a = run_info["args"]
    print()
    print(f"calla vs peers · {run_info['date']} · {m['cpu_model']}, {m['cores']} cores, "
          f"{(m['mem_total_bytes'] or 0) / 2**30:.0f} GiB · load {m['loadavg_start'][0]:.1f} -> "
          f"{run_info['load_avg_end'][0]:.1f} · git {run_info['git']['commit'][:10]}"
          f"{'+dirty' if run_info['git']['dirty'] else ''}")
    print(f"model: synthetic Qwen3.6-35B-A3B shapes, {a['layers']} layers, "
          f"{summary['experts']} experts (top-{summary['top_k']}), {summary['params'] or 0:,} params · "
          f"{a['bits']}-bit · {a['threads']} threads · memory bandwidth "
          f"{fmt(summary['memory_bandwidth_gb_s'], '.1f')} GB/s (calla bench, best run)")
    print("\n".join(out))
    if summary["ratios"]:
        print()
        for k, v in summary["ratios"].items():
            print(f"{k} (prompt {v['prompt_tokens']}): prefill {fmt(v['prefill'], '.2f')}x "
                  f"(best {fmt(v['prefill_best'], '.2f')}x), decode {fmt(v['decode'], '.2f')}x "
                  f"(best {fmt(v['decode_best'], '.2f')}x)" + (f"; {v['note']}" if v.get("note") else ""))
    print("\ntok/s: median of the runs (best run in brackets); runs interleave the engines. weight MB/tok: weight "
          "bytes one decode step reads from that engine's file (non-expert tensors, top-k/E of the experts, one "
          "embedding row); GB/s = that x median decode tok/s; % BW = of the bandwidth calla bench measured; others = "
          "share of the CPU other processes used during that engine's timed runs (median).")
    for n in run_info.get("notes", []):
        print("note: " + n)


# --------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=4, help="decoder layers of the synthetic model (default 4)")
    g.add_argument("--experts", type=int, default=0, help="routed experts (default: all 256)")
    g.add_argument("--bits", type=int, choices=[4, 8], default=4)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--hf", help="use this bf16 HF folder instead of `calla synth`")
    g.add_argument("--mlx", help="use this MLX-layout folder instead of `calla convert`")
    g.add_argument("--mlx-converter", choices=["calla", "mlx-lm"], default="calla",
                   help="who writes the MLX folder from the bf16 one (default calla; mlx-lm = mlx_lm.convert)")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--gen-tokens", type=int, default=64)
    g.add_argument("--reps", type=int, default=3,
                   help="rounds; each runs llama-bench (prefill, decode) and calla bench once, interleaved")
    g.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (default: all cores)")
    g.add_argument("--llama-depth", type=int, default=-1,
                   help="context depth of llama-bench's decode test (default: the prompt length)")
    g.add_argument("--mlx-prompt-tokens", type=int, default=None, help="MLX-LM prompt (default min(P, 64))")
    g.add_argument("--mlx-gen-tokens", type=int, default=None, help="MLX-LM generation (default min(G, 8))")
    g.add_argument("--mlx-trials", type=int, default=1)
    g.add_argument("--mlx-timeout", type=int, default=3600, help="seconds before MLX-LM is given up")
    g.add_argument("--timeout", type=int, default=7200, help="seconds for each llama-bench / calla bench run")
    g = p.add_argument_group("engines")
    g.add_argument("--gguf-types", default=None,
                   help="comma-separated GGUF types (default Q4_0 for 4-bit, Q8_0 for 8-bit; e.g. Q4_0,Q4_1)")
    g.add_argument("--no-pure", dest="pure", action="store_false",
                   help="let llama-quantize use its default mix (LM head at Q6_K) instead of --pure")
    g.add_argument("--skip-llama", action="store_true")
    g.add_argument("--skip-mlx", action="store_true")
    g.add_argument("--skip-calla", action="store_true")
    g.add_argument("--llama-cpp-python", default=PINS["llama-cpp-python"])
    g.add_argument("--mlx-version", default=PINS["mlx"])
    g.add_argument("--mlx-lm-version", default=PINS["mlx-lm"])
    g.add_argument("--convert-python", help="python with torch + transformers for convert_hf_to_gguf.py "
                                            "(default: .venv-fixtures/bin/python, else a venv is made)")
    g.add_argument("--calla", help="calla binary (default target/release/calla)")
    g.add_argument("--build-calla", action="store_true", help="run cargo build --release -p calla first")
    g = p.add_argument_group("run")
    g.add_argument("--workdir", default="/tmp/calla-bench")
    g.add_argument("--jobs", type=int, default=os.cpu_count(), help="build parallelism (default: cores)")
    g.add_argument("--nice", type=int, default=10, help="nice level of builds and conversions (not of timing)")
    g.add_argument("--force", action="store_true", help="redo synth/convert/GGUF even if cached")
    g.add_argument("--force-build", action="store_true", help="rebuild llama.cpp")
    g.add_argument("--force-venvs", action="store_true", help="recreate the venvs")
    g.add_argument("--no-record", action="store_true", help="do not append to bench/results/cpu.jsonl")
    g.add_argument("--keep-bf16-gguf", action="store_true",
                   help="keep the intermediate bf16 GGUF (as big as the bf16 folder) after quantizing")
    g.add_argument("--idle-wait", type=int, default=120,
                   help="before each timed run wait up to this many seconds for other load to drop (0: never)")
    g.add_argument("--idle-threshold", type=float, default=0.25,
                   help="fraction of all cores other processes may use when a timed run starts (default 0.25)")
    a = p.parse_args(argv)
    if a.gguf_types is None:
        a.gguf_types = ["Q4_0"] if a.bits == 4 else ["Q8_0"]
    else:
        a.gguf_types = [t.strip().upper() for t in a.gguf_types.split(",") if t.strip()]
    if a.mlx_prompt_tokens is None:
        a.mlx_prompt_tokens = min(a.prompt_tokens, 64)
    if a.mlx_gen_tokens is None:
        a.mlx_gen_tokens = min(a.gen_tokens, 8)
    if a.reps < 1:
        p.error("--reps must be at least 1")
    return a


def main(argv=None):
    a = parse_args(argv)
    ctx = Ctx(a)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    run_info = {"date": date, "machine": machine_info(), "git": git_info(), "pins": PINS | {
        "llama-cpp-python": a.llama_cpp_python, "mlx": a.mlx_version, "mlx-cpu": a.mlx_version,
        "mlx-lm": a.mlx_lm_version}, "args": dict(vars(a)), "notes": ctx.notes}
    results: dict = {}
    errors: dict[str, str] = {}
    calla = None
    try:
        needs_mlx = not (a.skip_calla and a.skip_mlx)
        if not a.hf or not a.skip_calla or (needs_mlx and not a.mlx and a.mlx_converter == "calla"):
            calla = step_calla_binary(ctx)
            run_info["calla_version"] = sh_out([calla, "--version"])
        hf, mlx = step_synth(ctx, calla)
    except StepError as e:
        log(f"FAILED: {e}")
        return 1
    entries = []
    if not a.skip_llama:
        try:
            entries = prepare_llama(ctx, hf, results)
        except (StepError, OSError, ValueError, KeyError) as e:
            errors["llama.cpp"] = str(e)
            log(f"llama.cpp FAILED: {e}")
    # the timed part: rounds interleaving the engines, so a change of load on a shared machine hits all
    run_info["loadavg_timed_start"] = list(os.getloadavg())
    t_timed = time.time()
    for rep in range(a.reps):
        for e in entries:
            if "llama.cpp" in errors:
                break
            try:
                measure_llama_once(ctx, e, rep)
            except (StepError, OSError, ValueError, KeyError, IndexError) as ex:
                errors["llama.cpp"] = str(ex)
                log(f"llama.cpp FAILED: {ex}")
        if not a.skip_calla and "calla" not in errors:
            try:
                measure_calla_once(ctx, calla, mlx, results, rep)
            except (StepError, OSError, ValueError, KeyError) as ex:
                errors["calla"] = str(ex)
                log(f"calla FAILED: {ex}")
    ctx.timed("llama_calla_rounds_s", time.time() - t_timed)
    for e in entries:
        if e["samples"]["pp"]:
            finish_llama(e)
            log(f"llama.cpp {e['gguf_type']}: prefill {e['prefill_tps']:.2f} tok/s, decode {e['decode_tps']:.2f} "
                f"tok/s (medians), {e['bpw']:.3f} bpw")
    if results.get("calla", {}).get("runs"):
        finish_calla(results["calla"])
    if not a.skip_mlx:
        try:
            step_mlx(ctx, mlx, results)
        except (StepError, OSError, ValueError, KeyError) as ex:
            errors["mlx-lm"] = str(ex)
            log(f"MLX-LM FAILED: {ex}")
    run_info["load_avg_end"] = list(os.getloadavg())
    ld = max(run_info["loadavg_timed_start"][0], run_info["load_avg_end"][0])
    measured_others = LAST.get("others") is not None or any(
        x is not None for e in entries for x in e["others"]["pp"] + e["others"]["tg"])
    if ld > 0.5 * (os.cpu_count() or 1) and not measured_others:
        ctx.notes.append(f"load average up to {ld:.1f} around the timed part on {os.cpu_count()} cores: the "
                         "machine was shared, so numbers are low and noisy (compare engines within this run)")
    busy = list({r["engine"]: (r["engine"], r["others"]) for r in summarize(ctx, results, hf, mlx)["rows"]
                 if r.get("others")}.values())
    if any(o > 0.1 for _, o in busy):
        ctx.notes.append("other processes took " + ", ".join(f"{pct(o)} ({n})" for n, o in busy) +
                         " of the CPU during the timed runs: those numbers are depressed, llama.cpp's spinning "
                         "threads most of all")
    if "mlx_lm" in results and results["mlx_lm"].get("capped"):
        ctx.notes.append(f"MLX-LM was capped to prompt {a.mlx_prompt_tokens} / gen {a.mlx_gen_tokens} "
                         f"({a.mlx_trials} trial): its CPU quantized-MoE path is very slow")
    if a.pure and entries:
        ctx.notes.append("GGUF quantized with llama-quantize --pure (every matrix at the one type, as MLX keeps the "
                         "LM head and embeddings at the same bits; GGUF keeps the routers in F32)")
    summary = summarize(ctx, results, hf, mlx)
    run_info["timings_s"] = ctx.timings
    record = {"run": run_info, "summary": summary, "results": results, "errors": errors,
              "paths": {"hf": hf, "mlx": mlx, "workdir": ctx.wd}}
    os.makedirs(os.path.join(ctx.wd, "results"), exist_ok=True)
    out = os.path.join(ctx.wd, "results", f"peers-{date.replace(':', '')}.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print_table(summary, run_info)
    if errors:
        print("\nfailed: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in errors.items()))
    print(f"\nfull results: {out}")
    if not a.no_record:
        line = {
            "date": date, "git": run_info["git"], "calla_version": run_info.get("calla_version"),
            "machine": {k: run_info["machine"][k] for k in ("cpu_model", "cores", "simd", "mem_total_bytes")},
            "load_avg": [run_info["machine"]["loadavg_start"][0], run_info["load_avg_end"][0]],
            "layers": a.layers, "experts": summary["experts"], "bits": a.bits, "threads": a.threads,
            "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "reps": a.reps, "pure": a.pure,
            "pins": run_info["pins"], "memory_bandwidth_gb_s": summary["memory_bandwidth_gb_s"],
            "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in summary["rows"]],
            "ratios": {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                       for k, v in summary["ratios"].items()},
            "errors": {k: v.splitlines()[0] for k, v in errors.items()},
            "details": out,
        }
        os.makedirs(os.path.join(BENCH, "results"), exist_ok=True)
        with open(os.path.join(BENCH, "results", "cpu.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
