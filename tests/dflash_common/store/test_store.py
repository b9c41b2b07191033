"""The store on real zarr v3 directories: round trips, subset reads, refusals, corruption, publishing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from test_store_support import LAYER_IDS, manifest, payload, unit_name, write_units

from dflash_common.store import (
    NonFiniteStatesError, ShardPayload, Store, StoreCorruptError, StoreError, StoreMismatchError, StoreWriter,
    carve_buffers, check_compatible, open_stores, shard_name,
)
from dflash_common.store.chunks import CODECS
from dflash_common.store.quant import FP8_ABS_ERROR, FP8_E4M3_MAX, FP8_REL_ERROR, decode_states
from dflash_common.store.verify import verify_store

T = 203  # not a multiple of chunk_tokens=64: four chunks of 51 rows, the last one padded


@pytest.mark.parametrize("codec", CODECS)
def test_bf16_round_trip_is_bit_exact(tmp_path, codec):
    m = manifest("bf16", codec)
    w = StoreWriter.create_or_open(tmp_path / "s", m)
    p, states = payload(7, T, m)
    info = w.write_shard(unit_name(7), p)
    assert (info.num_tokens, info.num_sequences) == (T, 3)
    with Store.open(tmp_path / "s") as store:
        d = store.read_shard(unit_name(7))
        assert np.array_equal(d.input_ids, p.input_ids.numpy()) and d.input_ids.dtype == np.int32
        assert np.array_equal(d.loss_mask, p.loss_mask.astype(np.uint8))
        assert np.array_equal(d.offsets, p.offsets) and d.sample_ids == list(p.sample_ids)
        for layer_id, x in states.items():
            assert torch.equal(d.states(layer_id).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_fp8_round_trip_within_the_bound(tmp_path, codec):
    m = manifest("fp8_e4m3", codec)
    p, states = payload(3, T, m)
    write_units(tmp_path / "s", m, [], T).write_shard("u3", p)
    with Store.open(tmp_path / "s") as store:
        d = store.read_shard("u3")
        for layer_id, x in states.items():
            s = x.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX
            err = (d.states(layer_id, out_dtype=torch.float32) - x).abs()
            assert (err <= (FP8_REL_ERROR * x.abs() + FP8_ABS_ERROR * s) * (1 + 1e-6)).all()


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_q4_round_trip_decodes_what_was_encoded(tmp_path, codec):
    """The store keeps q4_hadamard's rows and scales exactly: a read decodes to the bits the encoder's
    own output decodes to, and the error stays 4-bit sized. The store is format version 2."""
    m = manifest("q4_hadamard", codec)
    assert m.format_version == 2 and manifest("fp8_e4m3").format_version == 1
    p, states = payload(4, T, m)
    write_units(tmp_path / "s", m, [], T).write_shard("u4", p)
    with Store.open(tmp_path / "s") as store:
        assert store.manifest.format_version == 2
        d = store.read_shard("u4")
        for layer_id, x in states.items():
            enc = p.layers[layer_id]
            assert d.layers[layer_id].shape == (T, 36) and d.layers[layer_id].dtype == np.uint8  # 9H/16
            want = decode_states(enc.data, enc.scale, "q4_hadamard", out_dtype=torch.float32)
            got = d.states(layer_id, out_dtype=torch.float32)
            assert torch.equal(got, want)
            assert ((got - x).norm(dim=1) / x.norm(dim=1)).mean() < 0.08
        assert verify_store(store, progress=False).ok


@pytest.mark.parametrize("dtype,codec", [("bf16", "blosc-lz4-bitshuffle"), ("fp8_e4m3", "zstd"),
                                         ("q4_hadamard", "zstd")])
def test_zarr_reads_what_the_store_wrote(tmp_path, dtype, codec):
    """The data files follow zarr's sharding format: zarr itself decodes the same arrays."""
    m = manifest(dtype, codec)
    p, _ = payload(1, T, m)
    write_units(tmp_path / "s", m, [], T).write_shard("u1", p)
    root = zarr.open_group(tmp_path / "s", mode="r")
    version = 2 if dtype == "q4_hadamard" else 1
    assert root.attrs["layer_ids"] == list(LAYER_IDS) and root.attrs["format_version"] == version
    g = root["shards"]["u1"]
    assert g.attrs["num_tokens"] == T and g.attrs["sample_ids"] == list(p.sample_ids)
    assert np.array_equal(g["input_ids"][:], p.input_ids.numpy())
    assert np.array_equal(g["offsets"][:], p.offsets)
    for layer_id, enc in p.layers.items():
        assert np.array_equal(g[f"layer_{layer_id}"][:], enc.data.numpy())
        if dtype != "bf16":
            assert np.array_equal(g[f"layer_{layer_id}_scale"][:], enc.scale.numpy())


