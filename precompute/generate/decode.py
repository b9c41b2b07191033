"""The decoders of `dflash-generate`: prompt token
ids in, generated token ids and a finish reason out.

`TransformersDecoder` (the embedded one): requests are sorted by prompt length and cut into batches
of at most `token_budget` tokens counted as batch size x (longest prompt + max_new_tokens). A batch
is LEFT-padded; its attention mask zeroes the padding and each row's position ids count its own
tokens only (row i's first real token is at position 0), so a row decodes the same tokens as it
would alone (in float32; a test checks it). The KV cache is a transformers `StaticCache` of the
batch's full length, allocated once per batch; a row stops at any end-of-turn id (the tokenizer's
eos and the ids of generation_config.json's eos_token_id) or at max_new_tokens, and the batch ends
when every row has. Sampled rows draw from their own `torch.Generator`, seeded per request, so what
a request draws does not depend on its batch.

Decode steps after the prefill have static shapes: the step's token, position and cache slot live in
fixed buffers updated in place, and the attention mask is a 4D additive mask over the whole static
cache (the columns of the prompt's padding and of steps not yet taken hold the dtype's minimum; a
step opens its own column). With `cuda_graphs` (generate.cuda_graphs, on by default; a GPU test
checks the graph steps give the eager steps' tokens) the step is then captured once per batch as a
CUDA graph and replayed on CUDA (cuda_graph.py): one launch per token instead of a few hundred
kernel launches from Python. Without it the same static step runs eagerly (tests compare it with
transformers' own loop on a CPU), and where a 4D mask would be wrong or unsupported (sliding-window
layers, an attention implementation other than sdpa or eager) the steps fall back to a 2D mask grown
each step. A one-token step of a sdpa target attends through `packed_gqa_sdpa` (attention.py): the
query heads of a key/value group read the cache as it is stored, where transformers (before 5.24)
copies every layer's cache to the query heads' count at every step. With `compile` the parts of
every decoder layer are compiled (one graph for all layers, as precompute's `target.compile`),
fusing the norms and activations of each step; the attention, which indexes the cache by its layer
number, has only its q/k norms compiled (see compile_decoder_layers).

`VllmDecoder`: `vllm.LLM` offline on token-id prompts, one `SamplingParams(seed=...)` per request
(temperature 0 is greedy); tests/precompute/generate/test_generate_vllm.py checks its greedy answers
against the transformers backend in the serving environment (.venv-vllm).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Collection, Sequence

import torch

from dflash_common.hf import dtype_name
from dflash_common.sampling import Sampling, sampling_probs
from precompute.generate.attention import decode_attention, static_steps_allowed
from precompute.generate.cuda_graph import CudaGraph


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    seed: int  # of this request's generator (sampling only)


@dataclasses.dataclass(frozen=True)
class Generated:
    tokens: list[int]  # the answer, without the end-of-turn token that stopped it
    finish_reason: str  # "stop" | "length"
    stop: int | None = None  # the stop token that ended it (finish_reason "stop")

    @property
    def emitted(self) -> list[int]:
        """Every token the target emitted, the stop token last when it stopped."""
        return self.tokens + ([self.stop] if self.stop is not None else [])


OnTokens = Callable[[int], None]  # answer tokens (no end-of-turn token) since its last call
SYNC_EVERY = 8  # decode steps between two looks of the host at the device (stop check, progress)


def batch_requests(
    lengths: Sequence[int], max_new_tokens: int, token_budget: int, max_batch: int
) -> list[list[int]]:
    """Indices of requests (their prompt `lengths`) grouped into decode batches, longest prompts
    first (sorted: little padding), each within `token_budget` counted as batch size x (longest
    prompt + max_new_tokens), the KV cache it allocates, and `max_batch` requests."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            width = lengths[batch[0]] + max_new_tokens  # the first is the longest
            if len(batch) < max_batch and (len(batch) + 1) * width <= token_budget:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def sample_next(
    logits: torch.Tensor, s: Sampling, generators: list[torch.Generator] | None
) -> torch.Tensor:
    """[B, V] logits -> [B] next token ids: argmax, or a draw per row from its own generator."""
    if s.greedy:
        return logits.argmax(-1)
    # per-row CPU generators: a draw is the same on any device and in any batch
    probs = sampling_probs(logits, s).cpu()
    assert generators is not None
    return torch.stack(
        [torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)]
    )


