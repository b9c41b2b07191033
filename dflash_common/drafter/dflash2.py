"""The DFlash2 drafter: DFlash's drafter (model.py) plus, in every draft layer, a grouped dynamic
convolution over block positions around the attention and one around the MLP, and a candidate
selector that picks the served path through each block position's top-k tokens.

Math and names as vLLM 0.32 serves it (`vllm/model_executor/models/qwen3_dflash2.py`,
`vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py`) and z-lab's release:

    one layer:  h, d = attention_conv.prepare(input_layernorm(x))   conv of the sublayer's input
                x = x + attention_conv.finish(self_attn(h), d)       conv of its output (same d)
                h, d = mlp_conv.prepare(post_attention_layernorm(x))
                x = x + mlp_conv.finish(mlp(h), d)

    conv(x, delta, base)[i, c] = sum_t [p(i) >= t] (base[t, c] + delta[i, t, c // group]) x[i-t, c]

p(i) is row i's position inside its block: causal inside the block, zero across block starts, so the
training forward's rows ([A, B] blocks, flattened) and one served block convolve alike. `prepare`
projects the normalised input once (kernel_projection: H -> [2, T, G], side 0 for the input, side 1
for the output); base_kernel [2, T, H] is indexed the same way. Both start as the identity (tap 0 of
base = 1, projection 0), so a fresh DFlash2 layer is a DFlash layer.

Candidates and the path (what serving verifies), for the block's prediction rows n = 1..B-1:

    candidates c[n, :], unary u[n, :] = top-k of lm_head(hidden[n]) (sorted),
                                        u = values * output_multiplier, then tanh-capped by
                                        final_logit_softcapping if > 0
    score[n, i, j] = u[n, j] + sum_r P[pred(n, i), r] * proj(hidden[n])[r] * S[c[n, j], r]
                     pred(1, i) = the block's first token, pred(n, i) = c[n-1, i]
    walk: prev = 0; each n: j = argmax_j score[n, prev, j] (lowest j on ties), draft c[n, j], prev j

P, S are candidate_selector.{predecessor,successor}_codebook [V, r] (bare parameter names, as
engines load them), proj its hidden_projection [r, H]. The walk is greedy, not Viterbi: at each
position the row of the previously chosen candidate.

The convolution runs as Triton kernels on CUDA (conv_triton.py, forward and backward), as torch on
the CPU (`grouped_conv_torch`, also the reference the kernels are tested against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dflash_common.config import check
from dflash_common.drafter.config import Arch, DrafterConfig
from dflash_common.drafter.model import DFlashDrafter, DraftLayer

ARCHITECTURE = "DFlash2DraftModel"  # vLLM 0.32 and SGLang pick DFlash2's model by this name
# dflash_config keys of DFlash2 that vLLM 0.32 requires (qwen3_dflash2.py reads them with [])
REQUIRED_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

ConvBackend = Literal["auto", "triton", "torch"]
CONV_BACKEND: ConvBackend = (
    "auto"  # tests set "triton" to run the kernels on a CPU (TRITON_INTERPRET=1)
)


# ----------------------------------------------------------------------------------------------
# The config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DFlash2Config(DrafterConfig):
    """A DFlash2 drafter: the DFlash fields plus what DFlash2 adds (vLLM 0.32 `qwen3_dflash2.py`,
    z-lab's release), written in config.json's dflash_config under the same names: in every draft
    layer a grouped dynamic convolution over block positions around the attention and one around
    the MLP, and a candidate selector over each position's top-k tokens. Defaults are the released
    geometry (z-lab's config, SpecForge's and speculators' trainers)."""

    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    KIND: ClassVar[str] = "DFlash2"
    VLLM_METHOD: ClassVar[str] = "dflash"  # vLLM picks its DFlash2 speculator by the architecture
    V2_RUNNER: ClassVar[bool] = True  # the V1 runner refuses "DFlash candidate-head drafts"

    arch: Arch = "dflash2"
    conv_kernel_size: int = 2  # taps: a block row mixes in the rows up to taps-1 before it
    conv_group_size: int = 16  # channels sharing one per-row dynamic coefficient
    selector_rank: int = 256  # rank r of the predecessor/successor codebooks [V, r]
    selector_top_k: int = 16  # candidates per block position the selector chooses among
    # The served unary scores are top-k values * output_multiplier, then tanh-capped when the cap is
    # > 0 (both monotonic: the candidates are the top-k of the raw logits). Read from released
    # checkpoints; a drafter trained here keeps 1 and no cap.
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check(
            self.conv_kernel_size >= 1, f"conv_kernel_size = {self.conv_kernel_size} must be >= 1."
        )
        check(
            self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
            f"conv_group_size = {self.conv_group_size} must divide hidden_size = "
            f"{self.hidden_size} (vLLM and SGLang refuse it otherwise); e.g. 16.",
        )
        check(self.selector_rank >= 1, f"selector_rank = {self.selector_rank} must be >= 1.")
        check(
            1 <= self.selector_top_k <= self.vocab_size,
            f"selector_top_k = {self.selector_top_k} must be in 1..vocab_size ({self.vocab_size}).",
        )
        check(
            self.output_multiplier > 0,
            f"output_multiplier = {self.output_multiplier} must be > 0 (vLLM's top-k refuses "
            "it otherwise).",
        )
        check(
            self.final_logit_softcapping >= 0,
            f"final_logit_softcapping = {self.final_logit_softcapping} must be >= 0 (0 = none).",
        )

    def own_dflash_config(self) -> dict[str, Any]:
        """The keys DFlash2 adds to config.json's dflash_config (block_size too: SGLang's conv
        block when --speculative-num-draft-tokens is not given)."""
        names = ("block_size", *REQUIRED_KEYS, "output_multiplier", "final_logit_softcapping")
        return {name: getattr(self, name) for name in names}

    def to_config_json(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """DFlash's config.json with DFlash2's keys in its dflash_config."""
        config = super().to_config_json(dtype)
        config["dflash_config"].update(self.own_dflash_config())
        return config

    @classmethod
    def _own_fields_from_config_json(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        dflash = data.get("dflash_config") or {}
        missing = [k for k in REQUIRED_KEYS if dflash.get(k) is None]
        check(
            not missing,
            f"config.json's dflash_config has no {', '.join(missing)}; a DFlash2 drafter needs "
            f"all of {', '.join(REQUIRED_KEYS)} (vLLM fails to load it without them).",
        )
        return {
            **{k: int(dflash[k]) for k in REQUIRED_KEYS},
            "output_multiplier": float(dflash.get("output_multiplier", 1.0)),
            "final_logit_softcapping": float(dflash.get("final_logit_softcapping") or 0.0),
        }


# ----------------------------------------------------------------------------------------------
# The grouped convolution
# ----------------------------------------------------------------------------------------------


def grouped_conv_torch(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int, group_size: int
) -> torch.Tensor:
    """x [R, H], delta [R, T, G], base [T, H] -> [R, H] in x's dtype, computed in float32 (float64
    inputs in float64: the gradient checks)."""
    rows, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    acc = torch.promote_types(x.dtype, torch.float32)
    position = torch.arange(rows, device=x.device) % block
    x32 = x.to(acc).view(rows, groups, group_size)
    out = torch.zeros_like(x32)
    for t in range(taps):
        coeff = (
            base[t].to(acc).view(1, groups, group_size) + delta[:, t].to(acc)[..., None]
        )  # [R, G, group]
        shifted = F.pad(x32[: rows - t], (0, 0, 0, 0, t, 0)) * (position >= t).view(
            -1, 1, 1
        )  # row i - t
        out = out + coeff * shifted
    return out.view(rows, hidden).to(x.dtype)


def grouped_conv(
    x: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block: int,
    group_size: int,
    backend: ConvBackend | None = None,
) -> torch.Tensor:
    """The convolution (module docstring) by `backend` (default CONV_BACKEND): 'auto' runs the
    Triton kernels on CUDA and torch elsewhere."""
    backend = backend or CONV_BACKEND
    if backend == "auto":
        backend = "triton" if x.is_cuda and _triton_takes(group_size) else "torch"
    if backend == "torch":
        return grouped_conv_torch(x, delta, base, block, group_size)
    from dflash_common.drafter.conv_triton import GroupedConvFunction

    return GroupedConvFunction.apply(x, delta, base, block, group_size)


def _triton_takes(group_size: int) -> bool:
    try:
        from dflash_common.drafter.conv_triton import supported
    except ImportError:  # no Triton installed
        return False
    return supported(group_size)


class GroupedConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash2 layer: base_kernel [2, T, H] (side, tap, channel;
    side 0 convolves the sublayer's input, side 1 its output) and kernel_projection H -> 2*T*G whose
    output row is viewed [2, T, G] the same way."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 passes each row through, nothing else (the trainers' start)."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [R, H] (normalised sublayer input) -> (its convolution [R, H], the output side's
        delta [R, T, G])."""
        delta = self.kernel_projection(h).unflatten(-1, (2, self.taps, self.groups))  # [R, 2, T, G]
        return grouped_conv(h, delta[:, 0], self.base_kernel[0], block, self.group_size), delta[
            :, 1
        ]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        """y [R, H] (sublayer output), delta from `prepare` -> [R, H]."""
        return grouped_conv(y, delta, self.base_kernel[1], block, self.group_size)


class DFlash2Layer(DraftLayer):
    """A DFlash draft layer with a grouped convolution around its attention and around its MLP."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        shape = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = GroupedConv(*shape)
        self.mlp_conv = GroupedConv(*shape)

    def forward(self, x, ctx_k, ctx_v, rope, attend, mode, block: int) -> torch.Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), block)
        x = x + self.attention_conv.finish(
            self.self_attn(h, ctx_k, ctx_v, rope, attend, mode), delta, block
        )
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), delta, block)


# ----------------------------------------------------------------------------------------------
# The candidate selector
# ----------------------------------------------------------------------------------------------


class CandidateSelector(nn.Module):
    """Scores of candidate tokens given the token before them: the unary score plus a rank-r
    bilinear term P[previous] * proj(hidden) . S[candidate]."""

    def __init__(self, hidden: int, vocab: int, rank: int, init_range: float):
        super().__init__()
        self.init_range = init_range
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A zero successor codebook: a fresh selector scores by the unary logits alone, so the
        first steps serve exactly the top-1 (SpecForge's start); the other two ~ N(0,
        initializer_range)."""
        self.predecessor_codebook.normal_(0.0, self.init_range)
        self.successor_codebook.zero_()
        self.hidden_projection.weight.normal_(0.0, self.init_range)

    def queries(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], previous token ids [...] -> P[previous] * proj(hidden) [..., r]."""
        return self.predecessor_codebook[previous] * self.hidden_projection(hidden)

    def edge_scores(
        self,
        hidden: torch.Tensor,
        candidates: torch.Tensor,
        unary: torch.Tensor,
        first_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """What the walk reads, as vLLM's `CandidateSelector`: hidden [n, N, H] of the prediction
        rows, candidates / unary [n, N, K], first_tokens [n] -> scores [n, N, K (previous),
        K (candidate)]."""
        k = candidates.shape[-1]
        previous = torch.cat(
            [first_tokens[:, None, None].expand(-1, 1, k), candidates[:, :-1]], dim=1
        )
        pred = (
            self.predecessor_codebook[previous] * self.hidden_projection(hidden)[:, :, None]
        )  # [n, N, K, r]
        bilinear = torch.einsum("blpr,blcr->blpc", pred, self.successor_codebook[candidates])
        return unary[:, :, None] + bilinear


def unary_scores(values: torch.Tensor, multiplier: float, softcap: float) -> torch.Tensor:
    """Top-k logit values -> the unary scores served: float32, times the multiplier, then capped."""
    values = values.float()
    if multiplier != 1.0:
        values = values * multiplier
    if softcap > 0:
        values = torch.tanh(values / softcap) * softcap
    return values


def walk(candidates: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The greedy chain: candidates [n, N, K], scores [n, N, K, K] -> tokens [n, N]. At each step
    the row of the candidate chosen before (row 0 at the first step: every row is the first
    token's), its argmax with ties to the lowest index (vLLM's walk kernel; torch.argmax returns
    the first)."""
    n, steps, _ = candidates.shape
    rows = torch.arange(n, device=candidates.device)
    previous = torch.zeros(n, dtype=torch.long, device=candidates.device)
    out = []
    for step in range(steps):
        previous = scores[rows, step, previous].argmax(-1)  # [n]
        out.append(candidates[rows, step, previous])
    return torch.stack(out, dim=1) if out else candidates.new_zeros((n, 0))


# ----------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------


class DFlash2Drafter(DFlashDrafter):
    """DFlash's drafter with DFlash2 layers and a candidate selector."""

    cfg: DFlash2Config
    layer_class = DFlash2Layer

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(
            cfg.hidden_size, cfg.vocab_size, cfg.selector_rank, cfg.initializer_range
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        """DFlash's random start, then the DFlash2 parts' own: identity convolutions and a selector
        that adds nothing yet, so step 0 drafts as a DFlash drafter with these weights."""
        super().init_weights()
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        # init_weights also runs inside DFlashDrafter.__init__, before the selector exists
        if hasattr(self, "candidate_selector"):
            self.candidate_selector.reset_parameters()

    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prediction rows [..., H] -> (top-k token ids [..., K] sorted by logit, unary scores
        [..., K] float32), as vLLM's `compute_candidates` (logits in the head's dtype,
        torch.topk)."""
        cfg = self.cfg
        values, ids = torch.topk(self.logits(hidden), cfg.selector_top_k, dim=-1)
        return ids, unary_scores(values, cfg.output_multiplier, cfg.final_logit_softcapping)

    @torch.no_grad()
    def greedy_drafts(self, hidden: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
        """Block hidden states [n, b, H] -> the walked path [n, b-1] (module docstring)."""
        rows = hidden[:, 1:]  # [n, N, H]: position 0 is the given token
        ids, unary = self.candidates(rows)
        dtype = (
            self.candidate_selector.hidden_projection.weight.dtype
        )  # the bilinear term in the weights' dtype
        scores = self.candidate_selector.edge_scores(rows.to(dtype), ids, unary, first_tokens)
        return walk(ids, scores)

    def sampled_drafts(self, hidden, first_tokens, draw):
        """Not defined: a DFlash2 drafter proposes its selector's walk through the candidates,
        which is not a draw from a distribution the accept rule could weigh."""
        raise ValueError("a DFlash2 drafter drafts greedily only (its selector's walk)")
