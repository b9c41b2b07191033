"""The DFlash drafter, one module each: `model` (the drafter and its config), `layer_ids` (which target
layers it reads), `objective` (anchors, labels, position weights), `loss/` (the losses through the frozen
lm_head: `hard` and `soft`, each with its Triton kernels), `target_head` (the target's frozen embedding and
lm_head) and `export` (the released layout serving engines load, `dflash-export`).

Import the module you need; this package imports nothing, so `layer_ids` costs no torch import.
"""
