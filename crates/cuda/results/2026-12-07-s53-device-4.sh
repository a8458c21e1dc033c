#!/usr/bin/env bash
# session 53's fourth device script: the benchmark of the defaults with the warp-specialized
# TMA attention tile (Wg128tma where the plan says Wg128), and the whole prefill without it
# (Wg128) in one process, a second time.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res4; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b4
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s53d.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
echo "== synth ($(date +%T))"
[ -d $W/full-q4 ] || timeout 150 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; echo rc $?
echo "== bench ($(date +%T))"
timeout 200 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 512,1024,2048,8192 --decode-contexts 128,4096,32768 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
grep -E "^prefill|^decode|calla cuda-bench" $R/bench.txt | cut -c1-200
echo "== prefill compare ($(date +%T))"
# (only where the call's device time allows: the bench above is what this call is for)
[ $SECONDS -lt 150 ] && timeout 80 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only attn_wg128ws_ms --prefill-compare-rounds 9 > $R/compare-tma.txt 2>&1; echo rc $?
grep -E "prefill compare" $R/compare-tma.txt 2>/dev/null | cut -c1-220
echo "== done ($(date +%T))"
pk
