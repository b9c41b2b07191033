"""Drafters on disk, in the layout SGLang, vLLM and z-lab's loader read.

A drafter directory holds `config.json` (DrafterConfig.to_config_json) and `model.safetensors`:
every trainable weight under its released name (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`, ...), no `model.` prefix, no embedding, no lm_head.

Training checkpoints already hold the drafter in this layout, in float32:

    RUN_DIR/step-N/drafter/{config.json, model.safetensors}
    RUN_DIR/step-N/COMPLETE          (written last; a step without it does not count)

`dflash-export RUN_OR_CHECKPOINT OUT_DIR [--dtype bf16]` takes a run directory (its newest complete
step), one step directory, or a drafter directory, and writes OUT_DIR aside and renames it into
place. Loading refuses any weight whose name or shape the config does not expect, and any expected
weight that is missing: engines drop such weights silently, we do not.

model.safetensors also carries, in its metadata, the config.json it was saved with, so a config.json
edited by hand afterwards is refused by every loader of ours, naming the key (record.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash_common.cli import ArgumentParser, setup_logging, user_errors_exit

from dflash_common.errors import UserError
from dflash_common.drafter.arch import new_drafter
from dflash_common.drafter.config import DrafterConfig
from dflash_common.drafter.model import DFlashDrafter
from dflash_common.drafter.record import CONFIG_FILE, RECORD_KEY, WEIGHTS_FILE, read_drafter_config
from dflash_common.fsutil import check_writable, fsync_tree, publish_dir, temp_sibling
from dflash_common.hf import DTYPES, dtype_name, torch_dtype

log = logging.getLogger("dflash")

DRAFTER_SUBDIR = "drafter"  # step-N/drafter/ in a training checkpoint
COMPLETE_MARKER = "COMPLETE"  # step-N/COMPLETE, written last by the trainer
STEP_DIR = re.compile(r"^step-(\d+)$")
# Config fields that may differ between a released drafter and the run it initialises.
_INIT_MAY_DIFFER = {
    "block_size",
    "bos_token_id",
    "eos_token_id",
    "initializer_range",
    "max_position_embeddings",
    "tie_word_embeddings",
}


def save_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write `config.json` + `model.safetensors` (weights cast to `dtype`, default: as they are)
    into a hidden sibling of `out_dir`, fsync, then rename into place."""
    if not isinstance(drafter, DFlashDrafter):  # a DDP/compiled wrapper would prefix every name
        raise TypeError(
            f"save_drafter needs the DFlashDrafter itself, not a {type(drafter).__name__} wrapping "
            "it"
        )
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise UserError(f"{out_dir} already exists; choose a new directory or pass --overwrite.")
    if out_dir.exists():
        check_replaceable(out_dir)
    state = {
        name: p.detach().to(dtype or p.dtype).cpu().contiguous()
        for name, p in drafter.state_dict().items()
    }
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"drafter weights have mixed dtypes {dtypes}; pass dtype")
    config = drafter.cfg.to_config_json(dtype=dtype_name(dtypes.pop()))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out_dir)
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        # the config travels inside the weights file too: a hand-edited config.json is then found
        save_file(
            state,
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt", RECORD_KEY: json.dumps(config)},
        )
        fsync_tree(tmp)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def check_replaceable(out_dir: Path) -> None:
    """--overwrite replaces only a directory that is itself an exported drafter: config.json and
    model.safetensors and nothing else (not a run, a step-N/, a parent of drafters, another
    file)."""
    if not out_dir.is_dir():
        raise UserError(
            f"{out_dir} exists and is not a directory; --overwrite replaces only an exported "
            f"drafter directory: choose a new OUT_DIR."
        )
    held = sorted(p.name for p in out_dir.iterdir())
    if held != sorted([CONFIG_FILE, WEIGHTS_FILE]):
        others = [name for name in held if name not in (CONFIG_FILE, WEIGHTS_FILE)] or [
            f"no {WEIGHTS_FILE}"
        ]
        raise UserError(
            f"{out_dir} is not an exported drafter (it holds {', '.join(others[:3])}), so "
            f"--overwrite leaves it alone; choose a new OUT_DIR, or one holding only {CONFIG_FILE} "
            f"and {WEIGHTS_FILE}."
        )


