"""Multi-turn sessions on a hybrid model (Qwen3.5: linear-attention layers with a recurrent state), the
prefix cache on against off: restored tokens, restored fraction and TTFT per turn, and the memory the
recurrent-state snapshots take.

Each session shares one system prompt; each turn sends the whole conversation so far (the previous answers
as the server wrote them) and a new user message, through the chat API. The sessions run side by side, so
the second session's first turn meets the first's prefill of the system prompt (a prefix flight). The
model is a tiny random Qwen3.5 (mlx-lm's own class) with the default model's tokenizer and chat template,
so prompts are templated and tokenized as a real model's; a fresh server per configuration.

    python -m benchmarks.hybrid_sessions [--runs 3] [--quick] [--plot]
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import prompts, results, runner
from benchmarks.harness.client import RequestResult
from benchmarks.multi_turn import Texts

SESSIONS, TURNS, SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 2, 8, 2000, 120, 32
QUICK = (2, 3, 400, 40, 8)
CONFIGS = {"cache-on": {"MINIVLLM_PREFIX_CACHE": "1"}, "cache-off": {"MINIVLLM_PREFIX_CACHE": "0"}}
HYBRID = {  # Qwen3.5's shape, small: 3 linear layers to each attention layer, a convolution of 4
    "model_type": "qwen3_5",
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "full_attention_interval": 4,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def make_tiny_hybrid(path: Path, tokenizer_dir: Path) -> Path:
    """A random Qwen3.5 (HYBRID) with the tokenizer, chat template and vocabulary of tokenizer_dir's model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = {
        **HYBRID,
        "vocab_size": source["vocab_size"],
        "eos_token_id": source["eos_token_id"],
        "max_position_embeddings": 32768,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    params = dict(tree_flatten(model_class(args_class.from_dict(config)).parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), params)
    return path


async def one_session(
    session: runner.Session, shape: tuple, texts: Texts, system: str, index: int, seed: int
):
    _, turns, _, user_tokens, answer_tokens = shape
    messages = [{"role": "system", "content": system}]
    answers: list[RequestResult] = []
    for t in range(turns):
        messages.append({"role": "user", "content": texts(user_tokens, seed + 7919 * index + t)})
        answer = await session.chat(messages, answer_tokens, extra_body={"ignore_eos": True})
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer.text})
    return answers


async def one_run(session: runner.Session, run: int, shape: tuple, texts: Texts) -> dict[str, Any]:
    sessions, _, system_tokens, _, _ = shape
    seed = 1_000_003 * (run + 1)  # new text every run: earlier runs' cache does not help
    system = texts(system_tokens, seed)
    answers = await asyncio.gather(
        *(one_session(session, shape, texts, system, i, seed) for i in range(sessions))
    )
    metrics = session.metrics()
    return {
        "sessions": [[vars(a) for a in s] for s in answers],
        "snapshots": metrics.get("minivllm_state_snapshots", math.nan),
        "snapshot_bytes": metrics.get("minivllm_state_snapshot_bytes", math.nan),
        "snapshots_restored": metrics.get("minivllm_state_snapshots_restored_total", math.nan),
    }


def summarize(by_config: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
    per_config, per_turn = [], []
    for label, runs in by_config.items():
        sessions = [s for run in runs for s in run["sessions"]]
        later = [a for s in sessions for a in s[1:]]
        fractions = [a["cached_tokens"] / a["prompt_tokens"] for a in later]
        per_config.append(
            {
                "cache": label,
                "restored / prompt, turns 2+ (min)": f"{100 * min(fractions):.1f}%",
                "restored / prompt, turns 2+ (mean)": f"{100 * results.mean_sd(fractions)[0]:.1f}%",
                "mean TTFT ms, turn 1": results.fmt_ms([s[0]["ttft_s"] for s in sessions]),
                "mean TTFT ms, turns 2+": results.fmt_ms([a["ttft_s"] for a in later]),
                "snapshots at the end": results.mean_sd([r["snapshots"] for r in runs])[0],
                "snapshot MiB at the end": results.mean_sd([r["snapshot_bytes"] / 2**20 for r in runs])[0],
                "restores from a snapshot": results.mean_sd([r["snapshots_restored"] for r in runs])[0],
            }
        )
        for t in range(len(sessions[0])):
            turn = [s[t] for s in sessions]
            per_turn.append(
                {
                    "cache": label,
                    "turn": t + 1,
                    "prompt tokens": results.mean_sd([a["prompt_tokens"] for a in turn])[0],
                    "restored": results.mean_sd([a["cached_tokens"] for a in turn])[0],
                    "restored %": 100 * min(a["cached_tokens"] / a["prompt_tokens"] for a in turn),
                    "TTFT ms": results.fmt_ms([a["ttft_s"] for a in turn]),
                }
            )
    return per_config, per_turn


NOTES = (
    "Restored: usage.prompt_tokens_details.cached_tokens (pages and recurrent state resumed together). "
    "'restored %' per turn: the smallest over sessions and runs. TTFT: client-side, send -> first streamed "
    "content, mean ± sd over sessions and runs. Snapshots: /metrics after each run (RAM). The model is random: "
    "its answers are random tokens, written back into the next turn's prompt as the server returned them."
)


async def run(args) -> None:
    shape = QUICK if args.quick else (SESSIONS, TURNS, SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS)
    texts = Texts(prompts.load_tokenizer(args.model))
    specs = [runner.spec_for(args, label, env) for label, env in CONFIGS.items()]
    by_config = await runner.run_configs(
        specs, args.runs, lambda session, r: one_run(session, r, shape, texts)
    )
    per_config, per_turn = summarize(by_config)
    name = runner.result_name("hybrid_sessions", args)
    meta = results.metadata(args.model, args.page_size, runs=args.runs, env=args.env, model_config=HYBRID)
    meta["scenario"] = dict(
        zip(("sessions", "turns", "system_tokens", "user_tokens", "answer_tokens"), shape)
    )
    kw = {"out_dir": args.out, "notes": NOTES, "allow_dirty": args.allow_dirty}
    paths = results.write_results(name, per_config, meta, raw=by_config, **kw)
    results.write_results(name + "_turns", per_turn, meta, **kw)
    if args.plot:
        groups = [f"turn {t + 1}" for t in range(shape[1])]
        series = {c: [r["restored %"] for r in per_turn if r["cache"] == c] for c in by_config}
        results.save_plot(name, groups, series, "restored % of the prompt (min)", out_dir=args.out)
    results.print_report(paths)


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    args = runner.parse_args(p, argv)
    args.model = make_tiny_hybrid(Path(tempfile.mkdtemp(prefix="minivllm-hybrid-")), args.model)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
