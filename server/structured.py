"""What a request's output must match, as a grammar for the engine: `response_format` (a JSON object,
or JSON valid against a schema, strict or not), a forced tool call (`tool_choice` "required" or a named
function: one call whose arguments follow the function's schema), or, with tools on "auto" and a JSON
response format, either of the two."""

from minivllm.engine.sampling_params import StructuredOutput
from server.conversation import Conversation
from server.errors import APIError
from server.harmony import HarmonyFormat
from server.tools import ToolCalling, json_value


def output_grammar(conv: Conversation, calling: ToolCalling | None) -> StructuredOutput | None:
    """The conversation's answer format (JSON valid against a schema, or any JSON object) and tools."""
    json_wanted = conv.output is not None
    schema = conv.output.schema if conv.output else None
    if _forced(conv, calling):
        return StructuredOutput(lark=f"start: call\n{calling.call_grammar()}")
    if not json_wanted:
        return None
    if calling is None:
        return (
            StructuredOutput(json_schema=schema) if schema is not None else StructuredOutput(json_object=True)
        )
    # tools on "auto": the answer is either that JSON or a call
    answer = json_value(schema or {"type": "object"})
    return StructuredOutput(lark=f"start: answer | call\nanswer: {answer}\n{calling.call_grammar()}")


def harmony_grammar(
    conv: Conversation, calling: ToolCalling | None, harmony: HarmonyFormat, thinking_tokens: int | None
) -> StructuredOutput | None:
    """output_grammar for a model that writes Harmony: the reasoning first (thinking_tokens at most; 0:
    none), then the forced call, the JSON answer, or either."""
    bodies = []
    if calling is not None and (_forced(conv, calling) or conv.output is not None):
        bodies += harmony.call_alternatives(calling.grammar_tools())
    if conv.output is not None:
        bodies.append(harmony.answer_alternative(conv.output.schema))
    return StructuredOutput(lark=harmony.output_grammar(bodies, thinking_tokens)) if bodies else None


def _forced(conv: Conversation, calling: ToolCalling | None) -> bool:
    """A forced call; with a JSON response format too: a 400."""
    if calling is None or not calling.forced:
        return False
    if conv.output is not None:
        format_param = conv.name("output")
        raise APIError(
            400, f"{format_param} cannot be combined with a forced tool_choice", param=format_param
        )
    return True
