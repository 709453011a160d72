# Sourced by tools/gpu_check*.sh and tools/gpu_estimate.sh, which set $out first.
# step NAME SECONDS CMD...: run CMD under a time limit (killed
# 10 s after it), log to $out/NAME.log, print its exit code, its seconds and the log's last
# ${TAIL:-15} lines; returns CMD's exit code.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-15}" "$out/$name.log"
  return $rc
}

# install_fullshard: fullshard into the image's python (no downloads: --no-deps, no build
# isolation; its log in $out/install.log), then the machine's GPU, driver, torch and transformers
# versions to stdout and $out/machine.txt; returns 1 when the install fails.
install_fullshard() {
  python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . >"$out/install.log" 2>&1 \
    || { echo "install failed"; tail -20 "$out/install.log"; return 1; }
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>/dev/null
  } | tee "$out/machine.txt"
}

# skipped NAME: true (and says so) when NAME is in $SKIP, the steps a caller leaves out.
skipped() { [[ " ${SKIP:-} " == *" $1 "* ]] && echo "== $1: skipped"; }
