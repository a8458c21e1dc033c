#!/usr/bin/env bash
# session 57's device script: the dense products on bf16 weight copies (--gemm-bf16-weights:
# self-test bf16w, cuda-check, the prefill compare against the quantized products), then what
# session 56 could not run (the defaults' benchmark and cuda-check, self-test attnpre, cuda-check
# at pos0 % 16 = 4) and a prefill profile of the defaults, as the call's 600 s allow (each step
# has its own timeout and packs the results so far).
#   bash target/gpu-bundle/device.sh
# Not run in session 57: no device machine started (two starts failed, then lending paused).
# Rebuild the bundle (scripts/gpu_bundle.sh) and copy this file to target/gpu-bundle/device.sh.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res57a; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b57a
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s57a.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1; touch $W/L4.done
  [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; touch $W/full.done ) &
echo "== selftest bf16w ($(date +%T))"
timeout 120 $b/cuda_selftest --quick --only bf16w > $R/selftest-bf16w.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-bf16w.txt | head -8
echo "bit for bit ok: $(grep -c "bit for bit.* ok" $R/selftest-bf16w.txt) of $(grep -c "bit for bit" $R/selftest-bf16w.txt)"
grep -E "bf16w timing|TFLOP" $R/selftest-bf16w.txt | cut -c1-160
while [ ! -e $W/L4.done ]; do sleep 2; done
echo "== cuda-check bf16 weights ($(date +%T))"
timeout 90 $b/calla cuda-check --model $W/L4 --pdl --gemm-bf16-weights --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check-bf16w.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-bf16w.txt | head -3
while [ ! -e $W/full.done ]; do sleep 2; done; tail -1 $R/synth.txt
echo "== compare bf16 weights ($(date +%T))"
timeout 130 $b/calla cuda-bench --model $W/full-q4 --pdl --gemm-bf16-weights --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only dense_quantized_ms --prefill-compare-rounds 7 > $R/compare-bf16w.txt 2>&1; echo rc $?; pk
grep -iE "bf16|quantized|^prefill" $R/compare-bf16w.txt | cut -c1-200 | head -12
echo "== bench defaults ($(date +%T))"
timeout 100 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128,4096 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
grep -E "^prefill|^decode" $R/bench.txt | cut -c1-200
echo "== cuda-check defaults ($(date +%T))"
timeout 80 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check.txt | head -3
echo "== selftest attnpre ($(date +%T))"
timeout 70 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
echo "== cuda-check chunks of 2052 ($(date +%T))"
timeout 60 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 4100 --prefill-chunk 2052 > $R/cuda-check-c2052.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-c2052.txt | head -3
echo "== profile ($(date +%T))"
timeout 80 $b/calla cuda-bench --model $W/full-q4 --pdl --prefill-profile --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 16 > $R/profile.txt 2>&1; echo rc $?; pk
grep -E "prefill profile|GDN|experts|router|attn|shared" $R/profile.txt | head -30
echo "== done ($(date +%T))"
