"""What vLLM 0.32 and SGLang read from an exported DFlash2 drafter, beyond DFlash's rules
(serving.py).

- vLLM 0.32 (`model_executor/models/qwen3_dflash2.py`,
  `v1/worker/gpu/spec_decode/dflash2/speculator.py`, `config/vllm.py`): `architectures:
  ["DFlash2DraftModel"]` picks the model and the DFlash2 speculator (the method stays "dflash");
  `dflash_config` must hold conv_kernel_size, conv_group_size, selector_rank and selector_top_k
  (read with [], a KeyError without them); conv_group_size must divide hidden_size;
  output_multiplier (default 1) must be > 0; final_logit_softcapping <= 0 is off;
  input_embedding_scale (default 1) scales the block's embeddings; sample_from_anchor must be false.
  The convolution's block is 1 + num_speculative_tokens (dflash_config.block_size is not read). Only
  the V2 model runner drafts DFlash2 (the V1 runner refuses "DFlash candidate-head drafts").
  Weights: the codebooks are bare parameters (`candidate_selector.predecessor_codebook`, no
  `.weight`: a `.weight` name is refused, "nested weight"); a missing tensor stays uninitialised
  memory, silently; base_kernel [2, T, H] stored as [T, 2, H] loads silently when T = 2 (same
  shape).
- SGLang (PR 35371 lineage): the same architecture string and names (a `model.` prefix is accepted);
  conv_kernel_size / conv_group_size come together or not at all, selector_rank / selector_top_k
  likewise, and DFlash2DraftModel needs selector_rank; input_embedding_scale is not read (so it must
  be 1 to serve alike); the conv block is --speculative-num-draft-tokens (else
  dflash_config.block_size). Weights: unknown names are dropped silently (`.weight` codebooks then
  stay zero: the selector serves the unary top-1), missing ones keep their init (identity base,
  random kernel_projection), silently.

Neither loader checks everything, so the lint checks the name set, the shapes and the base_kernel's
layout itself (`conv_layout_findings`, from its values: tap 0 carries the identity in both sides).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from dflash_common.drafter.dflash2 import ARCHITECTURE, REQUIRED_KEYS, DFlash2Config

# (loader, severity, message): serving.py makes each a Finding
Found = tuple[str, str, str]
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def _finding(loader: str, severity: str, message: str) -> Found:
    return loader, severity, message


def config_findings(cfg: DFlash2Config, config: Mapping[str, Any]) -> list[Found]:
    """The DFlash2 keys of config.json against the drafter `cfg` that was trained."""
    d2, dflash, out = cfg, config.get("dflash_config") or {}, []
    if (config.get("architectures") or []) != [ARCHITECTURE]:
        out.append(
            _finding(
                "both",
                "error",
                f"architectures must be [{ARCHITECTURE!r}] (vLLM and SGLang "
                f"pick DFlash2 by it), not {config.get('architectures')}.",
            )
        )
    for key in REQUIRED_KEYS:
        if dflash.get(key) is None:
            out.append(
                _finding(
                    "vllm",
                    "error",
                    f"dflash_config.{key} is missing: vLLM fails to load the drafter "
                    "(it reads the key with []), SGLang drops the part it pairs with.",
                )
            )
        elif int(dflash[key]) != getattr(d2, key):
            out.append(
                _finding(
                    "both",
                    "error",
                    f"dflash_config.{key} is {dflash[key]}, trained {getattr(d2, key)}.",
                )
            )
    if float(dflash.get("output_multiplier", 1.0)) != d2.output_multiplier:
        out.append(
            _finding(
                "both",
                "error",
                f"dflash_config.output_multiplier reads {dflash.get('output_multiplier')}, "
                f"trained {d2.output_multiplier}.",
            )
        )
    if float(dflash.get("final_logit_softcapping") or 0.0) != d2.final_logit_softcapping:
        out.append(
            _finding(
                "both",
                "error",
                f"dflash_config.final_logit_softcapping reads "
                f"{dflash.get('final_logit_softcapping')}, trained {d2.final_logit_softcapping}.",
            )
        )
    if float(dflash.get("input_embedding_scale", 1.0)) != 1.0:
        out.append(
            _finding(
                "both",
                "error",
                "dflash_config.input_embedding_scale must be 1: vLLM scales the block's "
                "embeddings by it, SGLang does not read it.",
            )
        )
    if dflash.get("sample_from_anchor"):
        out.append(
            _finding(
                "vllm",
                "error",
                "dflash_config.sample_from_anchor must be false: the anchor is the "
                "bonus token (vLLM's DFlash speculator refuses it).",
            )
        )
    if config.get("hidden_size", cfg.hidden_size) % int(dflash.get("conv_group_size") or 1):
        out.append(
            _finding(
                "both",
                "error",
                f"conv_group_size {dflash.get('conv_group_size')} does not divide "
                f"hidden_size {config.get('hidden_size')}.",
            )
        )
    out.append(
        _finding(
            "vllm",
            "warning",
            "DFlash2 drafts only in vLLM's V2 model runner: set "
            "VLLM_USE_V2_MODEL_RUNNER=1 (needs Triton; the V1 runner refuses it).",
        )
    )
    return out


def weight_findings(found: Iterable[str]) -> list[Found]:
    """Names the loaders take otherwise than they look: `.weight`-suffixed codebooks."""
    suffixed = sorted(n for n in found if n in {c + ".weight" for c in CODEBOOKS})
    if not suffixed:
        return []
    return [
        _finding(
            "both",
            "error",
            f"{', '.join(suffixed)}: the codebooks are bare parameters (no '.weight'); "
            "vLLM refuses the name, SGLang drops it and serves zero codebooks.",
        )
    ]


def conv_layout_findings(base_kernels: Mapping[str, torch.Tensor]) -> list[Found]:
    """base_kernel [2 (side), T (tap), H] by its values: a convolution starts as the identity (tap 0
    = 1, the rest 0) and training keeps tap 0 dominant on both sides. Stored as [T, 2, H] (the other
    layout), side 1's tap 0 would read the input side's tap 1 (~0) and side 0's tap 1 the output's
    tap 0 (~1): a shape check cannot see it when T = 2, vLLM loads it."""
    bad = []
    for name, base in base_kernels.items():
        if base.dim() != 3 or base.shape[0] != 2 or base.shape[1] < 2:
            continue  # shapes are lint_weights' job; a single tap has no layout to get wrong
        tap_mean = base.float().mean(-1).abs()  # [2, T]
        if not bool((tap_mean[:, 0] > tap_mean[:, 1:].max(-1).values).all()):
            bad.append(name)
    if not bad:
        return []
    return [
        _finding(
            "both",
            "error",
            f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}: tap 0 does not "
            "dominate each side, as [2 (side), T (tap), H] holds it: stored as [T, 2, H]? "
            "vLLM and SGLang would load it silently and convolve with the wrong taps.",
        )
    ]
