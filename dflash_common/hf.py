"""A model directory as Hugging Face lays it out, read the same way by every stage: config.json, the
tokenizer, generation_config.json (sampling defaults, stop tokens), the weights as a causal LM; and
the names of dtypes users write in configs.

Each reader checks the directory first and refuses a bad one in one sentence naming the config field
it came from (`field`: "target.path", "run.target"; "target" where none names it), never with a
traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_common.errors import UserError

# Every spelling a config may use today: the short names of precompute, generate and export
# (bf16), the torch names of dflash-eval and config.json's `torch_dtype` (bfloat16).
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name (any spelling of DTYPES)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UserError(f"dtype {name!r} is not one of {', '.join(DTYPES)}.") from None


def dtype_name(dtype: str | torch.dtype) -> str:
    """The torch name of a dtype ('bfloat16'), as config.json's `torch_dtype` and vLLM spell it."""
    return str(torch_dtype(dtype) if isinstance(dtype, str) else dtype).removeprefix("torch.")


def text_fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields of a config.json dict: a composite checkpoint (a vision-language
    model) nests them under `text_config`."""
    return config.get("text_config") or config


def check_model_dir(path: str | Path | None, field: str = "target.path") -> Path:
    """`path` as a Path when it is a model directory (it holds config.json); else one sentence."""
    if not path or not (Path(path) / "config.json").is_file():
        raise UserError(
            f"{field} {str(path or '')!r} has no config.json; point it at a local "
            "checkpoint directory (the demo's tiny target is built with "
            f"`python -m dflash_common.tiny {path or 'DIR'}`)."
        )
    return Path(path)


def read_config_json(path: str | Path | None, field: str = "target.path") -> dict[str, Any]:
    """config.json of the model directory at `path`, as a dict."""
    file = check_model_dir(path, field) / "config.json"
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise UserError(f"{field}: {file} is not valid JSON ({e}); fix or replace it.") from e


def load_text_config(path: str | Path, field: str = "target.path") -> Any:
    """The (text) config of the model at `path` through transformers, without loading weights: a
    composite checkpoint (a vision-language model whose text tower is the target) gives its text
    model's."""
    from transformers import AutoConfig

    check_model_dir(path, field)
    try:
        return AutoConfig.from_pretrained(path).get_text_config()
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{field} {path}: transformers cannot read its config.json ({e}).") from e


def load_tokenizer(path: str | Path, field: str = "target.path") -> Any:
    """The tokenizer of the model directory at `path`."""
    from transformers import AutoTokenizer

    check_model_dir(path, field)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{field} {path} has no usable tokenizer ({e}); the directory needs its "
            "tokenizer files."
        ) from e


def generation_config(path: str | Path, field: str = "target.path") -> dict[str, Any]:
    """generation_config.json of the model directory at `path`, as a dict. Without the file, its
    eos_token_id is config.json's, as transformers derives a loaded model's generation config."""
    file = check_model_dir(path, field) / "generation_config.json"
    if not file.is_file():
        config = read_config_json(path, field)
        eos = config.get("eos_token_id", text_fields(config).get("eos_token_id"))
        return {} if eos is None else {"eos_token_id": eos}
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise UserError(f"{file} is not valid JSON ({e}); fix or remove it.") from e


def stop_token_ids(generation: Mapping[str, Any] | Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a turn: the generation config's eos_token_id (an id or a list; `generation`
    is `generation_config(path)` or a loaded model's `generation_config`) and the tokenizer's eos (a
    chat model's end of turn, Qwen3's <|im_end|>)."""
    eos = (
        generation.get("eos_token_id")
        if isinstance(generation, Mapping)
        else getattr(generation, "eos_token_id", None)
    )
    ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str,
    device: torch.device,
    attn_implementation: str | None = None,
    field: str = "target.path",
) -> Any:
    """The model at `path` with its LM head (transformers AutoModelForCausalLM), in eval mode on
    `device`; `attn_implementation` None is transformers' choice."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(dtype), attn_implementation=attn_implementation
        )
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"{field} {path} could not be loaded ({e}).") from e
    return model.to(device).eval()
