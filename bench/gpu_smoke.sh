#!/usr/bin/env bash
# Issue 30, GPUs as a first-class path: the GPU route end to end on a lent GPU machine, in a few
# minutes: train `tiny` for a few steps with --device cuda, eval it, generate from it, a 3-worker
# cluster with --gpus, doctor's device line, and a block host on the GPU behind a router (one
# completion through the sampler, one through the head exit). Exits non-zero on the first
# failure (set -e); prints each step's seconds. SMOKE_DEVICE=cpu runs the same steps on the CPU
# (what a session without a GPU can check of the script itself).
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
device=${SMOKE_DEVICE:-cuda}
bt() { python3 -m blocktrain "$@"; }
step() {  # step NAME COMMAND...: run it, print its seconds
  local name=$1 t0  # its seconds go to stderr: a step may write its own stdout to a file
  shift
  t0=$(date +%s%N)
  "$@"
  printf 'gpu_smoke: %-9s %6d ms\n' "$name" $((($(date +%s%N) - t0) / 1000000)) >&2
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
gpus=()
if [[ $device == cuda* ]]; then
  python3 -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), "GPU(s)")'
  gpus=(--gpus all)
fi

step train bt train --preset tiny --steps 20 --device "$device" --out "$work/tiny" --no-progress
step eval bt eval "$work/tiny" --split test --device "$device" --json >"$work/eval.json"
step generate bt generate "$work/tiny" --prompt "The " --bytes 32 --device "$device"
step cluster bt cluster --workers 3 --preset tiny --rounds 2 --local-steps 5 "${gpus[@]}" \
  --out "$work/cluster" --final-bytes 4096 --final-sweeps 4 --no-progress --json >"$work/cluster.json"
python3 - "$work/cluster.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
bad = {k: v for k, v in s["exit_codes"].items() if v not in (0, None)}
assert not bad, f"cluster processes failed: {bad}"
print("gpu_smoke: cluster final", {k: round(v, 3) for k, v in s["final"].items() if isinstance(v, float)})
PY

# doctor: its network checks fail here (no aggregator at port 1), its device line must still be ok
step doctor bt doctor http://127.0.0.1:1 --device "$device" --timeout 2 >"$work/doctor.txt" || true
grep -q "^ok   device   ${device%%:*}" "$work/doctor.txt" || { cat "$work/doctor.txt"; exit 1; }
tail -1 "$work/doctor.txt"

# serve-block on the device: one host holds the three blocks, a router in front of it
# (python3 itself in the background, not `bt`: $! must be the server's pid for the trap)
python3 -m blocktrain serve-block "$work/tiny" --blocks 0,1,2 --port 8101 --device "$device" \
  >"$work/host.log" 2>&1 &
host=$!
python3 -m blocktrain serve --hosts http://127.0.0.1:8101 --port 8100 >"$work/router.log" 2>&1 &
router=$!
trap 'kill $host $router 2>/dev/null || true' EXIT
step serve python3 - <<'PY'
import json, time, urllib.error, urllib.request

base = "http://127.0.0.1:8100"
deadline = time.time() + 120
while True:  # ready once a 1-byte sweep has gone through the host
    try:
        if urllib.request.urlopen(base + "/readyz", timeout=5).status == 200:
            break
    except (urllib.error.URLError, ConnectionError):
        pass
    assert time.time() < deadline, "the router never became ready"
    time.sleep(1)
for exit_ in ("sampler", "head"):
    body = {"model": "tiny", "prompt": "The ", "max_tokens": 16, "seed": 1, "exit": exit_}
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    text = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"]
    assert text, f"an empty completion through the {exit_} exit"
    print(f"gpu_smoke: served through the {exit_} exit: {text!r}")
PY
grep -q "serving blocks \[0, 1, 2\]" "$work/host.log" || { cat "$work/host.log"; exit 1; }
echo "gpu_smoke: every step passed"
