"""The target model, truncated to what the drafter needs, with its hidden states captured by hooks.

A layer id i is the output of decoder layer i (HF `hidden_states[i + 1]`). Nothing after the deepest
captured layer is loaded or run: the config is cut to `max(layer_ids) + 1` decoder layers (per-layer
lists such as `layer_types` cut with it), the base model is built without `lm_head`, and its final
norm is replaced by an identity. transformers' loader only reads checkpoint tensors that match a
parameter of the model it builds, so the weights of later layers, of the final norm's successors and
of `lm_head` are never read from disk (they show up as "unexpected" keys and are dropped unread).

With `store.final_state` the target also yields its final normed hidden state (the lm_head's
input, HF `hidden_states[-1]`), which the drafter's soft targets and greedy prompt labels need: then
every layer and the final norm are loaded and run (never the lm_head), and the norm's output is
captured by a hook like the layers'.

Composite checkpoints (a vision-language model whose text tower is the target, e.g. Qwen3.5/3.6)
load their text model only: `config.get_text_config()` picks it and transformers maps the weight
names.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dflash_common.drafter.layer_ids import check_layer_ids, default_layer_ids
from dflash_common.errors import UserError
from dflash_common.hf import load_text_config, torch_dtype

log = logging.getLogger("dflash")

_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")
_LAYER_LIST_NAMES = ("layers", "h")
FINAL = "final"  # key of the final normed state beside the layer ids (CapturedTarget.state_keys)


def resolve_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids, or the DFlash default for a target of `num_layers` decoder layers."""
    try:
        ids = default_layer_ids(num_layers) if configured is None else list(configured)
        check_layer_ids(ids, num_layers)
    except ValueError as e:
        raise UserError(f"target.layer_ids: {e}.") from e
    return ids


def truncated_config(text_config: Any, num_layers: int) -> Any:
    """A copy of the config with `num_layers` decoder
    layers; every per-layer list is cut with it."""
    full = text_config.num_hidden_layers
    cut = copy.deepcopy(text_config)
    for name, value in list(vars(cut).items()):
        if isinstance(value, (list, tuple)) and len(value) == full and name != "architectures":
            setattr(
                cut, name, type(value)(value[:num_layers])
            )  # layer_types, per-layer windows, ...
    cut.num_hidden_layers = num_layers
    cut.use_cache = False
    return cut


