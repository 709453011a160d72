#!/usr/bin/env bash
# The estimator on one CUDA device, then the `gpu` tests, in one device command.
# Usage there, in the repository root:  bash tools/gpu_estimate.sh [OUTDIR]   ($OUT by default)
# Installs fullshard into the image's python as tools/gpu_check.sh does; each step runs under its
# own time limit (env-overridable) and logs to OUTDIR/NAME.log. SKIP="NAME ..." leaves steps out.
set -u
out="${1:-${OUT:-/tmp/gpu_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . >"$out/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$out/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
    torch.cuda.get_device_name(), "transformers", transformers.__version__)'
} | tee "$out/machine.txt"
source "$(dirname "$0")/gpu_step.sh"  # step NAME SECONDS CMD...
skipped() { [[ " ${SKIP:-} " == *" $1 "* ]] && echo "== $1: skipped"; }
# (1) drawn configurations at world size 1 on CUDA, predicted for NCCL, with and without offload
skipped estimate || TAIL=12 step estimate "${ESTIMATE_S:-240}" fullshard bench estimate --sweep "${SWEEP_N:-30}" \
  --seed "${SWEEP_SEED:-4242}" --device cuda
# (2) fullshard on CUDA tensors at two ranks over gloo (NCCL refuses two ranks on one GPU)
skipped gloo_cuda || step gloo_cuda "${GLOO_CUDA_S:-60}" torchrun --standalone --nproc-per-node 2 tools/gloo_cuda_two_ranks.py
# (3) the gpu tests (the engine's CUDA path, the estimate's bound on CUDA included)
skipped gpu_tests ||
  step gpu_tests "${GPU_TESTS_S:-200}" python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 190
