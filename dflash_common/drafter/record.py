"""The config a drafter's weights were saved with, kept inside model.safetensors, and the reading of
a drafter directory's config.json against it.

save_drafter (export.py) writes config.json and, in model.safetensors' metadata under
`dflash_config_json`, the same config. A config.json edited by hand afterwards (target_layer_ids
shifted, block_size removed, ...) would otherwise load, evaluate and export as another drafter than
was trained; `read_drafter_config` refuses it naming the key. Weights saved by other tools carry no
record: their config.json is read as it is, a missing key still named in a sentence.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from dflash_common.config import ConfigError
from dflash_common.drafter.arch import config_from_json
from dflash_common.drafter.config import DrafterConfig, MissingKeyError
from dflash_common.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# The safetensors metadata key of the config.json a drafter's weights were saved with.
RECORD_KEY = "dflash_config_json"
_REEXPORT = "export the drafter again from its run (dflash-export RUN_DIR OUT_DIR)"


def read_drafter_config(directory: str | Path, fix: str | None = None) -> DrafterConfig:
    """The config of drafter directory `directory`, refused in one sentence naming the key when its
    config.json lacks a key, or says other than the record its weights were saved with (a hand
    edit: shifted layer ids or a removed block_size would load, and serve, another drafter).
    `fix` ends each sentence (default: export the drafter again from its run)."""
    fix = fix or _REEXPORT
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable JSON file ({e}); {fix}.") from e
    record = trained_record(directory)
    try:
        cfg = config_from_json(raw)
    except MissingKeyError as e:
        if record is None:
            them = "it" if len(e.keys) == 1 else "them"
            raise UserError(
                f"{path} lacks {_keys(e.keys)}; add {them} (see the released "
                f"checkpoint format, docs/serving.md)."
            ) from e
        values = ", ".join(f"`{k}: {json.dumps(_value(record, k))}`" for k in e.keys)
        raise UserError(
            f"{path} lacks {_keys(e.keys)}; put back {values} (saved with its weights), or {fix}."
        ) from e
    except (ConfigError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"{path} is not a valid drafter config: {e}") from e
    if record is not None:
        _check_against_record(path, raw, cfg, record, fix)
    return cfg


# Fields loaders only pass on (token ids, init scale, a length hint): hand edits of them stand.
_INFORMATIONAL = {
    "bos_token_id",
    "eos_token_id",
    "initializer_range",
    "max_position_embeddings",
    "tie_word_embeddings",
}
# Where a field lives in config.json, if not top-level under its own name (the first key is the one
# named; any of them present counts as present).
_JSON_KEYS = {
    "target_layer_ids": ("dflash_config.target_layer_ids", "target_layer_ids"),
    "mask_token_id": ("dflash_config.mask_token_id", "mask_token_id"),
    "block_size": ("block_size", "dflash_config.block_size"),
    "sliding_causal": ("is_causal", "dflash_config.causal"),
    "rope_theta": ("rope_theta", "rope_parameters.rope_theta"),
    "confidence_head": ("enable_confidence_head",),  # DSpark
    **{
        name: (f"dflash_config.{name}",)  # DFlash2
        for name in (
            "conv_kernel_size",
            "conv_group_size",
            "selector_rank",
            "selector_top_k",
            "output_multiplier",
            "final_logit_softcapping",
        )
    },
}


def trained_record(directory: str | Path) -> dict | None:
    """The config.json saved into `directory`'s model.safetensors with the weights (save_drafter),
    or None: weights saved by other tools, or an unreadable file (reading the weights names it)."""
    try:
        with safe_open(Path(directory) / WEIGHTS_FILE, framework="pt") as f:
            text = (f.metadata() or {}).get(RECORD_KEY)
        return json.loads(text) if text else None
    except (SafetensorError, OSError, ValueError):
        return None


def _check_against_record(
    path: Path, raw: dict, cfg: DrafterConfig, record: dict, fix: str
) -> None:
    trained = config_from_json(record)
    if type(trained) is not type(cfg):  # architectures edited: fields of another drafter
        raise UserError(
            f"{path} says architectures = {raw.get('architectures')} where its weights "
            f"were trained as {trained.ARCHITECTURE!r}; put it back, or {fix}."
        )
    differ = [
        f
        for f in (f.name for f in dataclasses.fields(cfg))
        if f not in _INFORMATIONAL and getattr(cfg, f) != getattr(trained, f)
    ]
    if not differ:
        return
    said = []
    for field in differ:
        keys = _JSON_KEYS.get(field, (field,))
        now, was = _as_json(getattr(cfg, field)), _as_json(getattr(trained, field))
        if any(_value(raw, k) is not None for k in keys):
            said.append(f"says `{keys[0]}` = {now} where its weights were trained with {was}")
        else:
            said.append(
                f"lacks `{keys[0]}`, which reads as {now}, where its weights were trained "
                f"with {was}"
            )
    values = "values" if len(said) > 1 else "value"
    raise UserError(
        f"{path} {'; it '.join(said)} (the record saved with model.safetensors); put "
        f"back the trained {values}, or {fix}."
    )


def _value(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _as_json(value) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _keys(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)
