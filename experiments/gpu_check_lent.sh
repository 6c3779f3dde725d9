#!/usr/bin/env bash
# The GPU check as ONE command of a lent device (docs/gpu_check.md, "On a lent device"): every step asked
# within DEADLINE_S seconds (each step gets what is left), the log, records and figures packed into
# $OUT/gpu_check.tar.gz; gpu_check's summary, the last lines of its output, is the short table. Run
# from the repository root with the machine's python3 (nothing is installed). BURST_BENCH_GIT_COMMIT
# names the commit the copied tree came from (its .git is an older checkout's).
#   DEADLINE_S=360 bash experiments/gpu_check_lent.sh
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-360}
STEPS=${STEPS:-packages,tests,sdpa,gemm,memory,sweep}
SEQLENS=${SEQLENS:-4096,8192,16384,32768}
KERNELS=${KERNELS:-flash_attn,xformers,cuda_sdpa,cuda_flash,cuda_cudnn}
SDPA=${SDPA-torch_sdpa,torch_sdpa_flash,torch_sdpa_efficient,torch_sdpa_cudnn}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
nvidia-smi -L 2>&1 | head -4
timeout -k 15 $((DEADLINE_S + 40)) python3 -m experiments.gpu_check --steps "$STEPS" --deadline-s "$DEADLINE_S" \
    --seqlens "$SEQLENS" --kernels "$KERNELS" --sdpa "$SDPA" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/gpu_check.tar.gz" results/gpu_check plots/gpu_check 2>/dev/null
exit $rc
