#!/usr/bin/env bash
# session 51's device call for the attention decode step's single split (one split per KV head up
# to N 16-key tiles, whose block writes the gated output; the combine returns at once):
# target/gpu-bundle built with scripts/gpu_bundle.sh from the working tree. Self-test attn (the
# new 300-step pass included), decode A/B in alternating processes of the same binary
# (--attn-single-split-max 0 / 16), cuda-check with it on.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
un target/gpu-bundle/calla.xz $b/calla; un target/gpu-bundle/cuda_selftest.xz $b/selftest
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" target/gpu-bundle/cuda-cache.tar.xz $CALLA_CUDA_CACHE
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s51g.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( $b/calla synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
echo "== selftest attn ($(date +%T))"
timeout 150 $b/selftest --quick --only attn > $R/selftest-attn.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked|out, steps|single step|splits per KV" $R/selftest-attn.txt | head -14
grep -E "^\| *[0-9]|context|us / step|alone" $R/selftest-attn.txt | head -8
wait $SP; tail -1 $R/synth-full.txt
for round in 1 2; do for t in 0 16; do
  timeout 70 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 512 --decode-contexts 128,4096 --gen-tokens 64 --attn-single-split-max $t > $R/ab-single$t-$round.txt 2>&1
  echo "single-max $t round $round rc $? $(grep -E '^decode @' $R/ab-single$t-$round.txt | awk '{printf "%s %s tok/s (%s); ", $3, $4, $6}')"; pk
done; done
timeout 40 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check L4, single split 16 ($(date +%T))"
timeout 120 $b/calla cuda-check --model $W/L4 --pdl --attn-single-split-max 16 > $R/cuda-check-single16.txt 2>&1; echo rc $?; tail -1 $R/cuda-check-single16.txt
echo "== done ($(date +%T))"
pk
