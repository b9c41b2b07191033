"""vLLM 0.32's own Qwen3 DSpark drafter, built on the CPU from an export of ours, drafting given
cycles (a child process of tests/test_serving_vllm.py, in .venv-vllm):

    python tests/vllm_dspark_model.py REQUEST.pt RESULT.pt

REQUEST: {"target": dir, "drafter": dir, "cases": [(context features [S, K*H] float32, anchor
token)], "probes": [drafter dirs]}: each case is one draft cycle whose anchor sits at position S,
after the target features of positions 0..S-1. RESULT: {"cycles": per case vLLM's greedy drafts [B],
confidences [B] and base logits [B, V]; "probes": what vLLM's loader does with each probe directory
(`probe_loader`)}.

vLLM's code does every step but the attention kernel call: its config for method "dspark"
(EngineArgs.create_engine_config; one validation skipped, since on this CPU without triton-cpu vLLM
refuses DSpark at config time), `Qwen3DSparkForCausalLM` and its `load_weights` on our safetensors
(the target's embedding and lm_head copied in, as `load_dspark_model` shares them),
`combine_hidden_states`, `precompute_and_store_context_kv` (the K/V it would write into its cache
captured instead), the backbone's forward over the block, and `DSparkSpeculator._sample_sequential`
(the Markov loop and the confidence head). vLLM's Attention layer needs the engine's forward
context; it is replaced by a module that calls the same CPU backend's impl and kernels
(`do_kv_cache_update`, `cpu_attention_with_kv_cache`, non-causal) over a paged cache holding
[context K/V ; block K/V].
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import json  # noqa: E402

import torch  # noqa: E402


def build(target_dir: str, drafter_dir: str):
    """(vLLM's DSpark model with our weights, its speculator, the drafter's config dict)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm.config import replace, set_current_vllm_config
    from vllm.config.vllm import VllmConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

    config = json.loads(open(os.path.join(drafter_dir, "config.json")).read())
    # the only patch: V1 refuses dspark, V2 needs Triton
    VllmConfig._validate_v1_model_runner = lambda self: None
    vcfg = EngineArgs(
        model=target_dir,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_num_seqs=4,
        speculative_config={
            "method": "dspark",
            "model": drafter_dir,
            "num_speculative_tokens": config["block_size"],
        },
    ).create_engine_config()
    spec_cfg = vcfg.speculative_config
    assert spec_cfg.method == "dspark", spec_cfg.method
    vcfg.attention_config = replace(
        vcfg.attention_config,
        use_non_causal=dflash_has_any_non_causal(spec_cfg.draft_model_config.hf_config),
    )
    with set_current_vllm_config(vcfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}",
        )
        initialize_model_parallel(1, 1)
        import vllm.model_executor.models.qwen3_dspark as qd
        from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

        model = qd.Qwen3DSparkForCausalLM(vllm_config=vcfg, prefix="").eval()
        model.load_weights(load_file(os.path.join(drafter_dir, "model.safetensors")).items())
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        with torch.no_grad():  # shared from the target, as load_dspark_model does
            model.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            model.lm_head.weight.copy_(target.get_output_embeddings().weight)
        process_weights_after_loading(model, spec_cfg.draft_model_config, torch.device("cpu"))
        speculator = DSparkSpeculator(vcfg, torch.device("cpu"))
        speculator.model = model
        speculator.use_confidence_head = model.model.confidence_head is not None
    return model, speculator, config


class _Capture:
    """Stands in for a layer's Attention while the context K/V are precomputed: keeps what vLLM
    writes."""

    def __init__(self, i: int, captured: dict):
        self.i, self.captured, self.kv_cache, self.impl = i, captured, None, self

    def do_kv_cache_update(self, layer, k, v, kv_cache, slot_mapping):
        self.captured[layer.i] = (k.clone(), v.clone())


