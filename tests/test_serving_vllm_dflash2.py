"""DFlash2 against vLLM 0.32's own code on the CPU (`make serve-check`, in .venv-vllm): vLLM's
DFlash2 model, built from our export by vLLM's config parsing and loader, gives our drafter's hidden
states, candidates, scores and walked paths; vLLM's CPU convolution is ours; vLLM's loader does with
broken exports what our lint says it does. vLLM runs in a child process (tests/vllm_dflash2.py:
what is vLLM's there and what is not, and the CPU k_norm bug it patches).

The serving check itself (vLLM serving a DFlash2 drafter our CLIs trained, through its V2 runner,
lossless and drafting as our engine does) is in tests/test_serving_vllm.py, beside DFlash's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.eval.vllm_engine import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not importable here"),
]

ROOT = Path(__file__).resolve().parent.parent
SPEC = dict(
    num_layers=4,
    hidden_size=128,
    intermediate_size=256,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=500.0,
    initializer_range=0.05,
)  # head_dim 64: vLLM's CPU attention layer takes it


def _child(*args: str, timeout: float = 900, **extra_env: str) -> None:
    """tests/vllm_dflash2.py with vLLM's Triton kernels interpreted: its walk kernel runs, and its
    V2 runner's rules apply (a mixed sliding/full drafter needs them)."""
    env = {
        **os.environ,
        **extra_env,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "DFLASH2_TRITON_WALK": "1",
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_dflash2.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a DFlash2 drafter for it (random, norms, convolutions and selector moved
    off their start; one sliding layer, one full), exported in float32 by dflash-export."""
    sys.path.insert(0, str(ROOT / "tests" / "dflash_common" / "drafter"))
    from drafter_testlib import randomise_dflash2

    from dflash_common.drafter.arch import config_class, new_drafter
    from dflash_common.drafter.export import export, save_drafter
    from dflash_common.tiny import TinySpec, build_tiny_target

    work = tmp_path_factory.mktemp("dflash2-vllm")
    target = build_tiny_target(work / "target", TinySpec(**SPEC))
    cfg = config_class("dflash2").from_target(
        json.loads((target / "config.json").read_text()),
        mask_token_id=259,
        depth=2,
        block_size=6,
        layer_ids=[0, 2],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=7,
        selector_rank=16,
        selector_top_k=5,
    )
    torch.manual_seed(0)
    drafter = randomise_dflash2(new_drafter(cfg))
    with torch.no_grad():  # every norm its own weights: a norm taken from another layer shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    save_drafter(drafter, work / "run-drafter", dtype=torch.float32)
    return target, export(work / "run-drafter", work / "export", dtype=torch.float32)


def test_our_grouped_convolution_is_vllms(tmp_path):
    from dflash_common.drafter.dflash2 import grouped_conv

    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, hidden, taps, group, block in (
        (24, 64, 2, 16, 8),
        (21, 96, 3, 8, 7),
        (12, 32, 2, 4, 5),
    ):
        proj = torch.randn(rows, 2, taps, hidden // group, generator=g)
        cases.append(
            {
                "x": torch.randn(rows, hidden, generator=g),
                "delta": proj[:, 1],
                "base": torch.randn(taps, hidden, generator=g),
                "block": block,
                "group": group,
            }
        )
    torch.save(cases, tmp_path / "conv.pt")
    _child("conv", str(tmp_path / "conv.pt"), str(tmp_path / "vllm.pt"))
    theirs = torch.load(tmp_path / "vllm.pt")
    for case, want in zip(cases, theirs):
        args = (case["x"], case["delta"], case["base"], case["block"], case["group"])
        torch.testing.assert_close(grouped_conv(*args, backend="torch"), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            grouped_conv(*args, backend="triton"), want, rtol=1e-6, atol=1e-5
        )


def _ours(drafter_dir: Path, target: Path, contexts, anchors) -> dict:
    """Our drafter, loaded from the export, drafting one block per request as dflash-eval does."""
    from transformers import AutoModelForCausalLM

    from dflash_common.drafter.dflash2 import walk
    from dflash_common.drafter.export import load_drafter

    drafter, cfg = load_drafter(drafter_dir)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    drafter.attach_frozen(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    hidden = []
    with torch.no_grad():
        for ctx, anchor in zip(contexts, anchors):
            block = torch.full((cfg.block_size,), cfg.mask_token_id)
            block[0] = anchor
            hidden.append(drafter.draft(drafter.new_cache(), ctx, block))
        hidden = torch.stack(hidden)  # [R, B, H]
        ids, unary = drafter.candidates(hidden[:, 1:])
        scores = drafter.candidate_selector.edge_scores(
            hidden[:, 1:], ids, unary, torch.tensor(anchors)
        )
        path = drafter.greedy_drafts(hidden, torch.tensor(anchors))
    assert torch.equal(path, walk(ids, scores))
    return {
        "hidden": hidden.flatten(0, 1),
        "ids": ids,
        "unary": unary,
        "scores": scores,
        "path": path,
        "argmax": drafter.logits(hidden[:, 1:]).argmax(-1),
    }


def test_vllms_dflash2_model_loads_our_export_and_drafts_our_paths(pair, tmp_path):
    """Hidden states, candidates, unary scores, edge scores and the path vLLM's walk kernel
    takes."""
    target, drafter_dir = pair
    g = torch.Generator().manual_seed(1)
    width = 2 * SPEC["hidden_size"]
    contexts, anchors = (
        [torch.randn(s, width, generator=g) for s in (5, 11, 3, 8)],
        [3, 17, 200, 42],
    )
    torch.save({"contexts": contexts, "anchors": anchors}, tmp_path / "inputs.pt")
    _child(
        "forward",
        str(drafter_dir),
        str(target),
        str(tmp_path / "inputs.pt"),
        str(tmp_path / "vllm.pt"),
    )
    theirs, ours = torch.load(tmp_path / "vllm.pt"), _ours(drafter_dir, target, contexts, anchors)
    torch.testing.assert_close(theirs["hidden"], ours["hidden"], rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs["ids"], ours["ids"])
    torch.testing.assert_close(theirs["unary"], ours["unary"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs["scores"], ours["scores"], rtol=1e-4, atol=1e-3)
    assert torch.equal(theirs["path"], ours["path"])
    assert not torch.equal(ours["path"], ours["argmax"])  # the selector chose otherwise somewhere


def test_vllms_cpu_build_normalises_every_layers_context_k_with_layer_0s(pair, tmp_path):
    """The CPU-build bug the parity child patches (tests/vllm_dflash2.py): left in, layer 1's
    context keys take layer 0's k_norm and the hidden states part from ours. When this fails, vLLM
    has fixed it: drop the patch and this test."""
    target, drafter_dir = pair
    g = torch.Generator().manual_seed(1)
    contexts, anchors = [torch.randn(9, 2 * SPEC["hidden_size"], generator=g)], [17]
    torch.save({"contexts": contexts, "anchors": anchors}, tmp_path / "inputs.pt")
    args = (str(drafter_dir), str(target), str(tmp_path / "inputs.pt"), str(tmp_path / "vllm.pt"))
    _child("forward", *args, DFLASH2_CPU_KNORM="1")
    theirs, ours = torch.load(tmp_path / "vllm.pt"), _ours(drafter_dir, target, contexts, anchors)
    rel = float((theirs["hidden"] - ours["hidden"]).abs().max() / ours["hidden"].abs().max())
    assert rel > 1e-3, f"vLLM's CPU context k_norm agrees with ours now (relative {rel:.2g})"


def test_vllms_walk_kernel_breaks_ties_to_the_lowest_index_as_ours(tmp_path):
    from dflash_common.drafter.dflash2 import walk

    ids = torch.arange(24).view(2, 3, 4) + 100
    scores = torch.zeros(2, 3, 4, 4)
    scores[0, 0, 0] = torch.tensor([0.0, 2.0, 2.0, 1.0])
    scores[0, 1, 1] = torch.tensor([0.0, 0.0, 0.0, 3.0])
    scores[1, 0, 0] = torch.tensor([5.0, 5.0, 5.0, 5.0])
    scores[1, 2, 0] = torch.tensor([-1.0, 4.0, 4.0, 0.0])
    torch.save({"ids": ids, "scores": scores}, tmp_path / "walk.pt")
    _child("walk", str(tmp_path / "walk.pt"), str(tmp_path / "vllm.pt"))
    assert (
        torch.load(tmp_path / "vllm.pt").tolist()
        == walk(ids, scores).tolist()
        == [[101, 107, 108], [112, 116, 121]]
    )


def test_vllms_loader_does_what_the_lint_says(pair, tmp_path):
    """What vLLM's load_weights does with each variant our lint refuses: refuses .weight codebooks,
    leaves a missing tensor unwritten without a word, takes a transposed base_kernel (T = 2)."""
    target, drafter_dir = pair
    _child("load", str(drafter_dir), str(target), str(tmp_path / "load.json"))
    got = json.loads((tmp_path / "load.json").read_text())
    # the target's embedding and head (shared at serving time), and vLLM's optional learned mask
    # embedding (read only from a mask_embedding.pt beside the checkpoint, unused otherwise)
    shared = ["model.mask_embedding", "model.embed_tokens.weight", "lm_head.weight"]
    assert got["as exported"] == f"accepted; never written: {shared}"
    assert (
        got["codebooks named .weight"].startswith("refused")
        and "nested weight" in got["codebooks named .weight"]
    )
    missing = [*shared[:2], "model.layers.1.mlp_conv.base_kernel", shared[2]]
    assert got["a tensor missing"] == f"accepted; never written: {missing}"
    assert got["base_kernel stored [T, 2, H]"] == f"accepted; never written: {shared}"
