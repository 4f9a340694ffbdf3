#!/usr/bin/env bash
# The backend micro-benchmark and the decode/prefill step benchmark on a lent accelerator (JAX's
# default platform there: a GPU or a TPU), results and logs under $OUT (default ./accel-out).
# Needs jax and numpy only (nothing is installed: the machine may have no network); multilora's
# CPU kernels are not used there. Try it on the CPU first: JAX_PLATFORMS=cpu QUICK=1 bash benchmarks/accelerator.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./accel-out}
mkdir -p "$OUT"
export MULTILORA_NATIVE=0 PYTHONUNBUFFERED=1
PLATFORM=${JAX_PLATFORMS:-}
{
  echo "date: $(date -u +%FT%TZ)"; uname -a; nproc
  python3 -c "import sys, jax, jaxlib, numpy; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__); print(jax.devices())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ -n "${QUICK:-}" ]; then
  OP_ARGS="--dims 576 --tokens 16 --adapters 8 --budget-s 1"; STEP_ARGS="--repeats 2 --adapters 0 8"
else
  OP_ARGS="--budget-s 3"; STEP_ARGS="--repeats 7 --adapters 0 8 64"
fi
# lora_op.py defaults JAX_PLATFORMS to cpu: hand it the accelerator's platform
JAX_PLATFORMS=${PLATFORM} timeout 230 python3 benchmarks/lora_op.py $OP_ARGS --json "$OUT/lora_op.json" 2>&1 | tee "$OUT/lora_op.log"
for dt in ${DTYPES:-bfloat16 float32}; do
  JAX_PLATFORMS=${PLATFORM} timeout ${STEP_TIMEOUT:-160} python3 benchmarks/forward_step.py --modes decode prefill --dtypes $dt \
      --backends auto bgmv sgmv dense $STEP_ARGS --json "$OUT/forward_step_$dt.json" 2>&1 | tee "$OUT/forward_step_$dt.log"
done
