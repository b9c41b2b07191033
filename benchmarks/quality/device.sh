#!/usr/bin/env bash
# The whole quality benchmark as one command on one H200 (the device tool's run), inside a deadline:
#   bash benchmarks/quality/device.sh [DEADLINE_S] [VARIANTS] [SEEDS]
# The machine has no network and lacks zarr, numcodecs, torchdata, crc32c, donfig and tomli-w: they
# travel as wheels in .whl/ (docs/benchmarks.md). Results, logs and the run table land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE=${1:-570}
VARIANTS=${2:-baseline,dpace,label}
SEEDS=${3:-0,1}
EXTRA=${4:---no-heldout-store}
OUT=${OUT:-/tmp/quality-out}
W=/tmp/quality
mkdir -p "$OUT" "$W"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/machine.txt" 2>&1
# keep what exists in $OUT every 20 s, so a run stopped at its limit still reports
snapshot() {
  cp -f "$W"/results.md "$W"/results.json "$W"/target/report.json "$OUT"/ 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude='stores' --exclude='tensorboard' \
    --exclude='target/model*' --exclude='data' logs runs target/manifest.json 2>/dev/null
}
(while sleep 20; do snapshot; done) &
SNAP=$!
python3 benchmarks/quality/run.py --work "$W" --stage all --variants "$VARIANTS" --seeds "$SEEDS" \
  --deadline-s "$DEADLINE" --target-args "--compile --steps 1500 --corpus-mb 100" --generate-timeout-s 120 \
  --train-prompts 4000 --eval-prompts 200 --max-new-tokens 128 $EXTRA 2>&1 | tee "$OUT/run.log"
python3 benchmarks/quality/run.py --work "$W" --stage table --variants "$VARIANTS" --seeds "$SEEDS" \
  --train-prompts 4000 --eval-prompts 200 --max-new-tokens 128 $EXTRA >> "$OUT/run.log" 2>&1
kill $SNAP 2>/dev/null
snapshot
ls -la "$OUT"
