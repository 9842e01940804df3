#!/bin/bash
# benchmarks/gpu_limit.py on a device machine (one H100 or H200), its table and figures copied into $OUT. One call,
# from the repository root, with the Llama-3.1 tokenizer and the alpaca rows at ../shared (or SPECGEN_SHARED=DIR
# holding tokenizers/llama-3.1 and datasets/alpaca_en_demo.json: carry them as an ignored path, e.g. .gpu/shared):
#   SPECGEN_SHARED=$PWD/.gpu/shared bash benchmarks/gpu_limit.sh      # timeout_s >= 540
# The benchmark stops its own stages at BUDGET seconds (390); DEADLINE kills it. Then benchmarks/train_profile.py
# says where the offline training step's time goes, on the default run's shards (PROFILE_S at most; all within 8 min).
# Put the table on a dated docs page (docs/benchmarks/) and quote it in the README.
# Local dry run: OUT=/tmp/o DEV=cpu SHAPE=tiny ROWS=16 PY=.venv/bin/python PROFILE_EXTRA=train.batch_tokens=1024 \
#   bash benchmarks/gpu_limit.sh
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEV=${DEV:-cuda}; SHAPE=${SHAPE:-8b}; ROWS=${ROWS:-600}; STEPS=${STEPS:-}; BUDGET=${BUDGET:-390}
DEADLINE=${DEADLINE:-440}; PROFILE_S=${PROFILE_S:-90}; W=${W:-/tmp/gpu-limit}; PY=${PY:-python3}; OUT=${OUT:-/tmp/gpu-limit-out}
mkdir -p "$OUT"; rm -rf "$W"
nvidia-smi -L 2>/dev/null; $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout -k 10 "$DEADLINE" $PY benchmarks/gpu_limit.py --device "$DEV" --shape "$SHAPE" --rows "$ROWS" \
  ${STEPS:+--steps "$STEPS"} --budget-s "$BUDGET" --out "$W" ${EXTRA:-} 2>&1 | tee "$OUT/gpu_limit.log"
rc=${PIPESTATUS[0]}
cp "$W/table.md" "$W/results.json" "$OUT/" 2>/dev/null
if [ -f "$W/gen-default/manifest.json" ]; then  # where a training step's time goes (phases, op kinds, top ops)
  timeout -k 5 "$PROFILE_S" $PY benchmarks/train_profile.py --device "$DEV" --shards "$W/gen-default" --warmup 2 \
    --steps 6 --profile-steps 2 --out "$W/profile" ${PROFILE_EXTRA:-} > "$OUT/profile.log" 2>&1 \
    || echo "train_profile: exit $? (see profile.log)"
  cp "$W/profile/table.md" "$OUT/profile.md" 2>/dev/null; cp "$W/profile/profile.json" "$OUT/" 2>/dev/null
  cat "$OUT/profile.md" 2>/dev/null
fi
(cd "$W" 2>/dev/null && tar czf "$OUT/logs.tgz" ./*.log ./*.peak.json gen-default/manifest.json train-*/metrics.jsonl \
  2>/dev/null)
rm -rf "$W"  # the 16 GB target and the shards stay behind otherwise
echo "exit $rc; total $(el) s"; ls -la "$OUT"
exit "$rc"
