"""dflash_common.hf: the model directory every stage reads, on the tiny target (no downloads)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_common import hf
from dflash_common.errors import UserError


def test_one_dtype_table_takes_every_spelling_of_every_stage():
    for short, long, dtype in (
        ("bf16", "bfloat16", torch.bfloat16),
        ("fp16", "float16", torch.float16),
        ("fp32", "float32", torch.float32),
    ):
        assert hf.torch_dtype(short) is hf.torch_dtype(long) is dtype
        assert hf.dtype_name(short) == hf.dtype_name(long) == hf.dtype_name(dtype) == long
    with pytest.raises(UserError, match="dtype 'f32' is not one of bf16, bfloat16"):
        hf.torch_dtype("f32")


def test_a_directory_without_config_json_is_one_sentence_naming_the_field(tmp_path):
    with pytest.raises(
        UserError, match=f"^run.target '{tmp_path}' has no config.json; point it at"
    ):
        hf.check_model_dir(tmp_path, "run.target")
    with pytest.raises(UserError, match="^target.path '' has no config.json"):
        hf.load_tokenizer("")
    for read in (hf.read_config_json, hf.load_text_config, hf.load_tokenizer, hf.generation_config):
        with pytest.raises(UserError, match="has no config.json"):
            read(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        hf.read_config_json(tmp_path)


def test_config_tokenizer_and_model_of_the_tiny_target(tiny_target):
    config = hf.read_config_json(tiny_target)
    text = hf.load_text_config(tiny_target)
    assert config["num_hidden_layers"] == text.num_hidden_layers == 8
    tokenizer = hf.load_tokenizer(tiny_target)
    assert tokenizer.eos_token == "<|im_end|>"
    model = hf.load_causal_lm(tiny_target, dtype="fp32", device=torch.device("cpu"))
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert model.get_output_embeddings() is not None  # with its LM head


def test_a_directory_without_a_tokenizer_or_weights_is_one_sentence(tiny_target, tmp_path):
    shutil.copy(tiny_target / "config.json", tmp_path / "config.json")
    (tmp_path / "tokenizer.json").write_text("{cut")
    with pytest.raises(UserError, match="has no usable tokenizer"):
        hf.load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="could not be loaded"):
        hf.load_causal_lm(tmp_path, dtype="fp32", device=torch.device("cpu"))


def _copy_target(tiny_target, dest, eos):
    """The tiny target without generation_config.json, its config.json's eos_token_id `eos`."""
    shutil.copytree(tiny_target, dest)
    (dest / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    return dest


def test_stop_ids_are_the_generation_configs_and_the_tokenizers(tiny_target, tmp_path):
    tokenizer = hf.load_tokenizer(tiny_target)
    assert hf.stop_token_ids({"eos_token_id": [5, 6]}, tokenizer) == {5, 6, tokenizer.eos_token_id}
    assert hf.stop_token_ids({"eos_token_id": 5}, tokenizer) == {5, tokenizer.eos_token_id}
    assert hf.stop_token_ids({}, tokenizer) == {tokenizer.eos_token_id}
    # without generation_config.json, config.json's eos counts, as in the generation config
    # transformers gives the loaded model: the file's reader and the loaded model agree
    target = _copy_target(tiny_target, tmp_path / "t", eos=7)
    assert hf.generation_config(target) == {"eos_token_id": 7}
    model = hf.load_causal_lm(target, dtype="fp32", device=torch.device("cpu"))
    from_file = hf.stop_token_ids(hf.generation_config(target), tokenizer)
    assert (
        from_file
        == hf.stop_token_ids(model.generation_config, tokenizer)
        == {7, tokenizer.eos_token_id}
    )
    (target / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [8, 9], "do_sample": True})
    )
    assert hf.generation_config(target) == {"eos_token_id": [8, 9], "do_sample": True}
    (target / "generation_config.json").write_text("{")
    with pytest.raises(UserError, match="generation_config.json is not valid JSON"):
        hf.generation_config(target)
