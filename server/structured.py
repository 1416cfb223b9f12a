"""What a chat request's output must match, as a grammar for the engine: `response_format` (a JSON object,
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
    return output_grammar(body.response_format, calling)


def output_grammar(
    fmt: p.ResponseFormat | None, calling: ToolCalling | None, field: str = "response_format"
) -> StructuredOutput | None:
    """fmt and calling as chat names them; field: the request field that carries fmt (for errors)."""
    json_wanted = fmt is not None and fmt.type != "text"
    if calling is not None and calling.forced:
        if json_wanted:
            raise APIError(400, f"{field} cannot be combined with a forced tool_choice", param=field)
        return StructuredOutput(lark=f"start: call\n{calling.call_grammar()}")
    if not json_wanted:
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    if calling is None:
        return (
            StructuredOutput(json_schema=schema) if schema is not None else StructuredOutput(json_object=True)
        )
    # tools on "auto": the answer is either that JSON or a call
    answer = json.dumps({**(schema or {"type": "object"}), "x-guidance": JSON_OPTIONS})
    return StructuredOutput(lark=f"start: answer | call\nanswer: %json {answer}\n{calling.call_grammar()}")
