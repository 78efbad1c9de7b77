"""The chat endpoint's conversation on the wire: its messages (text content parts, the tool calls of earlier
turns) and the tools a request offers or names in ``tool_choice``.

Apart from protocol.py, which holds the request bodies themselves, because these models describe what a
conversation and a tool look like (what the chat template renders, and the schemas tool calling makes a
grammar of), not how a request samples; /tokenize's chat form takes the same messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from pagedrs.sampling_params import MAX_SCHEMA_DEPTH, json_depth
from pagedrs.server.field_policy import check_role, not_supported
from pagedrs.server.wire_types import Text, _Strict

# Reasons for the fields OpenAI defines that pagedrs does not implement yet (ChatCompletionRequest's too).
_TOOLS = "the legacy functions API is not implemented: use tools and tool_choice"
_AUDIO = "pagedrs generates text only"


MAX_TOOLS = 128  # functions per request: each one's schema is part of the grammar


def _schema_depth(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema is rendered by the chat template (which recurses: a deep one overflows the
    stack) and may become a grammar: bounded as structured outputs' schemas are, before either."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise PydanticCustomError(
            "schema_too_deep", "the schema nests objects and arrays more than {limit} levels deep; allowed at most "
            "{limit}", {"limit": MAX_SCHEMA_DEPTH},
        )
    return schema


class ToolFunction(_Strict):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_schema_depth)] | None = None  # a JSON schema; None: any object
    strict: StrictBool | None = None  # the call always follows the schema: true and false alike


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatContentPart(_Strict):
    """A text part; other kinds (image_url, input_audio, file, refusal) are refused by their type."""

    type: Literal["text"]
    text: Text
    prompt_cache_breakpoint: Annotated[Any, not_supported("explicit prompt cache breakpoints")] = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError(
                "not_supported", "a content part of type {kind} is not supported: only 'text' parts are",
                {"kind": repr(kind)},
            )
        return data


class CalledFunction(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it back


class HistoryToolCall(_Strict):
    """A call an earlier assistant turn made (as this server answered it)."""

    id: Text
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Annotated[Text, AfterValidator(check_role)]
    content: Text | list[ChatContentPart] | None = None
    name: Annotated[Any, not_supported("message names: the chat template is given role and content only")] = None
    tool_calls: Annotated[list[HistoryToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call they answer
    function_call: Annotated[Any, not_supported(_TOOLS)] = None
    refusal: Annotated[Any, not_supported("refusals of earlier turns are not rendered")] = None
    audio: Annotated[Any, not_supported(_AUDIO)] = None

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self) -> ChatMessage:
        for name, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if getattr(self, name) is not None and self.role != role:
                raise PydanticCustomError("wrong_role", "{name} belongs on {role} messages, not on {actual} ones",
                                          {"name": name, "role": repr(role), "actual": repr(self.role)})
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            # rendered as "", a missing turn would pass for an empty one (OpenAI refuses it too)
            raise PydanticCustomError(
                "missing_content", "a {role} message needs content (a string or a list of text parts); only an "
                "assistant message that has tool_calls may leave it out or send null", {"role": repr(self.role)})
        if self.content == []:  # rendered as "", as null would be: refused for the same reason
            raise PydanticCustomError(
                "empty_content", "a {role} message has content [], an empty list of parts; send at least one text "
                "part, or a string", {"role": repr(self.role)})
        return self
