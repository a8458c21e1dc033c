#!/usr/bin/env bash
# session 53's first device call: session 52's prepared run (...-s52-device-4.sh) with the full
# model synthesized first, so the whole-prefill compare runs too: the dense GEMMs' mid tile
# (128 weight rows x 128 tokens, two blocks per SM) against the wide tile (self-test `wide`:
# mid = big bit for bit, and the products' timings), the whole prefill with it in one process,
# and the GDN prep's stalls at 8k with the warm-up launches filtered out.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b1
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s53a.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
echo "== synth ($(date +%T))"
[ -d $W/full-q4 ] || timeout 150 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; echo rc $?
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== selftest wide ($(date +%T))"
timeout 170 $b/cuda_selftest --quick --only wide > $R/selftest-wide.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-wide.txt | head -8
echo "mid = big lines ok: $(grep "mid tile = big tile" $R/selftest-wide.txt | grep -c " ok"), all: $(grep -c "mid tile = big tile" $R/selftest-wide.txt)"
grep -E "mid tile +[0-9]" $R/selftest-wide.txt | cut -c1-230
echo "== prefill compare ($(date +%T))"
timeout 150 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only dense_mid_ms --prefill-compare-rounds 7 > $R/compare-mid.txt 2>&1; echo rc $?; pk
grep -E "prefill compare|TTFT" $R/compare-mid.txt 2>/dev/null | cut -c1-220
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
M="--metrics gpu__time_duration.sum,launch__grid_size,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
echo "== ncu stalls: GDN prep at 8k ($(date +%T))"
timeout 120 $NCU -k regex:'^gdnp_prep_tf32$' -c 30 $M $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-stalls-prep-8k.txt 2>&1; echo rc $?
grep -A40 "gdnp_prep_tf32 (16, 128, 1)" $R/ncu-stalls-prep-8k.txt | head -40
echo "== done ($(date +%T))"
pk
