#!/usr/bin/env bash
# The prepared GPU check of the private step (one H100 or H200; about 4 minutes): the CUDA tests, then the DP step /
# non-private step grid against Opacus (hooks and ghost clipping) with the noise drawn on the device and, beside it,
# drawn on the CPU and copied, then the quickstart end to end on CUDA and on this machine's CPU.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]          (PY=/path/to/python to choose the interpreter)
#
# Every part has its own time limit, so one slow part cannot starve the others; the log is OUT_DIR/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${1:-${OUT:-/tmp/dporl_gpu_check}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee "$OUT/gpu_check.log") 2>&1

section() { echo; echo "=== $1 ($(date +%T), load: $(cut -d' ' -f1-3 /proc/loadavg))"; }

section "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

section "CUDA tests (device noise: keys, KS at 1e7, reproducibility; engine, trainer and evaluation on CUDA)"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_noise.py tests/test_stable_prefix.py \
    -k "cuda or device" -rs

section "grid: DP step / non-private step, dporl vs Opacus, wall time with synchronisation"
timeout 150 "$PY" benchmarks/bench_dpsgd.py --device cuda --grid --rounds 10 --block-seconds 0.05 \
    --opacus-hooks-max-gb 20

section "quickstart end to end: CUDA, then this machine's CPU (the same config, fresh run directories)"
for device in cuda cpu; do
    start=$(date +%s%N)
    timeout 120 "$PY" train.py --config configs/expert_cql_quickstart.yaml "run_dir=$OUT/quickstart_$device" \
        "trainer.device=$device" > "$OUT/quickstart_$device.txt" 2>&1
    status=$?
    echo "quickstart on $device: exit $status, $(( ($(date +%s%N) - start) / 1000000 )) ms wall"
    tail -3 "$OUT/quickstart_$device.txt"
done
section "done"
