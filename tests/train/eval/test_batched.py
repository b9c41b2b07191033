"""The batched draft-verify loop (train/eval/batched.py) against the one-at-a-time loop, prompt by
prompt: the same tokens, the same cycles (accepted lengths, cycle for cycle), the same cut output,
on prompts of different lengths that finish at different times (stop tokens, limits, a batch
compacted on the way).

Drafters whose acceptance lengths follow from the drafts they are given: an oracle that knows the
target's greedy continuation (with corrupted positions), in both loops' forms."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from test_evaluate import LAYER_IDS, OracleDrafter, greedy_continuations
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_common.config import ConfigError, load_config
from dflash_common.errors import UserError
from train.eval import batched
from train.eval.batched import BatchedTarget, speculative_generate_batch, target_generate_batch
from train.eval.config import EvalConfig
from train.eval.run import resolve_batch_size, target_answers
from train.eval.spec_decode import TargetRunner, speculative_generate, target_generate

# prompts of different lengths: padding, and rows that reach their limits in different cycles
TEXTS = [
    "hello world, this is a longer test prompt than the rest",
    "abc",
    "The quick brown fox",
    "0123456789",
    "spec decoding!",
    "x",
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
        )
        for t in TEXTS
    ]


class BatchedOracle:
    """OracleDrafter's drafts for every row of a batch at once (batched.BatchedDrafter)."""

    def __init__(
        self,
        continuations: dict[tuple, list[int]],
        block_size: int,
        vocab_size: int,
        corrupt: Callable[[int], bool] = lambda pos: False,
    ):
        self.continuations = continuations
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.layer_ids = list(LAYER_IDS)
        self.corrupt = corrupt
        self.seqs: list[list[int]] = []
        self.kept: list[int] = []  # batch widths after each compaction

    def start(self, prompts, length):
        self.seqs = [list(p) + self.continuations[tuple(p)] for p in prompts]

    def extend(self, context, starts, rows=slice(None)):
        assert context.shape[0] == len(self.seqs[rows]) == starts.shape[0]
        assert context.shape[-1] == len(LAYER_IDS) * 64  # the five layers' outputs, concatenated

    def propose_block(self, anchors, starts, num_drafts):
        out = []
        for seq, anchor, start in zip(self.seqs, anchors.tolist(), starts.tolist()):
            assert start >= len(seq) or seq[start] == anchor, (
                "the anchor must be the committed token at its start"
            )
            row = [seq[p] if p < len(seq) else 0 for p in range(start + 1, start + 1 + num_drafts)]
            out.append(
                [
                    (t + 1) % self.vocab_size if self.corrupt(p) else t
                    for p, t in zip(range(start + 1, start + 1 + num_drafts), row)
                ]
            )
        return torch.tensor(out)

    def keep(self, rows):
        self.seqs = [self.seqs[i] for i in rows.tolist()]
        self.kept.append(len(self.seqs))


def _irregular(pos: int) -> bool:
    return (pos * 7919) % 13 < 3


@pytest.mark.parametrize(
    "block, max_new, corrupt",
    [(4, 13, lambda pos: False), (6, 45, _irregular), (5, 20, lambda pos: True)],
)
def test_batched_cycles_equal_the_one_at_a_time_loop(tiny, prompts, block, max_new, corrupt):
    model = tiny[0]
    runner = TargetRunner(model, LAYER_IDS)
    conts = greedy_continuations(runner, prompts, max_new)
    oracle = OracleDrafter(conts, block, model.config.vocab_size, corrupt=corrupt)
    alone = [
        speculative_generate(runner, oracle, p, block_size=block, max_new_tokens=max_new)
        for p in prompts
    ]
    counted = []
    together = speculative_generate_batch(
        BatchedTarget(model, LAYER_IDS),
        BatchedOracle(conts, block, model.config.vocab_size, corrupt),
        prompts,
        block_size=block,
        max_new_tokens=max_new,
        on_tokens=counted.append,
    )
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens
        assert b.acceptance_lengths == a.acceptance_lengths
        assert b.emitted == a.emitted
        assert b.decode_s > 0 and b.prefill_s > 0
    assert sum(counted) == len(prompts) * max_new  # the bar ends full


