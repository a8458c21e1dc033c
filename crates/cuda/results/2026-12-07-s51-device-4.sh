#!/usr/bin/env bash
# session 51's fourth device call: ncu stall reasons (per issued instruction) of the attention
# prefill's 128-row flash tile at 8,192 tokens (attn_prefill_flash_wg128_acts), and of every
# gdnp_prep_tf32 / gdnp_state_tf32wgc launch of the same run (the 8k prompt's are those with 128
# chunks: grid (16, 128) for prep, 128 blocks for state), on a 4-layer model. Bundle: as the third call.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
[ -x $b/calla ] || un target/gpu-bundle/calla.xz $b/calla
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
[ -d $CALLA_CUDA_CACHE/sm_90a ] || python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" target/gpu-bundle/cuda-cache.tar.xz $CALLA_CUDA_CACHE
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
pk() { tar -C $R -czf $O/s51d.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
M="--metrics gpu__time_duration.sum,launch__grid_size,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
echo "== ncu flash wg128 8k stalls ($(date +%T))"
timeout 150 $NCU -k regex:'^attn_prefill_flash_wg128_acts$' -c 1 $M $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-flash-wg128-8k-stalls.txt 2>&1; echo rc $?; pk
grep -E "duration|inst_executed|issue_active|warps_active|stalled_(barrier|long|short|wait|math|mio|gmma|dispatch|not_sel|selected|branch|no_inst)" $R/ncu-flash-wg128-8k-stalls.txt | awk '{print $1, $NF}'
echo "== ncu gdnp prep/state, every launch ($(date +%T))"
timeout 200 $NCU -k regex:'^gdnp_(prep_tf32|state_tf32wgc)$' -c 40 $M $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-gdnp-8k-stalls.txt 2>&1; echo rc $?; pk
grep -E "^  gdnp|duration" $R/ncu-gdnp-8k-stalls.txt | tail -8
echo "== done ($(date +%T))"
pk
