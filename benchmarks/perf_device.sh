#!/usr/bin/env bash
# The speed benchmarks of one H200 in one command (the device tool's run, < 10 minutes): the loss first
# (its GPU tests, the row-kernel sweep with the label-odds kernel and the epilogue matmul against cuBLAS,
# the N=16384 table of every method beside Liger's), then the GPU tests of the compiled and graph paths,
# generate (columns a-d), one decode step's attention per SDPA backend, the drafter step (eager and
# compiled at 1 x 3072, compiled at 8 x 3072) and precompute ((a) against (b) with target.compile off
# and on, interleaved). Logs go to $OUT (default /tmp/perf-out).
# Each stage has its own time limit, cut to what is left of DEADLINE_S (default 570), so one that hangs
# costs only its share and the stages after it still report what time allows.
#
#   bash benchmarks/perf_device.sh [DEADLINE_S]   # wheels the machine lacks in .whl/ (docs/benchmarks.md)
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=${1:-570}
OUT=${OUT:-/tmp/perf-out}
mkdir -p "$OUT"
# limit CAP: CAP seconds, or what is left before the deadline if less (at least 1)
limit() { local left=$(( DEADLINE - ($(date +%s) - START) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
el() { echo "[perf_device.sh $(( $(date +%s) - START )) s] $*"; }
if ! python3 -c "import zarr, numcodecs, torchdata, crc32c, google_crc32c, tomli_w" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} | tee "$OUT/machine.txt"
el "loss (issue 18's open goal first): its GPU tests, the row kernels and the epilogue matmul, the N=16384 table"
timeout $(limit 90) python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/dflash_common/drafter/loss/test_hard_loss.py \
  > "$OUT/loss_tests.log" 2>&1; tail -3 "$OUT/loss_tests.log"
timeout $(limit 90) python3 benchmarks/loss.py --kernel-sweep > "$OUT/loss.log" 2>&1
timeout $(limit 100) python3 benchmarks/loss.py --sizes first --reps 15 >> "$OUT/loss.log" 2>&1
grep -E "^(\| |Triton)" "$OUT/loss.log"
el "GPU tests of the compiled and graph paths"
timeout $(limit 120) python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/precompute/test_target.py \
  tests/dflash_common/drafter/test_model.py tests/dflash_common/drafter/test_attention.py tests/precompute/generate/test_generate.py \
  -k "compiled or cuda_graph" \
  > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
el "generate"
timeout $(limit 170) python3 benchmarks/generate.py --shapes qwen3-8b --repeats 3 --new-tokens 128 > "$OUT/generate.log" 2>&1
grep -E "^(target|qwen)" "$OUT/generate.log"
el "decode attention"
timeout $(limit 40) python3 benchmarks/decode_attention.py > "$OUT/attention.log" 2>&1; grep -E "^\| " "$OUT/attention.log"
el "drafter step"
timeout $(limit 100) python3 benchmarks/drafter_step.py --variants eager,compiled --steps 5 --repeats 3 > "$OUT/drafter1.log" 2>&1
timeout $(limit 90) python3 benchmarks/drafter_step.py --variants compiled --seqs 8 --steps 3 --repeats 1 --warmup 2 \
  > "$OUT/drafter8.log" 2>&1; grep -hE "^\| (compiled|eager)" "$OUT/drafter1.log" "$OUT/drafter8.log"
el "precompute"
timeout $(limit 170) python3 benchmarks/precompute.py --dir /tmp/pb --seqs 30 --dtypes bf16 --compile off,on --repeats 3 \
  > "$OUT/precompute.log" 2>&1; tail -7 "$OUT/precompute.log"
el "done"
