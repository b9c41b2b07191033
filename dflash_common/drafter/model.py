"""The DFlash drafter's modules, from the config in config.py.

The model reads top to bottom like the method:

    block [token at anchor, MASK x (B-1)] -> the target's frozen embedding        [A, B, H]
    K target layers' states, concatenated -> fc (K*H -> H) -> hidden_norm          [T, H]
    draft layers: queries from the block; keys/values = this layer's projection
        of the fused context, *followed by* the block's own keys/values
    -> norm -> the target's frozen lm_head (applied by the loss, see loss/)

Positions are absolute: context features sit at their positions 0..S-1, the block at
anchor..anchor+B-1, rotated with the target's RoPE (theta and scaling from its config).

Two forwards share the layers:
- `forward` (training) runs many blocks of many packed sequences at once under a sparse mask built
  from the anchors (attention.py: which keys a block's queries see, and the backends that attend).
- `draft` (speculative decoding) keeps each layer's context keys/values in a `DraftCache`, appends
  the features of newly accepted tokens, drafts one block whose keys/values are never stored: the
  cache is back to "context only" after every draft.

The target's embedding and lm_head are attached with `attach_frozen`; they are plain attributes,
neither parameters nor buffers, so no optimizer, `state_dict` or checkpoint ever sees them, and
`.to()` does not move them (attach them on the device you run on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_common.drafter.attention import (
    Attend,
    BlockLayout,
    LayerMode,
    block_attend,
    dense_attend,
)
from dflash_common.drafter.config import DrafterConfig


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
            hf = Qwen3RotaryEmbedding(
                cfg.to_hf_config()
            )  # default / linear / yarn / llama3 scaling
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


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
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
        return apply_rope(
            self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))), rope
        )

    def forward(self, x, ctx_k, ctx_v, rope, attend: Attend, mode: LayerMode) -> torch.Tensor:
        """x [R, H] block tokens; ctx_k/ctx_v [T, nkv, D] go *before* the block's own
        keys/values."""
        q = self.queries(x, rope)  # [R, nh, D]
        k, v = self.context_kv(x, rope)  # the block's own keys/values [R, nkv, D]
        dtype = (
            v.dtype
        )  # norms in float32 can promote q/k under autocast; attention wants one dtype
        out = attend(
            q.to(dtype),
            torch.cat([ctx_k.to(dtype), k.to(dtype)]),
            torch.cat([ctx_v.to(dtype), v]),
            mode,
        )
        return self.o_proj(out.flatten(-2))  # [R, nh*D] -> [R, H]


class DraftLayer(nn.Module):
    """A Qwen3 decoder layer (pre-norm, q/k norm, SwiGLU) whose keys/values start with the
    context."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x, ctx_k, ctx_v, rope, attend: Attend, mode: LayerMode, block: int
    ) -> torch.Tensor:
        """x [R, H]: whole blocks of `block` rows each (DFlash2's layers convolve along them)."""
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
    layer_class: type[nn.Module] = DraftLayer  # DFlash2's layers add convolutions

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.embed_weight: torch.Tensor | None = None  # [V, H], the target's, frozen, not state
        self.lm_head_weight: torch.Tensor | None = None  # [V, H], the target's, frozen, not state
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """A random start, as the recipe says: linear weights ~ N(0, initializer_range), norms at
        1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.cfg.initializer_range)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def compile_regions(self) -> None:
        """torch.compile, in place, the parts of every draft layer that are not the sparse attention
        (flex compiles itself on the GPU): query and key projections with their per-head norms and
        RoPE, the two pre-norms and the SwiGLU MLP; and the context's and the final norm. Eagerly,
        each norm and rotation is several float32 passes over the block rows; compiled, one fused
        kernel each way. Layers share the compiled graphs (the parameters are their inputs), shapes
        are dynamic (rows and context vary by batch). Weight names and the state dict are
        unchanged."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.queries = torch.compile(
                attn.queries, dynamic=True
            )  # bound methods: instance attributes
            attn.context_kv = torch.compile(attn.context_kv, dynamic=True)
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
                module.compile(dynamic=True)
        for module in (self.hidden_norm, self.norm):  # the context's norm and the final one
            module.compile(dynamic=True)

    def attach_frozen(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Attach the target's embedding and lm_head ([V, H] each, may be the same tensor if
        tied)."""
        shape = (self.cfg.vocab_size, self.cfg.hidden_size)
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != shape:
                raise ValueError(
                    f"the target's {name} has shape {tuple(w.shape)}; this drafter needs {shape}"
                )
        self.embed_weight = embed_weight.detach().requires_grad_(False)
        self.lm_head_weight = lm_head_weight.detach().requires_grad_(False)

    def _frozen(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embed_weight is None or self.lm_head_weight is None:
            raise RuntimeError(
                "attach the target's embedding and lm_head first: drafter.attach_frozen(embed, "
                "lm_head)"
            )
        return self.embed_weight, self.lm_head_weight

    def _block_ids(self, first_tokens: torch.Tensor, length: int) -> torch.Tensor:
        """[A] tokens at the anchors -> [A, length] ids: [token, MASK x (length-1)]."""
        ids = torch.full(
            (first_tokens.shape[0], length),
            self.cfg.mask_token_id,
            dtype=torch.long,
            device=first_tokens.device,
        )
        ids[:, 0] = first_tokens
        return ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> [..., H] through the target's frozen embedding (the mask token's row
        included)."""
        # the residual stream runs in the parameters' dtype (float32 masters under autocast)
        return F.embedding(ids, self._frozen()[0]).to(self.norm.weight.dtype)

    def fuse_context(self, context: torch.Tensor) -> torch.Tensor:
        """[T, K*H] (target layers concatenated in target_layer_ids order) -> [T, H]."""
        expected = self.cfg.num_context_layers * self.cfg.hidden_size
        if context.shape[-1] != expected:
            raise ValueError(
                f"context features have width {context.shape[-1]}, expected K*H = {expected}"
            )
        if not torch.is_autocast_enabled(context.device.type):
            context = context.to(self.fc.weight.dtype)  # bf16 features into a float32 drafter
        return self.hidden_norm(self.fc(context))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] through the frozen lm_head (inference; training uses loss/)."""
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
            raise ValueError(
                "the batch has no anchors; drop sequences without response tokens before batching"
            )
        if context.shape[0] != t:
            raise ValueError(f"context has {context.shape[0]} rows but input_ids has {t}")
        layout = BlockLayout.build(cu_seqlens, anchors, t, b)
        return self.blocks(self.context_kv(context, layout.positions), input_ids, layout)

    def context_kv(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every draft layer's keys/values of the fused context: context [T, K*H] at `positions` [T]
        (within each sequence) -> per layer 2 x [T, nkv, D]. They do not depend on the anchors, so a
        caller drafting many rounds of blocks over one batch (train/path_tau.py) computes them
        once."""
        ctx = self.fuse_context(context)  # [T, K*H] -> [T, H]
        rope_ctx = self.rotary(positions)
        return [
            layer.self_attn.context_kv(ctx, rope_ctx) for layer in self.layers
        ]  # 2 x [T, nkv, D] each

    def blocks(
        self,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        input_ids: torch.Tensor,
        layout: "BlockLayout",
    ) -> torch.Tensor:
        """The blocks of `layout` (its block size may differ from the config's) over the context
        keys/values of `context_kv` -> block hidden states [A, B, H]. Each layer attends by its mode
        (window, causal inside the block: DrafterConfig.layer_mode)."""
        b, a = layout.block_size, layout.anchors.shape[0]
        x = self.embed(self._block_ids(input_ids[layout.anchors], b)).flatten(
            0, 1
        )  # [A, B] -> [A*B, H]
        rope_blk = self.rotary(layout.block_positions().flatten())
        modes = [self.cfg.layer_mode(i) for i in range(len(self.layers))]
        attend = block_attend(layout, set(modes), self.cfg.head_dim, x.device)
        for layer, mode, (ctx_k, ctx_v) in zip(self.layers, modes, context_kv):
            x = layer(x, ctx_k, ctx_v, rope_blk, attend, mode, b)
        return self.norm(x).unflatten(0, (a, b))  # [A*B, H] -> [A, B, H]

    # -- speculative decoding ------------------------------------------------------------------

    def new_cache(self) -> DraftCache:
        """An empty cache for one sequence."""
        p = self.fc.weight
        empty = p.new_zeros(0, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return DraftCache([empty] * len(self.layers), [empty] * len(self.layers))

    @torch.no_grad()
    def draft(
        self, cache: DraftCache, new_context: torch.Tensor, block_ids: torch.Tensor
    ) -> torch.Tensor:
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
        attend = dense_attend(start + n, nb, self.cfg.head_dim)
        x = self.embed(block_ids)  # [b, H]
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.self_attn.context_kv(ctx, rope_ctx)  # [n, nkv, D] each
            cache.keys[i] = torch.cat([cache.keys[i], k_new])
            cache.values[i] = torch.cat([cache.values[i], v_new])
            mode = self.cfg.layer_mode(i)
            x = layer(x, cache.keys[i], cache.values[i], rope_blk, attend, mode, nb)
        return self.norm(x)

    @torch.no_grad()
    def greedy_draft(
        self,
        cache: DraftCache,
        new_context: torch.Tensor,
        last_token: int,
        length: int | None = None,
    ) -> torch.Tensor:
        """The drafted tokens after `last_token` (greedy, as served even when the target samples)
        from a block of `length` rows (default: the block size; shorter near a length limit):
        length - 1 of them (DSpark: length; `greedy_drafts`)."""
        first = torch.tensor([last_token], device=new_context.device)
        ids = self._block_ids(first, length or self.cfg.block_size)
        hidden = self.draft(cache, new_context, ids[0])  # [b, H]
        return self.greedy_drafts(hidden[None], first)[0]

    @torch.no_grad()
    def greedy_drafts(self, hidden: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
        """Block hidden states [n, b, H] -> the drafts served [n, b - 1]: the argmax of each
        prediction (position 0 is the given anchor, not a prediction). `first_tokens` [n], the
        anchors, are for drafters that read them: DSpark's Markov head, DFlash2's selector walk."""
        return self.logits(hidden[:, 1:]).argmax(-1)

    @torch.no_grad()
    def sampled_drafts(
        self, hidden: torch.Tensor, first_tokens: torch.Tensor, draw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block hidden states [n, b, H] -> (drafts [n, b - 1], the distributions they were drawn
        from [n, b - 1, V]), each prediction's draft drawn by `draw` (logits [m, V] -> (tokens
        [m], their distribution [m, V])): drafts sampled from the drafter, as vLLM's
        `draft_sample_method = "probabilistic"` drafts them."""
        logits = self.logits(hidden[:, 1:])  # [n, b - 1, V]
        tokens, probs = draw(logits.flatten(0, 1))
        return tokens.view(logits.shape[:2]), probs.view(logits.shape)
