"""The DFlash drafter's config, one to one with the released `config.json`: built from a target's
config (`from_target`), written and read as config.json (`to_config_json`, `from_config_json`, also
z-lab's layout), and as the transformers Qwen3Config whose RoPE code the drafter uses (`to_hf_config`).
A DFlash2 drafter is the same config with `dflash2` set (`DFlash2Config`: convolutions, selector).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from dflash_common.config import ConfigError, check
from dflash_common.drafter.layer_ids import check_layer_ids, default_layer_ids
from dflash_common.hf import text_fields

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_DFLASH2 = "DFlash2DraftModel"  # vLLM 0.32 and SGLang pick DFlash2's model by this name
LAYER_TYPES = ("full_attention", "sliding_attention")
# dflash_config keys of DFlash2 that vLLM 0.32 requires (qwen3_dflash2.py reads them with [])
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Config:
    """What DFlash2 adds to a DFlash drafter (vLLM 0.32 `qwen3_dflash2.py`, z-lab's release): in
    every draft layer a grouped dynamic convolution over block positions around the attention and
    one around the MLP, and a candidate selector over each position's top-k tokens. Defaults are
    the released geometry (z-lab's config, SpecForge's and speculators' trainers)."""

    conv_kernel_size: int = 2  # taps: a block row mixes in the rows up to taps-1 before it
    conv_group_size: int = 16  # channels sharing one per-row dynamic coefficient
    selector_rank: int = 256  # rank r of the predecessor/successor codebooks [V, r]
    selector_top_k: int = 16  # candidates per block position the selector chooses among
    # The served unary scores are top-k values * output_multiplier, then tanh-capped when the cap is
    # > 0 (both monotonic: the candidates are the top-k of the raw logits). Read from released
    # checkpoints; a drafter trained here keeps 1 and no cap.
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0

    def check(self, hidden_size: int, vocab_size: int) -> None:
        check(self.conv_kernel_size >= 1,
              f"conv_kernel_size = {self.conv_kernel_size} must be >= 1.")
        check(self.conv_group_size >= 1 and hidden_size % self.conv_group_size == 0,
              f"conv_group_size = {self.conv_group_size} must divide hidden_size = {hidden_size} "
              f"(vLLM and SGLang refuse it otherwise); e.g. 16.")
        check(self.selector_rank >= 1, f"selector_rank = {self.selector_rank} must be >= 1.")
        check(1 <= self.selector_top_k <= vocab_size,
              f"selector_top_k = {self.selector_top_k} must be in 1..vocab_size ({vocab_size}).")
        check(self.output_multiplier > 0,
              f"output_multiplier = {self.output_multiplier} must be > 0 (vLLM's top-k refuses "
              "it otherwise).")
        check(self.final_logit_softcapping >= 0,
              f"final_logit_softcapping = {self.final_logit_softcapping} must be >= 0 (0 = none).")

    def to_dflash_config(self) -> dict[str, Any]:
        """The keys DFlash2 adds to config.json's dflash_config."""
        names = (*DFLASH2_KEYS, "output_multiplier", "final_logit_softcapping")
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_dflash_config(cls, dflash: Mapping[str, Any]) -> "DFlash2Config":
        missing = [k for k in DFLASH2_KEYS if dflash.get(k) is None]
        check(not missing, f"config.json's dflash_config has no {', '.join(missing)}; a DFlash2 "
                           f"drafter needs all of {', '.join(DFLASH2_KEYS)} (vLLM fails to load it "
                           "without them).")
        return cls(*(int(dflash[k]) for k in DFLASH2_KEYS),
                   output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                   final_logit_softcapping=float(dflash.get("final_logit_softcapping") or 0.0))


# Keys a config.json must hold (and dflash_config's target_layer_ids and mask_token_id, also read
# top-level); every other key has a default, the released format's or the engines'.
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "vocab_size", "num_target_layers")


class MissingKeyError(ConfigError):
    """A config.json without a key it must hold: `keys` names each (dotted below dflash_config)."""

    def __init__(self, keys: list[str]):
        named = ", ".join(f"`{k}`" for k in keys)
        super().__init__(f"config.json lacks {named}; add {'it' if len(keys) == 1 else 'them'} "
                         "(see the released checkpoint format, docs/serving.md).")
        self.keys = keys


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
    dflash2: DFlash2Config | None = None  # set: a DFlash2 drafter (convolutions and selector)

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
        if self.dflash2 is not None:
            self.dflash2.check(self.hidden_size, self.vocab_size)
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
    def architecture(self) -> str:
        """config.json's `architectures` entry: the name serving engines pick the model class by."""
        return ARCHITECTURE_DFLASH2 if self.dflash2 is not None else ARCHITECTURE

    @property
    def num_context_layers(self) -> int:
        """K, the number of concatenated target layers fed to `fc`."""
        return len(self.target_layer_ids)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of draft layer `layer`, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def causal(self, layer: int) -> bool:
        """Whether draft layer `layer` sees its own block causally (sliding layers), else bidirectionally."""
        return self.sliding_causal and self.layer_types[layer] == "sliding_attention"

    def layer_mode(self, layer: int) -> tuple[int | None, bool]:
        """(sliding window or None, causal inside the block) of draft layer `layer`."""
        return self.layer_sliding_window(layer), self.causal(layer)

    def layer_causality(self) -> tuple[bool, ...]:
        """Per draft layer, the causality it trains and drafts with (what a loader must read back)."""
        return tuple(self.causal(i) for i in range(self.num_hidden_layers))

    # -- construction from a target ------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig | Mapping[str, Any],
        *,
        mask_token_id: int,
        depth: int = 5,
        block_size: int = 16,
        layer_ids: list[int] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        dflash2: DFlash2Config | None = None,
    ) -> "DrafterConfig":
        """A drafter for `target_config` (an HF config object or its config.json as a dict).

        Sizes, vocabulary, RoPE and norm epsilon come from the target; `layer_ids` defaults to the
        DFlash rule (K=5 evenly from layer 1 to N-3); `layer_types` defaults to all full attention.
        """
        t = _target_text_config(target_config)
        n_target = int(t["num_hidden_layers"])
        return cls(
            **_model_fields(t),
            num_hidden_layers=depth,
            num_target_layers=n_target,
            target_layer_ids=tuple(layer_ids if layer_ids is not None else default_layer_ids(n_target)),
            mask_token_id=mask_token_id,
            layer_types=tuple(layer_types if layer_types is not None else ["full_attention"] * depth),
            block_size=block_size,
            sliding_window=sliding_window,
            dflash2=dflash2,
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
        if self.dflash2 is not None:
            # block_size too: SGLang's conv block when --speculative-num-draft-tokens is not given
            dflash |= {"block_size": self.block_size, **self.dflash2.to_dflash_config()}
        sliding = "sliding_attention" in self.layer_types
        causal = set(self.layer_causality())
        if len(causal) == 1:
            # one causality for every layer: said where vLLM reads it first (top-level is_causal, then
            # dflash_config.causal); a mixed drafter writes neither, both override every layer, and
            # relies on the layer_types rule of vLLM and SGLang (sliding causal, full bidirectional)
            dflash["causal"] = causal.pop()
        config = {
            "architectures": [self.architecture],
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
        check(ARCHITECTURE in arch or ARCHITECTURE_DFLASH2 in arch,
              f"config.json architectures = {arch} is neither [{ARCHITECTURE!r}] nor "
              f"[{ARCHITECTURE_DFLASH2!r}]; not a DFlash drafter.")
        dflash = data.get("dflash_config") or {}
        dflash2 = DFlash2Config.from_dflash_config(dflash) if ARCHITECTURE_DFLASH2 in arch else None

        def dflash_value(name: str):
            return dflash.get(name, data.get(name))

        missing = [k for k in REQUIRED_KEYS if data.get(k) is None]
        missing += [f"dflash_config.{k}" for k in ("target_layer_ids", "mask_token_id")
                    if dflash_value(k) is None]
        if missing:
            raise MissingKeyError(missing)
        depth = int(data["num_hidden_layers"])
        sliding = "sliding_attention" in (data.get("layer_types") or [])
        sliding_causal = _sliding_causal_from_config(data, sliding)
        return cls(
            **_model_fields(data),
            num_hidden_layers=depth,
            num_target_layers=int(data["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in dflash_value("target_layer_ids")),
            mask_token_id=int(dflash_value("mask_token_id")),
            layer_types=tuple(data.get("layer_types") or ["full_attention"] * depth),
            block_size=int(dflash_value("block_size") or 16),
            sliding_window=data.get("sliding_window") if sliding else None,
            sliding_causal=sliding_causal,
            dflash2=dflash2,
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
    return dict(data if "hidden_size" in data else text_fields(data))


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


def _model_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a drafter takes from a Qwen3-style config dict, a target's or its own released
    config.json, with the same defaults either way: sizes, vocabulary, RoPE, norm, special ids."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    theta, scaling = rope_from_config_dict(config)
    return dict(
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config["vocab_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 40960),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        initializer_range=float(config.get("initializer_range") or 0.02),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_as_id_or_ids(config.get("eos_token_id")),
    )


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
