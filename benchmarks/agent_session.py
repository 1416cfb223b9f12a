"""A coding agent's session on the prefix cache: Claude-Code-shaped through /v1/messages (anthropic SDK) and
Codex-shaped through /v1/responses (openai SDK), on one server.

Each session: a long system prompt and tool list, then --turns turns; every turn forces a tool call (the
model's own call is kept in the history, as an agent keeps it) and answers it with a tool result of about
--result-tokens tokens, so each turn adds >= 150 tokens. Claude Code's billing header (a new `cch` every
request) leads the system prompt of the Messages session; at turn --fan-out-turn three subagent requests
share the whole history and differ in their last message, sent at once. Per request: prompt tokens,
restored tokens, TTFT (to the stream's first event after the prompt: message_start / response.created).

    python -m benchmarks.agent_session [--model DIR] [--system-tokens 6000] [--turns 9] [--plot]
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import asyncio
import random
import time
from dataclasses import asdict, dataclass

import anthropic
import openai

from benchmarks.harness import models, prompts, results, runner
from benchmarks.harness.servers import ServerSpec, running_server

TOOLS = [
    ("read_file", "Read a file of the repository and return its text.", {"path": {"type": "string"}}),
    ("write_file", "Write text to a file.", {"path": {"type": "string"}, "text": {"type": "string"}}),
    ("run_tests", "Run the test suite, or the tests matching a pattern.", {"pattern": {"type": "string"}}),
    ("grep", "Search the repository for a regular expression.", {"regex": {"type": "string"}}),
    ("list_dir", "List a directory.", {"path": {"type": "string"}}),
]


@dataclass
class Turn:
    protocol: str
    turn: int
    kind: str  # "turn" | "subagent"
    prompt_tokens: int
    restored_tokens: int
    ttft_s: float

    @property
    def restored_share(self) -> float:
        return self.restored_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def tool_result_text(turn: int, n_tokens: int) -> str:
    return prompts.filler_text(1000 + turn, n_tokens * 4)


# -- the Messages session (Claude Code) ------------------------------------------------------------------
def billing_header() -> str:
    cch = "".join(random.choices("0123456789abcdef", k=5))
    return f"x-anthropic-billing-header: cc_version=2.1.90.3fa; cc_entrypoint=cli; cch={cch};"


async def messages_request(
    client, model: str, system: str, messages: list, tool_choice: dict
) -> tuple[Turn, list]:
    start, ttft = time.monotonic(), None
    tools = [{"name": n, "description": d, "input_schema": {"type": "object", "properties": p, "required": list(p)}}
             for n, d, p in TOOLS]  # fmt: skip
    async with client.messages.stream(
        model=model,
        max_tokens=64,
        system=[{"type": "text", "text": billing_header()}, {"type": "text", "text": system}],
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        extra_body={"temperature": 0},
    ) as stream:
        async for event in stream:
            if ttft is None and event.type == "message_start":
                ttft = time.monotonic() - start
        final = await stream.get_final_message()
    u = final.usage
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    turn = Turn("messages", 0, "turn", prompt, u.cache_read_input_tokens, ttft)
    return turn, [b.model_dump(exclude_none=True) for b in final.content]


async def messages_session(base_url: str, model: str, system: str, args) -> list[Turn]:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    messages = [{"role": "user", "content": "Fix the failing test in the repository, step by step."}]
    out = []
    for k in range(args.turns):
        turn, content = await messages_request(client, model, system, messages, {"type": "any"})
        out.append(Turn("messages", k, "turn", turn.prompt_tokens, turn.restored_tokens, turn.ttft_s))
        calls = [b for b in content if b["type"] == "tool_use"]
        messages.append({"role": "assistant", "content": content})
        results_ = [{"type": "tool_result", "tool_use_id": c["id"], "content": tool_result_text(k, args.result_tokens)}
                    for c in calls]  # fmt: skip
        messages.append({"role": "user", "content": results_ or f"Turn {k}: go on."})
        if k == args.fan_out_turn:
            subagents = [messages + [{"role": "assistant", "content": "I will ask a subagent."},
                                     {"role": "user", "content": f"Subagent {i}: check module {i} for the bug."}]
                         for i in range(3)]  # fmt: skip
            done = await asyncio.gather(
                *(messages_request(client, model, system, m, {"type": "auto"}) for m in subagents)
            )
            out += [
                Turn("messages", k, "subagent", t.prompt_tokens, t.restored_tokens, t.ttft_s) for t, _ in done
            ]
    await client.close()
    return out


# -- the Responses session (Codex) -----------------------------------------------------------------------
async def responses_request(client, model: str, system: str, items: list, tool_choice) -> tuple[Turn, list]:
    start, ttft, final = time.monotonic(), None, None
    tools = [{"type": "function", "name": n, "description": d,
              "parameters": {"type": "object", "properties": p, "required": list(p)}} for n, d, p in TOOLS]  # fmt: skip
    stream = await client.responses.create(
        model=model, instructions=system, input=items, tools=tools, tool_choice=tool_choice,
        max_output_tokens=64, temperature=0, store=False, stream=True,
    )  # fmt: skip
    async for event in stream:
        if ttft is None and event.type == "response.created":
            ttft = time.monotonic() - start
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    u = final.usage
    turn = Turn("responses", 0, "turn", u.input_tokens, u.input_tokens_details.cached_tokens, ttft)
    return turn, [o.model_dump(exclude_none=True) for o in final.output]


async def responses_session(base_url: str, model: str, system: str, args) -> list[Turn]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    items: list = [{"role": "user", "content": "Fix the failing test in the repository, step by step."}]
    out = []
    for k in range(args.turns):
        turn, output = await responses_request(client, model, system, items, "required")
        out.append(Turn("responses", k, "turn", turn.prompt_tokens, turn.restored_tokens, turn.ttft_s))
        items += [{k2: v for k2, v in o.items() if k2 not in ("status", "id")} for o in output]
        items += [{"type": "function_call_output", "call_id": o["call_id"], "output": tool_result_text(k, args.result_tokens)}
                  for o in output if o["type"] == "function_call"]  # fmt: skip
        if k == args.fan_out_turn:
            subagents = [items + [{"role": "user", "content": f"Subagent {i}: check module {i} for the bug."}]
                         for i in range(3)]  # fmt: skip
            done = await asyncio.gather(
                *(responses_request(client, model, system, m, "auto") for m in subagents)
            )
            out += [
                Turn("responses", k, "subagent", t.prompt_tokens, t.restored_tokens, t.ttft_s)
                for t, _ in done
            ]
    await client.close()
    return out


# -- the run ---------------------------------------------------------------------------------------------
def summary(turns: list[Turn]) -> list[dict]:
    rows = []
    for protocol in sorted({t.protocol for t in turns}):
        mine = [t for t in turns if t.protocol == protocol]
        cold = mine[0]
        warm = [t for t in mine if t.kind == "turn" and t.turn > 0]
        fan = [t for t in mine if t.kind == "subagent"]
        rows.append(
            {
                "protocol": protocol,
                "cold prompt tokens": cold.prompt_tokens,
                "cold TTFT s": cold.ttft_s,
                "warm turns": len(warm),
                "warm mean TTFT s": sum(t.ttft_s for t in warm) / len(warm),
                "warm / cold TTFT %": 100 * (sum(t.ttft_s for t in warm) / len(warm)) / cold.ttft_s,
                "min % restored, warm turns": 100 * min(t.restored_share for t in warm),
                "min % restored, fan-out": 100 * min((t.restored_share for t in fan), default=float("nan")),
                "last prompt tokens": mine[-1].prompt_tokens,
            }
        )
    return rows


def plot(turns: list[Turn], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for protocol in sorted({t.protocol for t in turns}):
        mine = [t for t in turns if t.protocol == protocol and t.kind == "turn"]
        a.plot([t.turn for t in mine], [t.ttft_s for t in mine], marker="o", label=protocol)
        b.plot([t.turn for t in mine], [100 * t.restored_share for t in mine], marker="o", label=protocol)
    a.set(xlabel="turn", ylabel="TTFT (s)", yscale="log", title="time to first token")
    b.set(xlabel="turn", ylabel="% of the prompt restored", title="restored from the prefix cache")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--system-tokens", type=int, default=6000, help="system prompt size (~1 min of prefill here)"
    )
    p.add_argument("--turns", type=int, default=9)
    p.add_argument("--result-tokens", type=int, default=200, help="tokens of each tool result")
    p.add_argument("--fan-out-turn", type=int, default=4)
    p.add_argument("--protocols", default="messages,responses")
    args = runner.parse_on_clean_tree(p, argv)
    model = models.resolve_model(args.model)
    tokenizer = prompts.load_tokenizer(model)
    system = prompts.filler_text(7, int(args.system_tokens * prompts.chars_per_token(tokenizer)))
    env = {"MINIVLLM_LOG_LEVEL": "warning"}
    turns: list[Turn] = []
    with running_server(ServerSpec("minivllm", model, env=env, label="agent-session")) as server:
        for protocol in args.protocols.split(","):
            session = messages_session if protocol == "messages" else responses_session
            # each agent has its own system prompt (as Claude Code's and Codex's differ): no session
            # starts from the other's cached prefix, so each cold turn is cold
            own_system = f"You are the coding agent of a {protocol} client.\n{system}"
            turns += asyncio.run(session(server.base_url, server.model_id, own_system, args))
    name = runner.result_name("agent_session", args)
    meta = results.metadata(model, system_tokens=args.system_tokens, turns=args.turns)
    paths = results.write_results(
        name,
        summary(turns),
        meta,
        raw=[asdict(t) for t in turns],
        allow_dirty=args.allow_dirty,
        out_dir=args.out,
    )
    if args.plot:
        plot(turns, args.out / f"{name}.png")
    results.print_report(paths)


if __name__ == "__main__":
    main()
