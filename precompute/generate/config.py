"""The configuration tree of `dflash-generate`: one frozen dataclass per section.

Read from the `[generate.*]` tables of a stage file (configs/tiny.toml) or a one-stage file; any
field is overridden on the command line as `--section.field=value` (e.g. `--generate.turns=last`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from dflash_common.config import check, check_device, option, section


@dataclass(frozen=True)
class TargetSection:
    path: str = option(
        "",
        "Local directory of the target checkpoint (config.json, weights, tokenizer, "
        "generation_config.json).",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = option(
        "bf16", "Dtype the target generates in; bf16 is how it is served, fp32 for parity tests."
    )
    attn_implementation: str = option(
        "sdpa", "transformers attention implementation ('sdpa', 'eager', ...)."
    )

    def __post_init__(self) -> None:
        check(
            bool(self.attn_implementation.strip()), "target.attn_implementation must not be empty."
        )


@dataclass(frozen=True)
class DataSection:
    inputs: list[str] = option(
        [],
        "Input files, globs or directories, as dflash-precompute reads them (OpenAI 'messages', "
        "ShareGPT 'conversations', .jsonl.gz, `datasets` saved to disk), plus plain prompts: "
        'JSONL records {"prompt": "..."} (optionally with "system") or a .txt file with one '
        "prompt per line.",
    )
    format: Literal["auto", "messages", "sharegpt", "prompt"] = option(
        "auto",
        "Record format; 'auto' decides per record from its keys ('.txt' files are always prompts).",
    )
    chat_template_kwargs: dict[str, Any] = option(
        {},
        "Extra variables for the target's chat template, e.g. {enable_thinking = false} for Qwen3.",
    )
    max_prompt_length: int = option(
        4096,
        "Longest prompt in tokens (after the chat template); a longer one ends its conversation "
        "there (or is skipped as 'prompt_too_long' when it is the first).",
    )
    report_first: int = option(
        5, "How many skipped records are printed with file and line (all are counted)."
    )

    def __post_init__(self) -> None:
        check(
            self.max_prompt_length >= 1,
            f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}.",
        )
        check(self.report_first >= 0, f"data.report_first must be >= 0, got {self.report_first}.")
        check(all(bool(p.strip()) for p in self.inputs), "data.inputs holds an empty path.")


@dataclass(frozen=True)
class SamplingSection:
    temperature: float | None = option(
        None,
        "Sampling temperature; 0 is greedy. Unset: the target's generation_config.json (greedy "
        "when it does not sample).",
    )
    top_p: float | None = option(
        None, "Nucleus sampling mass in (0, 1]; unset: generation_config.json, else 1."
    )
    top_k: int | None = option(
        None, "Keep the k most likely tokens (0: all); unset: generation_config.json, else 0."
    )
    max_new_tokens: int | None = option(
        None,
        "Most tokens per generated turn; unset: generation_config.json's max_new_tokens, else "
        "2048.",
    )
    seed: int = option(
        0, "Run seed; each sample draws from its own generator seeded by this and its content."
    )

    def __post_init__(self) -> None:
        check(
            self.temperature is None or self.temperature >= 0,
            f"sampling.temperature must be >= 0, got {self.temperature}.",
        )
        check(
            self.top_p is None or 0 < self.top_p <= 1,
            f"sampling.top_p must be in (0, 1], got {self.top_p}.",
        )
        check(
            self.top_k is None or self.top_k >= 0, f"sampling.top_k must be >= 0, got {self.top_k}."
        )
        check(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}.",
        )


@dataclass(frozen=True)
class GenerateSection:
    turns: Literal["all", "last"] = option(
        "all",
        "'all': every assistant turn is replaced by the target's answer given its own conversation "
        "so far; 'last': only the final assistant turn (a conversation ending with a user turn "
        "gets one answer).",
    )
    on_length: Literal["keep", "drop"] = option(
        "keep",
        "A turn cut by max_new_tokens: 'keep' ends the conversation there with finish_reason "
        "'length' (dflash-precompute then puts no loss on its end-of-turn token), 'drop' skips the "
        "record.",
    )
    token_budget: int = option(
        65536,
        "Tokens per batch counted as batch size x (longest prompt + max_new_tokens): bounds KV "
        "cache memory.",
    )
    max_batch_size: int = option(256, "Most sequences decoded together.")
    sort_window_units: int = option(
        4,
        "Prompts of this many consecutive work units (a sort window, answered whole by one "
        "rank) are sorted by length together before batching.",
    )
    backend: Literal["transformers", "vllm"] = option(
        "transformers",
        "'transformers' (batched, static KV cache, embedded) or 'vllm' (vllm.LLM offline, "
        "when installed).",
    )
    compile: bool = option(
        True,
        "transformers backend on CUDA: torch.compile the parts of every decoder layer (one graph "
        "for all layers, the attention by its norms; ignored on a CPU), fusing each step's norms "
        "and activations: the eager steps' greedy tokens in float32 (a GPU test), 1.24x the graph "
        "steps' speed on a Qwen3-8B shape and 3.5x plain model.generate (docs/benchmarks.md). "
        "Compiling adds to the start-up time; false skips it.",
    )
    cuda_graphs: bool = option(
        True,
        "transformers backend on CUDA: each decode step a CUDA graph, captured once per batch (not "
        "for sliding-window targets or attention other than sdpa/eager, which decode with eager "
        "steps): the same tokens as eager steps (a GPU test), 2.6x their speed on a Qwen3-8B shape "
        "(docs/benchmarks.md).",
    )
    vllm_tensor_parallel: int = option(1, "vllm backend: tensor_parallel_size of vllm.LLM.")

    def __post_init__(self) -> None:
        check(
            self.token_budget >= 1, f"generate.token_budget must be >= 1, got {self.token_budget}."
        )
        check(
            self.max_batch_size >= 1,
            f"generate.max_batch_size must be >= 1, got {self.max_batch_size}.",
        )
        check(
            self.sort_window_units >= 1,
            f"generate.sort_window_units must be >= 1, got {self.sort_window_units}.",
        )
        check(
            self.vllm_tensor_parallel >= 1,
            f"generate.vllm_tensor_parallel must be >= 1, got {self.vllm_tensor_parallel}.",
        )


@dataclass(frozen=True)
class OutputSection:
    dir: str = option(
        "",
        "Output directory: one JSONL shard per work unit plus manifest.json; dflash-precompute "
        "reads it as data.inputs. A rerun resumes it.",
    )


@dataclass(frozen=True)
class RunSection:
    samples_per_unit: int = option(
        256,
        "Input records per work unit (= per output shard), counted before filtering, so units "
        "never depend on the number of ranks.",
    )
    device: str = option(
        "auto", "Device of the target: 'auto' (this rank's GPU, else CPU), 'cpu', 'cuda'."
    )
    progress: bool = option(
        True, "Progress bar on rank 0 (prompts/s, generated tok/s, ETA) when on a terminal."
    )
    dry_run: bool = option(
        False,
        "Check the target, the inputs and the output directory, print the plan (prompts, "
        "skips, tokens in, max tokens out) and stop; writes nothing and loads no weights.",
    )

    def __post_init__(self) -> None:
        check(
            self.samples_per_unit >= 1,
            f"run.samples_per_unit must be >= 1, got {self.samples_per_unit}.",
        )
        check_device(self.device, "run.device")


@dataclass(frozen=True)
class GenerateConfig:
    STAGE: ClassVar[str] = "generate"  # its table in a config file that holds several stages
    target: TargetSection = section(TargetSection, "The target that answers.")
    data: DataSection = section(
        DataSection, "Input conversations or prompts and the chat template."
    )
    sampling: SamplingSection = section(
        SamplingSection, "Decoding: greedy or sampled, length of each turn."
    )
    generate: GenerateSection = section(
        GenerateSection, "Which turns, cut turns, batching, backend."
    )
    output: OutputSection = section(
        OutputSection, "Where the regenerated conversations are written."
    )
    run: RunSection = section(RunSection, "Work units, devices, progress, dry run.")
