#!/usr/bin/env bash
# session 51's second device call: the attention prefill's pipelined 128-row tile, second form (Wg128p: the next key block's Q·K^T beside each softmax, K two blocks and V one ahead, one barrier per 64 keys; the first form, K and V one key
# block ahead, one barrier per 64 keys; opt-in --attn-pipelined true; the same bits as Wg128).
# target/gpu-bundle built here with scripts/gpu_bundle.sh from the working tree (carry it; the
# checkout slimmed with scripts/gpu_slim.sh out, results aside).
# Self-test attnpre (Wg128p against the CPU and against Wg128 bit for bit, and the flash timings),
# the whole prefill with and without it in one process, cuda-check with it on chunks of 2,048.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
un target/gpu-bundle/calla.xz $b/calla; un target/gpu-bundle/cuda_selftest.xz $b/selftest
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" target/gpu-bundle/cuda-cache.tar.xz $CALLA_CUDA_CACHE
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s51b.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( $b/calla synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
echo "== selftest attnpre ($(date +%T))"
timeout 150 $b/selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
echo "Wg128p bit-for-bit lines ok: $(grep "Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok"), all: $(grep -c "Wg128's, bit for bit" $R/selftest-attnpre.txt)"
grep -E "wg128p?(_acts)?:" $R/selftest-attnpre.txt | head -4
grep -E "pos0    0:|pos0 7680:|pos0 8128:" $R/selftest-attnpre.txt | sed -E 's/\| (Q64|Q128)[^|]*//g' | cut -c1-260
wait $SP; tail -1 $R/synth-full.txt
echo "== prefill compare ($(date +%T))"
timeout 120 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only attn_wg128p_ms --prefill-compare-rounds 11 > $R/compare.txt 2>&1; echo rc $?
grep "prefill compare" $R/compare.txt | cut -c1-200; pk
timeout 40 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check L4, pipelined, chunks of 2048 ($(date +%T))"
timeout 150 $b/calla cuda-check --model $W/L4 --pdl --attn-pipelined true --prompt-tokens 300,2100 --prefill-chunk 2048 > $R/cuda-check-pipelined.txt 2>&1; echo rc $?; tail -2 $R/cuda-check-pipelined.txt
pk
echo "== bench, pipelined ($(date +%T))"
timeout 90 $b/calla cuda-bench --model $W/full-q4 --pdl --attn-pipelined true --prompt-tokens 512,1024,2048,8192 --decode-contexts 128 --gen-tokens 16 > $R/bench-pipelined.txt 2>&1; echo rc $?
grep -E "^prefill +[0-9]+:|^decode" $R/bench-pipelined.txt
echo "== done ($(date +%T))"
pk