class CapturedTarget:
    """A truncated target whose forward returns the hidden states of `layer_ids`, in that order."""

    def __init__(
        self,
        model: nn.Module,
        layer_ids: list[int],
        num_target_layers: int,
        final_state: bool = False,
    ):
        self.model = model
        self.layer_ids = layer_ids
        self.num_target_layers = num_target_layers  # depth of the full target, before truncation
        self.final_state = final_state  # also the final norm's output, after the layer ids' states
        self._captured: dict[int | str, torch.Tensor] = {}

    @property
    def state_keys(self) -> list[int | str]:
        """What `forward` returns, in order: the layer
        ids, then FINAL when final states are kept."""
        return [*self.layer_ids, *([FINAL] if self.final_state else [])]

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """input_ids [B, S] (right-padded, see precompute/batching.py) -> K tensors [B, S, H] (K + 1
        with the final state last, as `state_keys` says).

        No attention mask is passed: with right padding and causal attention a real token never sees
        a pad, and sdpa/flash keep their fastest causal kernels."""
        self._captured.clear()
        with self._hooks():
            self.model(input_ids=input_ids, use_cache=False)
        return [self._captured.pop(i) for i in self.state_keys]

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        layers = decoder_layers(self.model)
        handles = [layers[i].register_forward_hook(self._capture(i)) for i in self.layer_ids]
        if self.final_state:
            handles.append(final_norm(self.model).register_forward_hook(self._capture(FINAL)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _capture(self, layer_id: int | str):
        def hook(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a base model, or of the base model inside a causal LM (`model.model`,
    `model.transformer`), as generation loads it with its lm_head."""
    for owner in (model, getattr(model, "base_model", None)):
        for name in _LAYER_LIST_NAMES:
            layers = getattr(owner, name, None)
            if isinstance(layers, nn.ModuleList):
                return layers
    raise UserError(
        f"target model {type(model).__name__} has no list of decoder layers named "
        f"{' or '.join(_LAYER_LIST_NAMES)}; this architecture is not supported."
    )


def final_norm(model: nn.Module) -> nn.Module:
    for name in _FINAL_NORM_NAMES:
        if isinstance(getattr(model, name, None), nn.Module):
            return getattr(model, name)
    raise UserError(
        f"target model {type(model).__name__} has no final norm named "
        f"{' or '.join(_FINAL_NORM_NAMES)}; store.final_state is not supported for this "
        "architecture."
    )


def load_target(
    path: str | Path,
    layer_ids: list[int] | None,
    *,
    dtype: str = "bf16",
    attn_implementation: str = "sdpa",
    device: torch.device | str = "cpu",
    final_state: bool = False,
    compile: bool = False,
    text_config: Any = None,
) -> CapturedTarget:
    """Load the target truncated after its deepest captured layer, without lm_head or final norm;
    with `final_state`, whole (every layer and the final norm, still no lm_head). `compile` compiles
    the decoder layers' parts on CUDA (`compile_decoder_layers`); on a CPU it is ignored.
    `text_config`: the target's (`hf.load_text_config(path)`), read here when not given."""
    from transformers import AutoModel

    text_config = text_config if text_config is not None else load_text_config(path)
    num_layers = text_config.num_hidden_layers
    ids = resolve_layer_ids(layer_ids, num_layers)
    config = truncated_config(text_config, num_layers if final_state else max(ids) + 1)
    with _quiet_transformers():
        try:
            model, info = AutoModel.from_pretrained(
                path,
                config=config,
                dtype=torch_dtype(dtype),
                attn_implementation=attn_implementation,
                device_map={"": str(device)},
                output_loading_info=True,
            )
        except (OSError, ValueError, ImportError) as e:
            raise UserError(f"target.path {path} could not be loaded ({e}).") from e
    if info["missing_keys"]:
        raise UserError(
            f"target checkpoint {path} lacks weights {sorted(info['missing_keys'])[:4]}; "
            "is it complete and of the architecture its config.json names?"
        )
    if final_state:
        final_norm(model)  # the architecture must have one, before any work
    else:
        _drop_final_norm(model)
    model.eval().requires_grad_(False)
    compiled = compile and torch.device(device).type == "cuda"
    if compiled:
        compile_decoder_layers(model)
        _compile_now(model, torch.device(device))
    log.info(
        "target %s: %d of %d decoder layers loaded%s, capturing layer ids %s%s",
        path,
        config.num_hidden_layers,
        num_layers,
        " (their parts compiled)" if compiled else "",
        ids,
        " and the final normed state" if final_state else "",
    )
    return CapturedTarget(model, ids, num_layers, final_state)


def compile_decoder_layers(model: nn.Module, kv_cache: bool = False) -> int:
    """torch.compile every child module of every decoder layer (attention, MLP, norms), in place;
    returns how many were compiled. The layers themselves stay eager, so the capture hooks on them
    run as they do uncompiled. Children of one class share one compiled graph (the parameters are
    its inputs), so compilation costs one layer's worth, not the depth's; shapes are dynamic (batch
    and length vary from batch to batch).

    With kv_cache (generation), a child that knows its layer number (`layer_idx`: the attention) is
    not compiled whole, since it indexes the KV cache by that number and torch.compile specialises
    on it: one graph per layer, and past its recompile limit (8) the deeper layers' attention would
    run uncompiled. Its parts other than the projections (the q/k norms) are compiled instead."""
    count = 0
    for layer in decoder_layers(model):
        for child in layer.children():
            parts = [child]
            if kv_cache and hasattr(child, "layer_idx"):
                parts = [p for p in child.children() if not isinstance(p, nn.Linear)]
            for part in parts:
                part.compile(dynamic=True)
                count += 1
    return count


@torch.inference_mode()
def _compile_now(model: nn.Module, device: torch.device) -> None:
    """Compile now, at load time (logged apart from the batches): a forward of one row and one of
    two (dynamic shapes still specialise a size of 1), on a few tokens."""
    started = time.perf_counter()
    for rows in (2, 1):
        model(input_ids=torch.zeros((rows, 32), dtype=torch.long, device=device), use_cache=False)
    log.info("target compiled in %.1f s", time.perf_counter() - started)


def _drop_final_norm(model: nn.Module) -> None:
    for name in _FINAL_NORM_NAMES:
        if isinstance(getattr(model, name, None), nn.Module):
            setattr(model, name, nn.Identity())  # its output is never stored: do not run it


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers prints a load report listing every unread (= deliberately skipped) weight."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:  # off stays off (setup_logging: no bars when stderr is not a terminal)
            hf_logging.enable_progress_bar()
