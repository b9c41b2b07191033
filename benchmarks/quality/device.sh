#!/usr/bin/env bash
# The quality benchmark as one command on one GPU (the device tool's run), inside a deadline:
#
#   bash benchmarks/quality/device.sh DEADLINE_S STAGES VARIANTS SEEDS [TRAIN_PROMPTS]
#   e.g. bash benchmarks/quality/device.sh 560 target,data,drafters,eval baseline,dpace 0,1,2
#
# STAGES is a comma list of target, data, drafters, eval; with target/ and data/ carried in, `data`
# only rebuilds the training store from them. `eval` (after the drafters, EVAL_S seconds kept for
# it, default 150) makes the held-out answers with dflash-eval's own batched target loop on this
# GPU, runs dflash-eval (batched, float32, lossless) and the offline reports for every finished run
# of VARIANTS x SEEDS, and writes the table: a whole regime in one call. Without `eval`, the
# held-out answers and tau come from wherever dflash-eval runs later (run.py --stage
# heldout,eval,table; a CPU will do). Artefacts travel both ways as tar parts of at most 15 MiB (the
# device tool returns at most 8 files of 16 MiB): parts found in .carry/ are unpacked into the work
# directory first, and what this call made is packed into $OUT as
#   base.tgz.part-*  target/ and data/ (after the data stage: they come back if training runs late)
#   runs.tgz.part-*  every finished drafter (bf16), its metrics, run record and path tau, the logs;
#                    after `eval` also every run's reports, the held-out answers, results.md/.json
# With data/heldout.jsonl carried in (heldout.tgz.part-*) and no `eval`, every finished run's path
# tau on those answers comes back too (offline_heldout.json).
# PACK_DRAFTERS=0 leaves the drafters out of runs.tgz (an eval stage judged them already).
# EVALS picks the eval stage's reports (run.py --evals; default all three); GPU_CHECK=0 skips the
# flex-kernel check before the drafters (a warm machine that passed it in an earlier call); PACK_S
# (90) is the time kept for packing after the drafters (a few seconds without drafters and base).
# Unpack here with: cat OUT/base.tgz.part-* | tar xz -C WORK (the same for runs.tgz.part-*).
# The machine has no network and lacks zarr, numcodecs, torchdata, crc32c, google-crc32c (zarr's crc32c
# codec imports it), donfig and tomli-w: they travel as Python 3.12 wheels in .whl/ (docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
DEADLINE=${1:-560}
STAGES=${2:-target,data,drafters,eval}
VARIANTS=${3:-baseline,dpace}
SEEDS=${4:-0,1,2}
TRAIN_PROMPTS=${5:-}   # default: the regime's (run.py REGIMES)
REGIME=${REGIME:-small}  # small | rich (run.py --regime)
OUT=${OUT:-/tmp/quality-out}
W=${QUALITY_WORK:-/tmp/quality}
mkdir -p "$OUT" "$W"
if ! python3 -c "import zarr, numcodecs, torchdata, crc32c, google_crc32c, tomli_w" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=true
for name in base heldout runs; do  # artefacts of earlier calls
  if ls .carry/$name.tgz.part-* >/dev/null 2>&1 && [ ! -f "$W/.unpacked-$name" ]; then
    cat .carry/$name.tgz.part-* | tar xz -C "$W" && touch "$W/.unpacked-$name"
  fi
done
mkdir -p "$W/logs"  # the machine's description travels in the runs pack (the tool returns 8 files)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; } > "$W/logs/machine.txt" 2>&1
# QUALITY_EXTRA=--tiny and TARGET_ARGS= run this script's plumbing on a CPU in minutes
COMMON=(--work "$W" --regime "$REGIME" ${TRAIN_PROMPTS:+--train-prompts "$TRAIN_PROMPTS"} --eval-prompts 200
        --max-new-tokens 128 ${QUALITY_EXTRA:-})
