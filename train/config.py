"""The configuration tree of `dflash-train`: data, drafter, objective, optimiser, precision,
checkpoints, logging, validation and the run itself.

Defaults are the published DFlash recipe (AdamW lr 6e-4, weight decay 0, grad clip 1.0, cosine
schedule with 4% warmup, 6 epochs, block size 16, up to 512 anchors per sequence, 5 draft layers;
batches of 65,536 packed tokens) but for D-PACE position weights instead of the exp(-(k-1)/gamma)
decay (`objective.weights`), which reach a higher tau on the quality benchmark (docs/benchmarks.md).

    cfg = load_config(TrainConfig, "configs/tiny.toml", ["--optim.lr=3e-4"])
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, get_args

from dflash_common.config import (
    check,
    check_device,
    load_config,
    option,
    read_toml,
    section,
    stage_table,
)
from dflash_common.drafter.config import Arch


@dataclass(frozen=True)
class DataSection:
    stores: list[str] = option(
        [], "Store directories written by dflash-precompute; at least one (or --store)."
    )
    weights: list[float] | None = option(
        None,
        "Mixing weight of each store, in tokens: store i supplies weights[i]/sum(weights) of every "
        "epoch's tokens, over- or under-sampling its shards; none = every shard of every store "
        "once per epoch.",
    )
    cache_gb: float = option(
        16.0,
        "Host RAM for the shard cache in GiB, per rank (each process has its own), pinned once at "
        "start-up; must hold two shuffle windows of shards.",
    )
    reader_threads: int = option(
        4, "Threads reading shards from disk into the cache ahead of need, per rank."
    )
    batch_tokens: int = option(
        65536,
        "Token budget of one packed micro-batch; a longer sequence is truncated to it.",
    )
    window_shards: int = option(
        4,
        "Shards whose sequences are shuffled and packed together (the shuffle window, per rank); "
        "consecutive steps see sequences of these shards only. A window of at least a rank's "
        "shards shuffles the whole epoch, if data.cache_gb holds them all.",
    )
    gpu_prefetch: int = option(
        1,
        "Batches copied to the GPU on a side stream while one trains: 1 overlaps copy and compute, "
        "0 not.",
    )
    host_prefetch: int = option(2, "Packed batches assembled on the host ahead of the GPU copy.")
    holdout_sequences: int = option(
        256,
        "Sequences of each store held out for validation (chosen deterministically by shard and "
        "index).",
    )
    holdout_fraction: float = option(
        0.0,
        "Held-out share of each store's sequences; the larger of this and holdout_sequences "
        "applies.",
    )
    holdout_by: Literal["unit", "name"] = option(
        "unit",
        "How the held-out walk orders a store's shards: 'unit', by a hash of each shard's work "
        "unit (stores of the same conversations in any storage dtype, with or without final "
        "states, hold out the same ones); 'name', by a hash of its whole name, which digests the "
        "dtype (runs started before this option; a resume of one needs it).",
    )
    on_bad_shard: Literal["stop", "skip"] = option(
        "stop",
        "What a corrupt shard (a failed checksum, a cut or missing file, missing metadata) or a "
        "missing one (listed in the store's summary, gone from the store) does: 'stop' ends the "
        "run with one sentence naming it (delete a corrupt one, rerun dflash-precompute, rerun to "
        "resume); 'skip' trains on without its sequences, logging it (a corrupt one is also "
        "counted in the metrics, bad_shards).",
    )

    def __post_init__(self):
        check(
            self.weights is None or len(self.weights) == len(self.stores),
            f"data.weights has {len(self.weights or [])} entries but data.stores has "
            f"{len(self.stores)}; give one weight per store.",
        )
        check(
            self.weights is None or all(w > 0 for w in self.weights),
            "data.weights must all be > 0.",
        )
        check(self.cache_gb > 0, f"data.cache_gb must be > 0, got {self.cache_gb}.")
        check(
            self.reader_threads >= 1,
            f"data.reader_threads must be >= 1, got {self.reader_threads}.",
        )
        check(self.batch_tokens >= 1, f"data.batch_tokens must be >= 1, got {self.batch_tokens}.")
        check(
            self.window_shards >= 1, f"data.window_shards must be >= 1, got {self.window_shards}."
        )
        check(
            self.gpu_prefetch in (0, 1),
            f"data.gpu_prefetch must be 0 or 1, got {self.gpu_prefetch}.",
        )
        check(
            self.host_prefetch >= 1, f"data.host_prefetch must be >= 1, got {self.host_prefetch}."
        )
        check(self.holdout_sequences >= 0, "data.holdout_sequences must be >= 0.")
        check(0.0 <= self.holdout_fraction < 1.0, "data.holdout_fraction must be in [0, 1).")


@dataclass(frozen=True)
class DrafterSection:
    arch: Arch = option(
        "dflash",
        "The drafter, by what sits on the DFlash backbone: 'dflash' (nothing: block "
        "position k predicts the token at anchor+k, B-1 drafts a cycle); 'dspark' (DSpark, arXiv "
        "2607.05147: a Markov head over the block and a confidence head; every block position "
        "predicts the next token, the anchor's included, B drafts a cycle; the markov_* and "
        "confidence_* fields shape it); 'dflash2' (DFlash2: grouped convolutions over block "
        "positions around every attention and MLP, and a candidate selector over each position's "
        "top-k; the conv_* and selector_* fields shape it).",
    )
    depth: int = option(5, "Draft layers (5 for Qwen3/Llama drafters, 8 for Qwen3-Coder).")
    block_size: int = option(
        16, "Tokens per block: the anchor plus block_size-1 masked predictions."
    )
    layer_ids: list[int] | None = option(
        None,
        "Target layer ids the drafter reads, a subset of the store's, in this order; none = all "
        "the store's.",
    )
    mask_token_id: int | None = option(
        None, "Token id of MASK (151669 for Qwen3); none = the target tokenizer's '<|mask|>' token."
    )
    layer_types: list[str] | None = option(
        None,
        "Attention kind per draft layer ('full_attention' or 'sliding_attention'); none = all "
        "full.",
    )
    sliding_window: int | None = option(
        None,
        "Sliding window of sliding_attention layers, in tokens: a query sees the keys of "
        "at most this many positions, its own included (2048 on Qwen3.6).",
    )
    init_from: str | None = option(
        None,
        "A released drafter directory (config.json + model.safetensors) to start from instead of "
        "random; its shape (depth, layer ids, sizes) must be this drafter's, its block size may "
        "differ.",
    )
    # DFlash2's layers and selector (arch = dflash2)
    conv_kernel_size: int = option(
        2,
        "DFlash2: taps of each grouped convolution (a block row mixes in the "
        "conv_kernel_size - 1 rows before it).",
    )
    conv_group_size: int = option(
        16,
        "DFlash2: channels per group of the convolutions' per-row coefficients; must divide "
        "the hidden size.",
    )
    selector_rank: int = option(
        256, "DFlash2: rank of the selector's predecessor/successor codebooks [V, rank]."
    )
    selector_top_k: int = option(
        16, "DFlash2: candidates per block position the selector chooses among (the served top-k)."
    )
    # DSpark's heads (arch = dspark)
    markov_rank: int = option(
        256, "DSpark: rank r of the Markov head (markov_w1 [V, r], markov_w2 [V, r])."
    )
    confidence_head: bool = option(
        True,
        "DSpark: train a confidence head (each draft's chance of acceptance once the drafts "
        "before it are), which vLLM's adaptive verification schedules with; drafts do not depend "
        "on it.",
    )
    confidence_head_with_markov: bool = option(
        True,
        "DSpark: the confidence head also reads the previous token's Markov embedding "
        "(DeepSpec's default).",
    )

    def __post_init__(self):
        check(
            self.arch in get_args(Arch),
            f"drafter.arch must be one of {', '.join(get_args(Arch))}, got {self.arch!r}.",
        )
        check(self.markov_rank >= 1, f"drafter.markov_rank must be >= 1, got {self.markov_rank}.")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            check(value >= 1, f"drafter.{name} must be >= 1, got {value}.")
        check(self.depth >= 1, f"drafter.depth must be >= 1, got {self.depth}.")
        check(self.block_size >= 2, f"drafter.block_size must be >= 2, got {self.block_size}.")
        check(
            self.layer_types is None or len(self.layer_types) == self.depth,
            f"drafter.layer_types has {len(self.layer_types or [])} entries for drafter.depth = "
            f"{self.depth}.",
        )
        kinds = {"full_attention", "sliding_attention"}
        check(
            self.layer_types is None or set(self.layer_types) <= kinds,
            f"drafter.layer_types must hold only {sorted(kinds)}, got {self.layer_types}.",
        )
        check(
            self.layer_types is None
            or "sliding_attention" not in self.layer_types
            or self.sliding_window is not None,
            "drafter.layer_types has sliding_attention layers; set drafter.sliding_window.",
        )


@dataclass(frozen=True)
class ObjectiveSection:
    max_anchors: int = option(
        512, "Anchors sampled per sequence per epoch, at most (among loss-mask positions)."
    )
    anchors: Literal["block", "label"] = option(
        "block",
        "Which response positions may be anchors: 'block' = p <= S-B, the whole block inside the "
        "sequence (the paper's bound); 'label' = p <= S-2 with p+1 a response token, i.e. at least "
        "one valid label, labels past the end weighing zero (SpecForge's rule: the last tokens of "
        "a response, end of turn included, are learnt at block position 1). Validation always uses "
        "'block', so runs compare.",
    )
    gamma: float | None = option(
        None,
        "Loss weight decay exp(-(k-1)/gamma) over block positions (weights = gamma); none = by "
        "block size (7 for 16).",
    )
    weights: Literal["gamma", "dpace"] = option(
        "dpace",
        "Per-position loss weights: 'dpace' = D-PACE (arXiv 2605.18810), detached from the "
        "drafter's own confidence exp(-CE) at each block position, with dpace_alpha (the default: "
        "+38% tau over 'gamma' on the quality benchmark, docs/benchmarks.md); 'gamma' = "
        "exp(-(k-1)/gamma), the paper's recipe; validation always reports the gamma-weighted loss, "
        "so runs compare.",
    )
    dpace_alpha: float = option(
        0.5,
        "D-PACE's floor on each position's acceptance factor: alpha + (1-alpha)*exp(-CE) (weights "
        "= dpace).",
    )
    normalise: Literal["weight", "anchors"] = option(
        "weight",
        "What the step's summed weighted CE is divided by, over all micro-batches and ranks: "
        "'weight' = the summed weights; 'anchors' = the number of blocks with at least one valid "
        "label.",
    )
    path_weight: float = option(
        0.0,
        "Extra loss weight of the blocks greedy serving would draft: each block whose anchor lies "
        "on the path a -> a + accepted(a) + 1 from a response's first anchor (accepted drafts from "
        "this step's own argmax, detached; a position that is no anchor this step goes on at the "
        "next anchor) weighs 1 + path_weight times as much, so positions after a rejection count "
        "more; the step's normaliser counts them so too (weights, or blocks under normalise = "
        "anchors). 0 = off; validation is unchanged.",
    )

    # DFlash2's selector (drafter.arch = dflash2)
    selector_weight: float = option(
        1.0,
        "DFlash2: weight of the selector loss (teacher-forced K-way CE over each position's "
        "top-k, with the label's predecessor; loss/selector.py) added to the per-position CE, "
        "under the same position weights.",
    )
    selector_candidates: Literal["gold", "strict"] = option(
        "gold",
        "DFlash2: when the label is not among the top-k, 'gold' puts it in place of the "
        "weakest candidate in the selector loss (speculators' trainer); 'strict' leaves the row "
        "out of it (SpecForge's).",
    )
    selector_stop_gradient: bool = option(
        False,
        "DFlash2: the selector loss trains only the selector (codebooks, projection), not "
        "the drafter's logits and hidden states.",
    )
    dpace_confidence: Literal["served", "unary"] = option(
        "served",
        "D-PACE's per-position confidence (weights = dpace): 'served' = the probability "
        "the served proposal gives the label (DFlash: its softmax; DFlash2: its selector's over "
        "the top-k, 0 off them); 'unary' = the per-position softmax's, also for DFlash2.",
    )

    # DSpark's confidence head (drafter.arch = dspark, drafter.confidence_head = true)
    confidence_weight: float = option(
        1.0,
        "DSpark: weight of the confidence head's loss, a BCE per block position weighted as "
        "its CE (DeepSpec: 1).",
    )
    confidence_label: Literal["match", "tv"] = option(
        "match",
        "DSpark: what the confidence head learns to predict at each block position, given "
        "the previous tokens right (teacher forcing: the drafts before it accepted): 'match' = "
        "whether its greedy draft is the data's token (greedy verification's acceptance; no "
        "final states needed); 'tv' = 1 - TV(drafter, target), the acceptance chance of a "
        "*sampled* draft (DeepSpec's label; needs targets.soft = tv or dspark).",
    )
    confidence_detach: bool = option(
        True,
        "DSpark: the confidence loss trains the confidence head only, not the backbone or "
        "the Markov head (DeepSpec trains them all with it): the drafts then do not depend on it.",
    )

    def __post_init__(self):
        check(self.max_anchors >= 1, f"objective.max_anchors must be >= 1, got {self.max_anchors}.")
        check(
            self.selector_weight >= 0,
            f"objective.selector_weight must be >= 0, got {self.selector_weight}.",
        )
        check(
            self.selector_candidates in ("gold", "strict"),
            f"objective.selector_candidates must be gold or strict, got "
            f"{self.selector_candidates!r}.",
        )
        check(
            self.dpace_confidence in ("served", "unary"),
            f"objective.dpace_confidence must be served or unary, got {self.dpace_confidence!r}.",
        )
        check(
            self.confidence_weight > 0,
            f"objective.confidence_weight must be > 0, got {self.confidence_weight} (to train "
            "without a confidence head, set drafter.confidence_head=false).",
        )
        check(
            self.confidence_label in ("match", "tv"),
            f"objective.confidence_label must be match or tv, got {self.confidence_label!r}.",
        )
        check(
            self.gamma is None or self.gamma > 0, f"objective.gamma must be > 0, got {self.gamma}."
        )
        check(
            self.anchors in ("block", "label"),
            f"objective.anchors must be block or label, got {self.anchors!r}.",
        )
        check(
            self.weights in ("gamma", "dpace"),
            f"objective.weights must be gamma or dpace, got {self.weights!r}.",
        )
        check(
            0 < self.dpace_alpha <= 1,
            f"objective.dpace_alpha must be in (0, 1], got {self.dpace_alpha}.",
        )
        check(
            self.normalise in ("weight", "anchors"),
            f"objective.normalise must be weight or anchors, got {self.normalise!r}.",
        )
        check(
            0 <= self.path_weight < float("inf"),
            "objective.path_weight must be a finite number >= 0 (0 = off), got "
            f"{self.path_weight}.",
        )


@dataclass(frozen=True)
class RegulariseSection:
    noise: float = option(
        0.0,
        "Gaussian noise added to the context features while training (never in validation), with a "
        "standard deviation of this times each token's per-layer feature RMS; 0 = none.",
    )
    ema: float = option(
        0.0,
        "Decay of an exponential moving average of the weights, updated after every optimiser step "
        "(e.g. 0.999); validation and the final drafter use the averaged weights, checkpoints keep "
        "both; 0 = none.",
    )

    def __post_init__(self):
        check(0 <= self.noise, f"regularise.noise must be >= 0, got {self.noise}.")
        check(0 <= self.ema < 1, f"regularise.ema must be in [0, 1), got {self.ema}.")


@dataclass(frozen=True)
class SoftTargetsSection:
    soft: Literal["none", "kl", "tv", "dspark"] = option(
        "none",
        "Match the target's distribution softmax(lm_head(final state)) instead of only its token: "
        "'kl' = KL(target || drafter), 'tv' = total variation 1/2 sum|p - q|, 'dspark' = 0.1 CE + "
        "0.9 sum|p - q| (DSpark); 'none' = cross-entropy on the token. Needs a store precomputed "
        "with --store.final_state=true.",
    )
    temperature: float = option(
        1.0,
        "Both distributions of the soft term are softmax(logits / temperature); CE terms stay at "
        "1.",
    )
    prompt_anchors: bool = option(
        False,
        "Anchors may also sit on prompt tokens, whose labels are the target's own greedy "
        "prediction (argmax of its logits there); response labels stay the stored tokens. Needs "
        "final states too. Validation keeps response anchors, so its tau stays comparable.",
    )

    def __post_init__(self):
        check(self.temperature > 0, f"targets.temperature must be > 0, got {self.temperature}.")

    @property
    def needs_final_state(self) -> bool:
        return self.soft != "none" or self.prompt_anchors


@dataclass(frozen=True)
class OptimSection:
    name: Literal["adamw", "muon"] = option(
        "adamw",
        "The optimiser: 'adamw' (the recipe), or 'muon': Muon for the linear layers' weight "
        "matrices, AdamW for the rest, at the same lr (train/optim.py).",
    )
    lr: float = option(6e-4, "Peak learning rate (AdamW's; Muon's update is scaled to match it).")
    weight_decay: float = option(0.0, "AdamW weight decay (the recipe uses none).")
    betas: list[float] = option(
        [0.9, 0.999], "AdamW betas (torch's defaults; the recipe names none)."
    )
    eps: float = option(1e-8, "AdamW epsilon.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this; 0 = no clipping.")
    warmup_fraction: float = option(
        0.04, "Share of all optimiser steps spent warming the lr up linearly."
    )
    schedule: Literal["cosine", "constant"] = option("cosine", "Learning-rate decay after warmup.")
    min_lr_ratio: float = option(0.0, "The cosine schedule ends at lr * min_lr_ratio.")
    epochs: int = option(6, "Passes over the training data.")
    max_steps: int | None = option(
        None, "Stop after this many optimiser steps (the schedule spans them)."
    )
    grad_accum: int = option(
        1,
        "Micro-batches per optimiser step on each rank; the step's loss is their "
        "token-weighted whole, as one batch holding them all.",
    )
    muon_momentum: float = option(
        0.95, "Muon's momentum (optim.name = 'muon'; Muon's own default)."
    )

    def __post_init__(self):
        check(self.lr > 0, f"optim.lr must be > 0, got {self.lr}.")
        check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}.")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas must be two numbers in [0, 1), got {self.betas}.",
        )
        check(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}.")
        check(
            0 <= self.warmup_fraction < 1,
            f"optim.warmup_fraction must be in [0, 1), got {self.warmup_fraction}.",
        )
        check(
            0 <= self.min_lr_ratio <= 1,
            f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.",
        )
        check(self.epochs >= 1, f"optim.epochs must be >= 1, got {self.epochs}.")
        check(
            self.max_steps is None or self.max_steps >= 1,
            f"optim.max_steps must be >= 1, got {self.max_steps}.",
        )
        check(self.grad_accum >= 1, f"optim.grad_accum must be >= 1, got {self.grad_accum}.")
        check(
            0 <= self.muon_momentum < 1,
            f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}.",
        )


@dataclass(frozen=True)
class PrecisionSection:
    autocast: Literal["bf16", "none"] = option(
        "bf16",
        "Compute dtype of forward and loss; weights, gradients and AdamW state stay fp32 either "
        "way.",
    )
    compile: bool = option(
        False,
        "torch.compile the draft layers' projections, norms, RoPE and MLP on CUDA (the sparse "
        "attention is compiled either way): fused elementwise kernels instead of eager float32 "
        "passes; costs a compilation at the first steps. Ignored on a CPU.",
    )
    loss_method: Literal["exact", "odds", "odds_epilogue"] = option(
        "exact",
        "How the fused LM-head loss forms its softmax: 'exact' (against each row's max: a row "
        "kernel of two passes), 'odds' (against the label's logit: one pass, the label's gradient "
        "term in float32; rows past 80 nats of CE fall back to exact) or 'odds_epilogue' (the same "
        "inside a Triton logits matmul, no logits stored; CUDA only). Same objective; "
        "docs/design.md and docs/benchmarks.md say what each costs. On a CPU, 'odds_epilogue' runs "
        "as 'odds'.",
    )


@dataclass(frozen=True)
class CheckpointSection:
    every_steps: int = option(
        1000, "Save a checkpoint every this many optimiser steps (and at the end)."
    )
    keep_last: int = option(3, "Complete checkpoints kept; older ones are deleted.")
    resume: bool = option(
        True,
        "Resume from the newest complete checkpoint in run.out_dir, if any (settings that "
        "define what is trained must then be its own); false starts the run over there, removing "
        "the earlier run's checkpoints and final drafter.",
    )

    def __post_init__(self):
        check(
            self.every_steps >= 1, f"checkpoint.every_steps must be >= 1, got {self.every_steps}."
        )
        check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {self.keep_last}.")


@dataclass(frozen=True)
class LogSection:
    every_steps: int = option(10, "Print and record metrics every this many optimiser steps.")
    tensorboard: bool = option(True, "Also write TensorBoard event files into the run directory.")
    progress: bool = option(True, "Show a progress bar (on rank 0).")

    def __post_init__(self):
        check(self.every_steps >= 1, f"log.every_steps must be >= 1, got {self.every_steps}.")


@dataclass(frozen=True)
class ValidationSection:
    every_steps: int = option(
        1000, "Evaluate the held-out sequences every this many steps; 0 = only at the end."
    )

    def __post_init__(self):
        check(
            self.every_steps >= 0, f"validation.every_steps must be >= 0, got {self.every_steps}."
        )


@dataclass(frozen=True)
class RunSection:
    out_dir: str = option(
        "runs/dflash", "Run directory: checkpoints, metrics, report, final drafter."
    )
    seed: int = option(0, "Seed of the initial weights, the data order and the anchors.")
    target: str | None = option(
        None,
        "Target model directory (HF layout): its frozen embedding and lm_head, and its tokenizer, "
        "whose fingerprint must match the store's.",
    )
    device: str = option(
        "auto", "'auto' (CUDA if present), 'cpu' or 'cuda'; under torchrun each rank takes its GPU."
    )

    def __post_init__(self):
        check_device(self.device, "run.device", index=False)  # each rank takes its own GPU


@dataclass(frozen=True)
class TrainConfig:
    STAGE: ClassVar[str] = "train"  # its table in a config file that holds several stages
    data: DataSection = section(DataSection, "Stores, shard cache, batching and held-out data.")
    drafter: DrafterSection = section(DrafterSection, "Shape of the drafter being trained.")
    objective: ObjectiveSection = section(
        ObjectiveSection, "The DFlash objective: anchors and loss weights."
    )
    regularise: RegulariseSection = section(
        RegulariseSection, "Regularisers for small data: feature noise, EMA."
    )
    targets: SoftTargetsSection = section(
        SoftTargetsSection,
        "What the drafter is taught from the target's final state: soft targets, prompt anchors.",
    )
    optim: OptimSection = section(OptimSection, "AdamW and the learning-rate schedule.")
    precision: PrecisionSection = section(PrecisionSection, "Mixed precision.")
    checkpoint: CheckpointSection = section(CheckpointSection, "Checkpoints and resume.")
    log: LogSection = section(LogSection, "Console, JSONL and TensorBoard metrics.")
    validation: ValidationSection = section(ValidationSection, "Validation on held-out sequences.")
    run: RunSection = section(RunSection, "Run directory, seed and target.")

    def __post_init__(self):
        t = self.targets
        what = f"targets.soft = '{t.soft}'" if t.soft != "none" else "targets.prompt_anchors = true"
        check(
            self.objective.path_weight == 0 or not t.needs_final_state,
            f"{what} cannot be combined with objective.path_weight (the serving path is weighted "
            "on the hard loss of the stored tokens only); set --objective.path_weight=0",
        )
        if self.drafter.arch == "dspark":
            self._check_dspark()

    def _check_dspark(self) -> None:
        o, t = self.objective, self.targets
        check(
            o.path_weight == 0,
            "objective.path_weight is not implemented for drafter.arch = dspark (its loss forms "
            "the weights a chunk of blocks at a time); set --objective.path_weight=0.",
        )
        check(
            not t.prompt_anchors,
            "targets.prompt_anchors is not implemented for drafter.arch = dspark (its Markov "
            "head is taught the true previous token); set --targets.prompt_anchors=false.",
        )
        check(
            o.confidence_label != "tv" or (t.soft in ("tv", "dspark") and t.temperature == 1.0),
            "objective.confidence_label = 'tv' reads the total variation of the soft loss; set "
            "--targets.soft=tv or dspark (temperature 1), or --objective.confidence_label=match.",
        )


# Settings whose default is not what runs from before them did: a run.toml without one is of a run
# that behaved as this value (train/resume.py holds a resume to it; dflash-eval reads the run so).
BEFORE_THEY_EXISTED = {"data.holdout_by": "name"}


def load_run_config(path: str | Path) -> TrainConfig:
    """A run's run.toml as that run trained: the settings it predates (BEFORE_THEY_EXISTED) at
    their value before they existed, the others at their defaults."""
    written = stage_table(TrainConfig, read_toml(path), path)
    older = [
        f"--{key}={value}"
        for key, value in BEFORE_THEY_EXISTED.items()
        if key.split(".")[-1] not in written.get(key.split(".")[0], {})
    ]
    return load_config(TrainConfig, path, older)
