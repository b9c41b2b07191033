"""The drafter's losses through the target's frozen lm_head, never materialising [N, V] logits.

- `hard`: weighted cross-entropy to the data's tokens (`fused_lm_head_loss`), its methods and the
  chunked torch backend; `hard_triton` (the row kernels) and `epilogue_triton` (the odds formed in
  the logits matmul) are its Triton kernels.
- `soft`: the drafter's distribution matched to the target's (`soft_lm_head_loss`), with the
  helpers that give each block row its teacher row and greedy label; `soft_triton` is its kernel.

The names below are the losses' interface to the trainer; the Triton modules are imported only when
a Triton backend runs.
"""

from dflash_common.drafter.loss.hard import LossOutput, fused_lm_head_loss
from dflash_common.drafter.loss.soft import (
    TARGET_ARGMAX,
    greedy_prompt_labels,
    soft_kind,
    soft_lm_head_loss,
    teacher_rows,
)

__all__ = [
    "TARGET_ARGMAX",
    "LossOutput",
    "fused_lm_head_loss",
    "greedy_prompt_labels",
    "soft_kind",
    "soft_lm_head_loss",
    "teacher_rows",
]
