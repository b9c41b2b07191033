"""dflash_common.conversations: one reader of messages and ShareGPT records for every stage."""

from __future__ import annotations

import json

import pytest

from dflash_common.conversations import (
    MESSAGE_ROLES,
    SHAREGPT_ROLES,
    BadRecord,
    conversation_format,
    conversation_messages,
)
from dflash_common.errors import SkippedRecord


def _reason(obj, **kw) -> str:
    with pytest.raises(BadRecord) as e:
        conversation_messages(obj, **kw)
    return e.value.reason


def test_sharegpt_roles_are_the_union_of_every_stage():
    # precompute's map had system/human/user/gpt/assistant/chatgpt, eval's the same six; the message
    # roles stand for themselves too (tool and developer turns of ShareGPT-style exports)
    assert SHAREGPT_ROLES == {
        "system": "system",
        "developer": "developer",
        "user": "user",
        "assistant": "assistant",
        "tool": "tool",
        "human": "user",
        "gpt": "assistant",
        "chatgpt": "assistant",
    }
    assert set(SHAREGPT_ROLES.values()) == set(MESSAGE_ROLES)
    turns = [
        {"from": f, "value": f}
        for f in ("system", "human", "gpt", "user", "chatgpt", "assistant", "tool")
    ]
    got = conversation_messages({"conversations": turns})
    assert [m["role"] for m in got] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "assistant",
        "tool",
    ]
    assert [m["content"] for m in got] == [t["value"] for t in turns]


def test_both_layouts_give_the_same_messages():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
    sharegpt = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a", "reasoning_content": "r"},
    ]
    assert conversation_messages({"messages": messages}) == messages
    assert conversation_messages({"conversations": sharegpt}) == messages
    assert conversation_format({"messages": []}) == "messages"
    assert conversation_format({"conversations": []}) == "sharegpt"
    assert conversation_format({"prompt": "x"}) is None


def test_content_parts_tool_calls_and_prompts_without_an_answer():
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
        ]
    }
    assert conversation_messages(parts) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
    ]
    question = {"messages": [{"role": "user", "content": "only a question"}]}
    assert _reason(question) == "no_assistant_turn"
    assert conversation_messages(question, require_assistant=False) == question["messages"]


@pytest.mark.parametrize(
    "obj, fmt, reason",
    [
        ({"text": "x"}, "auto", "missing_field"),
        ({"messages": [{"role": "user", "content": "q"}]}, "sharegpt", "missing_field"),
        ({"messages": "hi"}, "auto", "wrong_field_type"),
        ({"messages": []}, "auto", "empty_conversation"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "auto", "unknown_role"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "auto", "unknown_role"),
        ({"messages": [{"role": "user"}]}, "auto", "missing_field"),
        ({"messages": [{"role": "user", "content": 3}]}, "auto", "wrong_field_type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "auto",
            "wrong_field_type",
        ),
        ({"messages": ["hi"]}, "auto", "wrong_field_type"),
        (
            json.loads('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
            "auto",
            "invalid_utf8",
        ),
    ],
)
def test_what_cannot_be_messages_is_one_reason(obj, fmt, reason):
    assert _reason(obj, fmt=fmt, require_assistant=False) == reason


def test_a_bad_record_is_a_skipped_record_with_its_reason_and_detail():
    with pytest.raises(SkippedRecord) as e:
        conversation_messages({"conversations": [{"from": "bot", "value": "x"}]})
    assert (e.value.reason, str(e.value)) == (
        "unknown_role",
        "unknown_role: turn 0 has role 'bot' (known: system, developer, user, assistant, tool, "
        "human, gpt, chatgpt)",
    )
