#!/usr/bin/env bash
# session 53's fifth device script (for the next session; no device time was left): the default
# attention tile (Wg128tma) with the mbarrier-init fence added after the review (b9873e3):
# self-test `attnpre` (every warp-specialized form against Wg128 bit for bit) and cuda-check
# with prompts that run the tile on chunks after a prefix (pos0 > 0) and on a 2,048-token chunk
# at pos0 % 16 = 4 (warpgroup 0's whole-masked last block). Bundle: target/gpu-bundle.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res5; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b5
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s53e.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
echo "== selftest attnpre ($(date +%T))"
timeout 170 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
for f in Wg128ws Wg128tma Wg128mc; do echo "$f bit-for-bit ok: $(grep " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok") of $(grep -c " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt)"; done
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check ($(date +%T))"
# 4,100 tokens in chunks of 2,048: the second chunk runs the tile at pos0 2,048; 2,052 + 2,048
# at chunk 2,052 would put a chunk at pos0 % 16 = 4
timeout 150 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check-4100.txt 2>&1; echo rc $?
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100.txt | head -3
timeout 150 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 4100 --prefill-chunk 2052 > $R/cuda-check-4100-c2052.txt 2>&1; echo rc $?
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100-c2052.txt | head -3
echo "== done ($(date +%T))"
pk
