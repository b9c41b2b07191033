"""The DFlash drafter's config, one to one with the released `config.json`: built from a target's
config (`from_target`), written and read as config.json (`to_config_json`, `from_config_json`, also
z-lab's layout), and as the transformers Qwen3Config whose RoPE code the drafter uses
(`to_hf_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping

from dflash_common.config import ConfigError, check
from dflash_common.drafter.layer_ids import check_layer_ids, default_layer_ids
from dflash_common.hf import text_fields

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCHITECTURE = "DFlashDraftModel"
# What sits on the DFlash backbone (the trainer's drafter.arch; drafter/arch.py maps each to its
# config and drafter classes)
Arch = Literal["dflash", "dspark", "dflash2"]
LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys a config.json must hold (and dflash_config's target_layer_ids and mask_token_id, also read
# top-level); every other key has a default, the released format's or the engines'.
REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_target_layers",
)


class MissingKeyError(ConfigError):
    """A config.json without a key it must hold: `keys` names each (dotted below dflash_config)."""

    def __init__(self, keys: list[str]):
        named = ", ".join(f"`{k}`" for k in keys)
        super().__init__(
            f"config.json lacks {named}; add {'it' if len(keys) == 1 else 'them'} "
            "(see the released checkpoint format, docs/serving.md)."
        )
        self.keys = keys


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter, field for field what the released `config.json` says (see
    `to_config_json`). Drafters built on the DFlash backbone subclass it (drafter/arch.py lists
    them)."""

    ARCHITECTURE: ClassVar[str] = ARCHITECTURE  # config.json's architectures entry
    KIND: ClassVar[str] = "DFlash"  # the drafter's name in messages
    VLLM_METHOD: ClassVar[str] = "dflash"  # vLLM's speculative_config method
    # only vLLM's V2 model runner drafts it (on a CPU: Triton interpreted, vllm_triton_cpu.py)
    V2_RUNNER: ClassVar[bool] = False
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
    # What sits on the backbone: "dflash" (nothing), or a subclass's parts (drafter/arch.py).
    arch: Arch = "dflash"

    def __post_init__(self):
        for name in (
            "target_layer_ids",
            "layer_types",
        ):  # lists from JSON/TOML: keep the config hashable
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check(
            self.arch == type(self).arch,
            f"arch = {self.arch!r} in a {type(self).__name__}; "
            "build it with drafter/arch.py's config_class.",
        )
        check(
            self.num_hidden_layers >= 1,
            f"num_hidden_layers = {self.num_hidden_layers} must be >= 1.",
        )
        check(
            self.block_size >= 2,
            f"block_size = {self.block_size} must be >= 2 (anchor + predictions).",
        )
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads = {self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads = {self.num_key_value_heads}.",
        )
        check(
            0 <= self.mask_token_id < self.vocab_size,
            f"mask_token_id = {self.mask_token_id} must be a row of the target's embedding "
            f"(0..{self.vocab_size - 1}).",
        )
        try:
            check_layer_ids(list(self.target_layer_ids), self.num_target_layers)
        except ValueError as e:
            raise ConfigError(f"target_layer_ids: {e}.") from e
        self._check_layer_types()
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        check(
            kind != "dynamic",
            "rope_scaling type 'dynamic' depends on the sequence length; it is not supported.",
        )

    def _check_layer_types(self) -> None:
        check(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries but num_hidden_layers = "
            f"{self.num_hidden_layers}.",
        )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        check(not bad, f"layer_types {bad} unknown; use {' or '.join(LAYER_TYPES)}.")
        sliding = "sliding_attention" in self.layer_types
        check(
            not sliding or (self.sliding_window is not None and self.sliding_window >= 1),
            "layer_types has sliding_attention layers but sliding_window is not set; set it (e.g. "
            "2048).",
        )
        check(
            sliding or self.sliding_window is None,
            f"sliding_window = {self.sliding_window} is set but no layer is sliding_attention; set "
            "layer_types.",
        )

    @property
    def verify_block_size(self) -> int:
        """Tokens of the block the target verifies, [anchor, drafts]: B for DFlash (block position
        0 is the given anchor, B-1 drafts), B+1 for drafters whose anchor row predicts too (DSpark:
        B drafts). A cycle emits at most this many tokens; tau lies in [1, verify_block_size]."""
        return self.block_size

    @property
    def num_drafts(self) -> int:
        """Drafts per cycle (vLLM's num_speculative_tokens)."""
        return self.verify_block_size - 1

    @property
    def num_context_layers(self) -> int:
        """K, the number of concatenated target layers fed to `fc`."""
        return len(self.target_layer_ids)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of draft layer `layer`, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def causal(self, layer: int) -> bool:
        """Whether draft layer `layer` sees its own block causally (sliding layers), else
        bidirectionally."""
        return self.sliding_causal and self.layer_types[layer] == "sliding_attention"

    def layer_mode(self, layer: int) -> tuple[int | None, bool]:
        """(sliding window or None, causal inside the block) of draft layer `layer`."""
        return self.layer_sliding_window(layer), self.causal(layer)

    def layer_causality(self) -> tuple[bool, ...]:
        """Per draft layer, the causality it trains and drafts with (what a loader must read
        back)."""
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
        **extra: Any,
    ) -> "DrafterConfig":
        """A drafter for `target_config` (an HF config object or its config.json as a dict).

        Sizes, vocabulary, RoPE and norm epsilon come from the target; `layer_ids` defaults to the
        DFlash rule (K=5 evenly from layer 1 to N-3); `layer_types` defaults to all full attention.
        `extra`: a subclass's own fields (its heads).
        """
        t = _target_text_config(target_config)
        n_target = int(t["num_hidden_layers"])
        return cls(
            **_model_fields(t),
            num_hidden_layers=depth,
            num_target_layers=n_target,
            target_layer_ids=tuple(
                layer_ids if layer_ids is not None else default_layer_ids(n_target)
            ),
            mask_token_id=mask_token_id,
            layer_types=tuple(
                layer_types if layer_types is not None else ["full_attention"] * depth
            ),
            block_size=block_size,
            sliding_window=sliding_window,
            **extra,
        )

    # -- config.json ------------------------------------------------------------------------------

    def to_config_json(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The released `config.json`: a Qwen3 config plus the DFlash fields, in the layout SGLang,
        vLLM and z-lab's loader read. `dtype` names the dtype of the saved weights."""
        from transformers import __version__ as transformers_version

        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta}
        rope_parameters.pop("type", None)
        dflash = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        sliding = "sliding_attention" in self.layer_types
        causal = set(self.layer_causality())
        if len(causal) == 1:
            # one causality for every layer: said where vLLM reads it first (top-level is_causal,
            # then dflash_config.causal); a mixed drafter writes neither, both override every layer,
            # and relies on the layer_types rule of vLLM and SGLang (sliding causal, full
            # bidirectional)
            dflash["causal"] = causal.pop()
        config = {
            "architectures": [self.ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            # top-level: z-lab's class fails without num_target_layers even when ids are given
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
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
        check(
            cls.ARCHITECTURE in arch,
            f"config.json architectures = {arch} is not [{cls.ARCHITECTURE!r}]; "
            f"not a {cls.KIND} drafter.",
        )
        dflash = data.get("dflash_config") or {}

        def dflash_value(name: str):
            return dflash.get(name, data.get(name))

        missing = [k for k in REQUIRED_KEYS if data.get(k) is None]
        missing += [
            f"dflash_config.{k}"
            for k in ("target_layer_ids", "mask_token_id")
            if dflash_value(k) is None
        ]
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
            **cls._own_fields_from_config_json(data),
        )

    @classmethod
    def _own_fields_from_config_json(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """A subclass's own fields (its heads) from its config.json; DFlash has none."""
        return {}

    def to_hf_config(self):
        """A transformers Qwen3Config with this drafter's shapes and RoPE (for transformers' RoPE
        code)."""
        from transformers import Qwen3Config

        rope = {
            "rope_type": "default",
            **dict(self.rope_scaling or {}),
            "rope_theta": self.rope_theta,
        }
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
    """The block causality a config.json asks of its sliding layers: an explicit top-level
    `is_causal` or `dflash_config.causal` (vLLM's order), else causal (the engines' layer_types
    rule). Full layers are bidirectional here; a config that asks them to be causal is refused."""
    explicit = data.get("is_causal")
    if explicit is None:
        explicit = (data.get("dflash_config") or {}).get("causal")
    full = "full_attention" in (data.get("layer_types") or ["full_attention"])
    check(
        not (explicit and full),
        "config.json asks for causal full_attention layers (is_causal / dflash_config.causal = "
        "true); full layers here are bidirectional inside the block, as the engines serve them.",
    )
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
        raise ConfigError(
            "the config has neither rope_theta nor rope_parameters.rope_theta; add the target's "
            "theta."
        )
    scaling = data.get("rope_scaling")
    if scaling is None:
        params.pop("rope_theta", None)
        scaling = params if params.get("rope_type", "default") != "default" else None
    return float(theta), (dict(scaling) if scaling else None)