def check_not_source(source: Path, out_dir: Path) -> None:
    """OUT_DIR may be neither the source, nor inside it, nor one of its parents."""
    out = out_dir.resolve()
    for src in dict.fromkeys([source.resolve(), resolve_drafter_dir(source).resolve()]):
        where = (
            "the source"
            if out == src
            else "a parent of the source"
            if out in src.parents
            else "inside the source"
            if src in out.parents
            else None
        )
        if where:
            raise UserError(
                f"OUT_DIR {out_dir} is {where} {source}; export to a directory outside it, "
                f"e.g. {source.resolve().parent / 'export'}."
            )


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` is moved aside first and removed after."""
    if not final.exists():
        if not publish_dir(tmp, final):
            raise UserError(f"{final} appeared while exporting; choose a new directory.")
        return
    old = temp_sibling(final)
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def resolve_drafter_dir(path: str | Path) -> Path:
    """The drafter directory behind a run directory (newest complete step), a step directory, or a
    drafter directory itself."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"{path} does not exist; pass a run directory, a step-N checkpoint or a drafter "
            "directory."
        )
    if (path / CONFIG_FILE).is_file():
        return path
    if STEP_DIR.match(path.name) and (path / DRAFTER_SUBDIR).is_dir():
        if not (path / COMPLETE_MARKER).is_file():
            raise UserError(
                f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker); pick another step."
            )
        return path / DRAFTER_SUBDIR
    steps = sorted(
        (int(m.group(1)), d) for d in path.iterdir() if (m := STEP_DIR.match(d.name)) and d.is_dir()
    )
    complete = [d for _, d in steps if (d / COMPLETE_MARKER).is_file()]
    if complete:
        return complete[-1] / DRAFTER_SUBDIR
    if (
        path / DRAFTER_SUBDIR / CONFIG_FILE
    ).is_file():  # a run's final drafter, without step checkpoints
        return path / DRAFTER_SUBDIR
    if steps:
        raise UserError(
            f"run {path} has no complete checkpoint yet ({len(steps)} step dirs, none with "
            f"{COMPLETE_MARKER})."
        )
    raise UserError(
        f"{path} holds no config.json, no {DRAFTER_SUBDIR}/ and no step-N/ checkpoints; "
        f"pass a run directory, a step-N checkpoint or a drafter directory."
    )


def read_drafter_dir(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, weights by name) of the drafter behind `path` (see resolve_drafter_dir)."""
    directory = resolve_drafter_dir(path)
    return read_drafter_config(directory), _read_weights(directory)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `directory/model.safetensors`; a missing or cut file is one sentence with the
    fix."""
    path = directory / WEIGHTS_FILE
    fix = (
        "export the drafter again from its run (dflash-export RUN_DIR OUT_DIR), or pass another "
        "step-N checkpoint"
    )
    if not path.is_file():
        raise UserError(f"{directory} has no {WEIGHTS_FILE}; {fix}.")
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (
        SafetensorError,
        OSError,
        ValueError,
    ) as e:  # a cut file: header or data shorter than it says
        raise UserError(f"{path} is damaged or cut short ({e}); {fix}.") from e


def check_weights(cfg: DrafterConfig, tensors: dict[str, torch.Tensor], where: str | Path) -> None:
    """Refuse unknown, missing or misshapen weights, naming them."""
    with torch.device("meta"):  # shapes only: no memory, no random init
        expected = {name: tuple(p.shape) for name, p in new_drafter(cfg).state_dict().items()}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        hint = (
            "; DFlash2's codebooks are bare parameters: rename *_codebook.weight to *_codebook"
            if any(n.endswith("_codebook.weight") for n in unknown)
            else ""
        )
        raise UserError(
            f"{where}: weights do not match the released {cfg.KIND} layout"
            + (
                f"; unknown: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}"
                if unknown
                else ""
            )
            + (
                f"; missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                if missing
                else ""
            )
            + hint
            + ". Nothing was loaded."
        )
    bad = [
        f"{n} {tuple(t.shape)} (expected {expected[n]})"
        for n, t in tensors.items()
        if tuple(t.shape) != expected[n]
    ]
    if bad:
        raise UserError(
            f"{where}: weights with the wrong shape for its config.json: {', '.join(bad[:8])}."
        )


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[DFlashDrafter, DrafterConfig]:
    """A drafter (and its config) from a run, step or drafter directory; weights in `dtype`.
    Attach the target's embedding and lm_head before use (`drafter.attach_frozen`)."""
    cfg, tensors = read_drafter_dir(path)
    check_weights(cfg, tensors, path)
    with torch.device("meta"):
        drafter = new_drafter(cfg)
    drafter.load_state_dict(
        tensors, strict=True, assign=True
    )  # the file's tensors become the parameters
    return drafter.to(device=device, dtype=dtype), cfg


def load_weights_into(drafter: DFlashDrafter, path: str | Path) -> None:
    """Initialise `drafter` from a released (or our own) drafter directory. The configs must agree
    on every field that shapes or means the weights (block size and token ids may differ)."""
    cfg, tensors = read_drafter_dir(path)
    differ = [
        f
        for f in _fields(cfg)
        if f not in _INIT_MAY_DIFFER and getattr(cfg, f) != getattr(drafter.cfg, f)
    ]
    if differ:
        detail = ", ".join(
            f"{f} = {getattr(cfg, f)!r} there vs {getattr(drafter.cfg, f)!r} here" for f in differ
        )
        raise UserError(f"cannot initialise from {path}: its config differs ({detail}).")
    check_weights(cfg, tensors, path)
    drafter.load_state_dict(tensors, strict=True)


def _fields(cfg: DrafterConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg)]


def export(
    source: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write the drafter behind `source` to `out_dir` in the released layout."""
    check_not_source(Path(source), Path(out_dir))
    # written aside beside OUT_DIR and renamed into place: its parent must take both
    check_writable(
        out_dir, "OUT_DIR", "export to a directory on a writable filesystem", directory=False
    )
    from dflash_common.drafter import serving

    drafter, cfg = load_drafter(source)
    # refused before anything is written: a loader would serve it otherwise than it trained
    warnings = serving.refuse_unservable(cfg, cfg.to_config_json(dtype_name(dtype)), str(source))
    save_drafter(drafter, out_dir, dtype, overwrite=overwrite)
    n_params = sum(p.numel() for p in drafter.parameters())
    log.info(
        "exported %s -> %s (%d layers, %.1fM parameters, %s)",
        resolve_drafter_dir(source),
        out_dir,
        cfg.num_hidden_layers,
        n_params / 1e6,
        dtype_name(dtype),
    )
    for finding in warnings:
        log.warning("%s", finding)
    for engine, command in serving.serve_commands(cfg, str(Path(out_dir).resolve())).items():
        log.info("serve with %s: %s", engine, command)
    return Path(out_dir)


EXAMPLES = """examples:
  dflash-export runs/exp1 drafters/exp1                  # the newest complete checkpoint, bf16
  dflash-export runs/exp1/step-4000 drafters/exp1-4k --dtype fp32
  dflash-export runs/exp1 drafters/exp1 --overwrite      # replace an earlier export of it"""


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="dflash-export",
        description=(
            "Write a trained drafter as config.json + model.safetensors, the layout SGLang and "
            "vLLM load."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT",
        help="run directory (newest complete step), step-N checkpoint, or drafter directory",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to create")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="bf16", help="dtype of the exported weights"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    setup_logging()
    export(args.source, args.out_dir, torch_dtype(args.dtype), args.overwrite)


if __name__ == "__main__":
    main()
