"""vLLM 0.32's own DFlash2 code on the CPU, driven from a child process of the parity tests
(tests/test_serving_vllm_dflash2.py), so that vLLM's distributed state and the Triton shim stay out
of the pytest process:

    python tests/vllm_dflash2.py forward DRAFTER TARGET INPUTS.pt OUT.pt  vLLM's model on our export
    python tests/vllm_dflash2.py load DRAFTER TARGET OUT.json             vLLM's loader on variants
    python tests/vllm_dflash2.py conv INPUTS.pt OUT.pt                    vLLM's _grouped_conv (CPU)
    python tests/vllm_dflash2.py walk INPUTS.pt OUT.pt                    vLLM's walk (given scores)

What is vLLM's here: the config parsing (SpeculativeConfig for method "dflash" on our config.json),
DFlash2Qwen3ForCausalLM and its load_weights on our model.safetensors, fc, the context K/V path
(hidden_norm, K/V projection, k_norm, RoPE), every layer (projections, norms, RoPE, the two grouped
convolutions, MLP), the final norm, compute_candidates (lm_head, top-k, multiplier, cap), the
CandidateSelector's edge scores and, with DFLASH2_TRITON_WALK=1, the CandidateSampler's walk kernel
(in Triton's interpreter, train/eval/vllm_triton_cpu.py). Not vLLM's: the attention kernel (vLLM's
Attention needs a KV cache and the runner's metadata; replaced by a plain softmax attention over
[the context K/V vLLM's own precompute produced, the block's K/V]).

Patched, a vLLM CPU-build bug: the context K of every draft layer is normalised by one fused call
with the stacked k_norm weights [L, head_dim] (`_normalize_context_k`), and the CPU kernel applies
row 0 to every layer, so context K of layers >= 1 uses layer 0's k_norm (DFlash drafters too). The
patch calls each layer's own vLLM k_norm, which is what the CUDA kernel computes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and os.environ.get("DFLASH2_TRITON_WALK") == "1":
    sys.path.insert(0, str(ROOT))
    from train.eval.vllm_triton_cpu import enable

    enable()  # before vllm is imported

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch import nn  # noqa: E402


def build(target: Path, drafter: Path):
    """vLLM's config for the target with our drafter attached as its DFlash speculator (attached
    after validation, which refuses DFlash2 on the V1 runner this build defaults to), and the
    model."""
    from vllm.config import SpeculativeConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs

    block = json.loads((drafter / "config.json").read_text())["block_size"]
    cfg = EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
    ).create_engine_config()
    cfg.speculative_config = SpeculativeConfig(
        method="dflash",
        model=str(drafter),
        num_speculative_tokens=block - 1,
        target_model_config=cfg.model_config,
        target_parallel_config=cfg.parallel_config,
    )
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{tempfile.mktemp()}",
        )
        ensure_model_parallel_initialized(1, 1)
        from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

        model = DFlash2Qwen3ForCausalLM(vllm_config=cfg, prefix="draft").eval()
    return cfg, model


def target_head(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
    weights = {}
    for f in sorted(target.glob("*.safetensors")):
        weights |= load_file(str(f))
    embed = weights["model.embed_tokens.weight"]
    return embed, weights.get("lm_head.weight", embed)


def load(cfg, model, weights: dict, target: Path) -> None:
    """Our tensors through vLLM's loader; then the target's embedding and head, which vLLM's
    speculator shares into the draft (a DFlash2 checkpoint holds neither)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(cfg):
        model.load_weights(weights.items())
    embed, head = target_head(target)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    with set_current_vllm_config(cfg):  # on a CPU it picks each linear's GEMM
        process_weights_after_loading(
            model, cfg.speculative_config.draft_model_config, torch.device("cpu")
        )


class _CaptureKV:
    """Stands in for an attention impl: keeps the context K/V vLLM's precompute would write."""

    def __init__(self):
        self.k = self.v = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.k, self.v = key.clone(), value.clone()