@pytest.mark.parametrize("lowest", [0, 17])
def test_stop_tokens_finish_rows_apart_and_the_batch_is_compacted(
    tiny, prompts, lowest, monkeypatch
):
    """A stop token that each row meets at its own time (or never): every row's cut output and
    cycles are the one-at-a-time loop's, and the batch narrows to the live rows on the way."""
    monkeypatch.setattr(batched, "COMPACT_AT", 0.9)  # compact at the first finished row
    model, block, max_new = tiny[0], 4, 40
    runner = TargetRunner(model, LAYER_IDS)
    conts = greedy_continuations(runner, prompts, max_new)
    first = conts[tuple(prompts[2])]
    stop = frozenset([next(t for j, t in enumerate(first) if j >= lowest and t not in first[:j])])
    oracle = OracleDrafter(conts, block, model.config.vocab_size, corrupt=_irregular)
    alone = [
        speculative_generate(
            runner, oracle, p, block_size=block, max_new_tokens=max_new, stop_ids=stop
        )
        for p in prompts
    ]
    drafter = BatchedOracle(conts, block, model.config.vocab_size, _irregular)
    together = speculative_generate_batch(
        BatchedTarget(model, LAYER_IDS),
        drafter,
        prompts,
        block_size=block,
        max_new_tokens=max_new,
        stop_ids=stop,
    )
    assert [b.tokens for b in together] == [a.tokens for a in alone]
    assert [b.acceptance_lengths for b in together] == [a.acceptance_lengths for a in alone]
    assert [b.emitted for b in together] == [a.emitted for a in alone]
    assert len({len(a.tokens) for a in alone}) > 1, "rows should finish at different lengths"
    assert drafter.kept and drafter.kept[-1] < len(prompts)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_target_alone_equals_one_at_a_time(tiny_target, prompts, attn, monkeypatch):
    monkeypatch.setattr(batched, "CHECK_EVERY", 5)  # reads between tokens, not only at the end
    monkeypatch.setattr(batched, "PREFILL_TOKENS", 64)  # the prefill in several slices of rows
    model = AutoModelForCausalLM.from_pretrained(
        tiny_target, dtype=torch.float32, attn_implementation=attn
    ).eval()
    runner = TargetRunner(model, [])
    free = {tuple(p): target_generate(runner, p, max_new_tokens=30).tokens for p in prompts}
    stop = frozenset([free[tuple(prompts[1])][7]])
    for max_new, stops in ((30, frozenset()), (30, stop), (1, frozenset())):
        alone = [
            target_generate(runner, p, max_new_tokens=max_new, stop_ids=stops).tokens
            for p in prompts
        ]
        counted = []
        together = target_generate_batch(
            BatchedTarget(model, []),
            prompts,
            max_new_tokens=max_new,
            stop_ids=stops,
            on_tokens=counted.append,
        )
        assert [d.tokens for d in together] == alone
        assert sum(counted) == len(prompts) * max_new


def test_batch_size_is_resolved_per_device_and_refused_where_it_cannot_serve(tiny, tiny_target):
    model = tiny[0]
    oracle = OracleDrafter({}, 4, model.config.vocab_size)
    gen = load_config(EvalConfig, None, []).generation
    assert gen.batch_size == 0
    assert resolve_batch_size(gen, model, oracle, torch.device("cpu")) == 1  # the CPU's default
    # no batched form: one at a time
    assert resolve_batch_size(gen, model, oracle, torch.device("cuda")) == 1
    oracle_b = BatchedOracle({}, 4, model.config.vocab_size)
    assert resolve_batch_size(gen, model, oracle_b, torch.device("cuda")) == batched.AUTO_ROWS
    explicit = load_config(EvalConfig, None, ["--generation.batch_size=8"]).generation
    assert resolve_batch_size(explicit, model, oracle_b, torch.device("cpu")) == 8
    with pytest.raises(
        UserError, match="generation.batch_size = 8: the drafter .* has no batched form"
    ):
        resolve_batch_size(explicit, model, oracle, torch.device("cpu"))
    with pytest.raises(ConfigError, match="greedily only"):
        load_config(EvalConfig, None, ["--generation.batch_size=8", "--generation.temperature=0.7"])
    fa2 = AutoModelForCausalLM.from_pretrained(
        tiny_target, dtype=torch.float32, attn_implementation="eager"
    )
    fa2.config._attn_implementation = (
        "flash_attention_2"  # (not installed here: the refusal needs no kernel)
    )
    with pytest.raises(UserError, match="takes no per-row masks"):
        resolve_batch_size(explicit, fa2, oracle_b, torch.device("cpu"))


def test_target_answers_are_dflash_evals_reference_in_its_batches(tiny, prompts):
    """What the quality benchmark replays path tau on: the target alone as dflash-eval decodes its
    reference, in batches of prompts sorted by length (here 4, then 2) or one at a time."""
    runner = TargetRunner(tiny[0], [])
    free = target_generate(runner, prompts[3], max_new_tokens=12).tokens
    stop = frozenset([free[5]])
    alone = [target_generate(runner, p, max_new_tokens=12, stop_ids=stop).tokens for p in prompts]
    assert target_answers(tiny[0], prompts, max_new_tokens=12, stop_ids=stop, batch_size=4) == alone
    assert target_answers(tiny[0], prompts, max_new_tokens=12, stop_ids=stop, batch_size=1) == alone
