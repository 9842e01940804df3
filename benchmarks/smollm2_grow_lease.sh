#!/bin/bash
# Issue #42 on a device machine (one H100 or H200): SmolLM2-135M-Instruct writes conversations for the data-size
# curve, as many as one call allows, into datasets that outlive the machine. Each call carries the datasets in
# (.gpu/grow.tgz, small: text), grows them, and sends them back ($OUT/grow.tgz); the next call, on another machine,
# goes on where it stopped (specgen regenerate resumes finished parts and grows to a larger data.max_rows,
# docs/guides/regenerate.md "Growing a dataset"). Training and vLLM serving of the curve run elsewhere on the text.
#
# The three datasets of the recommended pooled data, each grown size by size in SIZES so that every size is a
# balanced pool (reply0 and reply1: two sampled replies, regenerate.on_loop=resample; synth: the target's own
# questions too), into fixed paths ($W) so that their settings fingerprint holds from machine to machine:
#   python -m specgen.regenerate recipe=smollm2-135m model.path=$W/smol data.path=$W/prompts.jsonl \
#       data.max_rows=SIZE output.dir=$W/data/NAME output.shard_size=128 runtime.device=cuda ... (NAME's settings)
# Before them, the HF engine's two KV caches side by side on the same model (the first table of issue #42's
# "regeneration at a GPU's speed"; `regenerate.kv_cache`): benchmarks/regenerate.py, into $OUT/regen-bench.log.
#
# Prepared as benchmarks/smollm2_gpu_lease.sh is (two calls; a call carries at most 64 MiB): call 1 installs the
# wheels (hydra-core, omegaconf, antlr4-python3-runtime, gguf) into /tmp/site and keeps .gpu/g00 as /tmp/ga; call 2,
# within the machine's idle window, carries .gpu/g01 .gpu/gguf.sha256 .gpu/data/prompts.jsonl (python -m
# specgen.assets.smollm2 --prompts) and .gpu/grow.tgz (absent on the first lease):
#   DEADLINE=480 bash benchmarks/smollm2_grow_lease.sh                                    # timeout_s >= 540
# Then here: cp the returned grow.tgz to .gpu/grow.tgz for the next lease; tar xzf it to read the datasets, and keep
# them in the repository (e.g. benchmarks/data/smollm2-135m-gpu/, without lease files and logs; see
# benchmarks/data/smollm2-135m/README.md): this machine's files are gone in the next session, git is what stays.
# Local dry run (CPU, tiny):
#   OUT=/tmp/o DEV=cpu MODEL=M PY=.venv/bin/python SIZES="2 4" BENCH="--rows 4 --batch-size 2 --max-new-tokens 4" \
#     REGEN_EXTRA="regenerate.max_new_tokens=8 output.shard_size=2" DATA=/tmp/none bash benchmarks/smollm2_grow_lease.sh
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEV=${DEV:-cuda}; DEADLINE=${DEADLINE:-480}; W=${W:-/tmp/grow}; PY=${PY:-python3}; OUT=${OUT:-/tmp/grow-out}
SIZES=${SIZES:-"256 512 1024 1849"}; KV=${KV:-static}; DATA=${DATA:-.gpu/grow.tgz}
PROMPTS=${PROMPTS:-.gpu/data/prompts.jsonl}; BENCH_S=${BENCH_S:-150}
BENCH=${BENCH:-"--rows 256 --batch-size 128 --max-new-tokens 256"}
REGEN=(runtime.device=$DEV runtime.threads=8 runtime.progress=false output.shard_size=128 regenerate.kv_cache=$KV
       regenerate.batch_size=${BS:-256} regenerate.batch_tokens=${BT:-1048576} ${REGEN_EXTRA:-})
mkdir -p "$W/data" "$OUT"
CONVERT_LOG="$OUT/convert.log"; . benchmarks/lease_model.sh
if [ ! -f "$PROMPTS" ]; then $PY -m specgen.assets.smollm2 --prompts "$W/prompts.jsonl" || exit 1
else cp "$PROMPTS" "$W/prompts.jsonl"; fi
[ -f "$DATA" ] && tar xzf "$DATA" -C "$W/data"
echo "model and data ready at $(el) s"; nvidia-smi -L 2>/dev/null
timeout -k 5 "$BENCH_S" $PY benchmarks/regenerate.py --device "$DEV" --dtype float32 --model "$MODEL" $BENCH \
  --modes dynamic static > "$OUT/regen-bench.log" 2>&1 || echo "regen bench: exit $? (see regen-bench.log)"
grep -A4 "^model" "$OUT/regen-bench.log"
declare -A SETS=([reply0]="regenerate.seed=0 regenerate.on_loop=resample"
                 [reply1]="regenerate.seed=1 regenerate.on_loop=resample"
                 [synth]="regenerate.seed=0 regenerate.user_turns=synthesize")
for size in $SIZES; do
  for name in reply0 reply1 synth; do
    done_size=$(cat "$W/data/$name.size" 2>/dev/null || echo 0)
    [ "$size" -lt "$done_size" ] && continue  # a dataset never shrinks (regenerate refuses a smaller data.max_rows)
    left=$(( DEADLINE - $(el) - 20 )); [ "$left" -lt 20 ] && break 2
    echo "$size" > "$W/data/$name.size"
    timeout -k 5 "$left" $PY -m specgen.regenerate recipe=smollm2-135m model.path="$MODEL" data.path="$W/prompts.jsonl" \
      data.max_rows="$size" output.dir="$W/data/$name" "${REGEN[@]}" ${SETS[$name]} >> "$OUT/$name.log" 2>&1
    echo "$name to $size rows: exit $? at $(el) s; $(grep -h -o '"rows": [0-9]*' "$W/data/$name/manifest.json" 2>/dev/null | head -1)"
  done
done
(cd "$W/data" && tar czf "$OUT/grow.tgz" --exclude='*.lock' --exclude='*.lease' .)
ls -la "$OUT"; echo "total $(el) s"
