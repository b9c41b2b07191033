"""The configuration tree of `dflash-precompute`: one frozen dataclass per section.

Defaults live here and nowhere else; `configs/precompute-*.toml` set some of them and
`--section.field=value` on the command line sets any of them last (dflash_common/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from dflash_common.config import check, check_device, option, section


@dataclass(frozen=True)
class TargetSection:
    path: str = option(
        "",
        "Local directory of the target checkpoint (config.json, safetensors weights, tokenizer). "
        "Nothing is downloaded.",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = option(
        "bf16", "Dtype the target runs in; bf16 is how it is served. fp32 is for parity tests."
    )
    attn_implementation: str = option(
        "sdpa",
        "transformers attention implementation: 'sdpa', 'flash_attention_2', 'flash_attention_3' "
        "(where installed) or 'eager'.",
    )
    layer_ids: list[int] | None = option(
        None,
        "Target layers to capture; id i is the output of decoder layer i (HF hidden_states[i+1]). "
        "None means the DFlash rule for the target's depth ([1, 9, 17, 25, 33] for 36 layers). Any "
        "list may be given; capturing a superset (e.g. every 4th layer) lets later drafter "
        "experiments choose their layers from one store, at the cost of disk. Layers after the "
        "deepest id are never loaded nor run.",
    )
    compile: bool = option(
        True,
        "torch.compile the parts of every decoder layer (attention, MLP, norms; one compiled graph "
        "shared by all layers, dynamic shapes) on CUDA, fusing the norms, RoPE and activations "
        "that run eagerly otherwise: 1.26x the eager forward of a Qwen3-8B-shaped target on an "
        "H200; costs a compilation at start (~20 s, seconds once cached). Ignored on a CPU.",
    )

    def __post_init__(self) -> None:
        if self.layer_ids is not None:
            check(
                len(self.layer_ids) > 0,
                "target.layer_ids must not be empty; leave it unset for the default.",
            )
            check(
                len(set(self.layer_ids)) == len(self.layer_ids),
                f"target.layer_ids = {self.layer_ids} repeats an id.",
            )
            check(
                min(self.layer_ids) >= 0, f"target.layer_ids = {self.layer_ids} has a negative id."
            )
        check(
            bool(self.attn_implementation.strip()), "target.attn_implementation must not be empty."
        )


@dataclass(frozen=True)
class DataSection:
    inputs: list[str] = option(
        [],
        "Input files, globs or directories, read in this order (each glob sorted by path): JSONL "
        "(.jsonl or .jsonl.gz) with OpenAI 'messages', ShareGPT 'conversations' or pre-tokenized "
        "'input_ids' + 'loss_mask' records; a directory holding a `datasets` dataset saved with "
        "save_to_disk; any other directory means its *.jsonl files (dflash-generate's output: its "
        "records' 'answer_ids', the tokens the target emitted, are stored as they are).",
    )
    format: Literal["auto", "messages", "sharegpt", "tokenized"] = option(
        "auto", "Record format; 'auto' decides per record from its keys."
    )
    max_length: int = option(3072, "Longest sequence in tokens (after the chat template).")
    overlength: Literal["truncate", "drop"] = option(
        "truncate",
        "What to do with a longer sequence: keep its first max_length tokens, or drop it.",
    )
    chat_template_kwargs: dict[str, Any] = option(
        {},
        "Extra variables for the target's chat template, e.g. {enable_thinking = false} for Qwen3.",
    )
    block_size: int = option(
        16,
        "Drafter block size; sequences with fewer than 2 x block_size loss-mask (response) tokens "
        "are dropped, as the drafter cannot place anchors in them.",
    )
    earlier_answers: Literal["apart", "context"] = option(
        "apart",
        "An earlier answer of a dflash-generate conversation (its earlier_answer_ids) that the "
        "later turns' prompt renders otherwise than the target emitted it (a reasoning template "
        "drops its thinking) is context there, out of the loss; 'apart' also trains it as a "
        "sequence of its own (the prompt the target answered, then its tokens: more tokens to "
        "store), 'context' does not.",
    )
    report_first: int = option(
        5, "How many skipped records are logged with file and line (all are counted)."
    )

    def __post_init__(self) -> None:
        check(self.max_length >= 2, f"data.max_length must be >= 2, got {self.max_length}.")
        check(self.block_size >= 2, f"data.block_size must be >= 2, got {self.block_size}.")
        check(
            2 * self.block_size <= self.max_length,
            f"data.max_length = {self.max_length} cannot hold 2 x data.block_size = "
            f"{2 * self.block_size} response tokens.",
        )
        check(self.report_first >= 0, f"data.report_first must be >= 0, got {self.report_first}.")
        check(all(bool(p.strip()) for p in self.inputs), "data.inputs holds an empty path.")


@dataclass(frozen=True)
class StoreSection:
    path: str = option("", "Directory of the hidden-state store (created; a rerun resumes it).")
    dtype: Literal["bf16", "fp8_e4m3", "q4_hadamard"] = option(
        "bf16",
        "Element type on disk: bf16 (2 bytes per value), fp8 e4m3 with a float32 scale per token "
        "(half the disk), or q4_hadamard: 4-bit codes after a Hadamard rotation, a scale byte per "
        "16 values and a float32 per token (0.28x the disk of bf16; docs/store-format.md).",
    )
    codec: Literal["none", "zstd", "blosc-lz4-bitshuffle"] = option(
        "none",
        "Compression of the state arrays; hidden states compress little, so 'none' is fastest.",
    )
    final_state: bool = option(
        False,
        "Also store the target's final normed hidden state per token (the lm_head's input; one "
        "more [T, H] array in store.dtype), which the trainer's soft targets and prompt anchors "
        "(targets.*) need. Runs every layer of the target instead of stopping after the deepest "
        "layer id.",
    )


@dataclass(frozen=True)
class BatchingSection:
    token_budget: int = option(
        32768, "Padded tokens per forward batch (batch size x longest sequence in it)."
    )
    sort_window_units: int = option(
        4,
        "Samples of this many consecutive work units (a sort window, computed whole by one rank) "
        "are sorted by length together before batching: larger means less padding and more host "
        "memory for states of unfinished units.",
    )

    def __post_init__(self) -> None:
        check(
            self.token_budget >= 1, f"batching.token_budget must be >= 1, got {self.token_budget}."
        )
        check(
            self.sort_window_units >= 1,
            f"batching.sort_window_units must be >= 1, got {self.sort_window_units}.",
        )


@dataclass(frozen=True)
class RunSection:
    samples_per_unit: int = option(
        32,
        "Input records per work unit (= per shard), counted before filtering so units never depend "
        "on the number of ranks. Aim for shards of 1-4 GiB: records x tokens x bytes/token.",
    )
    device: str = option(
        "auto", "Device of the target: 'auto' (this rank's GPU, else CPU), 'cpu', 'cuda'."
    )
    tokenize_workers: int = option(
        0, "Processes that apply the chat template and tokenize (0: in the main process)."
    )
    cache_dir: str = option(
        "",
        "Where tokenized work units are kept between the plan and the forward pass (tokenize "
        "once); empty means '<store.path>.tokens' beside the store.",
    )
    writer_threads: int = option(
        4, "Threads that encode, compress and write shards while the GPU runs."
    )
    queue_depth: int = option(
        4, "Finished units waiting for a writer before the GPU waits (bounds host memory)."
    )
    force: bool = option(False, "Start even when the plan says the disk is too small.")
    progress: bool = option(
        True, "Show a progress bar (rank 0, on a terminal): samples, tokens/s, bytes written, ETA."
    )
    dry_run: bool = option(
        False, "Print the plan (samples, tokens, bytes on disk, free space) and stop."
    )

    def __post_init__(self) -> None:
        check(
            self.samples_per_unit >= 1,
            f"run.samples_per_unit must be >= 1, got {self.samples_per_unit}.",
        )
        check(
            self.tokenize_workers >= 0,
            f"run.tokenize_workers must be >= 0, got {self.tokenize_workers}.",
        )
        check(
            self.writer_threads >= 1, f"run.writer_threads must be >= 1, got {self.writer_threads}."
        )
        check(self.queue_depth >= 1, f"run.queue_depth must be >= 1, got {self.queue_depth}.")
        check_device(self.device, "run.device")


@dataclass(frozen=True)
class PrecomputeConfig:
    STAGE: ClassVar[str] = "precompute"  # its table in a config file that holds several stages
    target: TargetSection = section(
        TargetSection, "The target model and the layers captured from it."
    )
    data: DataSection = section(DataSection, "Input conversations, chat template and length rules.")
    store: StoreSection = section(StoreSection, "Where and how the hidden states are written.")
    batching: BatchingSection = section(
        BatchingSection, "How sequences are grouped into forward batches."
    )
    run: RunSection = section(RunSection, "Work units, devices, writer pool, disk check.")

    def __post_init__(self) -> None:
        check(
            self.batching.token_budget >= self.data.max_length,
            f"batching.token_budget = {self.batching.token_budget} must be >= data.max_length = "
            f"{self.data.max_length}, so the longest sequence fits one batch.",
        )
