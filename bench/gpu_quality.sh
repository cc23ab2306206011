#!/usr/bin/env bash
# Issue 3, must-show 5: the `paper` preset and its end-to-end reference side by side on one GPU
# (test CE, throughput, peak GPU memory), inside 8 minutes of device time: about 1 minute to start
# the machine, 150 s of BlockTrain training, less for the reference, a minute of evaluation.
#
# From a session whose task has a device (`status` says can_start_another), in the repo root:
#   mkdir -p .gpu_data && cp ../shared/data/wikitext/wikitext-2-raw-resplit/wiki.*.raw .gpu_data/
#   run(command="bash bench/gpu_quality.sh", carry=[".gpu_data"], timeout_s=480)
#   cp <files_at>/gpu_quality.json benchmarks/results/ && python bench/gpu_quality.py --report
# The device image has torch, numpy and safetensors; the package runs from src/ uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
data=${BLOCKTRAIN_DATA:-.gpu_data}
out=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 bench/gpu_quality.py --data "$data" --out "$out" --budget "${BUDGET:-150}" "$@"
