"""Chat templating and the loss mask: the target tokenizer's own chat template makes the tokens, and
the loss mask marks the tokens the assistant generated (its turns, up to and including its
end-of-turn token).

Two ways to find the assistant tokens, which give the same mask where both apply (tests check it):

1. Templates with `{% generation %}` markers: transformers' assistant-token mask
   (`apply_chat_template(..., return_assistant_tokens_mask=True)`).
2. Templates without them (Qwen3, Llama 3 ...), by rendering prefixes of the conversation. For
   assistant turn i, with F = render(all turns):
     start = len(render(turns[:i], add_generation_prompt=True))   (F must start with that text)
     end   = len(render(turns[:i+1]))                             where F starts with that text,
             trimmed to just after the end-of-turn token (the tokenizer's eos) when only whitespace
             follows it (the newline after `<|im_end|>` is template, not generation);
             otherwise (the template renders a last turn differently from an earlier one, as Qwen3
             does with its empty <think></think> block) just after the first end-of-turn token
             after `start`.
   A conversation that opens with an assistant turn has no prompt to render and is refused
   (`assistant_turn_first`) on this path. A token is masked when its characters overlap an assistant
   span, exactly as transformers does for marked templates. If the generation prompt of turn i is
   not a prefix of F, the template rewrites history (e.g. a template that strips earlier turns
   differently than at generation time); the position of the turn is then unknown and the
   conversation is refused with reason `template_rewrites_history` instead of getting a guessed
   mask.

Template options (`enable_thinking` and the like) pass through as `template_kwargs`, and a record's
tool specs (`tools`) to every render, as dflash-generate renders its prompts.

An answer dflash-generate wrote keeps the token ids the target emitted (`answer_ids`), and
`tokenize_as_generated` builds the sequence from them: the prompt's tokens as the target was fed
them, then those ids. Re-tokenising the answer's text instead would not give them back wherever the
target spelt a word in other tokens than the tokenizer's own (or emitted bytes that are no UTF-8
alone, which decode to U+FFFD): the drafter would learn tokens the target does not emit. For the
same reason an earlier answer whose ids dflash-generate kept (`earlier_answer_ids`) stays in the
loss only where the prompt holds it as those ids: a template that renders it otherwise in later
turns (without its thinking) leaves it as context only.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from dflash_common.errors import SkippedRecord, UserError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatMaskError(SkippedRecord):
    """A conversation the template cannot turn into tokens + mask; `reason` is the counted
    category."""


def assistant_message(text: str) -> dict[str, Any]:
    """A generated answer as a message; a thinking block goes to `reasoning_content`, as reasoning
    chat templates (Qwen3) expect assistant turns."""
    if THINK_CLOSE not in text:
        return {"role": "assistant", "content": text}
    reasoning, content = text.split(THINK_CLOSE, 1)
    reasoning = reasoning.split(THINK_OPEN, 1)[1] if THINK_OPEN in reasoning else reasoning
    return {"role": "assistant", "content": content.strip(), "reasoning_content": reasoning.strip()}


def answer_text(tokenizer: Any, ids: list[int]) -> str:
    """The text of answer tokens, special tokens kept (what dflash-generate writes)."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def render_messages(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = False,
    tools: list[Any] | None = None,
) -> str:
    """The chat template's text of `messages` (and the record's `tools`), with its options; a
    template error raises ChatMaskError('template_error')."""
    return run_template(
        lambda: tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}),
            **(template_kwargs or {}),
        )
    )


def prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[Any] | None = None,
) -> list[int]:
    """Token ids of a prompt that asks for the next assistant turn: the template rendered with its
    generation prompt, then tokenized as text (generation, evaluation and the prompts of generated
    answers in a store, all alike)."""
    text = render_messages(tokenizer, messages, template_kwargs, True, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


class ChatTemplate:
    """The target tokenizer's chat template with fixed options: conversation -> (input_ids,
    loss_mask)."""

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any] | None = None,
        use_markers: bool | None = None,
    ):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.use_markers = has_generation_markers(tokenizer) if use_markers is None else use_markers
        # <|im_end|> for Qwen, <|eot_id|> for Llama 3 Instruct
        self.end_of_turn = tokenizer.eos_token
        if not self.use_markers and not getattr(tokenizer, "is_fast", False):
            raise UserError(
                "the target's chat template has no {% generation %} markers and its tokenizer "
                "is not a fast tokenizer, so assistant tokens cannot be located; provide "
                "tokenizer.json or a template with generation markers."
            )

    @classmethod
    def from_pretrained(
        cls, path: str, template_kwargs: dict[str, Any] | None = None
    ) -> "ChatTemplate":
        from dflash_common.hf import load_tokenizer

        return cls(load_tokenizer(path), template_kwargs)

    def tokenize(
        self,
        messages: list[dict[str, Any]],
        last_turn_cut: bool = False,
        tools: list[Any] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """-> input_ids int32 [T], loss_mask uint8 [T] (1 on assistant tokens).

        `last_turn_cut`: the last assistant turn was cut by a length limit (dflash-generate's
        finish_reason "length"), so the end-of-turn token(s) the template appends to it were never
        generated; they get no loss, or the drafter would learn to end turns where the target did
        not. `tools`: the record's tool specs, passed to the template."""
        if self.use_markers:
            ids, mask = self._tokenize_marked(messages, tools)
        else:
            ids, mask = self._tokenize_by_rendering(messages, tools)
        if last_turn_cut:
            unmask_end_of_turn(ids, mask, set(getattr(self.tokenizer, "all_special_ids", [])))
        return ids, mask

    def tokenize_as_generated(
        self,
        messages: list[dict[str, Any]],
        answer_ids: list[int],
        stopped: bool,
        tools: list[Any] | None = None,
        earlier_ids: list[list[int]] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
        """-> (input_ids, loss_mask, the earlier answers masked: their message indices) of a
        conversation whose last assistant turn is `answer_ids`, the tokens the target emitted (its
        stop token last when `stopped`):
        the prompt that asked for that turn, tokenized as dflash-generate fed it to the target, then
        `answer_ids`, all in the loss (the stop token too: the drafter learns to end the turn where
        the target did). Earlier assistant turns are masked by their characters, as `tokenize`
        does; with `earlier_ids`, the tokens the target emitted for each of them, a turn whose
        tokens in that prompt are not those (a reasoning template drops the thinking of earlier
        turns; a re-tokenisation of its text differs) is taken out of the loss instead and listed:
        its tokens stay in the sequence, as the context the target saw, but are not the target's
        output there (`turn_as_generated` makes it a sequence of its own). None when the ids do not
        spell the last turn (the text was edited, or the store's tokenizer is not the one that
        generated): the caller tokenizes the text."""
        if not messages or messages[-1]["role"] != "assistant" or not answer_ids:
            return None
        said = answer_ids[:-1] if stopped else answer_ids
        if assistant_message(answer_text(self.tokenizer, list(said))) != messages[-1]:
            return None
        history = messages[:-1]
        earlier = [i for i, m in enumerate(history) if m["role"] == "assistant"]
        masked: list[int] = []
        if not earlier:  # the answer alone after its prompt
            return (*self.turn_as_generated(messages, len(history), answer_ids, tools), masked)
        if not getattr(self.tokenizer, "is_fast", False):
            return None  # no offsets to place the earlier answers by
        # the prompt's tokens (as `prompt_ids` makes them), its earlier answers by character
        text = self.render(history, add_generation_prompt=True, tools=tools)
        spans = [self._assistant_span(history, i, text, tools) for i in earlier]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        prompt, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        mask = mask_from_spans(offsets, spans)
        if earlier_ids is not None and len(earlier_ids) == len(spans):  # else edited: text
            for i, span, emitted in zip(earlier, spans, earlier_ids):
                at = np.flatnonzero(mask_from_spans(offsets, [span]))
                if [prompt[t] for t in at] != list(emitted):
                    mask[at] = 0
                    masked.append(i)
        ids = np.asarray(prompt + list(answer_ids), np.int32)
        return ids, np.concatenate([mask, np.ones(len(answer_ids), np.uint8)]), masked

    def turn_as_generated(
        self,
        messages: list[dict[str, Any]],
        i: int,
        emitted: list[int],
        tools: list[Any] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """-> (input_ids, loss_mask) of assistant turn `i` alone, as the target answered it: the
        prompt it was fed (the messages before it, rendered as dflash-generate rendered them), then
        `emitted`, its tokens, all in the loss."""
        prompt = self.prompt_ids(messages[:i], tools)
        ids = np.asarray(prompt + list(emitted), np.int32)
        return ids, np.concatenate(
            [np.zeros(len(prompt), np.uint8), np.ones(len(emitted), np.uint8)]
        )

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> list[int]:
        """Token ids of a prompt that asks for the next assistant turn (for generation and
        evaluation): the module's `prompt_ids` with this template's options."""
        return prompt_ids(self.tokenizer, messages, self.template_kwargs, tools)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[Any] | None = None,
    ) -> str:
        return render_messages(
            self.tokenizer, messages, self.template_kwargs, add_generation_prompt, tools
        )

    def _tokenize_marked(
        self, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        out = run_template(
            lambda: self.tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **({"tools": tools} if tools else {}),
                **self.template_kwargs,
            )
        )
        return np.asarray(out["input_ids"], np.int32), np.asarray(out["assistant_masks"], np.uint8)

    def _tokenize_by_rendering(
        self, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        full = self.render(messages, tools=tools)
        spans = [
            self._assistant_span(messages, i, full, tools)
            for i, m in enumerate(messages)
            if m["role"] == "assistant"
        ]
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        ids = np.asarray(enc["input_ids"], np.int32)
        return ids, mask_from_spans(offsets, spans)

    def _assistant_span(
        self, messages: list[dict[str, Any]], i: int, full: str, tools: list[Any] | None = None
    ) -> tuple[int, int]:
        # no history to render a generation prompt from (transformers refuses empty chats)
        if i == 0:
            raise ChatMaskError(
                "assistant_turn_first",
                "the conversation opens with an assistant turn; without generation "
                "markers in the template its prompt cannot be told from its text",
            )
        prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
        if not full.startswith(prompt):
            raise ChatMaskError(
                "template_rewrites_history",
                f"the template renders the history before assistant turn {i} differently "
                "once later turns follow",
            )
        start = len(prompt)
        turn = self.render(messages[: i + 1], tools=tools)
        if full.startswith(turn) and len(turn) > start:
            return start, self._trim_after_end_of_turn(full, start, len(turn))
        end = full.find(self.end_of_turn, start) if self.end_of_turn else -1
        if end < 0:
            raise ChatMaskError(
                "template_rewrites_history",
                f"assistant turn {i} renders differently as the last turn and has no "
                f"end-of-turn token {self.end_of_turn!r} to find its end",
            )
        return start, end + len(self.end_of_turn)

    def _trim_after_end_of_turn(self, full: str, start: int, end: int) -> int:
        eot = self.end_of_turn
        at = full.rfind(eot, start, end) if eot else -1
        if at >= 0 and not full[at + len(eot) : end].strip():
            return at + len(eot)
        return end


def unmask_end_of_turn(ids: np.ndarray, mask: np.ndarray, special_ids: set[int]) -> None:
    """Zero, in place, the mask of the special tokens (the end of turn) closing the last assistant
    span."""
    at = int(np.flatnonzero(mask)[-1]) if mask.any() else -1
    while at >= 0 and mask[at] and int(ids[at]) in special_ids:
        mask[at] = 0
        at -= 1


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [T]: 1 where token t's character range [a, b) overlaps a span; spans sorted, disjoint.

    The same rule as transformers' assistant mask for marked templates, so both paths agree."""
    mask = np.zeros(len(offsets), np.uint8)
    k = 0
    for t, (a, b) in enumerate(offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if b > spans[k][0]:
            mask[t] = 1
    return mask


def run_template(render: Callable[[], Any]) -> Any:
    """Run `render`, a call of the chat template (this module's, or a stage's own, such as
    dflash-generate's prompts); any error it raises (jinja's raise_exception, a missing variable, a
    role the template does not know) is a property of the conversation, reported as
    `template_error`."""
    try:
        return render()
    except ChatMaskError:
        raise
    except Exception as e:  # noqa: BLE001 - user templates raise anything
        raise ChatMaskError("template_error", f"{type(e).__name__}: {e}") from None