def test_subset_reads_touch_only_the_chosen_layers(tmp_path):
    m = manifest("fp8_e4m3")
    p, states = payload(2, T, m)
    write_units(tmp_path / "s", m, [], T).write_shard("u2", p)
    (tmp_path / "s/shards/u2/layer_1/c/0/0").unlink()  # a layer the drafter does not read
    with Store.open(tmp_path / "s") as store:
        d = store.read_shard("u2", [5, 3])
        assert sorted(d.layers) == [3, 5] and sorted(d.scales) == [3, 5]
        assert np.array_equal(d.layers[5], p.layers[5].data.numpy())
        with pytest.raises(StoreCorruptError, match="u2.*layer_1.*missing"):
            store.read_shard("u2")
        with pytest.raises(StoreMismatchError, match="not \\[7\\]"):
            store.read_shard("u2", [7])


def test_reads_land_in_caller_buffers(tmp_path):
    m = manifest("bf16", "zstd")
    p, _ = payload(4, T, m)
    write_units(tmp_path / "s", m, [], T).write_shard("u4", p)
    with Store.open(tmp_path / "s", read_threads=2) as store:
        info = store.shards[0]
        specs = store.buffer_specs(info, [3])
        assert sorted(specs) == ["input_ids", "layer_3", "loss_mask", "offsets"]
        assert specs["layer_3"].nbytes == T * m.hidden_size * 2
        slab = torch.zeros(store.shard_nbytes(info, [3]) + 4096, dtype=torch.uint8)  # a cache slot
        views = carve_buffers(store.buffer_specs(info, [3]), slab[4096:])
        d = store.read_shard("u4", [3], out=views)
        assert np.shares_memory(d.layers[3], slab.numpy()) and np.shares_memory(d.input_ids, slab.numpy())
        assert np.array_equal(d.layers[3], p.layers[3].data.numpy())
        base = slab[4096:].data_ptr()
        assert all((v.ctypes.data - base) % 4096 == 0 for v in views.values())  # page-aligned offsets
        with pytest.raises(ValueError, match="layer_3"):
            store.read_shard("u4", [3], out={**views, "layer_3": np.empty((T, 7), np.uint16)})


def test_listing_counts_and_skips_hidden_names(tmp_path):
    m = manifest()
    w = write_units(tmp_path / "s", m, [0, 1, 2], 100)
    os.makedirs(tmp_path / "s/shards/.u9-partial/layer_1")  # what a foreign or killed writer could leave
    os.makedirs(tmp_path / "s/.staging/u5~host~1~abcd/layer_1")
    with Store.open(tmp_path / "s") as store:
        assert [s.name for s in store.shards] == [unit_name(u) for u in range(3)]
        assert all(s.num_tokens == 100 and s.num_sequences == 3 for s in store.shards)
        assert verify_store(store).ok
    assert w.has_shard(unit_name(1)) and not w.has_shard(unit_name(5))


def test_create_or_open_is_idempotent_and_refuses_another_manifest(tmp_path):
    m = manifest()
    StoreWriter.create_or_open(tmp_path / "s", m)
    StoreWriter.create_or_open(tmp_path / "s", manifest())  # same manifest, other object: fine
    with pytest.raises(StoreMismatchError, match=r"hidden_size = 64.*hidden_size = 128") as e:
        StoreWriter.create_or_open(tmp_path / "s", manifest(hidden=128))
    assert str(e.value).count(".") <= 2  # one sentence
    other_target = manifest(target={**m.target, "weights_sha256": "f00d"})
    with pytest.raises(StoreMismatchError, match="target.weights_sha256"):
        StoreWriter.create_or_open(tmp_path / "s", other_target)
    with pytest.raises(StoreMismatchError, match="codec"):
        StoreWriter.create_or_open(tmp_path / "s", manifest(codec="zstd"))


def test_a_directory_that_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d/notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a dflash store"):
        StoreWriter.create_or_open(tmp_path / "d", manifest())
    with pytest.raises(StoreError, match="not a dflash store"):
        Store.open(tmp_path / "d")
    assert (tmp_path / "d/notes.txt").read_text() == "mine"


