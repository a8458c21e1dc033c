#!/usr/bin/env bash
# session 52's third device call: the stall reasons of the prefill's dense wide-tile GEMM (the
# GDN in_proj at 8,192 tokens, qgemm_q4_wide_lb: tensor pipe 63% busy, 2 warps per scheduler,
# 0.37 eligible in the second call) and of the GDN prep kernel at 8k; then the benchmark of this
# tree's defaults on the full-size model (prompts 512 / 1k / 2k / 8k, decode at 128 / 4k / 32k).
# Bundle: target/gpu-bundle (this session's tree).
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s52c.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
[ -d $W/full-q4 ] || ( $b/calla synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
M="--metrics gpu__time_duration.sum,launch__grid_size,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
echo "== ncu stalls: dense wide in_proj, GDN prep, 8k ($(date +%T))"
timeout 200 $NCU -k regex:'^(qgemm_q4_wide_lb|gdnp_prep_tf32)$' -c 2 $M $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-stalls-wide-prep-8k.txt 2>&1; echo rc $?; pk
grep -E "qgemm_q4_wide_lb \(|gdnp_prep_tf32 \(|duration|issue_active|hmma|stalled_(barrier|long_scoreboard|short_scoreboard|wait|gmma|math_pipe|dispatch|not_selected|mio|lg_throttle|membar|no_instruction|branch)" $R/ncu-stalls-wide-prep-8k.txt | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '{$1=$1; print}' | head -44
wait $SP; tail -1 $R/synth-full.txt 2>/dev/null
echo "== bench ($(date +%T))"
timeout 240 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 512,1024,2048,8192 --decode-contexts 128,4096,32768 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?
grep -E "^prefill +[0-9]+:|^decode" $R/bench.txt
echo "== done ($(date +%T))"
pk
