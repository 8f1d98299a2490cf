#!/usr/bin/env bash
# Issue 58's GPU check, as the device tool runs it on a lent GPU machine (torch, Triton, transformers and pytest are
# there; nothing can be downloaded). Here, once: `make gpu-wheels` (pagedllm's other dependencies, for that
# machine's Python 3.12, into .whl/). Then the device tool's run, with carry [".whl"]:
#     bash bench/gpu_check.sh
# It writes gpu.json, gpu.log and kernel.log under $OUT (the device tool brings them back); inside 8 minutes on
# an H200 (bench gpu stopped at 400 s, the kernel comparison at 80 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install (make gpu-wheels here, carry .whl)"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD:$PWD/bench" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.log"
timeout 400 python3 -m pagedllm_bench gpu --out "$OUT/gpu.json" "$@" 2>&1 | tee -a "$OUT/gpu.log"
# the two paged-attention backends and contiguous SDPA (which is faster, and why)
timeout 80 python3 -m pagedllm_bench kernel --device cuda 2>&1 | tee "$OUT/kernel.log"