class TransformersDecoder:
    """Batched decoding over a transformers causal LM with a static KV cache."""

    def __init__(
        self,
        model: Any,
        stop_ids: Collection[int],
        pad_id: int,
        sampling: Sampling,
        token_budget: int,
        max_batch: int,
        compile: bool = False,
        cuda_graphs: bool = False,
    ):
        self.model = model
        self.stop_ids = sorted(stop_ids)
        self.pad_id = pad_id
        self.sampling = sampling
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.device = next(model.parameters()).device
        self.forward = model.forward
        # transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes)
        self.cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        if compile and self.device.type == "cuda":
            from precompute.target import compile_decoder_layers

            compile_decoder_layers(
                model, kv_cache=True
            )  # the layers' parts, one graph for all layers
        self.static_steps = static_steps_allowed(model.config)
        self.cuda_graphs = cuda_graphs and self.static_steps and self.device.type == "cuda"

    def generate(
        self, requests: list[Request], on_tokens: OnTokens | None = None
    ) -> list[Generated]:
        out: list[Generated | None] = [None] * len(requests)
        lengths = [len(r.prompt) for r in requests]
        n_new = self.sampling.max_new_tokens
        for batch in batch_requests(lengths, n_new, self.token_budget, self.max_batch):
            for i, g in zip(batch, self.decode_batch([requests[i] for i in batch], on_tokens)):
                out[i] = g
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def decode_batch(
        self, requests: list[Request], on_tokens: OnTokens | None = None
    ) -> list[Generated]:
        """One left-padded batch, decoded to the end of its longest answer."""
        with decode_attention(self.model):
            return self._decode_batch(requests, on_tokens)

    def _decode_batch(self, requests: list[Request], on_tokens: OnTokens | None) -> list[Generated]:
        from transformers import StaticCache

        n_new = self.sampling.max_new_tokens
        bsz, width = len(requests), max(len(r.prompt) for r in requests)
        ids = torch.full((bsz, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(
            (bsz, width + n_new), dtype=torch.long
        )  # 1 on real tokens, 0 on left padding
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) : width] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # [B, P]: each row counts from 0
        cache = StaticCache(config=self.model.config, max_cache_len=width + n_new)
        gens = (
            None
            if self.sampling.greedy
            else [torch.Generator().manual_seed(r.seed) for r in requests]
        )
        stop = torch.tensor(self.stop_ids, device=self.device)
        logits = self.forward(
            input_ids=ids,
            attention_mask=mask[:, :width],
            position_ids=positions,
            **{self.cache_kw: cache},
            cache_position=torch.arange(width, device=self.device),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        tokens, done = [], torch.zeros(bsz, dtype=torch.bool, device=self.device)
        live = torch.zeros(
            (), dtype=torch.long, device=self.device
        )  # tokens generated since the last check
        last = positions[:, -1]
        step = (
            self._static_step(cache, mask, positions[:, -1:], width) if self.static_steps else None
        )
        for t in range(n_new):
            nxt = sample_next(logits, self.sampling, gens).to(self.device)
            nxt = torch.where(done, self.pad_id, nxt)  # [B]; finished rows only pad
            tokens.append(nxt)
            stopped = torch.isin(nxt, stop)
            live += (~(done | stopped)).sum()  # answer tokens: no end-of-turn token (_finish)
            done = done | stopped
            # the host looks at the device only every SYNC_EVERY steps: between two looks the CPU
            # queues the next steps' kernels while the GPU runs (finished rows decode a few pads
            # meanwhile)
            if t == n_new - 1 or (t + 1) % SYNC_EVERY == 0:
                if on_tokens is not None:
                    on_tokens(int(live))
                live.zero_()
                if t == n_new - 1 or bool(done.all()):
                    break
            if step is not None:
                logits = step(nxt, width + t)
                continue
            mask[:, width + t] = 1
            last = last + 1
            logits = self.forward(
                input_ids=nxt[:, None],
                attention_mask=mask[:, : width + t + 1],
                position_ids=last[:, None],
                **{self.cache_kw: cache},
                cache_position=torch.tensor([width + t], device=self.device),
                use_cache=True,
            ).logits[:, -1]
        return [self._finish(row) for row in torch.stack(tokens, 1).tolist()]

    def _static_step(
        self, cache: Any, mask: torch.Tensor, position: torch.Tensor, width: int
    ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """The decode step over fixed buffers: step(next tokens [B], cache slot) -> logits [B, V].
        The slot is the step's column of the static cache (width + t); with cuda_graphs, a CUDA
        graph runs it."""
        dtype = next(self.model.parameters()).dtype
        floor = torch.finfo(dtype).min
        # [B, 1, 1, L] additive: 0 where a key is visible
        # (prompt tokens now, each step's own column later)
        mask4 = torch.full(
            (mask.shape[0], 1, 1, mask.shape[1]), floor, dtype=dtype, device=self.device
        )
        mask4[:, 0, 0, :width].masked_fill_(mask[:, :width].bool(), 0.0)
        ids = torch.zeros((mask.shape[0], 1), dtype=torch.long, device=self.device)
        pos = position.clone()  # [B, 1]: the last prompt token's position; each step adds one first
        slot = torch.zeros(1, dtype=torch.long, device=self.device)

        def forward() -> torch.Tensor:
            return self.forward(
                input_ids=ids,
                attention_mask=mask4,
                position_ids=pos,
                **{self.cache_kw: cache},
                cache_position=slot,
                use_cache=True,
            ).logits[:, -1]

        run = CudaGraph(forward) if self.cuda_graphs else forward

        def step(nxt: torch.Tensor, column: int) -> torch.Tensor:
            ids.copy_(nxt[:, None])
            pos.add_(1)
            slot.fill_(column)
            mask4[:, :, :, column] = 0.0
            return run()

        return step

    def _finish(self, row: list[int]) -> Generated:
        for k, tok in enumerate(row):
            if tok in self.stop_ids:
                return Generated(row[:k], "stop", tok)
        return Generated(row[: self.sampling.max_new_tokens], "length")


class VllmDecoder:
    """`vllm.LLM` offline: the whole request list at once (vLLM batches and schedules itself)."""

    def __init__(
        self,
        target_path: str,
        dtype: str,
        sampling: Sampling,
        stop_ids: Collection[int],
        tensor_parallel: int = 1,
    ):
        import vllm

        self.vllm = vllm
        self.sampling = sampling
        self.stop_ids = sorted(stop_ids)
        self.llm = vllm.LLM(
            model=target_path,
            dtype=dtype_name(dtype),
            seed=sampling.seed,
            tensor_parallel_size=tensor_parallel,
            enable_prefix_caching=True,
        )

    def generate(
        self, requests: list[Request], on_tokens: OnTokens | None = None
    ) -> list[Generated]:
        s = self.sampling
        params = [
            self.vllm.SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1,
                max_tokens=s.max_new_tokens,
                seed=None if s.greedy else r.seed,
                stop_token_ids=self.stop_ids,
                skip_special_tokens=False,
                detokenize=False,
            )
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r.prompt} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for o in outputs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            stop = toks.pop() if toks and toks[-1] in self.stop_ids else None
            reason = "length" if c.finish_reason == "length" else "stop"
            result.append(Generated(toks, reason, stop if reason == "stop" else None))
            if on_tokens is not None:
                on_tokens(len(toks))  # answer tokens, as the transformers decoder counts them
        return result
