#!/usr/bin/env bash
# session 51's third device call: ncu on the attention prefill's 128-row flash tile at 8,192 tokens
# (the entry point the prefill runs, attn_prefill_flash_wg128_acts; a 4-layer model, whose one
# attention layer runs it), and on the GDN prep kernel of that prompt. The bundle is the second
# call's (target/gpu-bundle, built with the Wg128p patch, whose Wg128 entry points are the same
# code with the softmax in a lambda: 237 registers, as at HEAD).
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
[ -x $b/calla ] || un target/gpu-bundle/calla.xz $b/calla
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" target/gpu-bundle/cuda-cache.tar.xz $CALLA_CUDA_CACHE
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
pk() { tar -C $R -czf $O/s51c.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy --section InstructionStats"
echo "== ncu flash wg128 8k ($(date +%T))"
timeout 200 $NCU -k regex:'^attn_prefill_flash_wg128_acts$' -c 1 $S $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-flash-wg128-8k.txt 2>&1; echo rc $?; pk
grep -E "Duration|Throughput|Pipe|Issue|Eligible|Stall|Bank|Shared|tensor|Tensor|Registers|Warp Cycles" $R/ncu-flash-wg128-8k.txt | head -60
echo "== ncu gdnp_prep 8k ($(date +%T))"
timeout 200 $NCU -k regex:'^gdnp_prep_tf32$' --launch-skip 12 -c 1 $S $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-gdnp-prep-8k.txt 2>&1; echo rc $?; pk
grep -E "gdnp_prep_tf32 \(|Duration|Issue Slots|Eligible|Warp Cycles Per Issued" $R/ncu-gdnp-prep-8k.txt | head -20
echo "== done ($(date +%T))"
pk
