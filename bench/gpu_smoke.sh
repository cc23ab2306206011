#!/usr/bin/env bash
# Issue 30, GPUs as a first-class path: the GPU route end to end on a lent GPU machine, in a few
# minutes: train `tiny` for a few steps with --device cuda, eval it, generate from it, a 2-worker
# cluster with --gpus, and doctor's device line. Exits non-zero
# on the first failure (set -e); prints each step's seconds.
#
# From a session whose task has a device (`status` says can_start_another), in the repo root:
#   mkdir -p .gpu_data && cp ../shared/data/wikitext/wikitext-2-raw-resplit/wiki.*.raw .gpu_data/
#   run(command="bash bench/gpu_smoke.sh", carry=[".gpu_data"], timeout_s=420)
# The device image has torch, numpy and safetensors; the package runs from src/ uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export BLOCKTRAIN_DATA=${BLOCKTRAIN_DATA:-.gpu_data}
work=${OUT:-/tmp}/gpu_smoke
rm -rf "$work" && mkdir -p "$work"
bt() { python3 -m blocktrain "$@"; }
step() {  # step NAME COMMAND...: run it, print its seconds
  local name=$1 t0
  shift
  t0=$(date +%s%N)
  "$@"
  printf 'gpu_smoke: %-9s %6d ms\n' "$name" $((($(date +%s%N) - t0) / 1000000))
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), "GPU(s)")'

step train bt train --preset tiny --steps 20 --device cuda --out "$work/tiny" --no-progress
step eval bt eval "$work/tiny" --split test --device cuda --json >"$work/eval.json"
step generate bt generate "$work/tiny" --prompt "The " --bytes 32 --device cuda
step cluster bt cluster --workers 2 --preset tiny --rounds 2 --local-steps 5 --gpus all \
  --out "$work/cluster" --final-bytes 4096 --final-sweeps 4 --no-progress --json >"$work/cluster.json"
python3 - "$work/cluster.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
bad = {k: v for k, v in s["exit_codes"].items() if v not in (0, None)}
assert not bad, f"cluster processes failed: {bad}"
print("gpu_smoke: cluster final", {k: round(v, 3) for k, v in s["final"].items() if isinstance(v, float)})
PY

# doctor: its network checks fail here (no aggregator at port 1), its device line must still be ok
step doctor bt doctor http://127.0.0.1:1 --device cuda --timeout 2 >"$work/doctor.txt" || true
grep -q '^ok   device   cuda:' "$work/doctor.txt" || { cat "$work/doctor.txt"; exit 1; }
cat "$work/doctor.txt" | tail -1
echo "gpu_smoke: every step passed"
