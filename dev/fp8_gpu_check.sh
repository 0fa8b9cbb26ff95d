#!/usr/bin/env bash
# The FP8 path's checks and measurements on an H200 (docs/FP8.md): the GPU tests of the attention's
# FP8 forms, k_layernorm_fwd_fp8's block shapes, the amax in the optimizer's update and the
# folded GELU, the step with other settings against the defaults in one process, what the step's
# graphs hold, and the step against PyTorch.
#
#   bash dev/fp8_gpu_check.sh [OUT_DIR] [STEPS]     # from the repository root
#
# STEPS: which of the numbered steps below to run, e.g. "1 2" (default: all; about 9 minutes on one
# H200, the sm_90a builds of step 1 three of them, so split it where a job is limited to 10).
# Needs: a GPU of compute capability 9.0, CuPy, pytest, pandas; torch for the anchor (step 3). A
# failed step is recorded in summary.txt and the next runs.
set -uo pipefail
OUT=${1:-fp8-gpu-check}
STEPS=${2:-"1 2 3"}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
: > "$OUT/summary.txt"
run() {  # run NAME CMD...: its output to OUT/NAME.txt, its time and status to summary.txt
  local name=$1 t0=$SECONDS
  shift
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || tail -20 "$OUT/$name.txt"
}
want() { [[ " $STEPS " == *" $1 "* ]]; }
EXP="--exp ANDREA-120M --precision fp8 --batch 8"

# 1. the GPU tests: the attention's FP8 kernels bit for bit against the kernel and the cast, a run
#    with them on and off, k_layernorm_fwd_fp8 at every block shape, the delayed scales, two runs
#    bit-identical, the amax in the update, the folded GELU, programmatic launches, the casts'
#    tiles (partial and whole); and the sm_90a builds (ptxas)
if want 1; then
  run tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/cuda/test_fp8_cuda.py tests/cuda/test_engine_cuda.py \
    -k "attention or layernorm_fwd_fp8 or delayed or layernorm_cast or two_runs or adamw or weight_cache or gelu or pdl or cast_kernels or many_kernels"
  run hopper_compile python3 -m pytest -q -p no:cacheprovider tests/test_hopper_compile.py
fi

# 2. other tuning values, the dlogits rounded to nearest and the launch without programmatic
#    dependence against the defaults, in one process, interleaved, the step's graphs replayed
#    (dev/ab_settings.py --replay: the device's time alone), and the step's graphs as DOT with the
#    node census (dev/graph_probe.py)
if want 2; then
  run ab_switches python3 dev/ab_settings.py $EXP --replay --rounds 15 --steps 20 --json "$OUT/ab_switches.json" \
    --variant base: --variant ln16x8:fp8_layernorm_rows=16,fp8_layernorm_warps=8 \
    --variant tile128:fp8_tile_rows=128 --variant nearest:fp8_dlogits_rounding=nearest --variant nopdl:pdl=0
  run graph_probe python3 dev/graph_probe.py $EXP --out "$OUT/dot"
fi

# 3. the step against PyTorch's best 16-bit configuration (bf16, torch.compile reduce-overhead) in
#    this job, with the per-kernel table, and the device time per kernel; BENCH_SET (e.g. "--set
#    fp8_tile_rows=128") adds settings to both
if want 3; then
  run bench python3 -m andrea.bench $EXP --steps 50 --anchor benchmarks/torch_gpt.py ${BENCH_SET:-} \
    --anchor-modes reduce-overhead --anchor-precision bf16 --json "$OUT/bench.json"
  run profile python3 dev/profile_kernels.py $EXP --steps 3 --csv "$OUT/profile.csv" ${BENCH_SET:-}
fi
cat "$OUT/summary.txt"