pack() {  # pack NAME PATHS... (relative to $W) -> $OUT/NAME.tgz.part-*
  local name=$1; shift
  rm -f "$OUT/$name".tgz.part-*
  tar cf - -C "$W" --exclude='step-*' --exclude='tensorboard' --exclude='*.partial' --exclude='.dflash.lock' "$@" \
    | gzip -1 | split -b 15M - "$OUT/$name.tgz.part-"
  ls -la "$OUT"/"$name".tgz.part-*
}
elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[device.sh $(elapsed) s] $*"; }
{
  if [[ ,$STAGES, == *,target,* ]]; then
    log "target"
    python3 benchmarks/quality/run.py "${COMMON[@]}" --stage target ${TARGET_ARGS+--target-args "$TARGET_ARGS"} \
      || exit 1
  fi
  if [[ ,$STAGES, == *,data,* ]]; then
    log "data"
    # the variants' own stores (another dtype: dpace+q4) are precomputed beside stores/train
    python3 benchmarks/quality/run.py "${COMMON[@]}" --stage data --variants "$VARIANTS" \
      --generate-timeout-s 150 || exit 1
    if [ ! -f "$W/.unpacked-base" ]; then  # new here: send it back
      log "pack base"
      pack base target data
    fi
  fi
  EVAL=0; [[ ,$STAGES, == *,eval,* ]] && EVAL=1
  if [[ ,$STAGES, == *,drafters,* ]] && [ "${GPU_CHECK:-1}" != 0 ]; then
    log "GPU check: the compiled flex kernel without grad on a few blocks (validation's path replay)"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/dflash_common/drafter/test_attention.py -k "flex" || exit 1
  fi
  if [[ ,$STAGES, == *,drafters,* ]]; then
    LEFT=$(( DEADLINE - $(elapsed) - ${PACK_S:-90} - EVAL * ${EVAL_S:-150} ))  # reports, packing after
    log "drafters $VARIANTS x $SEEDS, deadline in $LEFT s"
    python3 benchmarks/quality/run.py "${COMMON[@]}" --stage drafters --variants "$VARIANTS" --seeds "$SEEDS" \
      --deadline-s "$LEFT"
    if [ "$EVAL" = 0 ] && [ -f "$W/data/heldout.jsonl" ]; then  # answers carried in as heldout.tgz
      log "path tau of every finished run on the held-out answers"
      python3 benchmarks/quality/run.py "${COMMON[@]}" --stage heldout --variants "$VARIANTS"
      python3 benchmarks/quality/run.py "${COMMON[@]}" --stage eval --evals offline_heldout \
        --variants "$VARIANTS" --seeds "$SEEDS" --deadline-s $(( DEADLINE - $(elapsed) ))
    fi
  fi
  if [ "$EVAL" = 1 ]; then
    log "eval: held-out answers by the batched target loop, dflash-eval, offline reports, table"
    python3 benchmarks/quality/run.py "${COMMON[@]}" --stage heldout --variants "$VARIANTS" || exit 1
    # a few processes side by side: each decodes its 200 prompts in one batch, host-bound
    python3 benchmarks/quality/run.py "${COMMON[@]}" --stage eval --variants "$VARIANTS" \
      --seeds "$SEEDS" ${EVALS:+--evals "$EVALS"} --parallel "${EVAL_PARALLEL:-4}" \
      --deadline-s $(( DEADLINE - $(elapsed) - 45 ))
    python3 benchmarks/quality/run.py "${COMMON[@]}" --stage table --variants "$VARIANTS" \
      --seeds "$SEEDS"
  fi
  if [[ ,$STAGES, == *,drafters,* ]] || [ "$EVAL" = 1 ]; then
    log "pack runs"
    # this call's runs only (a warm machine keeps earlier ones): finished drafters, and every run's
    # log, metrics, run record (how far it got) and reports
    FILES=(); DRAFTER=drafter; [ "${PACK_DRAFTERS:-1}" = 0 ] && DRAFTER=metrics.jsonl  # evaluated here
    for v in ${VARIANTS//,/ }; do for s in ${SEEDS//,/ }; do
      for f in runs/$v/{train,eval,eval_t1,offline_heldout,offline_train}-seed-$s.log \
          runs/$v/seed-$s/{$DRAFTER,metrics.jsonl,run.toml,run.json,bench_manifest.json} \
          runs/$v/seed-$s/{eval,eval_t1,offline_heldout,offline_train}.json \
          runs/$v/seed-$s/eval.run.toml; do
        [ -e "$W/$f" ] && FILES+=("$f")
      done
    done; done
    if [ "$EVAL" = 1 ]; then
      for f in data/heldout.jsonl data/heldout_manifest.json results.md results.json; do
        [ -e "$W/$f" ] && FILES+=("$f")
      done
    fi
    pack runs $(cd "$W" && ls -d logs 2>/dev/null) "${FILES[@]}"
  fi
  log "done"
} 2>&1 | tee "$OUT/run.log"
ls -la "$OUT"
