"""What a request's output must match, as a grammar for the engine: `response_format` (a JSON object,
or JSON valid against a schema, strict or not), a forced tool call (`tool_choice` "required" or a named
function: one call whose arguments follow the function's schema), or, with tools on "auto" and a JSON
response format, either of the two."""

import json

from minivllm.engine.grammar import JSON_OPTIONS
from minivllm.engine.sampling_params import StructuredOutput
from server import protocol as p
from server.errors import APIError
from server.tools import ToolCalling


def chat_output(body: p.ChatCompletionRequest, calling: ToolCalling | None) -> StructuredOutput | None:
    return format_grammar(body.response_format, calling, "response_format")


def format_grammar(
    fmt: p.ResponseFormat | None, calling: ToolCalling | None, field: str
) -> StructuredOutput | None:
    """An OpenAI response_format (chat's, or the Responses API's text.format) and tools; field: the
    request field that carries fmt (for errors)."""
    json_wanted = fmt is not None and fmt.type != "text"
    schema = fmt.json_schema.schema_ if json_wanted and fmt.type == "json_schema" else None
    return output_grammar(json_wanted, schema, calling, field)


def output_grammar(
    json_wanted: bool, schema: dict | None, calling: ToolCalling | None, format_param: str
) -> StructuredOutput | None:
    """Any protocol's answer format (JSON valid against schema, or any JSON object when schema is None) and
    tools; format_param names the request's answer-format field."""
    if calling is not None and calling.forced:
        if json_wanted:
            raise APIError(
                400, f"{format_param} cannot be combined with a forced tool_choice", param=format_param
            )
        return StructuredOutput(lark=f"start: call\n{calling.call_grammar()}")
    if not json_wanted:
        return None
    if calling is None:
        return (
            StructuredOutput(json_schema=schema) if schema is not None else StructuredOutput(json_object=True)
        )
    # tools on "auto": the answer is either that JSON or a call
    answer = json.dumps({**(schema or {"type": "object"}), "x-guidance": JSON_OPTIONS})
    return StructuredOutput(lark=f"start: answer | call\nanswer: %json {answer}\n{calling.call_grammar()}")