class _BlockAttention(nn.Module):
    """Softmax attention of each request's block over [its context K/V, the block's own K/V]."""

    def __init__(
        self, attn, capture: _CaptureKV, segments, causal: bool, window: int | None, scale: float
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size
        self.capture, self.segments, self.causal, self.window, self.scale = (
            capture,
            segments,
            causal,
            window,
            scale,
        )

    def forward(self, q, k, v):
        out = torch.empty_like(q)
        for (q0, q1), (c0, c1) in self.segments:
            qq = q[q0:q1].view(-1, self.heads, self.head_dim)
            kk = torch.cat([self.capture.k[c0:c1], k[q0:q1].view(-1, self.kv_heads, self.head_dim)])
            vv = torch.cat([self.capture.v[c0:c1], v[q0:q1].view(-1, self.kv_heads, self.head_dim)])
            rep = self.heads // self.kv_heads
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            s = torch.einsum("qhd,khd->hqk", qq.float(), kk.float()) * self.scale
            n_ctx, n_q = c1 - c0, q1 - q0
            qpos, kpos = n_ctx + torch.arange(n_q)[:, None], torch.arange(n_ctx + n_q)[None, :]
            visible = torch.ones(n_q, n_ctx + n_q, dtype=torch.bool)
            if self.causal:
                visible &= kpos <= qpos
            if self.window is not None:
                visible &= qpos - kpos < self.window
            o = torch.einsum(
                "hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vv.float()
            )
            out[q0:q1] = o.reshape(n_q, -1).to(q.dtype)
        return out


def draft(cfg, model, contexts: list[torch.Tensor], anchors: list[int]) -> dict:
    """One draft step of a batch of requests: contexts[i] [S_i, K*H] at positions 0..S_i-1,
    anchors[i] the bonus token at S_i. Returns vLLM's hidden [sum B, H], candidates / unary
    [R, N, K], edge scores [R, N, K, K] and the walked path [R, N]."""
    from vllm.config import set_current_vllm_config

    n = cfg.speculative_config.num_speculative_tokens
    block = n + 1
    mask_id = cfg.speculative_config.draft_model_config.hf_config.dflash_config["mask_token_id"]
    inner = model.model
    with set_current_vllm_config(cfg), torch.no_grad():
        if (
            os.environ.get("DFLASH2_CPU_KNORM") != "1"
        ):  # the CPU bug (module docstring); =1 keeps it
            inner._normalize_context_k = lambda all_k: torch.stack(
                [layer.self_attn.k_norm(all_k[i]) for i, layer in enumerate(inner.layers)]
            )
        captures = [_CaptureKV() for _ in inner.layers]
        for attn, cap in zip(inner._attn_layers, captures):
            attn.impl = cap
        ctx = torch.cat(contexts)
        ctx_pos = torch.cat([torch.arange(f.shape[0]) for f in contexts])
        slots = [torch.zeros(ctx.shape[0], dtype=torch.long) for _ in inner.layers]
        model.precompute_and_store_context_kv(model.combine_hidden_states(ctx), ctx_pos, slots)
        segments, c0 = [], 0
        for i, f in enumerate(contexts):
            segments.append(((i * block, (i + 1) * block), (c0, c0 + f.shape[0])))
            c0 += f.shape[0]
        for layer, cap in zip(inner.layers, captures):
            sa = layer.self_attn
            sa.attn = _BlockAttention(
                sa.attn, cap, segments, sa.causal, sa.sliding_window, sa.scaling
            )
        input_ids = torch.tensor(sum(([a] + [mask_id] * n for a in anchors), []))
        positions = torch.cat([torch.arange(f.shape[0], f.shape[0] + block) for f in contexts])
        hidden = model(input_ids, positions)
        rows = torch.tensor([i * block + j for i in range(len(anchors)) for j in range(1, block)])
        sampled = hidden[rows].view(len(anchors), n, -1)
        ids, unary = model.compute_candidates(sampled.flatten(0, 1))
        ids, unary = ids.view(len(anchors), n, -1), unary.view(len(anchors), n, -1)
        scores = inner.candidate_selector(ids, unary, sampled, torch.tensor(anchors))
    return {
        "hidden": hidden,
        "ids": ids,
        "unary": unary,
        "scores": scores,
        "path": walk(ids, scores),
    }


def walk(candidate_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """vLLM's CandidateSampler (its Triton walk kernel) at temperature 0, where Triton runs
    (DFLASH2_TRITON_WALK=1); else its rule restated: per step the row of the previous choice,
    argmax, lowest index on ties."""
    from vllm.triton_utils import HAS_TRITON

    reqs, steps, k = candidate_ids.shape
    if not HAS_TRITON:
        out, prev = torch.empty(reqs, steps, dtype=torch.long), torch.zeros(reqs, dtype=torch.long)
        for step in range(steps):
            for r in range(reqs):
                row = scores[r, step, prev[r]]
                prev[r] = int(torch.nonzero(row == row.max())[0])
                out[r, step] = candidate_ids[r, step, prev[r]]
        return out
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    sampler = CandidateSampler(reqs, steps, k, torch.device("cpu"))
    tokens = torch.zeros(reqs, steps, dtype=torch.int64)
    sampler.sample(
        candidate_ids,
        scores.float(),
        reqs,
        torch.zeros(reqs * steps, dtype=torch.int64),
        torch.arange(reqs).repeat_interleave(steps),
        torch.zeros(reqs),
        torch.zeros(reqs, dtype=torch.int64),
        tokens,
        None,
        False,
    )
    return tokens


def probe_loader(cfg, model, good: dict) -> dict[str, str]:
    """vLLM's load_weights on variants of our export: refused (its words), or what it left
    unwritten."""
    from vllm.config import set_current_vllm_config

    base = good["layers.0.attention_conv.base_kernel"]
    cases = {
        "as exported": dict(good),
        "codebooks named .weight": {
            (k + ".weight" if k.endswith("_codebook") else k): t for k, t in good.items()
        },
        "a tensor missing": {k: t for k, t in good.items() if k != "layers.1.mlp_conv.base_kernel"},
        "base_kernel stored [T, 2, H]": good
        | {"layers.0.attention_conv.base_kernel": base.transpose(0, 1).contiguous()},
    }
    out = {}
    for name, weights in cases.items():
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(12345.0)
        try:
            with set_current_vllm_config(cfg):
                model.load_weights(weights.items())
        except Exception as e:  # noqa: BLE001 - vLLM's refusal, reported
            out[name] = f"refused: {str(e).splitlines()[0][:200]}"
            continue
        untouched = [n for n, p in model.named_parameters() if bool((p == 12345.0).all())]
        out[name] = f"accepted; never written: {untouched}"
    return out


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "conv":
        from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv

        cases = torch.load(argv[1])
        torch.save(
            [
                _grouped_conv(
                    c["x"],
                    c["delta"],
                    c["base"],
                    c["block"],
                    c["x"].shape[1] // c["group"],
                    c["group"],
                    c["base"].shape[0],
                )
                for c in cases
            ],
            argv[2],
        )
        return
    if mode == "walk":
        inputs = torch.load(argv[1])
        torch.save(walk(inputs["ids"], inputs["scores"]), argv[2])
        return
    drafter, target = Path(argv[1]), Path(argv[2])
    cfg, model = build(target, drafter)
    good = load_file(str(drafter / "model.safetensors"))
    if mode == "load":
        Path(argv[3]).write_text(json.dumps(probe_loader(cfg, model, good)))
        return
    load(cfg, model, good, target)
    inputs = torch.load(argv[3])
    torch.save(draft(cfg, model, inputs["contexts"], inputs["anchors"]), argv[4])


if __name__ == "__main__":
    main(sys.argv[1:])