def test_unknown_format_version_is_refused(tmp_path):
    write_units(tmp_path / "s", manifest(), [0], 50)
    meta = json.loads((tmp_path / "s/zarr.json").read_text())
    meta["attributes"]["format_version"] = 3
    (tmp_path / "s/zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="format version 3.*reads versions 1, 2"):
        Store.open(tmp_path / "s")
    with pytest.raises(StoreError, match="format version 3"):
        StoreWriter.create_or_open(tmp_path / "s", manifest())


def test_a_reader_of_version_1_only_refuses_a_q4_store(tmp_path, monkeypatch):
    """What a dflash from before q4_hadamard says of such a store: one sentence, nothing misread."""
    from dflash_common.store import format as store_format

    write_units(tmp_path / "s", manifest("q4_hadamard"), [0], 50)
    monkeypatch.setattr(store_format, "READ_VERSIONS", (1,))
    with pytest.raises(StoreError, match=r"has store format version 2, but this dflash reads versions 1; use"):
        Store.open(tmp_path / "s")
    monkeypatch.undo()
    meta = json.loads((tmp_path / "s/zarr.json").read_text())
    meta["attributes"]["format_version"] = 1  # a manifest claiming version 1 with q4 states is malformed
    (tmp_path / "s/zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="malformed manifest.*format version 1 has no q4_hadamard states"):
        Store.open(tmp_path / "s")


@pytest.mark.parametrize("dtype,bad", [("bf16", float("nan")), ("fp8_e4m3", float("inf")), ("fp8_e4m3", float("nan")),
                                       ("q4_hadamard", float("nan")), ("q4_hadamard", -float("inf"))])
def test_nonfinite_states_are_refused_naming_the_sample(tmp_path, dtype, bad):
    m = manifest(dtype)
    w = StoreWriter.create_or_open(tmp_path / "s", m)
    p, states = payload(6, T, m)
    x = states[3].clone()
    row = int(p.offsets[1]) + 4  # token 4 of the second sample
    x[row, 10] = bad
    from dflash_common.store.quant import encode_states

    broken = ShardPayload(p.input_ids, p.loss_mask, p.offsets, p.sample_ids, {**p.layers, 3: encode_states(x, dtype)})
    with pytest.raises(NonFiniteStatesError, match=r"sample data\.jsonl:19 \(layer 3, token 4\)") as e:
        w.write_shard("u6", broken)
    assert e.value.sample_id == "data.jsonl:19"
    assert not w.has_shard("u6") and os.listdir(tmp_path / "s/.staging") == []
    with Store.open(tmp_path / "s") as store:
        assert store.shards == []


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("codec,where", [("none", 1000), ("zstd", 5), ("none", -10)])  # -10: in the index
def test_a_flipped_byte_is_found_by_verify_and_by_reads(tmp_path, codec, where):
    m = manifest("bf16", codec)
    write_units(tmp_path / "s", m, [0, 1, 2], T)
    victim = tmp_path / "s/shards" / unit_name(1) / "layer_5/c/0/0"
    _flip_byte(victim, where)
    with Store.open(tmp_path / "s") as store:
        report = verify_store(store)
        assert list(report.bad) == [unit_name(1)] and report.shards_checked == 3
        assert "crc32c" in report.bad[unit_name(1)] and "layer_5" in report.bad[unit_name(1)]
        with pytest.raises(StoreCorruptError, match=unit_name(1)) as e:
            store.read_shard(unit_name(1))
        assert e.value.shard == unit_name(1)
        store.read_shard(unit_name(1), [1, 3])  # other layers of the shard are intact
        store.read_shard(unit_name(2))


def test_verify_finds_broken_structure(tmp_path):
    m = manifest("fp8_e4m3")
    write_units(tmp_path / "s", m, [0, 1, 2, 3], 100)
    shards = tmp_path / "s/shards"
    (shards / unit_name(0) / "offsets/c/0").unlink()
    (shards / unit_name(1) / "zarr.json").unlink()
    os.truncate(shards / unit_name(2) / "layer_3_scale/c/0", 50)
    with Store.open(tmp_path / "s") as store:
        bad = verify_store(store).bad
    assert sorted(bad) == [unit_name(i) for i in range(3)]
    assert "offsets" in bad[unit_name(0)] and "zarr.json" in bad[unit_name(1)]


def test_rewriting_a_published_shard_keeps_the_first(tmp_path):
    m = manifest()
    w = write_units(tmp_path / "s", m, [0], 100)
    before = (tmp_path / "s/shards" / unit_name(0) / "layer_1/c/0/0").stat().st_mtime_ns
    info = w.write_shard(unit_name(0), payload(0, 100, m)[0])
    assert info.num_tokens == 100 and not info.published
    assert (tmp_path / "s/shards" / unit_name(0) / "layer_1/c/0/0").stat().st_mtime_ns == before
    assert os.listdir(tmp_path / "s/.staging") == []


def test_summary_is_separate_from_the_manifest(tmp_path):
    m = manifest()
    w = write_units(tmp_path / "s", m, [0], 100)
    w.write_summary({"tokens": 100, "seconds": 12.5})
    StoreWriter.create_or_open(tmp_path / "s", m)  # the summary does not count as a difference
    with Store.open(tmp_path / "s") as store:
        assert store.summary == {"tokens": 100, "seconds": 12.5} and store.manifest == m


def test_a_dead_writers_staging_is_cleaned_a_live_one_kept(tmp_path):
    from dflash_common.store.writer import _host

    StoreWriter.create_or_open(tmp_path / "s", manifest())
    staging = tmp_path / "s/.staging"
    dead = staging / f"u1~{_host()}~{2**22 + 12345}~dead"  # above the default pid_max: never alive
    live = staging / f"u2~{_host()}~{os.getpid()}~live"
    elsewhere = staging / "u3~otherhost~1~remote"
    for d in (dead, live, elsewhere):
        (d / "layer_1").mkdir(parents=True)
    StoreWriter.create_or_open(tmp_path / "s", manifest())
    assert not dead.exists() and live.exists() and elsewhere.exists()


def test_bad_payloads_are_refused_before_writing(tmp_path):
    m = manifest()
    w = StoreWriter.create_or_open(tmp_path / "s", m)
    p, _ = payload(0, 100, m)
    cases = [
        (ShardPayload(p.input_ids, p.loss_mask, p.offsets[:-1], p.sample_ids, p.layers), "offsets"),
        (ShardPayload(p.input_ids, p.loss_mask[:-1], p.offsets, p.sample_ids, p.layers), "loss_mask"),
        (ShardPayload(p.input_ids, p.loss_mask, p.offsets, p.sample_ids, {1: p.layers[1]}), "layers"),
    ]
    for bad, what in cases:
        with pytest.raises(ValueError, match=what):
            w.write_shard("u0", bad)
    with pytest.raises(ValueError, match="shard name"):
        w.write_shard(".hidden", p)
    assert os.listdir(tmp_path / "s/shards") == ["zarr.json"]


def test_the_finished_store_does_not_depend_on_how_units_were_spread(tmp_path):
    """Two 'runs' writing the same units in different orders and groupings: identical bytes."""
    m = manifest("fp8_e4m3", "blosc-lz4-bitshuffle")
    write_units(tmp_path / "a", m, [0, 1, 2, 3], 90)
    for units in ([3, 1], [2, 0]):
        write_units(tmp_path / "b", m, units, 90)

    def tree(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and ".staging" not in p.parts}

    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_compatibility_sentences():
    m = manifest()
    check_compatible(m, layer_ids=[5, 1], hidden_size=64, tokenizer_sha256="7f" * 32)
    with pytest.raises(StoreMismatchError, match="hidden size 64, but the drafter needs 128"):
        check_compatible(m, layer_ids=[1], hidden_size=128)
    with pytest.raises(StoreMismatchError, match=r"layers \[1, 3, 5\], but the drafter also reads \[2\]"):
        check_compatible(m, layer_ids=[1, 2], hidden_size=64)
    with pytest.raises(StoreMismatchError, match="tokenizer"):
        check_compatible(m, layer_ids=[1], hidden_size=64, tokenizer_sha256="00" * 32)


def test_open_stores_refuses_stores_of_different_targets(tmp_path):
    write_units(tmp_path / "a", manifest(), [0], 50)
    write_units(tmp_path / "b", manifest("fp8_e4m3", layer_ids=(1, 3)), [0], 50)  # mixable
    write_units(tmp_path / "c", manifest(tokenizer={"sha256": "11" * 32}), [0], 50)
    write_units(tmp_path / "d", manifest("q4_hadamard"), [0], 50)  # mixable
    stores = open_stores([tmp_path / "a", tmp_path / "b", tmp_path / "d"])
    assert [s.manifest.dtype for s in stores] == ["bf16", "fp8_e4m3", "q4_hadamard"]
    with pytest.raises(StoreMismatchError, match="differ in tokenizer.sha256"):
        open_stores([tmp_path / "a", tmp_path / "c"])


def test_shard_names_come_from_the_unit():
    assert shard_name(17, "ABCDEF0123456789ffff") == "u00000017-abcdef0123456789"
    with pytest.raises(ValueError):
        shard_name(1, "not-hex")


@pytest.mark.gpu
def test_states_decode_on_the_gpu_as_on_the_cpu(tmp_path):
    m = manifest("fp8_e4m3")
    p, _ = payload(8, T, m)
    write_units(tmp_path / "s", m, [], T).write_shard("u8", p)
    with Store.open(tmp_path / "s") as store:
        d = store.read_shard("u8", [3])
        gpu = d.states(3, device="cuda", out_dtype=torch.float32)
        assert gpu.is_cuda and torch.equal(gpu.cpu(), d.states(3, out_dtype=torch.float32))
