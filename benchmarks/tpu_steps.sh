#!/usr/bin/env bash
# On a lent TPU: the Pallas kernels' tests compiled on the chip, then model steps at both of the
# issue's shapes (SmolLM2-135M, Llama-3.2-1B; random bf16 weights, rank-16 adapters on all seven
# projections), 0 / 8 / 64 adapters, multilora's TPU backend beside `dense` (sglang-jax's one-hot
# product over every slot). Raw output under $OUT. Parts (PARTS="..."): tests atests (the kernels'
# tests compiled on the chip), small slots big (LoRA backends), pa pa1b (XLA and Pallas attention), asweep (the Pallas attention's query block x chunk keys), lanepack (kv heads two to a cache row, against one), chunkcopy (a chunk in one copy a pool), zerolocal (the zero page's copies from VMEM against HBM), lanes (the kernel at widths of whole lane tiles), overlap (copies under math, a probe kernel),
# trace, optrace, pprobe (the Pallas attention's prefill side), copyloop, families (issue 40's families on the chip), offline (the engine's throughput), startup (an
# Engine with adapters compiled at start), stash and
# agree (greedy tokens against the CPU's float32 record, benchmarks/tpu_agreement.py), cases
# (each shape x mode x adapter count in its own process, whole outputs kept), variants (other
# trees' cases side by side). Every limit is `timeout -k 5`: GNU timeout sends its SIGTERM to the
# child and then to the child's group, so it can reach the child twice. A cut JAX process then
# prints absl's "Signal 15 raised ... while already in FailureSignalHandler" (the second TERM,
# not a crash of its own: log 33 took it for one), and the KILL 5 s later frees the chip.
# Try it on the CPU first: JAX_PLATFORMS=cpu QUICK=1 bash benchmarks/tpu_steps.sh
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:=./tpu-out}" && OUT=$(cd "$OUT" && pwd)  # absolute: some parts run in other folders
export MULTILORA_NATIVE=0 PYTHONUNBUFFERED=1
PARTS=${PARTS:-tests small slots big}
R=${REPEATS:-7}
FS="python3 benchmarks/forward_step.py --dtypes bfloat16 --repeats $R"
if [ -n "${QUICK:-}" ]; then FS="$FS --decode-seqs 8 --prefill-tokens 64"; fi
python3 -c "import jax, sys; print(sys.version); print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
for part in $PARTS; do
  case $part in
    tests) timeout -k 5 300 python3 -m pytest -q -x -p no:cacheprovider --noconftest tests/test_lora_pallas.py 2>&1 | tee "$OUT/tests.log" ;;
    atests) timeout -k 5 150 python3 -m pytest -q -x -p no:cacheprovider --noconftest tests/test_attention_pallas.py \
              -k "${ATESTS_K:-bfloat16}" 2>&1 | tee "$OUT/attention_tests.log" || PA=off ;;
    pa)    timeout -k 5 300 $FS --modes decode prefill --adapters 0 8 64 --pallas-attention ${PA:-off on} \
             --json "$OUT/steps_small_pa.json" 2>&1 | tee "$OUT/steps_small_pa.log" ;;
    pa1b)  timeout -k 5 240 $FS --model llama-3.2-1b --decode-ctx 256 --modes decode prefill --adapters 0 64 \
             --pallas-attention ${PA:-off on} --json "$OUT/steps_1b_pa.json" 2>&1 | tee "$OUT/steps_1b_pa.log" ;;
    small) timeout -k 5 300 $FS --modes decode prefill --adapters 0 8 64 --backends auto dense \
             --json "$OUT/steps_small.json" 2>&1 | tee "$OUT/steps_small.log" ;;
    slots) timeout -k 5 240 $FS --modes decode prefill --adapters 0 8 64 --slots 256 --backends auto \
             --json "$OUT/steps_slots256.json" 2>&1 | tee "$OUT/steps_slots256.log" ;;
    big)   timeout -k 5 300 $FS --model llama-3.2-1b --decode-ctx 256 --modes decode prefill --adapters 0 8 64 \
             --backends auto --json "$OUT/steps_1b.json" 2>&1 | tee "$OUT/steps_1b.log" ;;
    trace) timeout -k 5 200 $FS --modes decode prefill --adapters 0 64 --backends auto --repeats 3 \
             --trace /tmp/fs-trace 2>&1 | tee "$OUT/steps_trace.log"
           timeout -k 5 200 $FS --model llama-3.2-1b --decode-ctx 256 --modes decode prefill --adapters 0 --repeats 3 \
             --trace /tmp/fs-trace-1b 2>&1 | tee "$OUT/steps_trace_1b.log" ;;
    # how the step's K/V rows are written (multilora.model.llama.KV_WRITES): alone, then in whole steps
    kvw) ls /opt/pypi/simple > "$OUT/pypi_index.txt" 2>/dev/null
         timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_kv_write.py 2>&1 | tee "$OUT/kv_write_tests.log"
         timeout -k 5 200 python3 benchmarks/kv_write_probe.py --json "$OUT/kv_write_probe.json" 2>&1 | tee "$OUT/kv_write_probe.log"
         timeout -k 5 240 $FS --modes decode prefill --adapters 0 --pallas-attention on off --kv-writes ${KVW:-rows pages pallas-pages} \
           --json "$OUT/steps_kvw.json" 2>&1 | tee "$OUT/steps_kvw.log" ;;
    # profiles by op (self time; the top ops by their jnp path, and the compiled HLO) of both attentions
    optrace) timeout -k 5 300 $FS --modes decode prefill --adapters 0 64 --pallas-attention on off --repeats 3 \
               --trace /tmp/fs-optrace 2>&1 | tee "$OUT/steps_optrace.log"
             for f in $(find /tmp/fs-optrace -name top_ops.txt); do
               n=$(echo "$f" | sed 's|/tmp/fs-optrace/||; s|/top_ops.txt||; s|[^A-Za-z0-9_.-]|_|g'); echo "== $n" >> "$OUT/top_ops.txt"
               cat "$f" >> "$OUT/top_ops.txt"; done ;;
    # the kernels' tests compiled on the chip (bf16 attention cases; ~31 tests, compiles dominate: one call)
    chip) timeout -k 5 480 python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_kv_write.py tests/test_lora_pallas.py \
            tests/test_attention_pallas.py -k "not float32 or kv_write or lora" 2>&1 | tee "$OUT/chip_tests.log" ;;
    # both shapes, both attentions, 0 / 8 / 64 adapters (12 cases a shape; another call)
    steps) timeout -k 5 ${T1:-270} $FS --modes decode prefill --adapters ${ADAPTERS:-0 8 64} --pallas-attention on off \
             --json "$OUT/steps_small.json" 2>&1 | tee "$OUT/steps_small.log"
           timeout -k 5 ${T2:-300} $FS --model llama-3.2-1b --decode-ctx 256 --modes decode prefill --adapters ${ADAPTERS:-0 8 64} \
             --pallas-attention on off --json "$OUT/steps_1b.json" 2>&1 | tee "$OUT/steps_1b.log" ;;
    # issue 40: a Llama-3.1-8B shape with an int8 base (quantization=int8) and 64 adapters on one chip,
    # a process each (forward_step keeps every case's cache: two 64-row caches and the 64
    # adapters' 5.4 GB do not fit beside the 9.1 GB of weights); 128 cached tokens a row
    int8) for k in 64 0; do
            timeout -k 5 ${CASE_LIMIT:-200} $FS --model llama-3.1-8b --dtypes int8 --decode-ctx ${CTX:-128} --modes decode prefill \
              --adapters $k --json "$OUT/steps_8b_int8_$k.json" 2>&1 | tee "$OUT/steps_8b_int8_$k.log"
          done ;;
    # the LoRA kernel alone, timed on the device over the model's layers: separate calls against
    # one call per stacked pool, adapters per chunk swept, a process per shape (whole outputs kept)
    probe) for shape in ${SHAPES_:-smollm2-135m llama-3.2-1b}; do
             n="probe_${shape}"
             timeout -k 5 ${CASE_LIMIT:-150} python3 benchmarks/lora_kernel_probe.py --model "$shape" \
               --tokens ${TOKENS:-64} --adapters ${ADAPTERS:-64} --chunks ${CHUNKS:-0 16 32} > "$OUT/$n.log" 2>&1; echo "$n: exit $?" | tee -a "$OUT/probe.txt"; grep -v "^# " "$OUT/$n.log"
           done ;;
    # the same cases for several trees side by side (VARIANTS: folders holding a multilora/ and a
    # benchmarks/, e.g. other branches' `git archive`), a process per tree and shape, whole outputs
    # in $OUT/var_<tree>_<shape>.log, Python's stacks 15 s before the limit
    variants) for shape in ${SHAPES_:-smollm2-135m llama-3.2-1b}; do
                ctx=$([ "$shape" = smollm2-135m ] && echo 80 || echo 256)
                for v in ${VARIANTS:-.}; do
                  n="var_$([ "$v" = . ] && echo this || basename "$v")_${shape}"
                  (cd "$v" && MULTILORA_STACKS_AFTER_S=$((${CASE_LIMIT:-200} - 15)) timeout -k 5 ${CASE_LIMIT:-200} $FS --model "$shape" \
                     --decode-ctx "$ctx" --modes decode prefill --adapters ${ADAPTERS:-0 8 64} \
                     --json "$OUT/$n.json") > "$OUT/$n.log" 2>&1
                  echo "$n: exit $?" | tee -a "$OUT/variants.txt"; grep -E "^(decode |prefill )" "$OUT/$n.log"
                done
              done ;;
    # the LoRA kernel's adapter copies unrolled (0) and in a loop (1, MULTILORA_LORA_COPY_LOOP):
    # compile seconds and step times with adapters, a process each
    copyloop) for v in 0 1; do MULTILORA_LORA_COPY_LOOP=$v timeout -k 5 ${CASE_LIMIT:-200} $FS --modes decode prefill \
                --adapters ${ADAPTERS:-8 64} --json "$OUT/copyloop_$v.json" 2>&1 | tee "$OUT/copyloop_$v.log"; done ;;
    # the block kernel's cost model at the 1B decode step: rows a query block (MULTILORA_PALLAS_QUERY_BLOCK)
    # x keys a chunk (MULTILORA_PALLAS_CHUNK_KEYS), a process each: time that follows the rows says
    # the MXU's streamed rows bound it, time that follows the chunk count says each product's fixed cost
    asweep) for qb in ${QBS:-8 16 32}; do for ck in ${CKS:-128 256 512}; do
              MULTILORA_PALLAS_QUERY_BLOCK=$qb MULTILORA_PALLAS_CHUNK_KEYS=$ck timeout -k 5 ${CASE_LIMIT:-90} $FS \
                --model llama-3.2-1b --decode-ctx 256 --modes decode --adapters 0 --json "$OUT/asweep_q${qb}_k${ck}.json" \
                > "$OUT/asweep_q${qb}_k${ck}.log" 2>&1
              echo "qb $qb keys $ck: $(grep -E '^decode ' "$OUT/asweep_q${qb}_k${ck}.log")" | tee -a "$OUT/asweep.txt"
            done; done ;;
    # kv heads of 64 two to a 128-lane cache row (MULTILORA_KV_LANE_PACK=1, multilora.model.kv_lanes)
    # against one a row (0, the default): both shapes, a process each; decides the default. "1k":
    # packed, with 1024 keys a chunk (the score-tile rule gives a packed decode block 512: twice the rows)
    lanepack) for shape in ${SHAPES_:-llama-3.2-1b smollm2-135m}; do
                ctx=$([ "$shape" = smollm2-135m ] && echo 80 || echo 256)
                for lp in ${LPS:-0 1 1k}; do
                  ck=$([ "$lp" = 1k ] && echo 1024 || echo 0)
                  MULTILORA_KV_LANE_PACK=${lp%k} MULTILORA_PALLAS_CHUNK_KEYS=$ck timeout -k 5 ${CASE_LIMIT:-100} $FS \
                    --model "$shape" --decode-ctx "$ctx" --modes decode prefill --adapters ${ADAPTERS:-0 64} \
                    --json "$OUT/lanepack_${shape}_$lp.json" > "$OUT/lanepack_${shape}_$lp.log" 2>&1
                  echo "$shape pack $lp: exit $?" | tee -a "$OUT/lanepack.txt"; grep -E "^(decode |prefill )" "$OUT/lanepack_${shape}_$lp.log" | tee -a "$OUT/lanepack.txt"
                done
              done ;;
    # a chunk of adapters in one copy a pool (MULTILORA_LORA_CHUNK_COPY=1: 6 copies a q/k/v chunk
    # instead of 48, the same bytes) against a copy an adapter, the probe's q/k/v and gate/up calls
    # on a step whose adapters are consecutive slots (--contiguous), a process each (log 49: 64
    # adapters 11-21 % faster, 8 adapters 9-17 % slower)
    chunkcopy) for v in 0 1; do
                 MULTILORA_LORA_CHUNK_COPY=$v timeout -k 5 ${CASE_LIMIT:-90} python3 benchmarks/lora_kernel_probe.py \
                   --contiguous --tokens 64 --adapters 8 64 --calls qkv gate_up --ways "one call" > "$OUT/chunkcopy_$v.log" 2>&1
                 echo "chunk copy $v: exit $?" | tee -a "$OUT/chunkcopy.txt"
                 grep "us a layer" "$OUT/chunkcopy_$v.log" | tee -a "$OUT/chunkcopy.txt"
               done ;;
    # the zero page's copies (padding entries, pages past a lower rank) from VMEM zeros
    # (MULTILORA_LORA_ZERO_PAGE_LOCAL=1, the default since log 49) against from HBM, alternating, a process each: SmolLM2
    # decode from a 65-slot pool with 3 adapters (one chunk of 8: 5 padding entries) and 64 (~41 used)
    zerolocal) for zl in 0 1 0 1; do
                 MULTILORA_LORA_ZERO_PAGE_LOCAL=$zl timeout -k 5 ${CASE_LIMIT:-90} $FS --modes decode --adapters 0 3 64 \
                   --slots 65 > "$OUT/zerolocal_$zl.log" 2>&1
                 echo "zero page local $zl: exit $? $(grep -E '^decode ' "$OUT/zerolocal_$zl.log" | awk '{print $6, $8, $11}' | tr '\n' ' ')" \
                   | tee -a "$OUT/zerolocal.txt"
               done ;;
    # whether a kernel of the LoRA kernel's form runs its copies under its math at all: one copy a
    # step against 16-row pages, with and without products (benchmarks/dma_overlap_probe.py)
    overlap) timeout -k 5 ${CASE_LIMIT:-300} python3 benchmarks/dma_overlap_probe.py --dims 576 640 2048 --rows 128 512 \
               --reps 1 4 --json "$OUT/overlap.json" 2>&1 | tee "$OUT/overlap.log" ;;
    # the LoRA kernel alone at SmolLM2's widths (576 and 192: 4.5 and 1.5 lane tiles) beside widths
    # of whole 128-lane tiles (640 / 256: more bytes; 512 / 128: fewer), 64 decode rows, a process each:
    # whether a pool's rows padded to whole tiles copy and multiply faster despite their bytes
    lanes) for dims in ${DIMS:-576,1536,576,192 640,1536,640,256 512,1536,512,128}; do
             timeout -k 5 ${CASE_LIMIT:-90} python3 benchmarks/lora_kernel_probe.py --dims "$dims" --tokens 64 \
               --adapters ${ADAPTERS:-8 64} --calls qkv gate_up --ways "one call" > "$OUT/lanes_${dims//,/x}.log" 2>&1
             echo "dims $dims: exit $?" | tee -a "$OUT/lanes.txt"; grep "us a layer" "$OUT/lanes_${dims//,/x}.log" | tee -a "$OUT/lanes.txt"
           done ;;
    # every (shape, mode, adapters) case in its own process, its whole output kept
    # ($OUT/case_<shape>_<mode>_<k>.log): a case that crashes or hangs costs only its own
    # CASE_LIMIT seconds and says which it was (forward_step prints compile and first step apart)
    cases) for shape in ${SHAPES_:-smollm2-135m llama-3.2-1b}; do
             ctx=$([ "$shape" = smollm2-135m ] && echo 80 || echo 256)
             for mode in decode prefill; do for k in ${ADAPTERS:-0 8 64}; do
               n="case_${shape}_${mode}_${k}"
               timeout -k 5 ${CASE_LIMIT:-150} $FS --model "$shape" --decode-ctx "$ctx" --modes $mode --adapters $k \
                 --json "$OUT/$n.json" > "$OUT/$n.log" 2>&1; echo "$n: exit $?" | tee -a "$OUT/cases.txt"
               grep -E "^(# |decode |prefill )" "$OUT/$n.log" | tail -4
             done; done
           done ;;
    # next: the prefill side of the Pallas attention (query blocks of 16 and 64 rows; its profile)
    pprobe) for qb in 16 64; do MULTILORA_PALLAS_QUERY_BLOCK=$qb timeout -k 5 150 $FS --modes prefill --adapters 0 \
               --pallas-attention off on --json "$OUT/prefill_qb$qb.json" 2>&1 | tee "$OUT/prefill_qb$qb.log"; done
            timeout -k 5 150 $FS --modes prefill decode --adapters 0 --pallas-attention on --repeats 3 \
              --trace /tmp/fs-trace-pa 2>&1 | tee "$OUT/steps_trace_pa.log" ;;
    # offline throughput through the engine (64 requests x 64 new tokens), its packages from the
    # machine's own index (not yet tried there)
    offline) PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --only-binary=:all: \
               --index-url file:///opt/pypi/simple --target /tmp/site safetensors tokenizers jinja2 markupsafe \
               && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site
             timeout -k 5 500 python3 benchmarks/engine_throughput.py --adapters 0 8 64 --dtype bfloat16 --warmup on-first-use \
               --workdir /tmp/bench --json "$OUT/offline.json" 2>&1 | tee "$OUT/offline.log" ;;
    # an Engine with 8 adapters warmed up at start (every bucket compiled before it serves, one
    # compile a host core: warmup.compile_threads): its start-up seconds, then its throughput
    startup) PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --only-binary=:all: \
               --index-url file:///opt/pypi/simple --target /tmp/site safetensors tokenizers jinja2 markupsafe \
               && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site
             nproc | tee "$OUT/startup_nproc.txt"
             timeout -k 5 ${CASE_LIMIT:-540} python3 benchmarks/engine_throughput.py --adapters 8 --dtype bfloat16 \
               --warmup all --workdir /tmp/bench --json "$OUT/startup.json" 2>&1 | tee "$OUT/startup.log" ;;
    # issue 40: every family's tiny checkpoint with a PEFT adapter, greedy tokens against PEFT's on
    # the CPU (.tpu-families/ carried: `python benchmarks/tpu_families.py record --dir .tpu-families`)
    families) PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --only-binary=:all: \
                --index-url file:///opt/pypi/simple --target /tmp/site safetensors tokenizers jinja2 markupsafe \
                && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site
              for dt in ${FAMILY_DTYPES:-float32}; do
                timeout -k 5 ${CASE_LIMIT:-540} python3 benchmarks/tpu_families.py check --dir .tpu-families --dtype $dt \
                  --min-agree ${MIN_AGREE:-0.9} --json "$OUT/families_$dt.json" 2>&1 | tee "$OUT/families_$dt.log"; done ;;
    # greedy tokens against the CPU's float32 record: the GGUF's parts carried in .tpu-carry/ by
    # earlier calls of the same lease (PARTS=stash), the gguf wheel in .whl-tpu/ (not yet tried there)
    stash) mkdir -p /tmp/gguf && cp .tpu-carry/model.gguf.part* /tmp/gguf/ && ls -l /tmp/gguf ;;
    agree) PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --only-binary=:all: \
             --index-url file:///opt/pypi/simple --target /tmp/site safetensors tokenizers jinja2 markupsafe \
             pyyaml tqdm requests
           PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --target /tmp/site \
             .whl-tpu/gguf-*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site
           cat /tmp/gguf/model.gguf.part* > /tmp/model.gguf
           timeout -k 5 400 python3 benchmarks/tpu_agreement.py check --ref benchmarks/results/agreement_cpu_f32.json \
             --gguf /tmp/model.gguf --dtype bfloat16 --json "$OUT/agreement_tpu_bf16.json" 2>&1 | tee "$OUT/agreement.log" ;;
  esac
  # everything so far in one archive after each part, named to sort first: a call brings back 8
  # files of $OUT, and one cut by its limit still brings back what its finished parts wrote
  (cd "$OUT" && tar czf 00-all.tgz --exclude=00-all.tgz . 2>/dev/null)
done
