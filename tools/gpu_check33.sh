#!/usr/bin/env bash
# torchtitan 0.3.0 against fullshard on one CUDA GPU (examples/torchtitan_compare.py --device cuda).
# Usage there, in the repository root:  bash tools/gpu_check33.sh [OUTDIR]   ($OUT by default)
# The machine has no network: the packages torchtitan needs and the image lacks come as wheels in
# .whl/ (ignored by git: `echo /.whl/ >> .git/info/exclude`; name `.whl` in the device call's carry),
# made here with:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d .whl torchtitan==0.3.0 datasets==4.7.0 tyro==1.0.17 torchdata==0.11.0 \
#     torch_checkpointing==0.1.1 spmd_types==0.2.3 dill==0.4.0 multiprocess==0.70.18 \
#     docstring_parser==0.18.0 typeguard==4.6.1 typing_extensions==4.16.0 fsspec==2026.2.0
# (2.9 MiB; the versions of .venv's torchtitan extra). A wheel is installed
# into /tmp/site, which goes first on PYTHONPATH, only when the image lacks that distribution or
# has an older version, so nothing of the image's is shadowed without need. fullshard is installed
# into the image's python as in tools/gpu_check.sh. Each step runs under its own time limit
# (env-overridable), logs to OUTDIR/NAME.log and prints its rc, time and log tail; SKIP="NAME ..."
# leaves out the steps named (gpu_tests, nccl_one_gpu, partial_group, bench_gpu).
set -u
out="${1:-${OUT:-/tmp/gpu_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

source "$(dirname "$0")/gpu_step.sh"  # step NAME SECONDS CMD..., install_fullshard, skipped NAME

wheels_needed() {  # print the .whl/*.whl whose distribution is absent or older in this python
  python3 - <<'EOF'
import glob, importlib.metadata as md
try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version
for path in sorted(glob.glob(".whl/*.whl")):
    name, version = path.split("/")[-1].split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(version):
        print(path)
    else:
        print(f"skip {path}: {name} {have} installed", file=__import__("sys").stderr)
EOF
}

if [ -d .whl ]; then
  mapfile -t wheels < <(wheels_needed 2>"$out/wheels_skipped.log")
  cat "$out/wheels_skipped.log"
  if [ "${#wheels[@]}" -gt 0 ]; then
    echo "wheels: ${wheels[*]}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${wheels[@]}" >"$out/wheels.log" 2>&1 || { echo "wheel install failed"; tail -20 "$out/wheels.log"; exit 1; }
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
install_fullshard || exit 1

# (1) two ranks on the one GPU: does NCCL allow it (world size 2 on CUDA for the quantized rows)?
skipped nccl_one_gpu || step nccl_one_gpu "${NCCL_S:-40}" torchrun --standalone --nproc-per-node 2 tools/nccl_one_gpu.py
# (2) torch's FSDP2 on torchtitan's chunked-loss pattern, without torchtitan: a fully_shard([norm, head])
#     group whose forward ran only norm (torch 2.11 leaves it incomplete; the example's shim 10)
skipped partial_group || step partial_group "${PARTIAL_GROUP_S:-60}" torchrun --standalone --nproc-per-node 1 \
  tools/fsdp2_partial_group.py
# (a) can torchtitan, its data stack and its llama3 path import on this torch?
step titan_import "${TITAN_IMPORT_S:-20}" python3 -c '
import importlib.metadata as md, sys
import torch, torchtitan, datasets
sys.path.insert(0, "examples")
import torchtitan_compare
torchtitan_compare.apply_shims("cuda")  # the stub of the triton kernel module llama3 never calls
for d in ("torch", "torchtitan", "datasets", "tyro", "torchdata", "torch_checkpointing", "spmd_types",
          "huggingface_hub", "fsspec", "pyarrow", "typing_extensions"):
    print(d, md.version(d))
import torchtitan.trainer, torchtitan.models.llama3.parallelize, torchtitan.hf_datasets.text_datasets
print("torchtitan trainer imports")'
# (b) torch's FSDP2 vs fullshard inside torchtitan's trainer, loss for loss, one GPU
#     Both engines run even when one fails; each launch gets half the step's time.
compare_s="${TITAN_COMPARE_S:-300}"
launch_s=$(((compare_s - 20) / 2)); [ "$launch_s" -ge 1 ] || launch_s=1
TAIL=40 step titan_compare "$compare_s" python3 examples/torchtitan_compare.py --device cuda \
  --variants "${TITAN_VARIANTS:-eager}" --nproc 1 --timeout "$launch_s"
# (c) fullshard bench gpu on this tree (the 124m preset and its CPU-offload row by default)
cp BENCHMARKS.md "$out/BENCHMARKS.md"
skipped bench_gpu || step bench_gpu "${BENCH_GPU_S:-150}" fullshard bench gpu --offload-presets ${OFFLOAD_PRESETS:-124m} \
  --write "$out/BENCHMARKS.md"
# (d) last, so that a slow test cannot starve the steps above: the gpu tests (the engine's CUDA path)
skipped gpu_tests ||
  step gpu_tests "${GPU_TESTS_S:-150}" python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 140
# The device tool returns at most 8 files: BUNDLE=1 packs everything written into OUTDIR/logs.tgz.
if [ "${BUNDLE:-0}" = 1 ]; then
  tar -C "$out" -czf /tmp/gpu_logs.tgz . && find "$out" -mindepth 1 -delete && mv /tmp/gpu_logs.tgz "$out/logs.tgz"
fi
