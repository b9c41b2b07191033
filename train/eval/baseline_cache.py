"""The target's own decodes, kept on disk for `dflash-eval --check.baseline_cache=DIR`.

Every evaluation decodes each prompt twice: with the drafter, and with the target alone (the speed
baseline and, greedy, the output the speculative one must equal). The second never depends on the
drafter, so comparing several drafters on one target and one prompt set decodes the same thing again
and again; with a cache directory it is decoded once and read back afterwards.

An entry is one JSON file, `<key>.json`, written aside and renamed into place (two evaluations sharing
the directory may both write an entry; the second rename replaces an identical file). The key hashes
everything the decode depends on: the target (its fingerprint: config and weight bytes, as the store's
manifest has it), the dtype and device it ran in, the prompt's token ids, the token limit, the
sampling settings and seed, the stop tokens, and the batch size when prompts are decoded many at
once (train/eval/batched.py: its times are per prompt at that batch size). A changed target, prompt
or setting is a miss, never a stale hit. The entry keeps the tokens and the prefill and decode times
of the run that made it, so the baseline's tokens/s in a report built from the cache is that run's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash_common.fsutil import atomic_write_text
from dflash_common.sampling import Sampling
from train.eval.spec_decode import Decoded

FORMAT = "dflash-eval-baseline/1"


@dataclass(frozen=True)
class BaselineCache:
    """A cache directory and the identity of the target whose decodes it keeps (fingerprint, dtype,
    device), which every key includes."""

    directory: Path
    target: str  # hash of the target's fingerprint, dtype and device

    @classmethod
    def open(cls, directory: str | Path, target_path: str, dtype: str, device: str) -> "BaselineCache":
        from dflash_common.fingerprint import target_fingerprint

        fingerprint = target_fingerprint(target_path)
        fingerprint.pop("name", None)  # where it lies does not change what it decodes
        identity = json.dumps({"fingerprint": fingerprint, "dtype": dtype, "device": device}, sort_keys=True)
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, hashlib.sha256(identity.encode()).hexdigest())

    def key(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, seed: int,
            stop_ids: frozenset[int], batch_size: int = 1) -> str:
        what = {"format": FORMAT, "target": self.target, "prompt": list(prompt_ids), "max_new_tokens": max_new_tokens,
                "sampling": [sampling.temperature, sampling.top_p, sampling.top_k], "seed": seed,
                "stop_ids": sorted(stop_ids)}
        if batch_size > 1:  # batched decodes are timed per prompt at that size, and round as such
            what["batch_size"] = batch_size
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()

    def get(self, key: str) -> Decoded | None:
        path = self.directory / f"{key}.json"
        try:
            entry = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # a file cut by a crash is a miss, rewritten
            return None
        if entry.get("format") != FORMAT:
            return None
        return Decoded(entry["tokens"], [], entry["prefill_s"], entry["decode_s"])

    def put(self, key: str, decoded: Decoded) -> None:
        entry = {"format": FORMAT, "tokens": decoded.tokens, "prefill_s": decoded.prefill_s,
                 "decode_s": decoded.decode_s}
        atomic_write_text(self.directory / f"{key}.json", json.dumps(entry), durable=False)  # a cut entry is a miss
