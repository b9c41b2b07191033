"""The optional final-state array: written, read (alone or with layers), verified, refused when it
does not match the manifest; stores without it keep their manifest bytes and open as before."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from test_store_support import manifest, payload, unit_name

from dflash_common.store import Store, StoreMismatchError, StoreWriter
from dflash_common.store.format import FINAL_ARRAY, StoreManifest
from dflash_common.store.quant import encode_states
from dflash_common.store.verify import store_info, verify_store

T = 150


def _with_final(p, m, seed=0):
    final = torch.randn(T, m.hidden_size, generator=torch.Generator().manual_seed(seed))
    return dataclasses.replace(p, final=encode_states(final, m.dtype)), final


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_final_state_round_trip_and_verify(tmp_path, dtype):
    m = manifest(dtype, final_state=True)
    p, _ = payload(4, T, m)
    p, final = _with_final(p, m)
    StoreWriter.create_or_open(tmp_path / "s", m).write_shard(unit_name(4), p)
    with Store.open(tmp_path / "s") as store:
        assert store.manifest.final_state
        alone = store.read_shard(unit_name(4), layer_ids=[], final=True)  # no layer read
        assert alone.layers == {} and alone.final.shape == (T, m.hidden_size)
        got = alone.states(None, out_dtype=torch.float32)
        want = final.to(torch.bfloat16).float()
        if dtype == "bf16":
            assert torch.equal(got, want)
        else:
            assert (got - final).abs().max() < 0.1 * final.abs().max()
        everything = store.read_shard(unit_name(4))  # all layers: the final state comes with them
        assert np.array_equal(everything.final, alone.final)
        assert FINAL_ARRAY not in store.buffer_specs(unit_name(4), layer_ids=[1])  # not asked for
        assert store.shard_nbytes(unit_name(4), [1], final=True) > store.shard_nbytes(
            unit_name(4), [1]
        )
        assert verify_store(store).ok and store_info(store)["final_state"] is True


def test_payload_and_manifest_must_agree_about_the_final_state(tmp_path):
    with_final = manifest(final_state=True)
    p, _ = payload(1, T, with_final)
    with pytest.raises(ValueError, match="lacks the final state"):
        StoreWriter.create_or_open(tmp_path / "a", with_final).write_shard(unit_name(1), p)
    plain = manifest()
    p_final, _ = _with_final(p, plain)
    with pytest.raises(ValueError, match="has the final state"):
        StoreWriter.create_or_open(tmp_path / "b", plain).write_shard(unit_name(1), p_final)
    StoreWriter.create_or_open(tmp_path / "b", plain).write_shard(unit_name(1), p)
    with (
        Store.open(tmp_path / "b") as store,
        pytest.raises(StoreMismatchError, match="--store.final_state=true"),
    ):
        store.read_shard(unit_name(1), final=True)


def test_a_store_without_final_states_keeps_its_manifest_bytes(tmp_path):
    """A version-1 store written before the field existed has no `final_state` key; the field stays
    out of the manifest unless true, so such a store opens, compares equal and resumes."""
    m = manifest()
    assert (
        "final_state" not in m.to_json()
        and manifest(final_state=True).to_json()["final_state"] is True
    )
    StoreWriter.create_or_open(tmp_path / "s", m)
    root = json.loads((tmp_path / "s" / "zarr.json").read_text())["attributes"]
    assert "final_state" not in root
    assert StoreManifest.from_json(root).final_state is False
    StoreWriter.create_or_open(tmp_path / "s", m)  # the same manifest: opens again
    with pytest.raises(StoreMismatchError, match="final_state"):
        StoreWriter.create_or_open(tmp_path / "s", manifest(final_state=True))
