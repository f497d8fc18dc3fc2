#!/usr/bin/env bash
# The GPU checks, in the order the project runs them whenever a GPU is available (docs/gpu.md, "Running the GPU
# checks"): the machine's facts, `pytest -m gpu`, the hook's cost with real CUDA events, the fill runtime's gap
# between steps, the helper thread's wake-up on CUDA events, and the one-GPU harvesting benchmark at full size
# (about 10 minutes on an H100).
# Everything lands in one folder to paste from.
#
#   tools/gpu-checks.sh [OUT]            default OUT: out/gpu-checks
#   PYTHON=/path/to/python tools/gpu-checks.sh   the interpreter with CUDA torch, DeepSpeed and bubbles[agent]
#   HARVEST_ARGS="--jobs batch-inference" tools/gpu-checks.sh   extra flags for benchmarks/gpu_harvest.py
#   SKIP_HARVEST=1 ...                   everything but the benchmark
#
# Exit status: 0 when every step passed; 1 when a step failed (the summary says which); 2 without a GPU.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out/gpu-checks}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-checks: nvidia-smi not found: this needs a machine with an NVIDIA GPU and its driver" >&2
  exit 2
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-checks: $PY has no CUDA torch (torch.cuda.is_available() is False): set PYTHON to one that has" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
failed=()
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  "$PY" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>&1
  echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo 'not found: the MPS regimes and test will be skipped or fail')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "gpu-checks: pytest -m gpu" >&2
"$PY" -m pytest -m gpu -v -p no:cacheprovider > "$OUT/pytest-gpu.txt" 2>&1 || failed+=("pytest -m gpu")
tail -1 "$OUT/pytest-gpu.txt"

echo "gpu-checks: what the hook costs the training's thread, with real CUDA events (benchmarks/hook_overhead.py)" >&2
"$PY" benchmarks/hook_overhead.py --cuda --json "$OUT/hook-overhead.json" > "$OUT/hook-overhead.md" \
  || failed+=("hook_overhead")

echo "gpu-checks: the fill runtime's gap between two steps of a bubble, eager and CUDA graphs (benchmarks/step_gap.py)" >&2
for graphs in false true; do  # about a minute each; a job that never arms gives up after 60 s, saying why
  STEP_GAP_ARM_TIMEOUT_S=60 "$PY" benchmarks/step_gap.py --device cuda:0 --entry bubbles.fill_examples.batch_inference:BatchInference \
    --args "{\"cuda_graphs\": $graphs}" --json "$OUT/step-gap-graphs-$graphs.json" > "$OUT/step-gap-graphs-$graphs.md" \
    || failed+=("step_gap (cuda_graphs $graphs)")
done

echo "gpu-checks: the helper thread's wake-up on CUDA events (benchmarks/gpu_event_wake.py)" >&2
"$PY" benchmarks/gpu_event_wake.py --out "$OUT/wake.json" > "$OUT/wake.md" || failed+=("gpu_event_wake")

if [ "${SKIP_HARVEST:-0}" != 1 ]; then
  echo "gpu-checks: the one-GPU harvesting benchmark (benchmarks/gpu_harvest.py)" >&2
  # shellcheck disable=SC2086
  "$PY" benchmarks/gpu_harvest.py --device cuda --out "$OUT/harvest" ${HARVEST_ARGS:-} > /dev/null \
    || failed+=("gpu_harvest")
fi

echo "gpu-checks: results in $OUT (env.txt, pytest-gpu.txt, hook-overhead.md, step-gap-*.md, wake.md, harvest/report.md)" >&2
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-checks: FAILED: ${failed[*]}" >&2
  exit 1
fi
