#!/usr/bin/env bash
# session 49, call 3: wgmma descriptors advanced by an add (flash attention's 128-row tile, GDN state kernels):
# self-tests attnpre + gdnpre (new; base for the times), cuda-check, interleaved A/B of the whole prefill.
# Build here first: scripts/gpu_bundle.sh at the commit to compare against, then
# `mv target/gpu-bundle target/gpu-bundle-s49b`; apply 2026-12-07-s49-wgmma-desc-add.patch and run
# scripts/gpu_bundle.sh again (target/gpu-bundle); copy this script into target/gpu-bundle, and
# carry both folders (scripts/gpu_slim.sh out, and move crates/cuda/results aside: 64 MiB).
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
un target/gpu-bundle/calla.xz $b/calla-new; un target/gpu-bundle/cuda_selftest.xz $b/selftest-new
un target/gpu-bundle-s49b/calla.xz $b/calla-base; un target/gpu-bundle-s49b/cuda_selftest.xz $b/selftest-base
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
for t in target/gpu-bundle/cuda-cache.tar.xz target/gpu-bundle-s49b/cuda-cache.tar.xz; do python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" $t $CALLA_CUDA_CACHE; done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
W=/tmp/calla-gpu; mkdir -p $W
( $b/calla-base synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
for v in new base; do
  echo "== selftest $v ($(date +%T))"
  timeout 150 $b/selftest-$v --quick --only attnpre,gdnpre > $R/selftest-$v.txt 2>&1; echo rc $?; tar -C $R -czf $O/s49c.tar.gz .
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-$v.txt | head -5
  grep -E "t  1024 pos0    0:|t  8192 pos0    0:" $R/selftest-$v.txt | sed -E 's/\| (Q64|Q128)[^|]*//g' | cut -c1-230
  grep -E "^gdn_prefill tf32(-wg|-wgc)? +T=(1024|8192) " $R/selftest-$v.txt | cut -c1-200
done
timeout 60 $b/calla-new synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check L4 new ($(date +%T))"
timeout 60 $b/calla-new cuda-check --model $W/L4 --pdl > $R/cuda-check-new.txt 2>&1; echo rc $?; tail -1 $R/cuda-check-new.txt
wait $SP; tail -1 $R/synth-full.txt
for v in base new new base; do
  n=$(ls $R/ab-$v-*.txt 2>/dev/null | wc -l)
  timeout 45 $b/calla-$v cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 8 > $R/ab-$v-$n.txt 2>&1
  echo "$v $n rc $? $(grep -E '^prefill +[0-9]+:' $R/ab-$v-$n.txt | awk '{printf "%s %s ms; ", $2, $4}')"; tar -C $R -czf $O/s49c.tar.gz .
done
echo "== done ($(date +%T))"
tar -C $R -czf $O/s49c.tar.gz .
