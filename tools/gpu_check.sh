#!/usr/bin/env bash
# The device checks of a lent GPU machine in one command (see BENCHMARKS.md, "On one GPU").
# Usage there:  bash tools/gpu_check.sh [OUTDIR]   (the device tool's $OUT by default)
# Installs fullshard into the image's python (no downloads: --no-deps, no build isolation),
# then runs the `gpu` tests, `fullshard bench gpu` and `fullshard bench compare` on CUDA, each
# with its own time limit so one hang cannot eat the rest; logs go to OUTDIR.
set -u
out="${1:-${OUT:-/tmp/gpu_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_step.sh"  # step NAME SECONDS CMD..., install_fullshard, skipped NAME
install_fullshard || exit 1
step gpu_tests "${GPU_TESTS_S:-240}" python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 230
cp BENCHMARKS.md "$out/BENCHMARKS.md"
step bench_gpu "${BENCH_GPU_S:-200}" fullshard bench gpu --offload-presets ${OFFLOAD_PRESETS:-124m 350m 1.3b} \
  --write "$out/BENCHMARKS.md"
TAIL=40 step bench_compare "${COMPARE_S:-150}" fullshard bench compare --nproc 1 --rounds 1 --steps 10 --warmup 3
