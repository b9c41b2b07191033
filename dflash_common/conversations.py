"""Conversations as records hold them -> role/content messages, one reader for every stage: the
training inputs of precompute, the prompts generate answers and the prompts eval decodes.

    messages = conversation_messages({"conversations": [{"from": "human", "value": "hi"}, ...]})
    # [{"role": "user", "content": "hi"}, ...]

Two layouts: OpenAI `messages` (`role`/`content`; content may be a list of text parts, joined) and
ShareGPT `conversations` (`from`/`value`, roles mapped by SHAREGPT_ROLES). A message keeps its
`reasoning_content` and `tool_calls` where given (an assistant turn that only calls tools has
content ""). What cannot become messages raises `BadRecord(reason, detail)`; the reasons:

    missing_field, wrong_field_type, unknown_role, empty_conversation, no_assistant_turn,
    invalid_utf8

(precompute counts them per reason and skips the record; eval refuses the line in one sentence).
"""

from __future__ import annotations

import json
from typing import Any

from dflash_common.errors import SkippedRecord

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
# ShareGPT speakers: the names of ShareGPT dumps (human, gpt, chatgpt), and the message roles as
# themselves (tool and developer turns of ShareGPT-style exports).
SHAREGPT_ROLES = {
    **{role: role for role in MESSAGE_ROLES},
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
}
_LAYOUTS = {
    "messages": ("messages", "role", "content", None),
    "sharegpt": ("conversations", "from", "value", SHAREGPT_ROLES),
}


class BadRecord(SkippedRecord):
    """A record that cannot become a conversation (or a training sequence)."""


def conversation_format(obj: dict) -> str | None:
    """'messages' or 'sharegpt' by the key the record holds; None when it holds neither."""
    return "messages" if "messages" in obj else "sharegpt" if "conversations" in obj else None


def conversation_messages(
    obj: dict, fmt: str = "auto", require_assistant: bool = True
) -> list[dict]:
    """The record's conversation as messages; `fmt` 'messages' or 'sharegpt' ('auto': by its key).
    `require_assistant=False` accepts conversations without an assistant turn (prompts to answer).
    """
    fmt = (conversation_format(obj) or "messages") if fmt == "auto" else fmt
    key, role_key, text_key, roles = _LAYOUTS[fmt]
    if key not in obj:
        raise BadRecord("missing_field", f"record has no '{key}'")
    turns = obj[key]
    if not isinstance(turns, list):
        raise BadRecord(
            "wrong_field_type", f"the conversation must be a list, got {type(turns).__name__}"
        )
    if not turns:
        raise BadRecord("empty_conversation", "the conversation has no turns")
    messages = [_message(i, turn, role_key, text_key, roles) for i, turn in enumerate(turns)]
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn", "no assistant turn to learn from")
    return messages


def _message(i: int, turn: Any, role_key: str, text_key: str, roles: dict[str, str] | None) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord(
            "wrong_field_type", f"turn {i} must be an object, got {type(turn).__name__}"
        )
    role = turn.get(role_key)
    if not isinstance(role, str):
        raise BadRecord(
            "wrong_field_type" if role_key in turn else "missing_field",
            f"turn {i} needs a string '{role_key}'",
        )
    mapped = roles.get(role) if roles is not None else (role if role in MESSAGE_ROLES else None)
    if mapped is None:
        known = ", ".join(roles if roles is not None else MESSAGE_ROLES)
        raise BadRecord("unknown_role", f"turn {i} has role {role[:40]!r} (known: {known})")
    message = {"role": mapped, "content": _content(i, turn, text_key)}
    if isinstance(turn.get("reasoning_content"), str):
        message["reasoning_content"] = checked_text(i, turn["reasoning_content"])
    if isinstance(turn.get("tool_calls"), list) and turn["tool_calls"]:
        checked_text(i, json.dumps(turn["tool_calls"], ensure_ascii=False))
        message["tool_calls"] = turn["tool_calls"]
    return message


def _content(i: int, turn: dict, text_key: str) -> str:
    content = turn.get(text_key)
    if content is None and isinstance(turn.get("tool_calls"), list) and turn["tool_calls"]:
        return ""  # an assistant turn that only calls tools
    if isinstance(content, list):  # OpenAI content parts: text parts are joined, others refused
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise BadRecord("wrong_field_type", f"turn {i} has content parts that are not text")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRecord(
            "wrong_field_type" if text_key in turn else "missing_field",
            f"turn {i} needs a string '{text_key}'",
        )
    return checked_text(i, content)


def checked_text(i: int, text: str) -> str:
    """`text` of turn `i`, refused when it holds what no tokenizer can encode."""
    try:  # JSON may carry lone surrogates ("\ud800") that no tokenizer can encode
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecord("invalid_utf8", f"turn {i} holds an unpaired surrogate") from None
    return text
