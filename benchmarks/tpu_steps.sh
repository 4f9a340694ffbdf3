#!/usr/bin/env bash
# On a lent TPU: the Pallas kernels' tests compiled on the chip, then model steps at both of the
# issue's shapes (SmolLM2-135M, Llama-3.2-1B; random bf16 weights, rank-16 adapters on all seven
# projections), 0 / 8 / 64 adapters, multilora's TPU backend beside `dense` (sglang-jax's one-hot
# product over every slot). Raw output under $OUT. Parts: PARTS="tests small slots big trace".
# Try it on the CPU first: JAX_PLATFORMS=cpu QUICK=1 bash benchmarks/tpu_steps.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./tpu-out}
mkdir -p "$OUT"
export MULTILORA_NATIVE=0 PYTHONUNBUFFERED=1
PARTS=${PARTS:-tests small slots big}
R=${REPEATS:-7}
FS="python3 benchmarks/forward_step.py --dtypes bfloat16 --repeats $R"
if [ -n "${QUICK:-}" ]; then FS="$FS --decode-seqs 8 --prefill-tokens 64"; fi
python3 -c "import jax, sys; print(sys.version); print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
for part in $PARTS; do
  case $part in
    tests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider --noconftest tests/test_lora_pallas.py 2>&1 | tee "$OUT/tests.log" ;;
    small) timeout 300 $FS --modes decode prefill --adapters 0 8 64 --backends auto dense \
             --json "$OUT/steps_small.json" 2>&1 | tee "$OUT/steps_small.log" ;;
    slots) timeout 240 $FS --modes decode prefill --adapters 0 8 64 --slots 256 --backends auto \
             --json "$OUT/steps_slots256.json" 2>&1 | tee "$OUT/steps_slots256.log" ;;
    big)   timeout 300 $FS --model llama-3.2-1b --decode-ctx 256 --modes decode prefill --adapters 0 8 64 \
             --backends auto --json "$OUT/steps_1b.json" 2>&1 | tee "$OUT/steps_1b.log" ;;
    trace) timeout 200 $FS --modes decode prefill --adapters 0 64 --backends auto --repeats 3 \
             --trace /tmp/fs-trace 2>&1 | tee "$OUT/steps_trace.log"
           timeout 200 $FS --model llama-3.2-1b --decode-ctx 256 --modes decode prefill --adapters 0 --repeats 3 \
             --trace /tmp/fs-trace-1b 2>&1 | tee "$OUT/steps_trace_1b.log" ;;
  esac
done
