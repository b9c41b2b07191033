"""Fingerprints of target, tokenizer, chat template and dataset: stable, and sensitive to
content."""

from __future__ import annotations

import shutil

from transformers import AutoTokenizer

from dflash_common.fingerprint import (
    chat_template_sha256,
    dataset_fingerprint,
    target_fingerprint,
    tokenizer_fingerprint,
)
from dflash_common.tiny import TinySpec, build_tiny_target


def test_target_fingerprint_of_the_tiny_target(tiny_target, tmp_path):
    fp = target_fingerprint(tiny_target, name="tiny")
    assert (fp["name"], fp["num_layers"], fp["hidden_size"], fp["vocab_size"]) == (
        "tiny",
        8,
        64,
        320,
    )
    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny_target, copy)
    assert target_fingerprint(copy, name="tiny") == fp  # content, not location
    # same architecture and config, other weights (another seed): only the weights hash changes
    other = build_tiny_target(tmp_path / "other", TinySpec(seed=5))
    fp2 = target_fingerprint(other, name="tiny")
    assert fp2["weights_sha256"] != fp["weights_sha256"]
    assert {k: v for k, v in fp2.items() if k != "weights_sha256" and k != "config_sha256"} == {
        k: v for k, v in fp.items() if k != "weights_sha256" and k != "config_sha256"
    }


def test_tokenizer_and_template_fingerprints(tiny_target, tiny_target_2layer):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    fp = tokenizer_fingerprint(tok)
    assert fp == tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_target))
    assert fp["vocab_size"] == len(tok)
    tok.add_tokens(["<|extra|>"], special_tokens=True)
    assert tokenizer_fingerprint(tok)["sha256"] != fp["sha256"]
    # the 2-layer target's template lacks generation markers: another template hash
    tok2 = AutoTokenizer.from_pretrained(tiny_target_2layer)
    assert chat_template_sha256(tok) != chat_template_sha256(tok2)
    assert chat_template_sha256(tok) == chat_template_sha256(tok.chat_template)
    assert chat_template_sha256(None) is None


def test_dataset_fingerprint_follows_content(tmp_path):
    a = tmp_path / "a" / "data.jsonl"
    a.parent.mkdir()
    a.write_text('{"text": "hi"}\n')
    b = tmp_path / "b" / "data.jsonl"
    b.parent.mkdir()
    b.write_text('{"text": "hi"}\n')
    assert dataset_fingerprint([a]) == dataset_fingerprint([b])
    b.write_text('{"text": "ho"}\n')
    assert dataset_fingerprint([a])["sha256"] != dataset_fingerprint([b])["sha256"]
    d = dataset_fingerprint([tmp_path / "a"], extra={"split": "train"})
    assert [f["name"] for f in d["files"]] == ["a/data.jsonl"] and d["extra"] == {"split": "train"}
