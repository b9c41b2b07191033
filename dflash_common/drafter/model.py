"""The DFlash drafter: its config (one to one with the released `config.json`) and the model.

The model reads top to bottom like the method:

    block [token at anchor, MASK x (B-1)] -> the target's frozen embedding        [A, B, H]
    K target layers' states, concatenated -> fc (K*H -> H) -> hidden_norm          [T, H]
    draft layers: queries from the block; keys/values = this layer's projection
        of the fused context, *followed by* the block's own keys/values
    -> norm -> the target's frozen lm_head (applied by the loss, see loss.py)

Positions are absolute: context features sit at their positions 0..S-1, the block at
anchor..anchor+B-1, rotated with the target's RoPE (theta and scaling from its config).

Two forwards share the layers:
- `forward` (training) runs many blocks of many packed sequences at once under a sparse mask built
  from the anchors: a block's queries see the context of their own sequence strictly before the
  anchor, their own block and nothing else. Inside the block a `full_attention` layer is
  bidirectional and a `sliding_attention` layer is causal (k_pos <= q_pos), with its keys capped
  by the window (`q_pos - k_pos < sliding_window`): the rule vLLM (`_dflash_layer_causal`), SGLang
  (sliding layers are DECODER attention) and the DFlash authors serve such layers by. It uses `flex_attention` with a BlockMask whose
  tile tables are computed from the intervals each query row sees (never a dense [Q, KV] mask),
  eager on the CPU and compiled on the GPU.
- `draft` (speculative decoding) keeps each layer's context keys/values in a `DraftCache`, appends
  the features of newly accepted tokens, drafts one block whose keys/values are never stored: the
  cache is back to "context only" after every draft.

The target's embedding and lm_head are attached with `attach_frozen`; they are plain attributes,
neither parameters nor buffers, so no optimizer, `state_dict` or checkpoint ever sees them, and
`.to()` does not move them (attach them on the device you run on).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from dflash_common.config import ConfigError, check
from dflash_common.drafter.layer_ids import check_layer_ids, default_layer_ids

ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
# flex_attention's default sparse tile (rows x columns of the score matrix per BlockMask entry).
FLEX_TILE = 128


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter, field for field what the released `config.json` says (see `to_config_json`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # draft depth
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    num_target_layers: int  # the target's depth; top-level in config.json (loaders need it)
    target_layer_ids: tuple[int, ...]  # ids index decoder-layer outputs (HF hidden_states[i + 1])
    mask_token_id: int
    layer_types: tuple[str, ...]
    block_size: int = 16
    sliding_window: int | None = None
    rope_theta: float = 1_000_000.0
    rope_scaling: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False  # the target's; informational for loaders
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Sliding layers see their own block causally, as vLLM and SGLang serve them. False only reads
    # old checkpoints that trained them bidirectionally; SGLang cannot serve those (export refuses).
    sliding_causal: bool = True

    def __post_init__(self):
        for name in ("target_layer_ids", "layer_types"):  # lists from JSON/TOML: keep the config hashable
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check(self.num_hidden_layers >= 1, f"num_hidden_layers = {self.num_hidden_layers} must be >= 1.")
        check(self.block_size >= 2, f"block_size = {self.block_size} must be >= 2 (anchor + predictions).")
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads = {self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads = {self.num_key_value_heads}.",
        )
        check(
            0 <= self.mask_token_id < self.vocab_size,
            f"mask_token_id = {self.mask_token_id} must be a row of the target's embedding (0..{self.vocab_size - 1}).",
        )
        try:
            check_layer_ids(list(self.target_layer_ids), self.num_target_layers)
        except ValueError as e:
            raise ConfigError(f"target_layer_ids: {e}.") from e
        self._check_layer_types()
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        check(kind != "dynamic", "rope_scaling type 'dynamic' depends on the sequence length; it is not supported.")

    def _check_layer_types(self) -> None:
        check(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries but num_hidden_layers = {self.num_hidden_layers}.",
        )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        check(not bad, f"layer_types {bad} unknown; use {' or '.join(LAYER_TYPES)}.")
        sliding = "sliding_attention" in self.layer_types
        check(
            not sliding or (self.sliding_window is not None and self.sliding_window >= 1),
            "layer_types has sliding_attention layers but sliding_window is not set; set it (e.g. 2048).",
        )
        check(
            sliding or self.sliding_window is None,
            f"sliding_window = {self.sliding_window} is set but no layer is sliding_attention; set layer_types.",
        )

    @property
    def num_context_layers(self) -> int:
        """K, the number of concatenated target layers fed to `fc`."""
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """The sliding window of draft layer `layer`, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def causal(self, layer: int) -> bool:
        """Whether draft layer `layer` sees its own block causally (sliding layers), else bidirectionally."""
        return self.sliding_causal and self.layer_types[layer] == "sliding_attention"

    def layer_mode(self, layer: int) -> tuple[int | None, bool]:
        """(sliding window or None, causal inside the block) of draft layer `layer`."""
        return self.window(layer), self.causal(layer)

    def layer_causality(self) -> tuple[bool, ...]:
        """Per draft layer, the causality it trains and drafts with (what a loader must read back)."""
        return tuple(self.causal(i) for i in range(self.num_hidden_layers))

    # -- construction from a target ------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        mask_token_id: int,
        depth: int = 5,
        block_size: int = 16,
        layer_ids: list[int] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
    ) -> "DrafterConfig":
        """A drafter for `target_config` (an HF config object or its config.json as a dict).

        Sizes, vocabulary, RoPE and norm epsilon come from the target; `layer_ids` defaults to the
        DFlash rule (K=5 evenly from layer 1 to N-3); `layer_types` defaults to all full attention.
        """
        t = _target_text_config(target_config)
        n_target = int(t["num_hidden_layers"])
        theta, scaling = rope_from_config_dict(t)
        hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(t["intermediate_size"]),
            num_hidden_layers=depth,
            num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or hidden // heads),
            vocab_size=int(t["vocab_size"]),
            num_target_layers=n_target,
            target_layer_ids=tuple(layer_ids if layer_ids is not None else default_layer_ids(n_target)),
            mask_token_id=mask_token_id,
            layer_types=tuple(layer_types if layer_types is not None else ["full_attention"] * depth),
            block_size=block_size,
            sliding_window=sliding_window,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(t.get("max_position_embeddings") or 40960),
            rms_norm_eps=float(t.get("rms_norm_eps") or 1e-6),
            initializer_range=float(t.get("initializer_range") or 0.02),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            bos_token_id=t.get("bos_token_id"),
            eos_token_id=_as_id_or_ids(t.get("eos_token_id")),
        )

    # -- config.json ------------------------------------------------------------------------------

    def to_config_json(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The released `config.json`: a Qwen3 config plus the DFlash fields, in the layout SGLang,
        vLLM and z-lab's loader read. `dtype` names the dtype of the saved weights."""
        from transformers import __version__ as transformers_version

        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta}
        rope_parameters.pop("type", None)
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        sliding = "sliding_attention" in self.layer_types
        causal = set(self.layer_causality())
        if len(causal) == 1:
            # one causality for every layer: said where vLLM reads it first (top-level is_causal, then
            # dflash_config.causal); a mixed drafter writes neither, both override every layer, and
            # relies on the layer_types rule of vLLM and SGLang (sliding causal, full bidirectional)
            dflash["causal"] = causal.pop()
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            # top-level: z-lab's class fails without num_target_layers even when ids are given
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "dtype": dtype,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            # written by hand: transformers 5 writes only rope_parameters, and a 4.x loader would
            # then silently fall back to theta 10000
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope_parameters,
            "sliding_window": self.sliding_window,
            # Qwen3Config drops sliding_window unless use_sliding_window is true
            "use_sliding_window": sliding,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "vocab_size": self.vocab_size,
            "transformers_version": transformers_version,
        }
        return config | ({"is_causal": dflash["causal"]} if "causal" in dflash else {})

    @classmethod
    def from_config_json(cls, data: Mapping[str, Any]) -> "DrafterConfig":
        """Read a released `config.json` (ours, or one following z-lab's layout)."""
        arch = data.get("architectures") or []
        check(ARCHITECTURE in arch,
              f"config.json architectures = {arch} is not [{ARCHITECTURE!r}]; not a DFlash drafter.")
        dflash = data.get("dflash_config") or {}

        def dflash_value(name: str):
            return dflash.get(name, data.get(name))

        for name, value in (("target_layer_ids", dflash_value("target_layer_ids")),
                            ("mask_token_id", dflash_value("mask_token_id")),
                            ("num_target_layers", data.get("num_target_layers"))):
            check(value is not None, f"config.json has no {name}; add it (see the released checkpoint format).")
        depth = int(data["num_hidden_layers"])
        sliding = "sliding_attention" in (data.get("layer_types") or [])
        sliding_causal = _sliding_causal_from_config(data, sliding)
        theta, scaling = rope_from_config_dict(data)
        heads = int(data["num_attention_heads"])
        return cls(
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=depth,
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
            vocab_size=int(data["vocab_size"]),
            num_target_layers=int(data["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in dflash_value("target_layer_ids")),
            mask_token_id=int(dflash_value("mask_token_id")),
            layer_types=tuple(data.get("layer_types") or ["full_attention"] * depth),
            block_size=int(dflash_value("block_size") or 16),
            sliding_window=data.get("sliding_window") if sliding else None,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(data.get("max_position_embeddings") or 40960),
            rms_norm_eps=float(data.get("rms_norm_eps") or 1e-6),
            initializer_range=float(data.get("initializer_range") or 0.02),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=_as_id_or_ids(data.get("eos_token_id")),
            sliding_causal=sliding_causal,
        )

    def to_hf_config(self):
        """A transformers Qwen3Config with this drafter's shapes and RoPE (for transformers' RoPE code)."""
        from transformers import Qwen3Config

        rope = {"rope_type": "default", **dict(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        rope.pop("type", None)
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
        )


def _target_text_config(target_config: Any) -> dict[str, Any]:
    data = target_config if isinstance(target_config, Mapping) else target_config.to_dict()
    # multimodal targets keep the language model's fields under text_config
    return dict(data.get("text_config") or data) if "hidden_size" not in data else dict(data)


def _sliding_causal_from_config(data: Mapping[str, Any], sliding: bool) -> bool:
    """The block causality a config.json asks of its sliding layers: an explicit top-level `is_causal`
    or `dflash_config.causal` (vLLM's order), else causal (the engines' layer_types rule). Full layers
    are bidirectional here; a config that asks them to be causal is refused."""
    explicit = data.get("is_causal")
    if explicit is None:
        explicit = (data.get("dflash_config") or {}).get("causal")
    full = "full_attention" in (data.get("layer_types") or ["full_attention"])
    check(not (explicit and full),
          "config.json asks for causal full_attention layers (is_causal / dflash_config.causal = true); "
          "full layers here are bidirectional inside the block, as the engines serve them.")
    return True if explicit is None or not sliding else bool(explicit)


def _as_id_or_ids(value: Any) -> int | tuple[int, ...] | None:
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return None if value is None else int(value)


def rope_from_config_dict(data: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config dict written by transformers 4 (rope_theta,
    rope_scaling) or 5 (rope_parameters); rope_scaling is None for plain RoPE."""
    params = dict(data.get("rope_parameters") or {})
    theta = data.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ConfigError("the config has neither rope_theta nor rope_parameters.rope_theta; add the target's theta.")
    scaling = data.get("rope_scaling")
    if scaling is None:
        params.pop("rope_theta", None)
        scaling = params if params.get("rope_type", "default") != "default" else None
    return float(theta), (dict(scaling) if scaling else None)


# ----------------------------------------------------------------------------------------------
# Building blocks (names are the released weight names)
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, scale by `weight` (same rounding as the target's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary:
    """The target's RoPE as (cos, sin) tables for given absolute positions.

    Not an nn.Module: `inv_freq` stays float32 whatever `.to(dtype)` does to the drafter (a bf16
    inv_freq would shift far positions: a training/serving mismatch)."""

    def __init__(self, cfg: DrafterConfig):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        with torch.device("cpu"):  # also when the drafter is built on the meta device
            hf = Qwen3RotaryEmbedding(cfg.to_hf_config())  # default / linear / yarn / llama3 scaling
        self.inv_freq = hf.inv_freq.detach().float().cpu()  # [D/2]
        self.scaling = float(hf.attention_scaling)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)  # once, not per call
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, D]
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [n, heads, D] rotated by (cos, sin) [n, D], computed in float32."""
    cos, sin = (t[:, None, :] for t in rope)
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


# A draft layer's attention rule: (sliding window or None, causal inside the block).
LayerMode = tuple[int | None, bool]
# attend(q [R, nh, D], k [KV, nkv, D], v [KV, nkv, D], mode) -> [R, nh, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LayerMode], torch.Tensor]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys/values of the fused context: [T, H] -> 2 x [T, nkv, D]."""
        k = self.k_norm(self.k_proj(ctx).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(ctx).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, rope), v

    def queries(self, x: torch.Tensor, rope) -> torch.Tensor:
        """[R, H] -> [R, nh, D]: projected, normed per head, rotated."""
        return apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))), rope)

    def forward(self, x, ctx_k, ctx_v, rope, attend: Attend, mode: LayerMode) -> torch.Tensor:
        """x [R, H] block tokens; ctx_k/ctx_v [T, nkv, D] go *before* the block's own keys/values."""
        q = self.queries(x, rope)  # [R, nh, D]
        k, v = self.context_kv(x, rope)  # the block's own keys/values [R, nkv, D]
        dtype = v.dtype  # norms in float32 can promote q/k under autocast; attention wants one dtype
        out = attend(q.to(dtype), torch.cat([ctx_k.to(dtype), k.to(dtype)]), torch.cat([ctx_v.to(dtype), v]), mode)
        return self.o_proj(out.flatten(-2))  # [R, nh*D] -> [R, H]


