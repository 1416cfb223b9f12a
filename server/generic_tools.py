"""A tool-call format for models whose chat template has none (llama.cpp's generic handler does the same).

The tool definitions go into the system prompt with an instruction to answer a call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes' format, which instruction-tuned
models know best); past calls are written into their assistant turn in that format, and tool results become
user turns in `<tool_response>` blocks, so a template that knows only user and assistant turns renders the
whole conversation. A call the model writes is read by mlx-lm's JSON parser; a forced call's grammar holds it
to its function's schema (server.tools). The model's own format wins wherever its template has one.
"""

import json

from mlx_lm.tool_parsers import json_tools

START = json_tools.tool_call_start
END = json_tools.tool_call_end
parse_tool_call = json_tools.parse_tool_call
INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The functions, as JSON "
    "schemas:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one block per call, holding a "
    'JSON object with the function\'s name and its arguments:\n{start}\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n{end}\nThe results come back in <tool_response> blocks.'
)


def render(turns: list[dict], tools: list[dict] | None) -> list[dict]:
    """Chat-template turns (server.tools.conversation's) with the tools in the system turn, past calls in
    their assistant turn's text, and consecutive tool results as one user turn."""
    out: list[dict] = []
    after_result = False  # the last turn out holds tool results: the next result joins it
    for turn in turns:
        if turn["role"] == "tool":
            block = f"<tool_response>\n{turn['content']}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_result = True
            continue
        after_result = False
        calls = turn.get("tool_calls")
        if calls:
            turn = {k: v for k, v in turn.items() if k != "tool_calls"}
            turn["content"] = _with_calls(turn.get("content") or "", calls)
        out.append(turn)
    if tools:
        _add_to_system(out, instructions(tools))
    return out


def instructions(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return INSTRUCTIONS.format(tools=listed, start=START, end=END)


def _with_calls(content: str, calls: list[dict]) -> str:
    blocks = [f"{START}\n{json.dumps(_call(c), ensure_ascii=False)}\n{END}" for c in calls]
    return "\n".join(([content] if content else []) + blocks)


def _call(call: dict) -> dict:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def _add_to_system(turns: list[dict], text: str) -> None:
    if turns and turns[0]["role"] == "system":
        turns[0] = {
            **turns[0],
            "content": f"{turns[0]['content']}\n\n{text}" if turns[0]["content"] else text,
        }
    else:
        turns.insert(0, {"role": "system", "content": text})