class _CpuPagedAttention(torch.nn.Module):
    """vLLM's CPU attention backend (its impl and kernels) over [context ; block] keys,
    non-causal."""

    def __init__(
        self, i: int, attn, captured: dict, heads: int, kv_heads: int, head_dim: int, page: int = 32
    ):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        super().__init__()
        self.i, self.attn, self.captured, self.page = i, attn, captured, page
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        # set by the metadata builder in vLLM
        attn.isa = _get_attn_isa(torch.float32, page, head_dim, "auto")

    def forward(self, q, k, v):
        from vllm import _custom_ops as ops

        impl, t = self.attn.impl, q.shape[0]
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        ck, cv = self.captured[self.i]
        s = ck.shape[0]
        pages = (s + t + self.page - 1) // self.page
        cache = torch.zeros(pages, nkv, self.page, 2 * hd)
        impl.do_kv_cache_update(self.attn, ck, cv, cache, torch.arange(s))
        impl.do_kv_cache_update(
            self.attn, k.view(t, nkv, hd), v.view(t, nkv, hd), cache, torch.arange(s, s + t)
        )
        kc, vc = cache.view(pages, nkv, 2 * self.page, hd).chunk(2, dim=2)
        qsl, seq = torch.tensor([0, t], dtype=torch.int32), torch.tensor([s + t], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=hd,
            seq_lens=seq,
            dtype=torch.float32,
            query_start_loc=qsl,
            causal=False,
            sliding_window_size=-1,
            isa=self.attn.isa,
            enable_kv_split=False,
        )
        out = torch.empty(t, nh, hd)
        ops.cpu_attention_with_kv_cache(
            query=q.view(t, nh, hd),
            key_cache=kc,
            value_cache=vc,
            output=out,
            query_start_loc=qsl,
            seq_lens=seq,
            scale=impl.scale,
            causal=False,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=torch.arange(pages, dtype=torch.int32)[None],
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
            dynamic_causal=None,
            k_scale=self.attn._k_scale_float,
            v_scale=self.attn._v_scale_float,
            kv_cache_dtype="auto",
        )
        return out.reshape(t, nh * hd)


@torch.no_grad()
def draft_cycles(model, speculator, config: dict, cases) -> list[dict]:
    b, mask = config["block_size"], config["dflash_config"]["mask_token_id"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    captured: dict = {}
    layers = model.model.layers
    real_attn = [layer.self_attn.attn for layer in layers]
    for i, layer in enumerate(layers):
        layer.self_attn.attn = _CpuPagedAttention(
            i, real_attn[i], captured, heads, kv_heads, head_dim
        )
    out = []
    for aux, anchor in cases:
        s = aux.shape[0]
        captured.clear()
        ctx = model.combine_hidden_states(aux.float())  # fc: [S, H]
        real = model.model._attn_layers
        model.model._attn_layers = [_Capture(i, captured) for i in range(len(real))]
        model.precompute_and_store_context_kv(ctx, torch.arange(s), torch.arange(s))
        model.model._attn_layers = real
        input_ids = torch.tensor([anchor] + [mask] * (b - 1))
        positions = torch.arange(s, s + b)  # the anchor at the context's length
        hidden = model(input_ids, positions)  # [B, H], after the final norm
        speculator.input_buffers.input_ids[:b] = input_ids.to(torch.int32)
        speculator.sample_indices[:b] = torch.arange(b)  # every row is sampled (sample_from_anchor)
        speculator.sample_pos[:b] = positions + 1
        speculator.sample_idx_mapping[:b] = 0
        speculator._sample_sequential(1, hidden)
        row = {
            "drafts": speculator.draft_tokens[0, :b].clone().long(),
            "base_logits": model.compute_draft_logits(hidden).float(),
        }
        if speculator.use_confidence_head:
            row["confidences"] = speculator.draft_token_confidence_probs[0, :b].clone().float()
        out.append(row)
    return out


def probe_loader(target_dir: str, drafter_dirs: list[str]) -> list[str]:
    """What vLLM's loader does with each drafter directory: 'loads (confidence head kept|dropped)'
    or 'refused: ExceptionType: first line'."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    out = []
    for i, d in enumerate(drafter_dirs):
        config = json.loads(open(os.path.join(d, "config.json")).read())
        try:
            vcfg = EngineArgs(
                model=target_dir,
                dtype="float32",
                max_model_len=1024,
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_num_seqs=4,
                speculative_config={
                    "method": "dspark",
                    "model": d,
                    "num_speculative_tokens": config["block_size"],
                },
            ).create_engine_config()
            with set_current_vllm_config(vcfg):
                import vllm.model_executor.models.qwen3_dspark as qd

                model = qd.Qwen3DSparkForCausalLM(vllm_config=vcfg, prefix=f"probe{i}")
                model.load_weights(load_file(os.path.join(d, "model.safetensors")).items())
            kept = "kept" if model.model.confidence_head is not None else "dropped"
            out.append(f"loads (confidence head {kept})")
        except Exception as e:  # noqa: BLE001 - the loader's own words are the result
            out.append(f"refused: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
    return out


def main(request_path: str, result_path: str) -> None:
    request = torch.load(request_path, weights_only=False)
    model, speculator, config = build(request["target"], request["drafter"])
    result = {"cycles": draft_cycles(model, speculator, config, request["cases"])}
    if request.get("probes"):
        result["probes"] = probe_loader(request["target"], request["probes"])
    torch.save(result, result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # vLLM's distributed state would otherwise hold the process at exit
