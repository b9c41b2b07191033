"""What the trainer needs to know of the target besides its weights: its config, its tokenizer's
fingerprint (checked against the store's) and the MASK token id."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_common.errors import UserError
from dflash_common.fingerprint import DRAFTER_CONFIG_KEYS, head_fingerprint, target_fingerprint, tokenizer_fingerprint
from dflash_common.hf import check_model_dir, load_tokenizer, read_config_json

if TYPE_CHECKING:
    from dflash_common.store import StoreManifest

MASK_TOKEN = "<|mask|>"  # the token DFlash adds to the tokenizer (dflash_common/tiny.py has it too)


def _target_dir(path: str | None) -> Path:
    if path is None:
        raise UserError("No target given; set run.target to the target model's directory (its embedding, "
                        "lm_head and tokenizer are needed).")
    return check_model_dir(path, "run.target")


def target_config(path: str | None) -> dict[str, Any]:
    return read_config_json(_target_dir(path), "run.target")


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    return load_tokenizer(path, "run.target")  # asked for twice (fingerprint, MASK id): loaded once


def tokenizer_sha256(path: str | None) -> str:
    return tokenizer_fingerprint(_tokenizer(str(_target_dir(path))))["sha256"]


def mask_token_id(path: str | None, configured: int | None) -> int:
    """`configured` if set, else the id of the tokenizer's MASK token."""
    if configured is not None:
        return configured
    token_id = _tokenizer(str(_target_dir(path))).convert_tokens_to_ids(MASK_TOKEN)
    unk = _tokenizer(str(_target_dir(path))).unk_token_id
    if token_id is None or token_id == unk:
        raise UserError(f"the tokenizer of {path} has no {MASK_TOKEN} token; set drafter.mask_token_id to an "
                        f"unused embedding row (151669 for Qwen3).")
    return int(token_id)


def check_same_target(manifest: StoreManifest, store: str | Path, path: str | None) -> None:
    """Refuse a run.target other than the store's target: its embedding/lm_head (what the drafter is
    trained and served with) or the config fields the drafter copies differ. Content, not names:
    a copy in a directory of another name passes. Stores without a `target_head` record (older
    dflash) compare the whole-checkpoint fingerprints they hold instead."""
    target = str(_target_dir(path))
    differ = _head_differences(manifest.target_head, target) if manifest.target_head else \
        _fingerprint_differences(manifest.target, target)
    if differ:
        raise UserError(f"run.target = {path} is not the target store {store} was precomputed from "
                        f"({manifest.target.get('name')!r}): {'; '.join(differ[:4])}; pass that target as "
                        f"--run.target, or precompute a store from this one.")


def _head_differences(recorded: dict[str, Any], target: str) -> list[str]:
    mine = _head(target)
    differ = ["its embedding/lm_head weights differ"] if recorded.get("head_sha256") != mine["head_sha256"] else []
    theirs = recorded.get("config", {})
    return differ + [f"{k} = {mine['config'].get(k)!r} vs {theirs.get(k)!r} in the store"
                     for k in DRAFTER_CONFIG_KEYS if k in theirs and theirs[k] != mine["config"].get(k)]


def _fingerprint_differences(recorded: dict[str, Any], target: str) -> list[str]:
    mine = target_fingerprint(target)
    return [f"its {what} differ ({key})" for key, what in (("weights_sha256", "weights"), ("config_sha256", "config.json"))
            if recorded.get(key) is not None and recorded[key] != mine[key]]


@functools.lru_cache(maxsize=4)
def _head(target: str) -> dict[str, Any]:
    return head_fingerprint(target)
