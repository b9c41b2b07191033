"""The forward pipeline on the tiny target, in one process: what lands in the store against the full
model's own hidden states, sequences in input order, fp8 and q4_hadamard, NaN/Inf stopping the run,
units with no sequence, the order of forwards and copies, and the back-pressure that bounds host
memory."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash_common.store import NonFiniteStatesError, Store, StoreWriter
from dflash_common.store.quant import FP8_ABS_ERROR, FP8_REL_ERROR
from dflash_common.store.verify import store_info, verify_store
from precompute import job
from precompute.inputs import resolve_inputs
from precompute.pipeline import STAGING_BUFFERS, Pipeline, sort_window_batches
from precompute.target import CapturedTarget
from precompute.tokenizing import TokenCache

from precompute_helpers import chat, make_config, write_jsonl


def tokens_record(ids, response_from: int) -> dict:
    return {
        "input_ids": list(ids),
        "loss_mask": [0] * response_from + [1] * (len(ids) - response_from),
    }


@pytest.fixture(scope="module")
def full_model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def reference(full_model, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The full model's hidden_states of one sequence
    run alone: layer id i is [i + 1][0], [T, H]."""
    with torch.no_grad():
        return full_model(
            torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True
        ).hidden_states


def _inputs(tmp_path):
    """Conversations of many lengths (so batches mix units
    and reorder them), a bad line and a short answer."""
    records = [chat(i, answer_len=20 + (37 * i) % 150) for i in range(13)]
    records[4] = "{broken"
    records[9] = chat(9, answer_len=3)
    return [write_jsonl(tmp_path / "chats.jsonl", records)]


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "q4_hadamard"])
def test_shards_hold_each_unit_in_input_order_with_the_full_models_states(
    tiny_target, full_model, tmp_path, dtype
):
    cfg = make_config(
        tiny_target,
        _inputs(tmp_path),
        tmp_path / "store",
        f'store.dtype="{dtype}"',
        "batching.token_budget=400",
        "batching.sort_window_units=2",
        "run.writer_threads=2",
        "run.progress=false",
    )
    job.run(cfg)
    store = Store.open(tmp_path / "store")
    cache = TokenCache.for_config(cfg, resolve_inputs(cfg.data.inputs))
    assert [s.name[:9] for s in store.shards] == [
        "u00000000",
        "u00000001",
        "u00000002",
        "u00000003",
    ]
    assert store.manifest.layer_ids == (1, 2, 3, 4, 5) and store.manifest.dtype == dtype
    units = [cache.load(u) for u in range(4)]
    batches = sort_window_batches(units[:2], 400)
    order = [seq for batch in batches for seq in batch]
    # batching did reorder the sequences of the sort window
    assert len(batches) > 1 and order != sorted(order)
    _check_store(store, units, full_model, dtype)
    assert "sample" in json.dumps(store.summary) and store.summary["samples"] == 11
    assert store.summary["skips"]["counts"] == {"malformed_json": 1, "too_few_response_tokens": 1}
    assert "GPU" not in job.format_summary(store.summary)  # a CPU run has no GPU clock
    if dtype == "q4_hadamard":  # a version-2 store that verify and info read
        assert store.manifest.format_version == 2 and verify_store(store, progress=False).ok
        info = store_info(store)
        assert (
            info["array_bytes_per_token"] == 5 * (9 * 64 // 16 + 4) + 5
            and info["format_version"] == 2
        )
        assert info["decoded_bytes"] == sum(
            s.nbytes for sh in store.shards for s in store.buffer_specs(sh).values()
        )


@pytest.mark.gpu
def test_on_a_gpu_the_shards_hold_the_full_models_states_and_the_gpu_time_is_counted(
    tiny_target, full_model, tmp_path
):
    """Inputs copied from pinned memory without a sync, states copied out on the copy stream: the
    store still holds every unit's states, and the summary says how long the GPU computed and
    waited."""
    cfg = make_config(
        tiny_target,
        _inputs(tmp_path),
        tmp_path / "store",
        "run.device=cuda",
        "batching.token_budget=400",
        "batching.sort_window_units=2",
        "run.writer_threads=2",
        "run.progress=false",
    )
    job.run(cfg)
    store = Store.open(tmp_path / "store")
    cache = TokenCache.for_config(cfg, resolve_inputs(cfg.data.inputs))
    _check_store(store, [cache.load(u) for u in range(4)], full_model, "bf16")
    run = store.summary["runs"][0]
    assert (
        0 < run["gpu_busy_s"] <= run["seconds"]["forward_write"] and run["gpu_idle_s_max_rank"] >= 0
    )
    assert "the GPU computed" in job.format_summary(store.summary)


def _check_store(store, units, full_model, dtype) -> None:
    """Every shard holds its unit's tokens in input order
    and the full model's states of layers 1 and 5."""
    worst = 0.0
    assert len(store.shards) == len(units)
    for shard, unit in zip(store.shards, units):
        data = store.read_shard(shard.name)
        assert data.sample_ids == unit.sample_ids  # input order, whatever the batching order
        np.testing.assert_array_equal(data.input_ids, unit.input_ids)
        np.testing.assert_array_equal(data.loss_mask, unit.loss_mask)
        np.testing.assert_array_equal(data.offsets, unit.offsets)
        for n in range(unit.num_samples):
            a, b = unit.offsets[n], unit.offsets[n + 1]
            hidden = reference(full_model, unit.input_ids[a:b])
            for layer_id in (1, 5):
                got = data.states(layer_id, out_dtype=torch.float32)[a:b]
                want = hidden[layer_id + 1][0]
                worst = max(worst, _check_close(got, want, dtype, data.scales.get(layer_id), a, b))
    assert worst > 0  # the comparison saw rounding, so it compared real numbers


def _check_close(got, want, dtype, scale, a, b) -> float:
    """bf16: within bf16 rounding of the fp32 reference; fp8: within the format's bound (+ bf16
    slack); q4_hadamard: 4-bit sized errors per token (its bound is per group of the rotated state:
    test_quant)."""
    err = (got - want).abs()
    if dtype == "q4_hadamard":
        rel = (got - want).norm(dim=1) / want.norm(dim=1)
        assert rel.max() < 0.15 and rel.mean() < 0.09, (float(rel.max()), float(rel.mean()))
    elif dtype == "bf16":
        assert torch.all(err <= 2**-8 * want.abs() + 1e-5), float(err.max())
    else:
        s = torch.from_numpy(scale[a:b])[:, None]
        bound = (FP8_REL_ERROR + 2**-8) * want.abs() + FP8_ABS_ERROR * s + 1e-5
        assert torch.all(err <= bound), float((err - bound).max())
    return float(err.max())


def test_nonfinite_states_stop_the_run_naming_the_sample_and_the_shard(tiny_target, tmp_path):
    broken = tmp_path / "broken-target"
    shutil.copytree(tiny_target, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.embed_tokens.weight"][300] = float("nan")  # a token only one sample holds
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    ids = [list(range(40 + i, 80 + i)) for i in range(8)]
    ids[5][10] = 300
    inputs = [write_jsonl(tmp_path / "t.jsonl", [tokens_record(x, 10) for x in ids])]
    cfg = make_config(
        broken,
        inputs,
        tmp_path / "store",
        "run.samples_per_unit=2",
        "batching.sort_window_units=1",
        "run.progress=false",
    )
    with pytest.raises(NonFiniteStatesError) as caught:
        job.run(cfg)
    message = str(caught.value)
    bad_unit = [n for n in Store.open(tmp_path / "store").shard_names()]
    assert caught.value.sample_id == "t.jsonl:6" and "sample t.jsonl:6" in message
    assert "u00000002-" in message and "rerunning the same command resumes" in message
    assert not any(n.startswith("u00000002") for n in bad_unit)  # nothing published for that unit
    assert verify_store(Store.open(tmp_path / "store")).bad == {}


def test_a_unit_whose_records_were_all_skipped_is_done_without_a_shard(tiny_target, tmp_path):
    records = (
        [chat(i) for i in range(4)]
        + ["{bad", chat(5, answer_len=2), "", "[]"]
        + [chat(i) for i in range(8, 12)]
    )
    cfg = make_config(
        tiny_target,
        [write_jsonl(tmp_path / "a.jsonl", records)],
        tmp_path / "store",
        "batching.sort_window_units=1",
        "run.progress=false",
    )
    job.run(cfg)
    store = Store.open(tmp_path / "store")
    assert [s.name[:9] for s in store.shards] == ["u00000000", "u00000002"]
    assert store.summary["empty_units"] == [1] and store.summary["runs"][0]["units_written"] == 2
    job.run(cfg)  # the rerun knows unit 1 is done: nothing runs
    again = Store.open(tmp_path / "store").summary["runs"]
    assert len(again) == 2 and again[1]["batches"] == 0 and again[1]["units_written"] == 0


def test_a_unit_another_job_published_first_is_not_counted_as_written(
    tiny_target, tmp_path, monkeypatch, capsys
):
    real_write = StoreWriter.write_shard
    raced, lock = {}, threading.Lock()

    def racing_write(self, name, payload):
        with lock:  # another job publishes the first unit written just before this job does
            first = not raced
            if first:
                raced[name] = None
        if first:
            raced[name] = real_write(self, name, payload).published
        return real_write(self, name, payload)

    monkeypatch.setattr(StoreWriter, "write_shard", racing_write)
    inputs = [write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(8)])]
    cfg = make_config(
        tiny_target, inputs, tmp_path / "store", "run.samples_per_unit=2", "run.progress=false"
    )
    job.run(cfg)
    store = Store.open(tmp_path / "store")
    run = store.summary["runs"][0]
    assert list(raced.values()) == [True] and len(store.shards) == 4
    assert run["units_written"] == 3 and run["units_published_elsewhere"] == 1
    ours = [s.name for s in store.shards if s.name not in raced]
    assert run["bytes_written"] == sum(
        f.stat().st_size
        for name in ours
        for f in (tmp_path / "store/shards" / name).rglob("*")
        if f.is_file()
    )
    assert (
        "3 shards written" in capsys.readouterr().out
        and "1 published meanwhile by another job" in job.format_summary(store.summary)
    )


