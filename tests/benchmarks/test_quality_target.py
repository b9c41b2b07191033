"""benchmarks/quality/target.py: the tiny mode builds a loadable target end to end, and a rerun is
cached."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/quality/target.py"
# The tiny mode of the script's docstring, smaller still: only the plumbing is judged here.
TINY = [
    "--device",
    "cpu",
    "--corpus-mb",
    "1",
    "--bpe-train-mb",
    "1",
    "--vocab-size",
    "1024",
    "--hidden",
    "64",
    "--heads",
    "1",
    "--kv-heads",
    "1",
    "--intermediate",
    "128",
    "--seq-len",
    "64",
    "--batch",
    "4",
    "--steps",
    "6",
    "--warmup-steps",
    "2",
    "--eval-rows",
    "8",
    "--heldout-frac",
    "0.1",
    "--train-prompts",
    "30",
    "--heldout-prompts",
    "10",
    "--report-prompts",
    "4",
    "--max-new-tokens",
    "24",
    "--loop-window",
    "16",
]


def _load_script():
    if (
        "quality_target" not in sys.modules
    ):  # dataclasses look their module up while the class is built
        spec = importlib.util.spec_from_file_location("quality_target", SCRIPT)
        sys.modules["quality_target"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["quality_target"])
    return sys.modules["quality_target"]


def _run(out: Path) -> subprocess.CompletedProcess:
    # one thread: two processes' OpenMP pools fighting over 2 shared cores make steps 10x slower
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *TINY],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "target"
    return out, _run(out)


@pytest.mark.slow  # the module's tiny build: ~30-40 s on 2 cores
def test_saved_target_loads_and_answers(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
    }
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|mask|>": 3}
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.config.head_dim == 64 and model.config.tie_word_embeddings
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 10000.0 and config["max_position_embeddings"] == 4096
    assert model.generation_config.eos_token_id == 2 and model.generation_config.do_sample is False
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "def f(x):"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    answer = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert answer.shape[1] > prompt["input_ids"].shape[1]


@pytest.mark.slow  # the module's tiny build: ~30-40 s on 2 cores
def test_chat_template_matches_the_training_render(built):
    from transformers import AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(out)
    messages = [
        {"role": "user", "content": "Complete the function:\ndef f(x):"},
        {"role": "assistant", "content": "    return x + 1"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == _load_script().render_chat(messages[0]["content"], messages[1]["content"])
    assert text == (
        "<|im_start|>user\nComplete the function:\ndef f(x):<|im_end|>\n"
        "<|im_start|>assistant\n    return x + 1<|im_end|>\n"
    )
    enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(marked) == "    return x + 1<|im_end|>"


@pytest.mark.slow  # the module's tiny build: ~30-40 s on 2 cores
def test_mask_token_unused_and_outputs_written(built):
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["corpus"]["mask_tokens_in_training_data"] == 0
    assert manifest["token_ids"]["<|mask|>"] == 3 and manifest["parameters"] > 0
    report = json.loads((out / "report.json").read_text())
    assert report["answers"] == 4 and 0 <= report["loop_frac"] <= 1 and report["heldout_loss"] > 0
    for split, count in (("train", 30), ("heldout", 10)):
        lines = (out / "prompts" / f"{split}.jsonl").read_text().splitlines()
        assert len(lines) == count
        assert all(json.loads(line)["messages"][0]["role"] == "user" for line in lines)
        assert all("<|mask|>" not in line for line in lines)
    files = [json.loads(line) for line in (out / "corpus_files.jsonl").read_text().splitlines()]
    assert {f["split"] for f in files} == {"train", "heldout"}
    assert not out.with_name(out.name + ".partial").exists()


@pytest.mark.slow  # the module's tiny build: ~30-40 s on 2 cores
def test_second_run_is_cached(built):
    out, _ = built
    before = (out / "manifest.json").stat().st_mtime_ns
    again = _run(out)
    assert "skipping" in again.stdout
    assert (out / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.slow  # the module's tiny build: ~30-40 s on 2 cores
def test_other_settings_are_refused_without_force(built):
    out, _ = built
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *TINY, "--seed", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--force" in done.stderr


def test_loop_and_function_helpers():
    target = _load_script()
    assert target.ends_in_loop([5, 6, 7] * 30, window=64, max_period=8)
    assert not target.ends_in_loop(list(range(100)), window=64, max_period=8)
    assert not target.ends_in_loop([1] * 10, window=64, max_period=8)  # too short to judge
    source = (
        "import os\n\n\ndef f(a,\n      b):\n    '''Doc.'''\n    return a + b\n\n\n"
        "def g(): return 1\n"
    )
    spans = target.function_spans(source)
    assert spans == [(3, 5, 7)]  # g's body shares its line: not a prompt/answer split
    cfg = target.TargetConfig(out="x", context_chars=40)
    user, answer = target.chat_pair(source.split("\n"), spans[0], cfg)
    assert user == "Complete the function:\nimport os\n\n\ndef f(a,\n      b):"
    assert answer == "    '''Doc.'''\n    return a + b"
