#!/usr/bin/env bash
# session 57's first device script: session 56's second script (the new defaults' cuda-check
# and benchmark, self-test attnpre, cuda-check at pos0 % 16 = 4), then a prefill profile of the
# defaults (the last one is session 45's).
#   bash target/gpu-bundle/device.sh
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
  [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1 ) &
while [ ! -e $W/L4.done ]; do sleep 2; done
echo "== cuda-check defaults ($(date +%T))"
timeout 100 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check.txt | head -3
echo "== selftest attnpre ($(date +%T))"
timeout 90 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
for f in Wg128ws Wg128tma Wg128mc; do echo "$f bit-for-bit ok: $(grep " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok") of $(grep -c " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt)"; done
echo "== cuda-check chunks of 2052 ($(date +%T))"
timeout 80 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 4100 --prefill-chunk 2052 > $R/cuda-check-c2052.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-c2052.txt | head -3
wait; tail -1 $R/synth.txt
echo "== bench ($(date +%T))"
timeout 120 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128,4096 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
grep -E "^prefill|^decode" $R/bench.txt | cut -c1-200
echo "== profile ($(date +%T))"
timeout 100 $b/calla cuda-bench --model $W/full-q4 --pdl --prefill-profile --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 16 > $R/profile.txt 2>&1; echo rc $?; pk
grep -E "prefill profile|GDN|experts|router|attn|shared" $R/profile.txt | head -30
echo "== done ($(date +%T))"
