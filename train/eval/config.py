"""Configuration of `dflash-eval`: which target, which prompts, how to decode, what to check and
report.

One frozen tree; defaults live here and nowhere else. `configs/tiny.toml` and
`configs/eval-qwen3-8b.toml` set some of them; `--section.field=value` sets any of them last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from dflash_common.config import check, check_device, option, section

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class TargetSection:
    path: str = option("", "Directory of the target (HF checkpoint with its tokenizer).")
    dtype: Dtype = option(
        "float32",
        "Dtype of the target and drafter. float32 makes the lossless check exact on small models; "
        "bfloat16 is for speed on GPUs, where batched verification and one-token decoding round "
        "differently and can flip near-tied argmaxes (numerics, not a bug).",
    )
    device: str = option(
        "auto", "Device: 'auto' (cuda when present, else cpu), 'cpu', 'cuda', 'cuda:1', ..."
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = option(
        "sdpa", "Attention implementation of the target (transformers `attn_implementation`)."
    )
    engine: Literal["transformers", "vllm"] = option(
        "transformers",
        "Who decodes: 'transformers' (our own loop, one prompt at a time or batched: "
        "generation.batch_size) or 'vllm' (the exported drafter served by vLLM, greedy, float32, "
        "one prompt at a time; vLLM must be installed, e.g. .venv-vllm).",
    )

    def __post_init__(self):
        check_device(self.device, "target.device")


@dataclass(frozen=True)
class DrafterSection:
    path: str = option(
        "", "Directory of an exported drafter (config.json + model.safetensors); --drafter sets it."
    )


@dataclass(frozen=True)
class PromptsSection:
    files: list[str] = option(
        [],
        "JSONL files of prompts: {'messages': [...]}, ShareGPT {'conversations': [...]}, {'turns': "
        "[...]} (user turns, each answered by the speculative output) or {'prompt': '...'} (raw "
        "text, no template).",
    )
    num_prompts: int = option(0, "Evaluate the first N prompts (in file order); 0 means all.")
    chat_template_kwargs: dict = option(
        {}, "Extra arguments to the chat template, e.g. {enable_thinking = false}."
    )

    def __post_init__(self):
        check(self.num_prompts >= 0, f"prompts.num_prompts must be >= 0, got {self.num_prompts}")


@dataclass(frozen=True)
class GenerationSection:
    max_new_tokens: int = option(
        256, "New tokens per prompt, the prefill's token included (as the reference)."
    )
    temperature: float = option(
        0.0, "0 decodes greedily; > 0 samples with the speculative accept/resample rule."
    )
    top_p: float = option(
        1.0, "Nucleus sampling threshold (temperature > 0 only); 1 keeps all tokens."
    )
    top_k: int = option(0, "Keep the k most likely tokens (temperature > 0 only); 0 keeps all.")
    block_size: int | None = option(
        None,
        "Draft block size B (B-1 drafts per cycle; a DSpark drafter drafts B); none uses the "
        "drafter's.",
    )
    confidence_threshold: float = option(
        0.0,
        "DSpark drafters with a confidence head: verify only the drafts before the first "
        "whose confidence is below this (DeepSpec's eval rule); 0 verifies every draft, as vLLM "
        "0.32 does unless its adaptive verification is on (whose cost-model schedule is not "
        "reproduced here). Batched, the target still runs whole blocks and counts no draft "
        "past the verified ones.",
    )
    draft_sampling: Literal["greedy", "probabilistic"] = option(
        "greedy",
        "How the drafter drafts when the target samples (temperature > 0), as vLLM's "
        "speculative_config.draft_sample_method: 'greedy' drafts the argmax (the draft counts as "
        "certain in the accept rule; vLLM's default); 'probabilistic' samples each draft from "
        "softmax(draft logits / temperature) (a DSpark drafter left to right through its Markov "
        "head) and accepts it with probability min(1, p/q), as the DSpark paper measures. DFlash "
        "and DSpark drafters.",
    )
    seed: int = option(0, "Seed of the sampling generator (temperature > 0).")
    ignore_eos: bool = option(
        False, "Do not stop at the end-of-sequence token(s); always decode max_new_tokens."
    )
    warmup: bool = option(
        True, "Decode a few tokens once before timing, so one-time setup is not timed."
    )
    batch_size: int = option(
        0,
        "Prompts decoded at once (train/eval/batched.py; greedy, an 'sdpa' or 'eager' target): "
        "1 decodes one prompt at a time; 0 picks 1 on a CPU and, on a GPU, up to 256 prompts, as "
        "many as half the free memory holds. Every prompt's tokens and cycles are the same either "
        "way in float32.",
    )

    def __post_init__(self):
        check(
            self.max_new_tokens >= 1,
            f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}",
        )
        check(self.temperature >= 0, f"generation.temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"generation.top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"generation.top_k must be >= 0, got {self.top_k}")
        check(
            0 <= self.confidence_threshold < 1,
            f"generation.confidence_threshold must be in [0, 1), got {self.confidence_threshold}",
        )
        check(self.batch_size >= 0, f"generation.batch_size must be >= 0, got {self.batch_size}")
        check(
            self.draft_sampling == "greedy" or self.temperature > 0,
            "generation.draft_sampling = 'probabilistic' samples drafts as the target samples; "
            "set generation.temperature > 0 or generation.draft_sampling = 'greedy'",
        )
        check(
            self.batch_size <= 1 or self.temperature == 0,
            f"generation.batch_size = {self.batch_size} decodes greedily only; set "
            "generation.temperature = 0 or generation.batch_size = 1",
        )
        check(
            self.block_size is None or self.block_size >= 2,
            "generation.block_size must be >= 2 (one anchor and at least one draft), got "
            f"{self.block_size}",
        )


@dataclass(frozen=True)
class CheckSection:
    lossless: Literal["error", "warn", "off"] = option(
        "error",
        "Greedy runs only: compare the speculative output with the target's own greedy output "
        "token for token. 'error' fails the run naming prompt and position; 'warn' reports it "
        "(bf16 targets, whose near-tied argmaxes flip between batched and one-token forwards); "
        "'off' skips it.",
    )
    baseline: bool = option(
        True,
        "Also decode with the target alone: tokens/s without the drafter, speedup, lossless "
        "reference.",
    )
    baseline_cache: str = option(
        "",
        "A directory keeping the target-alone decodes (tokens and times), keyed by the target's "
        "fingerprint, dtype, device, prompt and generation settings: evaluating more drafters on "
        "the same target and prompts reads them back instead of decoding the target alone again; "
        "empty keeps none.",
    )

    def __post_init__(self):
        check(
            self.baseline or self.lossless == "off",
            "check.lossless needs check.baseline = true (the target's own output is the "
            "reference); set check.lossless = 'off' to skip both",
        )


@dataclass(frozen=True)
class ReportSection:
    path: str = option(
        "", "Write the JSON report here (the run record lands beside it); empty writes none."
    )


@dataclass(frozen=True)
class OfflineSection:
    store: str = option(
        "", "Store whose held-out sequences --offline reads (per-position accuracy, implied tau)."
    )
    holdout_sequences: int | None = option(
        None,
        "Held-out sequences per store; none takes the training run's value (run.toml beside the "
        "drafter), else the trainer's default. It must match training, or the estimate reads "
        "training data.",
    )
    holdout_fraction: float | None = option(
        None,
        "Held-out share of each store's sequences; none takes the training run's value, as above.",
    )

    def __post_init__(self):
        check(
            self.holdout_sequences is None or self.holdout_sequences >= 0,
            f"offline.holdout_sequences must be >= 0, got {self.holdout_sequences}",
        )
        check(
            self.holdout_fraction is None or 0 <= self.holdout_fraction < 1,
            f"offline.holdout_fraction must be in [0, 1), got {self.holdout_fraction}",
        )


@dataclass(frozen=True)
class EvalConfig:
    STAGE: ClassVar[str] = "eval"  # its table in a config file that holds several stages
    target: TargetSection = section(TargetSection, "The target model.")
    drafter: DrafterSection = section(DrafterSection, "The drafter under evaluation.")
    prompts: PromptsSection = section(PromptsSection, "Prompts to decode.")
    generation: GenerationSection = section(GenerationSection, "Decoding.")
    check: CheckSection = section(CheckSection, "Checks and baseline.")
    report: ReportSection = section(ReportSection, "Where results go.")
    offline: OfflineSection = section(
        OfflineSection, "Offline estimate from a store (no target needed)."
    )
