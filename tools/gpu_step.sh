# Sourced by tools/gpu_check*.sh. step NAME SECONDS CMD...: run CMD under a time limit (killed
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