class DraftLayer(nn.Module):
    """A Qwen3 decoder layer (pre-norm, q/k norm, SwiGLU) whose keys/values start with the context."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx_k, ctx_v, rope, attend: Attend, mode: LayerMode) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, rope, attend, mode)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------


@dataclass
class DraftCache:
    """Per draft layer, keys/values of the context accepted so far ([L, nkv, D] each)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[0]


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.embed_weight: torch.Tensor | None = None  # [V, H], the target's, frozen, not state
        self.lm_head_weight: torch.Tensor | None = None  # [V, H], the target's, frozen, not state
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """A random start, as the recipe says: linear weights ~ N(0, initializer_range), norms at 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.cfg.initializer_range)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def compile_regions(self) -> None:
        """torch.compile, in place, the parts of every draft layer that are not the sparse attention
        (flex compiles itself on the GPU): query and key projections with their per-head norms and RoPE,
        the two pre-norms and the SwiGLU MLP; and the context's and the final norm. Eagerly, each norm
        and rotation is several float32 passes over the block rows; compiled, one fused kernel each way.
        Layers share the compiled graphs (the parameters are their inputs), shapes are dynamic (rows and
        context vary by batch). Weight names and the state dict are unchanged."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.queries = torch.compile(attn.queries, dynamic=True)  # bound methods: instance attributes
            attn.context_kv = torch.compile(attn.context_kv, dynamic=True)
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
                module.compile(dynamic=True)
        for module in (self.hidden_norm, self.norm):  # the context's norm and the final one
            module.compile(dynamic=True)

    def attach_frozen(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Attach the target's embedding and lm_head ([V, H] each, may be the same tensor if tied)."""
        shape = (self.cfg.vocab_size, self.cfg.hidden_size)
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != shape:
                raise ValueError(f"the target's {name} has shape {tuple(w.shape)}; this drafter needs {shape}")
        self.embed_weight = embed_weight.detach().requires_grad_(False)
        self.lm_head_weight = lm_head_weight.detach().requires_grad_(False)

    def _frozen(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embed_weight is None or self.lm_head_weight is None:
            raise RuntimeError("attach the target's embedding and lm_head first: drafter.attach_frozen(embed, lm_head)")
        return self.embed_weight, self.lm_head_weight

    def _block_ids(self, first_tokens: torch.Tensor, length: int) -> torch.Tensor:
        """[A] tokens at the anchors -> [A, length] ids: [token, MASK x (length-1)]."""
        ids = torch.full((first_tokens.shape[0], length), self.cfg.mask_token_id, dtype=torch.long,
                         device=first_tokens.device)
        ids[:, 0] = first_tokens
        return ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> [..., H] through the target's frozen embedding (the mask token's row included)."""
        # the residual stream runs in the parameters' dtype (float32 masters under autocast)
        return F.embedding(ids, self._frozen()[0]).to(self.norm.weight.dtype)

    def fuse_context(self, context: torch.Tensor) -> torch.Tensor:
        """[T, K*H] (target layers concatenated in target_layer_ids order) -> [T, H]."""
        expected = self.cfg.num_context_layers * self.cfg.hidden_size
        if context.shape[-1] != expected:
            raise ValueError(f"context features have width {context.shape[-1]}, expected K*H = {expected}")
        if not torch.is_autocast_enabled(context.device.type):
            context = context.to(self.fc.weight.dtype)  # bf16 features into a float32 drafter
        return self.hidden_norm(self.fc(context))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] through the frozen lm_head (inference; training uses loss.py)."""
        head = self._frozen()[1]
        return hidden.to(head.dtype) @ head.T

    # -- training ------------------------------------------------------------------------------

    def forward(
        self,
        context: torch.Tensor,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """Blocks of a packed batch: context [T, K*H], input_ids [T], cu_seqlens [N+1], anchors [A]
        (packed positions) -> block hidden states [A, B, H] (after `norm`, before the lm_head)."""
        b, (t, a) = self.cfg.block_size, (input_ids.shape[0], anchors.shape[0])
        if a == 0:
            raise ValueError("the batch has no anchors; drop sequences without response tokens before batching")
        if context.shape[0] != t:
            raise ValueError(f"context has {context.shape[0]} rows but input_ids has {t}")
        layout = BlockLayout.build(cu_seqlens, anchors, t, b)
        return self.blocks(self.context_kv(context, layout.positions), input_ids, layout)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every draft layer's keys/values of the fused context: context [T, K*H] at `positions` [T]
        (within each sequence) -> per layer 2 x [T, nkv, D]. They do not depend on the anchors, so a
        caller drafting many rounds of blocks over one batch (train/path_tau.py) computes them once."""
        ctx = self.fuse_context(context)  # [T, K*H] -> [T, H]
        rope_ctx = self.rotary(positions)
        return [layer.self_attn.context_kv(ctx, rope_ctx) for layer in self.layers]  # 2 x [T, nkv, D] each

    def blocks(self, context_kv: list[tuple[torch.Tensor, torch.Tensor]], input_ids: torch.Tensor,
               layout: "BlockLayout") -> torch.Tensor:
        """The blocks of `layout` (its block size may differ from the config's) over the context
        keys/values of `context_kv` -> block hidden states [A, B, H]. Each layer attends by its mode
        (window, causal inside the block: DrafterConfig.layer_mode)."""
        b, a = layout.block_size, layout.anchors.shape[0]
        x = self.embed(self._block_ids(input_ids[layout.anchors], b)).flatten(0, 1)  # [A, B] -> [A*B, H]
        rope_blk = self.rotary(layout.block_positions().flatten())
        modes = [self.cfg.layer_mode(i) for i in range(len(self.layers))]
        attend = _block_attend(layout, set(modes), self.cfg.head_dim, x.device)
        for layer, mode, (ctx_k, ctx_v) in zip(self.layers, modes, context_kv):
            x = layer(x, ctx_k, ctx_v, rope_blk, attend, mode)
        return self.norm(x).unflatten(0, (a, b))  # [A*B, H] -> [A, B, H]

    # -- speculative decoding ------------------------------------------------------------------

    def new_cache(self) -> DraftCache:
        """An empty cache for one sequence."""
        p = self.fc.weight
        empty = p.new_zeros(0, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return DraftCache([empty] * len(self.layers), [empty] * len(self.layers))

    @torch.no_grad()
    def draft(self, cache: DraftCache, new_context: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Append the features of newly accepted tokens and draft one block right after them.

        new_context [n, K*H]: target features at positions cache.length .. cache.length+n-1;
        block_ids [b] ([last accepted token, MASK, ...]) at the positions that follow.
        Returns the block's hidden states [b, H]; the cache then holds the context only.
        """
        start, n, nb = cache.length, new_context.shape[0], block_ids.shape[0]
        device = new_context.device
        ctx = self.fuse_context(new_context)  # [n, K*H] -> [n, H]
        rope_ctx = self.rotary(torch.arange(start, start + n, device=device))
        rope_blk = self.rotary(torch.arange(start + n, start + n + nb, device=device))
        attend = _dense_attend(start + n, nb, self.cfg.head_dim)
        x = self.embed(block_ids)  # [b, H]
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.self_attn.context_kv(ctx, rope_ctx)  # [n, nkv, D] each
            cache.keys[i] = torch.cat([cache.keys[i], k_new])
            cache.values[i] = torch.cat([cache.values[i], v_new])
            x = layer(x, cache.keys[i], cache.values[i], rope_blk, attend, self.cfg.layer_mode(i))
        return self.norm(x)

    @torch.no_grad()
    def greedy_draft(self, cache: DraftCache, new_context: torch.Tensor, last_token: int,
                     length: int | None = None) -> torch.Tensor:
        """The drafted tokens [length - 1] after `last_token` (greedy, as served even when the target
        samples); `length` defaults to the block size (shorter near a length limit)."""
        ids = self._block_ids(torch.tensor([last_token], device=new_context.device), length or self.cfg.block_size)
        hidden = self.draft(cache, new_context, ids[0])  # [b, H]
        return self.logits(hidden[1:]).argmax(-1)  # position 0 is the given token, not a prediction


# ----------------------------------------------------------------------------------------------
# Where the blocks sit, and the sparse attention mask built from it
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockLayout:
    """The blocks of a packed batch. Query row r is block r // B, offset r % B; key column c < T is
    context position c (packed), c >= T is block key (c - T) // B, offset (c - T) % B."""

    anchors: torch.Tensor  # [A] packed positions of the anchors
    starts: torch.Tensor  # [A] packed start of each anchor's sequence
    positions: torch.Tensor  # [T] position of every packed token within its own sequence
    total: int  # T
    block_size: int  # B

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, anchors: torch.Tensor, total: int, block_size: int) -> "BlockLayout":
        cu = cu_seqlens.to(anchors.device, torch.long)
        anchors = anchors.long()
        tokens = torch.arange(total, device=anchors.device)
        seq_of_token = torch.searchsorted(cu, tokens, right=True) - 1  # [T]
        seq_of_anchor = torch.searchsorted(cu, anchors, right=True) - 1  # [A]
        return cls(anchors, cu[seq_of_anchor], tokens - cu[seq_of_token], total, block_size)

    def block_positions(self) -> torch.Tensor:
        """[A, B] absolute positions anchor..anchor+B-1 within each block's sequence."""
        offsets = torch.arange(self.block_size, device=self.anchors.device)
        return self.positions[self.anchors][:, None] + offsets

    def mask_mod(self, window: int | None, causal: bool = False):
        """flex_attention mask_mod: context of the same sequence strictly before the anchor and the
        own block, bidirectionally or (`causal`) up to the query; with a window, q_pos - k_pos < window
        (and k_pos - q_pos < window when bidirectional)."""
        anchors, starts, b = self.anchors, self.starts, self.block_size
        # first key column of each block's own keys, as a tensor: a compiled kernel then does not
        # specialise on the batch's token count
        block0 = self.total + torch.arange(anchors.shape[0], device=anchors.device) * b  # [A]

        def visible(batch, head, q, kv):
            j, k = q // b, q % b
            anchor = anchors[j]
            in_ctx = (kv >= starts[j]) & (kv < anchor)  # kv < anchor < T: a context column
            rel = kv - block0[j]  # offset inside block j's keys
            in_block = (rel >= 0) & (rel < b)
            if window is not None:
                in_ctx = in_ctx & (anchor + k - kv < window)
                in_block = in_block & (k - rel < window) & (causal or rel - k < window)
            if causal:
                in_block = in_block & (rel <= k)  # a sliding layer's block: the query and what precedes it
            return in_ctx | in_block

        return visible

    def row_intervals(self, window: int | None, causal: bool = False) -> tuple[torch.Tensor, ...]:
        """Per query row, the key columns it sees as two half-open intervals (context, block):
        (ctx_lo, ctx_hi, blk_lo, blk_hi), each [A*B]; the same set as `mask_mod`."""
        b = self.block_size
        k = torch.arange(b, device=self.anchors.device)
        anchor, start = self.anchors[:, None], self.starts[:, None]  # [A, 1]
        block0 = self.total + torch.arange(self.anchors.shape[0], device=k.device)[:, None] * b  # [A, 1]
        ctx_lo, ctx_hi = start.expand(-1, b), anchor.expand(-1, b)
        blk_lo, blk_hi = block0.expand(-1, b), (block0 + b).expand(-1, b)
        if window is not None:
            ctx_lo = torch.maximum(ctx_lo, anchor + k - window + 1)
            blk_lo = block0 + (k - window + 1).clamp(min=0)
            blk_hi = block0 + (k + window).clamp(max=b)
        if causal:
            blk_hi = torch.minimum(blk_hi, block0 + k + 1)
        return tuple(x.flatten() for x in (ctx_lo, ctx_hi, blk_lo, blk_hi))

    def block_mask(self, window: int | None, causal: bool = False, tile: int = FLEX_TILE) -> BlockMask:
        """The sparse BlockMask, its tile tables computed from `row_intervals` in chunks of rows
        (no dense [Q, KV] mask is ever built)."""
        q_len = self.anchors.shape[0] * self.block_size
        kv_len = self.total + q_len
        partial, full = _tile_tables(self.row_intervals(window, causal), q_len, kv_len, tile)
        return BlockMask.from_kv_blocks(
            *_tables_to_indices(partial), *_tables_to_indices(full),
            BLOCK_SIZE=tile, mask_mod=self.mask_mod(window, causal), seq_lengths=(q_len, kv_len),
        )


# Rows x column-tiles evaluated at once when building tile tables (bounds temporary memory).
_TILE_TABLE_CHUNK = 1 << 24


def _tile_tables(intervals, q_len: int, kv_len: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool [Q_tiles, KV_tiles]: tiles some / every query row sees entirely.

    A tile is full when every row of the q tile covers all its columns with one interval; rows and
    columns past the ends count as masked (as create_block_mask pads), so edge tiles are partial."""
    device = intervals[0].device
    n_q, n_kv = -(-q_len // tile), -(-kv_len // tile)
    pad = n_q * tile - q_len
    # padding rows see nothing: empty intervals
    lo_hi = [F.pad(x, (0, pad), value=0) for x in intervals]
    col_lo = torch.arange(n_kv, device=device) * tile  # [KVt]
    col_hi_clip = (col_lo + tile).clamp(max=kv_len)
    col_whole = col_lo + tile <= kv_len  # a tile past kv_len is never full
    rows_per_chunk = max(tile, (_TILE_TABLE_CHUNK // max(n_kv, 1)) // tile * tile)
    any_parts, full_parts = [], []
    for r0 in range(0, n_q * tile, rows_per_chunk):
        ctx_lo, ctx_hi, blk_lo, blk_hi = (x[r0:r0 + rows_per_chunk, None] for x in lo_hi)  # [r, 1]
        seen = _overlaps(ctx_lo, ctx_hi, col_lo, col_hi_clip) | _overlaps(blk_lo, blk_hi, col_lo, col_hi_clip)
        whole = ((ctx_lo <= col_lo) & (col_lo + tile <= ctx_hi)) | ((blk_lo <= col_lo) & (col_lo + tile <= blk_hi))
        whole = whole & col_whole  # padding rows have empty intervals: their tile is never full
        any_parts.append(seen.unflatten(0, (-1, tile)).any(1))
        full_parts.append(whole.unflatten(0, (-1, tile)).all(1))
    seen, full = torch.cat(any_parts), torch.cat(full_parts)  # [Qt, KVt]
    return seen & ~full, full


def _overlaps(lo, hi, col_lo, col_hi):
    return torch.maximum(lo, col_lo) < torch.minimum(hi, col_hi)


def _tables_to_indices(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [Qt, KVt] -> (num_blocks [1, 1, Qt], indices [1, 1, Qt, KVt]) with listed tiles first."""
    counts = table.sum(-1, dtype=torch.int32)
    order = torch.argsort((~table).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


_compiled_flex: Callable | None = None
# Always the main flex kernel: without grad and with fewer than 128 query rows (a few blocks, e.g. the
# last rounds of a path-tau replay), inductor picks its flex-decoding kernel, which finds no valid
# config for our BlockMask under dynamic shapes (NoValidChoicesError, torch 2.11 on an H200).
# Not ROWS_GUARANTEED_SAFE: the padding rows of the last query tile see no key, and without the
# kernel's guard their NaNs reach every key's gradient (every drafter trained with it on an H200
# had NaN loss from its first step).
_FLEX_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _flex_fn(device: torch.device) -> Callable:
    """flex_attention compiled on the GPU (its fast sparse kernel); eager elsewhere (tests)."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # default dynamic=None: a second batch shape marks lengths dynamic instead of recompiling per shape
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


FLEX_ON_CPU = False  # tests set it to run the flex path (eager or inductor-compiled) on the CPU too
# The CPU path's chunks: query rows at most, and scores one chunk may hold (x 4 bytes), at any batch size.
_CPU_ROWS_PER_CHUNK = 1024
_CPU_SCORES_PER_CHUNK = 1 << 25


def _block_attend(layout: "BlockLayout", modes: set[LayerMode], head_dim: int, device: torch.device) -> Attend:
    """The blocks' sparse attention: compiled flex on the GPU; on the CPU, dense attention over chunks
    of query rows, whose masks come from the same row intervals (flex's eager CPU path materialises
    every score of the batch at once: ~17 GiB for one validation batch of the quality benchmark)."""
    if device.type == "cuda" or FLEX_ON_CPU:
        return _flex_attend({m: layout.block_mask(*m) for m in modes}, head_dim)
    return _chunked_attend({m: layout.row_intervals(*m) for m in modes}, head_dim)


def _flex_attend(masks: dict[LayerMode, BlockMask], head_dim: int) -> Attend:
    def attend(q, k, v, mode):
        # [R, heads, D] -> [1, heads, R, D]
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        gqa, scale, mask = q.shape[1] != k.shape[1], head_dim**-0.5, masks[mode]
        if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            # flex_attention has no CPU backward: the same mask_mod, densified, through SDPA (tests only)
            dense = create_mask(mask.mask_mod, None, None, q.shape[2], k.shape[2], q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=gqa)
        else:
            with warnings.catch_warnings():  # eager on the CPU is intended (tests); say nothing
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                out = _flex_fn(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa,
                                         kernel_options=_FLEX_OPTIONS if q.device.type == "cuda" else None)
        return out[0].transpose(0, 1)

    return attend


def _chunked_attend(intervals: dict[LayerMode, tuple[torch.Tensor, ...]], head_dim: int) -> Attend:
    """Attention of query rows over key columns given, per row, two visible intervals (context, block):
    SDPA with a boolean mask, a chunk of rows at a time, over only the key columns the chunk's intervals
    span (consecutive blocks share a sequence: a few hundred context columns and the chunk's own block
    keys, not the whole batch). Without grad (validation, the offline estimate) memory stays bounded at
    any batch size; with grad, autograd keeps every chunk for the backward."""

    def attend(q, k, v, mode):
        ctx_lo, ctx_hi, blk_lo, blk_hi = intervals[mode]  # [R] each
        heads, out, r0 = q.shape[1], [], 0
        while r0 < q.shape[0]:
            r1 = min(q.shape[0], r0 + _CPU_ROWS_PER_CHUNK)
            while True:  # fewer rows while the chunk's scores would pass the budget
                spans = [(int(lo[r0:r1].min()), int(hi[r0:r1].max())) for lo, hi in ((ctx_lo, ctx_hi), (blk_lo, blk_hi))]
                width = sum(max(0, b - a) for a, b in spans)
                if r1 - r0 == 1 or (r1 - r0) * heads * width <= _CPU_SCORES_PER_CHUNK:
                    break
                r1 = r0 + (r1 - r0) // 2
            cols = torch.cat([torch.arange(a, b, device=k.device) for a, b in spans])  # [W] key columns
            r = slice(r0, r1)
            mask = (((cols >= ctx_lo[r, None]) & (cols < ctx_hi[r, None]))
                    | ((cols >= blk_lo[r, None]) & (cols < blk_hi[r, None])))  # [rows, W]
            k_, v_ = (x[cols].transpose(0, 1)[None] for x in (k, v))  # [1, nkv, W, D]
            out.append(F.scaled_dot_product_attention(
                q[r].transpose(0, 1)[None], k_, v_, attn_mask=mask, scale=head_dim**-0.5,
                enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))  # [rows, nh, D]
            r0 = r1
        return torch.cat(out)

    return attend


def _dense_attend(context_len: int, block_len: int, head_dim: int) -> Attend:
    """Attention of one drafted block over [context (context_len), block (block_len)] keys: the
    whole context and block for full layers; for sliding layers, causally within the window."""

    def attend(q, k, v, mode):
        (window, causal), mask = mode, None
        if window is not None or causal:
            q_pos = context_len + torch.arange(block_len, device=q.device)[:, None]
            k_pos = torch.arange(context_len + block_len, device=q.device)[None, :]
            mask = torch.ones(block_len, context_len + block_len, dtype=torch.bool, device=q.device)  # [b, L+b]
            if window is not None:
                mask = (q_pos - k_pos < window) & (causal | (k_pos - q_pos < window))
            if causal:
                mask = mask & (k_pos <= q_pos)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=head_dim**-0.5, enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)

    return attend
