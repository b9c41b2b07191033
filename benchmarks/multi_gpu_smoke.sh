#!/usr/bin/env bash
# Real multi-GPU check of both stages on the tiny target: dflash-precompute under torchrun on every GPU
# of this host must write the same store, shard for shard and byte for byte, as one GPU; dflash-train
# under torchrun (DDP over NCCL) must run, checkpoint and finish. Prints a small table.
#   bash benchmarks/multi_gpu_smoke.sh [WORKDIR]
set -euo pipefail
W=${1:-$(mktemp -d)}; mkdir -p "$W"
DEVICE=${DEVICE:-cuda}  # cpu: the same check with processes on the CPU (gloo)
N=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
python -m dflash_common.tiny .cache/tiny-target >/dev/null
t0=$(date +%s.%N)
python -m precompute.cli --config configs/tiny.toml --out="$W/one" --run.device="$DEVICE" >"$W/one.log" 2>&1
t1=$(date +%s.%N)
torchrun --standalone --nproc_per_node="$N" -m precompute.cli --config configs/tiny.toml \
         --out="$W/many" --run.device="$DEVICE" >"$W/many.log" 2>&1
t2=$(date +%s.%N)
same=$(cd "$W/one/shards" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
other=$(cd "$W/many/shards" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
torchrun --standalone --nproc_per_node="$N" -m train.cli --config configs/tiny.toml --store="$W/many" \
         --out="$W/train" --run.device="$DEVICE" --optim.epochs=1 >"$W/train.log" 2>&1
t3=$(date +%s.%N)
printf '| run | GPUs | seconds | result |\n| --- | --- | --- | --- |\n'
printf '| precompute | 1 | %.1f | %s shards, digest %s |\n' "$(python -c "print($t1 - $t0)")" "$(ls -d "$W"/one/shards/*/ | wc -l)" "$same"
printf '| precompute | %s | %.1f | %s shards, digest %s |\n' "$N" "$(python -c "print($t2 - $t1)")" "$(ls -d "$W"/many/shards/*/ | wc -l)" "$other"
printf '| train (DDP) | %s | %.1f | %s |\n' "$N" "$(python -c "print($t3 - $t2)")" "$(grep -o 'done: [0-9]* steps' "$W/train.log")"
[ "$same" = "$other" ] && echo "stores identical: yes" || { echo "stores identical: NO"; exit 1; }
