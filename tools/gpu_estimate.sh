#!/usr/bin/env bash
# The estimator on one CUDA device, then the `gpu` tests, in one device command.
# Usage there, in the repository root:  bash tools/gpu_estimate.sh [OUTDIR]   ($OUT by default)
# Installs fullshard into the image's python as tools/gpu_check.sh does; each step runs under its
# own time limit (env-overridable) and logs to OUTDIR/NAME.log. SKIP="NAME ..." leaves steps out.
set -u
out="${1:-${OUT:-/tmp/gpu_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_step.sh"  # step NAME SECONDS CMD..., install_fullshard, skipped NAME
install_fullshard || exit 1
# (1) drawn configurations at world size 1 on CUDA, predicted for NCCL, with and without offload
skipped estimate || TAIL=12 step estimate "${ESTIMATE_S:-240}" fullshard bench estimate --sweep "${SWEEP_N:-30}" \
  --seed "${SWEEP_SEED:-4242}" --device cuda
# (2) fullshard on CUDA tensors at two ranks over gloo (NCCL refuses two ranks on one GPU)
skipped gloo_cuda || step gloo_cuda "${GLOO_CUDA_S:-60}" torchrun --standalone --nproc-per-node 2 tools/gloo_cuda_two_ranks.py
# (3) the gpu tests (the engine's CUDA path, the estimate's bound on CUDA included)
skipped gpu_tests ||
  step gpu_tests "${GPU_TESTS_S:-200}" python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 190
