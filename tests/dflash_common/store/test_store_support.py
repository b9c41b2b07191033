"""Helpers for the store tests (no tests here), and a writer process the multi-process tests start:

    python tests/dflash_common/store/test_store_support.py \
        STORE DTYPE CODEC FIRST_UNIT NUM_UNITS TOKENS HIDDEN [--forever]

writes units FIRST_UNIT.. of the standard test manifest into STORE, one shard each; `--forever`
keeps writing fresh units (for a test that kills the process mid-shard); `--go FILE` prints `ready`
once the store is open and waits for FILE to exist before writing (so two writers surely run at
once).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script from anywhere

from dflash_common.store import ShardPayload, StoreManifest, StoreWriter, shard_name  # noqa: E402
from dflash_common.store.quant import encode_states  # noqa: E402

LAYER_IDS = (1, 3, 5)
HIDDEN = 64


def manifest(
    dtype: str = "bf16",
    codec: str = "none",
    chunk_tokens: int = 64,
    hidden: int = HIDDEN,
    layer_ids=LAYER_IDS,
    **changes,
) -> StoreManifest:
    fields = dict(
        target={
            "name": "tiny",
            "config_sha256": "c0ffee",
            "weights_sha256": "beef",
            "num_layers": 8,
            "hidden_size": hidden,
            "vocab_size": 320,
        },
        tokenizer={"sha256": "7f" * 32, "vocab_size": 260},
        chat_template_sha256="ab" * 32,
        layer_ids=layer_ids,
        hidden_size=hidden,
        dtype=dtype,
        codec=codec,
        chunk_tokens=chunk_tokens,
        dataset={"files": [{"name": "data.jsonl", "sha256": "00"}]},
        precompute={"samples_per_unit": 3, "max_length": 512},
    )
    fields.update(changes)
    return StoreManifest(**fields)


def unit_states(
    unit: int, tokens: int, m: StoreManifest
) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Deterministic float32 states [T, H] per layer for a unit, and its sequence lengths."""
    g = torch.Generator().manual_seed(unit)
    cuts = sorted(torch.randperm(tokens - 1, generator=g)[:2].add(1).tolist())
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]
    states = {}
    for layer_id in m.layer_ids:
        x = torch.randn(tokens, m.hidden_size, generator=g) * (1 + layer_id)
        x[:, layer_id % m.hidden_size] *= 50  # one massive-activation channel, as real targets have
        states[layer_id] = x
    return states, lens


def payload(
    unit: int, tokens: int, m: StoreManifest
) -> tuple[ShardPayload, dict[int, torch.Tensor]]:
    states, lens = unit_states(unit, tokens, m)
    g = np.random.default_rng(unit)
    p = ShardPayload(
        input_ids=torch.from_numpy(g.integers(0, 320, tokens).astype(np.int32)),
        loss_mask=g.random(tokens) < 0.6,
        offsets=np.cumsum([0, *lens]),
        sample_ids=[f"data.jsonl:{unit * 3 + i}" for i in range(len(lens))],
        layers={i: encode_states(x, m.dtype) for i, x in states.items()},
    )
    return p, states


def unit_name(unit: int) -> str:
    return shard_name(unit, hashlib.sha256(f"unit-{unit}".encode()).hexdigest())


def write_units(path, m: StoreManifest, units, tokens: int) -> StoreWriter:
    w = StoreWriter.create_or_open(path, m)
    for unit in units:
        w.write_shard(unit_name(unit), payload(unit, tokens, m)[0])
    return w


if __name__ == "__main__":
    store, dtype, codec, first, count, tokens, hidden = sys.argv[1:8]
    m = manifest(dtype, codec, hidden=int(hidden))
    forever = "--forever" in sys.argv
    go = Path(sys.argv[sys.argv.index("--go") + 1]) if "--go" in sys.argv else None
    unit = int(first)
    writer = StoreWriter.create_or_open(store, m)
    if go is not None:
        print("ready", flush=True)
        while not go.exists():
            time.sleep(0.001)
    while forever or unit < int(first) + int(count):
        writer.write_shard(unit_name(unit), payload(unit, int(tokens), m)[0])
        print(unit_name(unit), flush=True)
        unit += 1
