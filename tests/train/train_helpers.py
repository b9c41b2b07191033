"""Real tiny stores for the trainer's tests: the demo conversations (data/tiny-train.jsonl,
responses of the tiny target itself), their hidden states from the tiny target's own forward (HF
output_hidden_states: layer id i is hidden_states[i + 1]), written through the store API. (A module
of its own, not conftest.py: several conftest modules share that name on sys.path.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
LAYER_IDS = (1, 2, 3, 4, 5)  # the DFlash default for the 8-layer tiny target


def tiny_records(n: int) -> list[dict]:
    lines = (ROOT / "data" / "tiny-train.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


@torch.no_grad()
def write_tiny_store(
    path: Path,
    target_dir: Path,
    *,
    n_shards: int = 6,
    per_shard: int = 8,
    dtype: str = "bf16",
    layer_ids=LAYER_IDS,
    first_record: int = 0,
    final_state: bool = False,
) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_common.fingerprint import (
        chat_template_sha256,
        target_fingerprint,
        tokenizer_fingerprint,
    )
    from dflash_common.store import (
        ShardPayload,
        StoreManifest,
        StoreWriter,
        encode_states,
        shard_name,
    )

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    manifest = StoreManifest(
        target=target_fingerprint(target_dir),
        tokenizer=tokenizer_fingerprint(tok),
        chat_template_sha256=chat_template_sha256(tok),
        layer_ids=tuple(layer_ids),
        hidden_size=model.config.hidden_size,
        dtype=dtype,
        chunk_tokens=64,
        final_state=final_state,
    )
    writer = StoreWriter.create_or_open(path, manifest)
    records = tiny_records(first_record + n_shards * per_shard)[first_record:]
    for unit in range(n_shards):
        recs = records[unit * per_shard : (unit + 1) * per_shard]
        ids = [torch.tensor(r["input_ids"]) for r in recs]
        # one right-padded forward per shard: causal attention keeps pads out of the real positions
        padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)  # [N, S_max]
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)
        hidden = model(padded, attention_mask=mask, output_hidden_states=True).hidden_states
        layers = {
            i: encode_states(
                torch.cat([hidden[i + 1][k, : len(x)] for k, x in enumerate(ids)]), dtype
            )
            for i in layer_ids
        }
        final = encode_states(
            torch.cat([hidden[-1][k, : len(x)] for k, x in enumerate(ids)]), dtype
        )  # normed
        lengths = torch.tensor([0] + [len(x) for x in ids])
        sample_ids = [
            f"tiny-train.jsonl:{first_record + unit * per_shard + k}" for k in range(len(recs))
        ]
        payload = ShardPayload(
            input_ids=torch.cat(ids).int(),
            loss_mask=torch.tensor(sum((r["loss_mask"] for r in recs), [])),
            offsets=lengths.cumsum(0).numpy(),
            sample_ids=sample_ids,
            layers=layers,
            final=final if final_state else None,
        )
        digest = hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()
        writer.write_shard(shard_name(unit, digest), payload)
    return path


def train_args(stores, target, out, *extra: str, block_size: int = 4) -> list[str]:
    """A short, quiet dflash-train run on the tiny target (one draft layer, fp32) from one store
    or a list of them; `extra` overrides come last."""
    stores = stores if isinstance(stores, (list, tuple)) else [stores]
    return [
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        *[a for s in stores for a in ("--store", str(s))],
        "--out",
        str(out),
        f"--run.target={target}",
        "--data.batch_tokens=1024",
        "--data.holdout_sequences=4",
        f"--drafter.block_size={block_size}",
        "--objective.max_anchors=8",
        "--log.every_steps=1",
        "--log.progress=false",
        "--log.tensorboard=false",
        *extra,
    ]
