"""A target is its content: `dflash-train --run.target` must be the store's target (embedding,
lm_head, the config fields the drafter copies), whatever its directory is called; precompute
resumes a store with a byte-identical target copied under another name."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dflash_common.errors import UserError
from dflash_common.config import load_config
from dflash_common.fingerprint import head_fingerprint
from train.config import TrainConfig
from train.loop import check_stores, open_train_stores, resolve_drafter

from fault_helpers import copy_store


def _variant(tiny_target, tmp_path, change: str):
    """A copy of the tiny target under another name, changed in one way."""
    out = shutil.copytree(tiny_target, tmp_path / f"target-{change}")
    config = json.loads((out / "config.json").read_text())
    if change == "rope_theta":
        config["rope_parameters"]["rope_theta"] = 1e6
    elif change == "rms_norm_eps":
        config["rms_norm_eps"] = 1e-5
    elif change == "lm_head":
        weights = load_file(out / "model.safetensors")
        weights["lm_head.weight"] = weights["lm_head.weight"] * 1.01
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _with_head_record(store, tiny_target):
    """The store as this dflash's precompute writes it: with the target_head record."""
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["target_head"] = head_fingerprint(tiny_target)
    (store / "zarr.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return store


def _check(store, target) -> str:
    cfg = load_config(TrainConfig, None, [f"--data.stores={json.dumps([str(store)])}", f"--run.target={target}"])
    stores = open_train_stores(cfg)
    return check_stores(stores, resolve_drafter(cfg, stores), str(target))


@pytest.mark.parametrize("record", ["target_head", "old_store"])
@pytest.mark.parametrize("change", ["rope_theta", "rms_norm_eps", "lm_head"])
def test_a_target_other_than_the_stores_is_refused_naming_what_differs(tiny_store, tiny_target, tmp_path,
                                                                       change, record):
    store = copy_store(tiny_store, tmp_path / "store")
    if record == "target_head":
        store = _with_head_record(store, tiny_target)
    target = _variant(tiny_target, tmp_path, change)
    with pytest.raises(UserError) as info:
        _check(store, target)
    message = str(info.value)
    assert message.startswith(f"run.target = {target} is not the target store {store} was precomputed from")
    assert message.endswith("pass that target as --run.target, or precompute a store from this one.")
    if record == "target_head":
        assert ("embedding/lm_head" if change == "lm_head" else change) in message
    else:  # a store of an older dflash: its whole-checkpoint fingerprints
        assert ("weights_sha256" if change == "lm_head" else "config_sha256") in message


def test_a_copy_of_the_target_under_another_name_is_the_same_target(tiny_store, tiny_target, tmp_path):
    store = _with_head_record(copy_store(tiny_store, tmp_path / "store"), tiny_target)
    copy = shutil.copytree(tiny_target, tmp_path / "renamed-target")
    assert "the embedding, lm_head, config and tokenizer of" in _check(store, copy)
    resharded = shutil.copytree(tiny_target, tmp_path / "resharded")  # the same tensors, split in two files
    weights = load_file(resharded / "model.safetensors")
    (resharded / "model.safetensors").unlink()
    names = sorted(weights)
    save_file({n: weights[n] for n in names[::2]}, str(resharded / "a.safetensors"))
    save_file({n: weights[n] for n in names[1::2]}, str(resharded / "b.safetensors"))
    index = {"weight_map": {n: "a.safetensors" if i % 2 == 0 else "b.safetensors" for i, n in enumerate(names)}}
    (resharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert head_fingerprint(resharded) == head_fingerprint(tiny_target)
