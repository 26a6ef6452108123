"""Conversations, one set of rules for every stage: which messages a prompt row sends, which a training row holds,
and how a chat template turns them into token ids with the assistant answer located.

* `request_messages(row)`: what the data generator sends for a prompt row (`conversations` or `messages`, roles
  `role/content` or ShareGPT's `from/value`); assistant turns and empty turns dropped; a user turn required.
* `training_messages(row)`: a generated row as the trainers read it: role/content messages ending with the
  assistant's answer.
* `prompt_messages(row)`: a training row without its final assistant turn (what the model was asked).
* `render_prompt(tokenizer, messages)`: the prompt's token ids with the generation prompt, as generation starts.
* `render_with_answer(tokenizer, messages)`: (ids, prompt_len) of a whole conversation. The prompt and the answer
  are tokenised separately, so the answer starts exactly where generation would, even when a token could span the
  boundary; a template that renders the prompt differently inside the conversation is an error.
"""
from __future__ import annotations

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "assistant": "assistant"}


class ConversationError(ValueError):
    """A row's conversation cannot be used; the message names the row."""


def _turns(row: dict, where: str) -> list:
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ConversationError(f"{where}: the row has no 'conversations' (or 'messages') list")
    return turns


def request_messages(row: dict, where: str) -> list[dict]:
    """The messages to send for one prompt row (docs/recipe.md §1.5 step 2)."""
    messages = []
    for turn in _turns(row, where):
        if not isinstance(turn, dict):
            raise ConversationError(f"{where}: a conversation turn is not an object: {turn!r}")
        role = ROLE_ALIASES.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None:
            raise ConversationError(f"{where}: unknown role in turn {turn!r}")
        if role == "assistant" or not isinstance(content, str) or not content.strip():
            continue
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise ConversationError(f"{where}: prompt has no non-empty user turn")
    return messages


def training_messages(row: dict, where: str = "") -> list[dict]:
    """A training row's messages (role in ROLES, string content), the last one the assistant's answer."""
    messages = []
    for msg in _turns(row, where):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
            raise ConversationError(f"{where}: every message needs a role in {list(ROLES)} and string content")
        messages.append({"role": msg["role"], "content": msg["content"]})
    if messages[-1]["role"] != "assistant":
        raise ConversationError(f"{where}: the last message must be the assistant's answer")
    return messages


def prompt_messages(row: dict, where: str = "") -> list[dict]:
    """A training row without its final assistant turn: what the model was asked."""
    return training_messages(row, where)[:-1]


def _template_kwargs(thinking: str) -> dict:
    return {} if thinking == "auto" else {"enable_thinking": thinking == "on"}


def render_prompt(tokenizer, messages: list[dict], thinking: str = "auto") -> list[int]:
    """Token ids of the chat-template rendering with the generation prompt (string first, then tokenised
    without special tokens, as the reference does); `thinking` on/off sets the template's enable_thinking."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **_template_kwargs(thinking))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_with_answer(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """Token ids of a whole conversation (ending with the assistant's answer) and where the answer starts."""
    return encode_prompt_and_answer(tokenizer, [prompt_and_answer_text(tokenizer, messages)])[0]


def prompt_and_answer_text(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """The chat-template rendering of a conversation split where the assistant's answer starts: (the prompt with
    its generation prompt, the answer with the template's end of turn)."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ConversationError("a training conversation must end with an assistant turn")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    if not text.startswith(prompt):
        at = next((i for i, (a, b) in enumerate(zip(text, prompt)) if a != b), min(len(text), len(prompt)))
        raise ConversationError(
            f"the chat template renders the prompt (with its generation prompt) differently inside the full "
            f"conversation (first difference at character {at}: prompt {prompt[at:at + 40]!r} vs conversation "
            f"{text[at:at + 40]!r}), so the assistant answer cannot be located; use a template "
            f"whose generation prompt is a prefix of the rendered conversation")
    return prompt, text[len(prompt):]


def encode_prompt_and_answer(tokenizer, parts: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(token ids, answer start) of conversations split by `prompt_and_answer_text`. Prompt and answer are
    tokenised apart, so no token straddles the boundary; all prompts go to the tokenizer in one call and all
    answers in another, which a fast tokenizer encodes in parallel (what a data set of 10^4-10^5 rows needs)."""
    if not parts:
        return []
    prompts = tokenizer([prompt for prompt, _ in parts], add_special_tokens=False)["input_ids"]
    answers = tokenizer([answer for _, answer in parts], add_special_tokens=False)["input_ids"]
    return [(prompt + answer, len(prompt)) for prompt, answer in zip(prompts, answers)]
