"""Prompts of `dflash-eval`: JSONL lines (`prompt`, `turns`, `messages` or ShareGPT `conversations`)
made into token ids with the target's chat template, or kept as turns that are answered one by one.

    prompts = load_prompts(cfg.prompts.files, tokenizer, cfg.prompts.chat_template_kwargs, limit)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash_common.conversations import BadRecord, conversation_format, conversation_messages
from dflash_common.errors import UserError


@dataclass(frozen=True)
class Prompt:
    """One thing to decode: `ids` ready, or `turns` (user messages, each answered by the speculative
    output before the next, as the reference benchmark does for MT-Bench)."""

    name: str  # file:line, as the user can find it
    ids: list[int] | None = None
    turns: list[str] | None = None


def _conversation(record: dict, where: str) -> list[dict] | None:
    """A record's conversation as role/content messages (dflash_common/conversations.py, the reader
    of every stage), or None when it is not a conversation."""
    if conversation_format(record) is None:
        return None
    try:
        return conversation_messages(record, require_assistant=False)
    except BadRecord as e:
        raise UserError(f"{where}: {e.detail} ({e.reason}); fix the line.") from None


def _record_to_prompt(record: Any, where: str, tokenizer, template_kwargs: dict) -> Prompt:
    if not isinstance(record, dict):
        raise UserError(
            f"{where}: each line must be a JSON object with 'messages', 'conversations', "
            f"'turns' or 'prompt'."
        )
    if isinstance(record.get("prompt"), str):
        return Prompt(where, ids=tokenizer.encode(record["prompt"]))
    if isinstance(record.get("turns"), list):
        if not record["turns"] or not all(isinstance(t, str) for t in record["turns"]):
            raise UserError(
                f"{where}: 'turns' must be a non-empty list of strings (the user's messages)."
            )
        return Prompt(where, turns=list(record["turns"]))
    messages = _conversation(record, where)
    if messages is None:
        raise UserError(
            f"{where}: found none of 'messages', 'conversations', 'turns' or 'prompt'; "
            f"give each line one of them."
        )
    while messages and messages[-1]["role"] == "assistant":  # the reply is what we generate
        messages.pop()
    if not messages:
        raise UserError(
            f"{where}: the conversation has no message before its reply; drop the line."
        )
    tools = record.get("tools") if isinstance(record.get("tools"), list) else None
    return Prompt(where, ids=render_chat(tokenizer, messages, template_kwargs, where, tools))


def render_chat(
    tokenizer,
    messages: list[dict],
    template_kwargs: dict,
    where: str = "",
    tools: list | None = None,
) -> list[int]:
    """Token ids of `messages` (and the record's `tools`) with the target's chat template and the
    generation prompt, as dflash-generate renders its prompts (dflash_common.chat `prompt_ids`)."""
    from dflash_common.chat import ChatMaskError, prompt_ids

    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the target's tokenizer has no chat template; use {'prompt': ...} lines for raw text."
        )
    try:
        return prompt_ids(tokenizer, messages, template_kwargs, tools)
    except ChatMaskError as e:
        raise UserError(
            f"{where or 'a prompt'}: the chat template refused the conversation ({e}); fix the "
            "line."
        ) from e


def load_prompts(
    files: Sequence[str], tokenizer, template_kwargs: dict, limit: int = 0
) -> list[Prompt]:
    """Prompts from JSONL files, in file order; `limit` > 0 keeps the first `limit`."""
    if not files:
        raise UserError("no prompts: set prompts.files to one or more JSONL files.")
    prompts = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise UserError(f"prompts file {path} does not exist; fix prompts.files.")
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{line_no} is not valid JSON ({e.msg}); fix the line."
                ) from e
            prompts.append(
                _record_to_prompt(record, f"{path}:{line_no}", tokenizer, template_kwargs)
            )
            if 0 < limit <= len(prompts):
                return prompts
    if not prompts:
        raise UserError(f"prompts files {list(files)} hold no prompt; add JSONL lines.")
    return prompts