def test_a_slow_disk_holds_the_forward_back_instead_of_filling_memory(
    tiny_target, tmp_path, monkeypatch
):
    real_write = StoreWriter.write_shard

    def slow_write(self, name, payload):
        time.sleep(0.05)  # a disk much slower than the forward
        return real_write(self, name, payload)

    monkeypatch.setattr(StoreWriter, "write_shard", slow_write)
    inputs = [write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(24)])]
    cfg = make_config(
        tiny_target,
        inputs,
        tmp_path / "store",
        "run.samples_per_unit=2",
        "batching.sort_window_units=1",
        "run.queue_depth=1",
        "run.writer_threads=1",
        "batching.token_budget=256",
        "run.progress=false",
    )
    job.run(cfg)
    run = Store.open(tmp_path / "store").summary["runs"][0]
    assert run["units_written"] == 12
    # window being computed + the one whose copy waits +
    # those in the staging buffers + the queue + the writer
    assert run["max_units_in_memory"] <= (STAGING_BUFFERS + 2) * 1 + 1 + 1
    assert run["disk_wait_s_max_rank"] > 0.1  # the forward waited for the disk


@pytest.mark.parametrize("after_next_forward", [True, False])
def test_a_batchs_copy_is_queued_after_the_next_forward_is_launched(
    tiny_target, tmp_path, monkeypatch, after_next_forward
):
    """The model syncs at the start of every forward; a copy queued before it made it wait (module
    docstring). Each copy goes out after the next batch's forward, the last one at close; the
    other order is kept for the benchmark. Either way the store holds every unit."""
    events: list[str] = []
    real_forward, real_copy = CapturedTarget.forward, Pipeline._copy_all

    def forward(self, input_ids):
        events.append("forward")
        return real_forward(self, input_ids)

    def copy_all(encoded, staging, tokens):
        events.append("copy")
        return real_copy(encoded, staging, tokens)

    monkeypatch.setattr(CapturedTarget, "forward", forward)
    monkeypatch.setattr(Pipeline, "_copy_all", staticmethod(copy_all))
    monkeypatch.setattr(Pipeline, "copy_after_next_forward", after_next_forward)
    inputs = [write_jsonl(tmp_path / "a.jsonl", [chat(i, answer_len=40) for i in range(8)])]
    cfg = make_config(
        tiny_target,
        inputs,
        tmp_path / "store",
        "run.samples_per_unit=2",
        "batching.sort_window_units=2",
        "batching.token_budget=256",
        "run.progress=false",
    )
    job.run(cfg)
    batches = events.count("forward")
    assert batches >= 4 and events.count("copy") == batches
    if after_next_forward:
        assert events == ["forward"] + ["forward", "copy"] * (batches - 1) + ["copy"]
    else:
        assert events == ["forward", "copy"] * batches
    assert len(Store.open(tmp_path / "store").shards) == 4
