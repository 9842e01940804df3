#!/bin/bash
# The SmolLM2 GPU lease of 2026-11-26 (docs/benchmarks/2026-11-26-smollm2-gpu-and-heldout.md), as it ran: the second
# of two calls on a device machine that can be sent at most 64 MiB a call. From the repository root, here:
#   split -b 49181216 -d SmolLM2-135M-Instruct.Q4_1.gguf .gpu/g          # .gpu/g00, .gpu/g01 (ignored paths)
#   sha256sum of the GGUF, written as "<hash>  /tmp/smol.gguf" into .gpu/gguf.sha256
#   .gpu/data/prompts.jsonl (python -m specgen.assets.smollm2 --prompts) and .gpu/data/mt_bench.jsonl
#   .whl/: hydra-core, omegaconf, antlr4-python3-runtime, gguf wheels (pip download --no-deps, cp312 manylinux)
# Call 1 (carry .whl .gpu/g00): pip install --no-deps --target /tmp/site .whl/*.whl; cp .gpu/g00 /tmp/ga
#   (speculators too, only if `import speculators.train.trainer` works there: /tmp/spec_ok; its wheels failed on
#   2026-11-26 for want of httpx2, httpcore2 and truststore)
# Call 2, within the machine's 30 s idle window (carry .gpu/g01 .gpu/data .gpu/gguf.sha256 and this script):
#   DEADLINE=540 bash benchmarks/smollm2_gpu_lease.sh
# Everything the harness finished comes back in $OUT/res.tgz, and one fp32 draft split into 15 MiB pieces (a call
# returns at most 8 files of 16 MiB, 64 MiB in all: one SmolLM2 draft of vocabulary 8192 is 37 MB).
# For a local dry run: OUT=/tmp/o DEV=cpu MODEL=M ROWS=6 PY=.venv/bin/python EXTRA="--steps 2 --max-prompts 2
#   --ks 3 --seeds 0" REGEN_EXTRA=regenerate.max_new_tokens=16 JA=2 JB=2 bash benchmarks/smollm2_gpu_lease.sh
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
DEV=${DEV:-cuda}; ROWS=${ROWS:-1000}; DEADLINE=${DEADLINE:-520}; W=${W:-/tmp/g}; PY=${PY:-python3}; SPY=${SPY:-python3}
JA=${JA:-12}; JB=${JB:-6}
mkdir -p $W
CONVERT_LOG=$W/convert.log; . benchmarks/lease_model.sh
echo "model ready at $(el) s"; nvidia-smi -L 2>/dev/null
COMMON=(--model $MODEL --prompts .gpu/data/prompts.jsonl --eval-prompts .gpu/data/mt_bench.jsonl --rows $ROWS
        --ttt-length 5 --eval-device $DEV ${EXTRA:-})
SETS="runtime.device=$DEV train.precision=fp32 ${SETS_EXTRA:-}"
SPEC=(); [ -f /tmp/spec_ok ] && SPEC=(--speculators $SPY)
setsid $PY benchmarks/levers.py "${COMMON[@]}" --out $W/a --levers original --methods eagle3 eagle3.1 p-eagle dflash \
  --jobs $JA --set $SETS > $W/a.log 2>&1 &
A=$!
setsid $PY benchmarks/levers.py "${COMMON[@]}" --out $W/b --levers regenerated --jobs $JB "${SPEC[@]}" \
  --set $SETS regenerate.batch_size=${RB:-192} regenerate.batch_tokens=${RT:-196608} ${REGEN_EXTRA:-} > $W/b.log 2>&1 &
B=$!
while kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; do
  [ $(el) -ge $DEADLINE ] && { echo "deadline: stopping at $(el) s"; break; }
  sleep 5
done
for p in $A $B; do kill -TERM -- -$p 2>/dev/null; done; sleep 2; for p in $A $B; do kill -KILL -- -$p 2>/dev/null; done
wait 2>/dev/null
echo "harness done at $(el) s"; grep -v -i warn $W/a.log | tail -4; grep -v -i warn $W/b.log | tail -4
mkdir -p $W/back
for d in $W/b/drafts/regenerated-specgen-seed0/01-train $W/a/drafts/original-specgen-seed0/01-train; do
  if [ -f $d/model.safetensors ] && [ -f $d/config.json ]; then
    echo "draft back: $d"; cp $d/config.json $W/back/draft-config.json; echo $d > $W/back/draft-name.txt
    split -b 15M -d $d/model.safetensors $OUT/draft.st.; sha256sum $d/model.safetensors > $W/back/draft.sha256; break
  fi
done
cd $W && tar czf $OUT/res.tgz --exclude='*.safetensors' --exclude=checkpoints --exclude=speculators --exclude='*.arrow' \
  back *.log a/results.jsonl a/stages.json a/logs a/eval a/drafts b/results.jsonl b/stages.json b/logs b/eval b/drafts \
  b/data a/shards/*/01-generate/manifest.json b/shards/*/01-generate/manifest.json smol/specgen-manifest.json 2>/dev/null; cd - > /dev/null
grep -h '"k": 3' $W/a/results.jsonl $W/b/results.jsonl 2>/dev/null | cut -c1-200
ls -la $OUT; echo "total $(el) s"
