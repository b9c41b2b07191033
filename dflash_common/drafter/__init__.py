"""The DFlash drafter, one module each: `config` (the drafter's config and its released config.json),
`model` (the drafter's modules), `attention` (the sparse block mask and the attention backends),
`packed` (a packed batch's dtypes and the sequence of each position),
`layer_ids` (which target layers it reads), `objective` (anchors, labels, position weights), `loss/`
(the losses through the frozen lm_head: `hard` and `soft`, each with its Triton kernels),
`target_head` (the target's frozen embedding and lm_head), `serving` (what the serving engines will
read from an exported drafter) and `export` (the released layout serving engines load, `dflash-export`).

Import the module you need; this package imports nothing, so `layer_ids` and `config` cost no torch
import.
"""
