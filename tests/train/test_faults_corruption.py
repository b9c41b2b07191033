"""Corrupt stores end to end: a flipped bit in a chunk, a cut file, missing metadata, a missing
array file. `dflash-store verify` names each bad shard; `dflash-train` stops with the shard's name
in one sentence (exit 2, no traceback, no hang) or, with data.on_bad_shard = "skip", trains without
it, logging and counting it, and still resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest
import torch

import train.loop as loop
from dflash_common.config import load_config
from dflash_common.store import Store
from dflash_common.store.cli import main as store_main
from train.cli import main as train_main
from train.cli import parse
from train.config import TrainConfig
from train.data import TrainData
from train.metrics import read_metrics

from fault_helpers import (
    CORRUPTIONS,
    ROOT,
    copy_store,
    corrupt,
    shard_names,
    subprocess_env,
    train_cmd,
)
from train_helpers import train_args, write_tiny_store


@pytest.fixture(scope="module")
def store8(tiny_target, tmp_path_factory):
    """8 shards x 5 conversations: enough shards that training goes on with several skipped."""
    return write_tiny_store(
        tmp_path_factory.mktemp("faults") / "store8", tiny_target, n_shards=8, per_shard=5
    )


@pytest.fixture()
def damaged(store8, tmp_path):
    """A copy of store8 with shards 1..5 damaged, one kind each: {kind: shard name}."""
    path = copy_store(store8, tmp_path / "damaged")
    names = shard_names(path)
    bad = {kind: names[i + 1] for i, kind in enumerate(CORRUPTIONS)}
    for kind, name in bad.items():
        corrupt(path, name, kind)
    return path, bad


def test_verify_names_every_damaged_shard(damaged, capsys):
    path, bad = damaged
    assert store_main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out.split() == sorted(bad.values())  # stdout: exactly the bad shards, one per line
    reasons = {line.split()[1]: line for line in err.splitlines() if line.startswith("  Shard ")}
    assert set(reasons) == set(bad.values())
    expected = {
        "flipped_byte": "fails its crc32c checksum",
        "truncated_file": "the file was cut short",
        "missing_shard_metadata": "its zarr.json is missing",
        "missing_array_metadata": "layer_4 is missing",
        "missing_array_file": "is missing",
    }
    for kind, name in bad.items():
        assert expected[kind] in reasons[name] and "rerun dflash-precompute" in reasons[name], (
            kind,
            reasons[name],
        )
    assert "8 shard(s)" in err and "5 bad shard(s)" in err


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_training_stops_with_the_shards_name_in_one_sentence(
    store8, tiny_target, tmp_path, capsys, kind
):
    path = copy_store(store8, tmp_path / "store")
    name = shard_names(path)[3]
    corrupt(path, name, kind)
    with pytest.raises(SystemExit) as e:
        train_main(train_args(path, tiny_target, tmp_path / "run", "--optim.max_steps=30"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("error: Shard " + name) and "corrupt" in err, err
    assert 'data.on_bad_shard = "skip"' in err and f"delete {path / 'shards' / name}" in err


def test_a_real_trainer_process_stops_without_traceback_or_hang(store8, tiny_target, tmp_path):
    """The damage is found by a cache reader thread, handed to the loader thread, and must reach the
    main thread as the same one sentence (torchdata would turn it into a RuntimeError traceback)."""
    path = copy_store(store8, tmp_path / "store")
    name = shard_names(path)[6]
    corrupt(path, name, "flipped_byte")
    done = subprocess.run(
        train_cmd(*train_args(path, tiny_target, tmp_path / "run", "--optim.max_steps=30")),
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(f"error: Shard {name} of store {path} is corrupt: chunk ")
    assert "crc32c" in lines[-1]
    assert any(
        " step 1/30 " in line for line in lines
    )  # met mid-run, by the readers, not at start-up


def test_skipped_shards_never_reach_a_batch_and_every_other_sequence_does(damaged):
    path, bad = damaged
    store = Store.open(path)
    cfg = load_config(
        TrainConfig,
        None,
        [
            f'--data.stores=["{path}"]',
            "--data.cache_gb=0.01",
            "--data.batch_tokens=512",
            "--data.window_shards=2",
            "--data.holdout_sequences=0",
            "--drafter.block_size=4",
            "--precision.autocast=none",
            "--data.on_bad_shard=skip",
        ],
    )
    data = TrainData.build(
        cfg, [store], [1, 2, 3, 4, 5], rank=0, world=1, device=torch.device("cpu")
    )
    plan = data.plan
    assert {(0, bad["missing_shard_metadata"])} == set(
        data.bad.skipped
    )  # found by the start-up scan
    assert bad["missing_shard_metadata"] not in {m.name for m in plan.shards}
    feeder = data.start()
    seen, epoch0 = [], plan.epoch(0, 0).batches
    while True:
        batch = next(feeder)
        if batch.epoch > 0:
            break
        rows = [
            r for r in epoch0[batch.index].tolist() if plan.shards[r[0]].name not in bad.values()
        ]
        want = []
        for shard, seq, n in rows:
            d = store.read_shard(plan.shards[shard].name)
            want.append(d.input_ids[d.offsets[seq] : d.offsets[seq] + n].astype(np.int64))
            seen.append((shard, seq))
        assert torch.equal(
            batch.input_ids, torch.from_numpy(np.concatenate(want))
        )  # exactly the good rows
    assert {name for _, name in data.bad.skipped} == set(
        bad.values()
    )  # every damaged shard met once
    good = {
        (s, q) for b in epoch0 for s, q, _ in b.tolist() if plan.shards[s].name not in bad.values()
    }
    assert set(seen) == good and len(seen) == len(good)  # every good sequence, once
    data.close()
    store.close()


def test_skip_logs_counts_and_still_resumes_exactly(
    damaged, tiny_target, tmp_path, monkeypatch, caplog
):
    path, bad = damaged
    extra = [
        "--data.on_bad_shard=skip",
        "--optim.max_steps=10",
        "--validation.every_steps=5",
        "--checkpoint.every_steps=100",
    ]
    straight = tmp_path / "straight"
    loop.run(parse(train_args(path, tiny_target, straight, *extra)))
    records = [r for r in read_metrics(straight) if r["kind"] == "train"]
    assert (
        records[-1]["bad_shards"] == 5 and records[0]["bad_shards"] >= 1
    )  # the scan's one from the start
    assert all(np.isfinite(r["loss"]) for r in records)
    warned = [m for m in caplog.messages if m.startswith("skipping a corrupt shard")]
    assert sorted(next(n for n in bad.values() if n in m) for m in warned) == sorted(bad.values())
    assert any(m.startswith("5 corrupt shard(s) skipped") for m in caplog.messages)

    real_step, calls = loop.train_step, []

    def step_then_sigterm(*a, **k):
        info = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return info

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    resumed = tmp_path / "resumed"
    loop.run(parse(train_args(path, tiny_target, resumed, *extra)))
    monkeypatch.setattr(loop, "train_step", real_step)
    loop.run(parse(train_args(path, tiny_target, resumed, *extra)))

    def curve(run):
        keys = ("kind", "step", "epoch", "loss", "acc", "acc_by_pos", "grad_norm")
        return [tuple(json.dumps(r.get(k)) for k in keys) for r in read_metrics(run)]

    assert curve(resumed) == curve(straight)


def test_offline_evaluation_of_a_damaged_store_is_one_sentence(
    store8, tiny_target, tmp_path, capsys
):
    """dflash-eval --offline reads the held-out shards through the same reader: same sentence, exit
    2."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_common.drafter.config import DrafterConfig
    from dflash_common.drafter.export import save_drafter
    from dflash_common.drafter.model import DFlashDrafter
    from dflash_common.tiny import MASK_TOKEN
    from train.eval.cli import main as eval_main

    path = copy_store(store8, tmp_path / "store")
    for name in shard_names(path):  # whichever shard holds the held-out sequences is damaged
        corrupt(path, name, "flipped_byte")
    mask = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids(MASK_TOKEN)
    cfg = DrafterConfig.from_target(
        AutoConfig.from_pretrained(tiny_target), mask_token_id=mask, depth=1, block_size=4
    )
    drafter = save_drafter(DFlashDrafter(cfg), tmp_path / "drafter")
    with pytest.raises(SystemExit) as e:
        eval_main(
            [
                "--offline",
                "--store",
                str(path),
                "--drafter",
                str(drafter),
                f"--target.path={tiny_target}",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        e.value.code == 2 and err.startswith("error: Shard ") and "fails its crc32c checksum" in err
    ), err
