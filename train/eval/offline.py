"""`dflash-eval --offline`: tau estimated from a store's held-out sequences, without running the target.

    dflash-eval --offline --store PATH --drafter DIR --target.path=DIR
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_common.cli import UserError
from train.eval.config import EvalConfig
from train.eval.load import check_model_dir, load_dflash, resolve_device
from train.eval.report import format_offline, write_report


# What the offline estimate takes from the training run's run.toml: its held-out split, and how its
# validation packed and weighted the blocks, so the estimate repeats the trainer's own validation.
_RUN_SETTINGS = {"holdout_sequences": ("data", "holdout_sequences"), "holdout_fraction": ("data", "holdout_fraction"),
                 "batch_tokens": ("data", "batch_tokens"), "max_anchors": ("objective", "max_anchors"),
                 "gamma": ("objective", "gamma")}


def _training_run_settings(drafter_path: str) -> dict:
    """Settings of the training run behind `drafter_path` (its run.toml, in a run or step-N directory
    or beside a run's drafter/), by the keyword names of `evaluate_offline`; {} when there is none."""
    import tomllib

    here = Path(drafter_path)
    for candidate in (here / "run.toml", here.parent / "run.toml"):
        if candidate.is_file():
            run = tomllib.loads(candidate.read_text())
            return {key: run[sec][name] for key, (sec, name) in _RUN_SETTINGS.items()
                    if run.get(sec, {}).get(name) is not None}
    return {}


def run_offline(cfg: EvalConfig) -> dict:
    """The offline estimate: per-position accuracy and the tau it implies on a store's held-out
    sequences, by the trainer's own validation (train/validate.py), and the path tau: greedy decoding
    replayed from the stored responses with generation.block_size and generation.max_new_tokens
    (train/path_tau.py; what dflash-eval measures when the responses are the target's greedy output).
    The target never runs; only its embedding and lm_head are read from target.path."""
    from transformers import AutoConfig

    from dflash_common.drafter.target_head import load_target_head
    from train.validate import evaluate_offline, path_tau_offline

    if not cfg.offline.store:
        raise UserError("--offline needs a store: pass --store PATH (a store written by dflash-precompute).")
    check_model_dir(cfg.target.path)
    device = resolve_device(cfg.target.device)
    bf16 = cfg.target.dtype == "bfloat16"  # the trainer's precision: fp32 weights, bf16 autocast
    drafter = load_dflash(cfg.drafter.path, AutoConfig.from_pretrained(cfg.target.path), device, torch.float32)
    head = load_target_head(cfg.target.path, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    drafter.attach_frozen(head.embed, head.lm_head)
    settings = _training_run_settings(cfg.drafter.path)
    for key in ("holdout_sequences", "holdout_fraction"):
        if getattr(cfg.offline, key) is not None:
            settings[key] = getattr(cfg.offline, key)
    autocast = "bf16" if bf16 else "none"
    metrics = evaluate_offline(drafter, cfg.offline.store, autocast=autocast, path=False, **settings)
    split = {k: settings[k] for k in ("holdout_sequences", "holdout_fraction", "batch_tokens") if k in settings}
    path = path_tau_offline(drafter, cfg.offline.store, block_size=cfg.generation.block_size,
                            max_new_tokens=cfg.generation.max_new_tokens, autocast=autocast, **split)
    path.pop("path_prompt_tails")
    report = {"mode": "offline", "store": cfg.offline.store, "drafter": cfg.drafter.path,
              "block_size": drafter.cfg.block_size, **settings, **metrics, **path,
              "path_max_new_tokens": cfg.generation.max_new_tokens,
              "path_block_size": cfg.generation.block_size or drafter.cfg.block_size}
    if cfg.report.path:
        write_report(report, cfg.report.path, cfg)
    print(format_offline(report))
    return report
