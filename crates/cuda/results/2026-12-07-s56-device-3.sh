#!/usr/bin/env bash
# session 56's third device script (little device time left): the benchmark of the new defaults
# only (the GDN prep's balanced Tm products, the 8k GDN input projection on the big tile).
#   bash target/gpu-bundle/device.sh
# Not run in session 56: no device machine could be started again after the first call (the
# session's device time went on failed starts). Rebuild the bundle (scripts/gpu_bundle.sh) and
# copy this file to target/gpu-bundle/device.sh.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res56c; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b56c
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s56c.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
[ -d $W/full-q4 ] || timeout 150 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; tail -1 $R/synth.txt
echo "== bench ($(date +%T))"
timeout 100 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
grep -E "^prefill|^decode" $R/bench.txt | cut -c1-200
echo "== done ($(date +%T))"
