"""Checks of chat messages before templating: each problem is a ValueError naming the message and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, Mapping):
        return f"is a {type(message).__name__}, not a dict with 'role' and 'content'"
    role = message.get("role")
    if not isinstance(role, str) or not role:
        return "has no 'role' (give one of system, user, assistant, tool)"
    content = message.get("content")
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, (list, tuple)):
        return (f"has content of type {type(content).__name__}; content must be a string or a list of typed parts "
                "such as {'type': 'text', 'text': ...} or {'type': 'image', 'image': ...}")
    for index, part in enumerate(content):
        if isinstance(part, str):
            continue
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            return (f"has content part {index} ({type(part).__name__}) without a 'type'; give typed parts such as "
                    "{'type': 'text', 'text': ...}")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return f"has text part {index} whose 'text' is not a string"
    return None


def validate_conversations(conversations: list, batched: bool) -> None:
    """Raise ValueError for the first malformed message of normalized conversations (a list of message lists)."""
    for batch_index, messages in enumerate(conversations):
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"Chat conversation {batch_index} must be a non-empty list of messages.")
        for index, message in enumerate(messages):
            problem = _message_problem(message)
            if problem is not None:
                where = f"conversation {batch_index}, message {index}" if batched else f"message {index}"
                raise ValueError(f"Chat {where} {problem}.")
