"""Speculative decoding by prompt lookup: decode tok/s with speculation off and on, and mlx-lm's, at batch 1
and 4, on an edit that copies a file back and on a free-form answer.

    python -m benchmarks.speculative [--model DIR] [--runs 1] [--tokens 128] [--batch 1,4] [--quick]
        [--skip-mlx-lm]

Workloads (chat-templated, greedy, `--tokens` output tokens each, EOS ignored so that every engine decodes
the same count):
  - edit: the prompt holds a 157-line Python file (benchmarks/texts/code.txt up to its FakeClock class)
    and asks for the whole file back with one function renamed: most of the answer is in the prompt;
  - free: a question answered in free-form prose, with little to copy.
Batch 4 is four copies of the request (mlx-lm's batch needs prompts of one length), all running together.

All engines live in this process and share one copy of the weights; every measurement is taken for each
engine in turn (in reversed order every other run), so a busy machine slows them alike. minivllm's rates
are benchmarks.harness.engine_timing.decode_rate's (from the step where every request has its first token;
the prompt is restored from the prefix cache after the first run); mlx-lm's are those of
benchmarks.long_context: its `generate_step` at batch 1 and its model stepped in a pipelined loop at batch
4, each from a copy of the prompt's KV cache. Acceptance: drafted tokens accepted / drafted. "same tokens":
whether speculation on gave the tokens speculation off did (it must: greedy is exact).
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import gc
import math
import sys
import time
from pathlib import Path
from unittest import mock

from tqdm import tqdm

from benchmarks.harness.engine_timing import decode_rate
from benchmarks.harness.prompts import chat_token_ids, load_tokenizer
from benchmarks.harness.results import mean_sd, metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from benchmarks.long_context import MlxLm, kv_bytes_per_token
from minivllm.models.backend import detect_backend
from minivllm.models.loader import load_model

CODE = Path(__file__).resolve().parent / "texts" / "code.txt"
EDIT_LINES = 157  # the module up to and with its FakeClock class
RENAME = ("purge_expired", "drop_expired")
FREE_QUESTION = (
    "In a few paragraphs of plain prose, with no code and no lists, explain to a new colleague why a "
    "hospital emergency department triages patients, and what can go wrong when it does so badly."
)


def workloads(tokenizer, lines: int = EDIT_LINES) -> dict[str, list[int]]:
    code = "".join(CODE.read_text().splitlines(keepends=True)[:lines])
    old, new = RENAME
    edit = (
        f"Here is a Python file:\n\n```python\n{code}```\n\nRename the method `{old}` to `{new}` and "
        "write out the whole file again, unchanged otherwise, in one Python code block."
    )
    return {
        "edit": chat_token_ids(tokenizer, [{"role": "user", "content": edit}]),
        "free": chat_token_ids(tokenizer, [{"role": "user", "content": FREE_QUESTION}]),
    }


class Minivllm:
    """One minivllm engine (speculation off or ngram) over the shared weights."""

    def __init__(self, loaded: tuple, model_dir: str, speculative: str, kv_cache_mib: int, batch: int):
        import minivllm.engine.llm_engine as engine_module

        with mock.patch.object(engine_module, "load_model", lambda *args, **kw: loaded):
            self.llm = minivllm.LLM(
                model_dir, max_num_seqs=batch, kv_cache_bytes=kv_cache_mib << 20, speculative=speculative
            )

    def decode(self, prompt: list[int], batch: int, n: int) -> tuple[float, float, list[list[int]]]:
        """(aggregate decode tok/s, acceptance, the outputs) of `batch` requests of one prompt."""
        engine = self.llm.engine
        before = engine.stats()
        params = minivllm.SamplingParams(max_tokens=n + 1, ignore_eos=True)
        seqs = [engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params) for i in range(batch)]
        rate = decode_rate(engine, seqs)
        after = engine.stats()
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        return rate, accepted / drafted if drafted else math.nan, [s.output_token_ids for s in seqs]


def measure(plan: dict, engines: dict, mlx: dict[str, MlxLm] | None) -> dict:
    """raw[workload][batch][engine] -> {"rate": [...], "acceptance": [...], "same": [...]}."""
    raw: dict = {w: {b: {} for b in plan["batch"]} for w in plan["prompts"]}
    cells = [(run, w, b) for run in range(plan["runs"]) for w in plan["prompts"] for b in plan["batch"]]
    for run, workload, batch in tqdm(cells, desc="measurements", file=sys.stderr):
        prompt = plan["prompts"][workload]
        names = list(engines) + (["mlx-lm"] if mlx else [])
        outputs = {}
        for name in names[:: -1 if run % 2 else 1]:
            cell = raw[workload][batch].setdefault(name, {"rate": [], "acceptance": []})
            if name == "mlx-lm":
                cell["rate"].append(mlx[workload].decode(prompt, batch))
            else:
                rate, acceptance, outputs[name] = engines[name].decode(prompt, batch, plan["n"])
                cell["rate"].append(rate)
                cell["acceptance"].append(acceptance)
            gc.collect()
        same = raw[workload][batch].setdefault("same", [])
        same.append(outputs["speculation on"] == outputs["speculation off"])
    return raw


def rows_of(raw: dict) -> list[dict]:
    rows = []
    for workload, by_batch in raw.items():
        for batch, cells in by_batch.items():
            on = cells["speculation on"]["rate"]
            row = {"workload": workload, "batch": batch}
            row |= {f"{name} (tok/s)": _rate(cells[name]["rate"]) for name in cells if name != "same"}
            row["on / off"] = _ratio(on, cells["speculation off"]["rate"])
            if "mlx-lm" in cells:
                row["on / mlx-lm"] = _ratio(on, cells["mlx-lm"]["rate"])
            acceptance = mean_sd(cells["speculation on"]["acceptance"])[0]
            row["acceptance"] = "—" if math.isnan(acceptance) else f"{acceptance:.2f}"  # nothing drafted
            row["same tokens"] = "yes" if all(cells["same"]) else "NO"
            rows.append(row)
    return rows


def _rate(values: list[float]) -> str:
    mean, sd = mean_sd(values)
    return f"{mean:.2f} ± {sd:.2f}"


def _ratio(values: list[float], bases: list[float]) -> str:
    """Run by run (each run measures the engines one after the other): the mean ± sd of the ratios."""
    mean, sd = mean_sd([v / b for v, b in zip(values, bases)])
    return f"{mean:.2f}x ± {sd:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens per request (default 128)")
    p.add_argument("--batch", default="1,4", help="batch sizes, comma-separated (default 1,4)")
    p.add_argument("--skip-mlx-lm", action="store_true", help="only minivllm, speculation off and on")
    args = parse_args(p, argv)
    args.runs = 1 if args.quick else args.runs
    tokenizer = load_tokenizer(args.model)
    prompts = workloads(tokenizer, lines=30 if args.quick else EDIT_LINES)  # quick: a tiny model's context
    batch = [int(b) for b in args.batch.split(",")]
    n = 8 if args.quick else args.tokens
    plan = {"prompts": prompts, "batch": batch, "n": n, "runs": args.runs}
    tokens = sum(len(p) for p in prompts.values()) + max(batch) * (n + 32) * 2
    kv_cache_mib = max(64, int(tokens * kv_bytes_per_token(args.model) * 1.5) >> 20)
    loaded = load_model(str(args.model))  # one copy of the weights for every engine
    engines = {
        f"speculation {state}": Minivllm(loaded, str(args.model), mode, kv_cache_mib, max(batch))
        for state, mode in (("off", "off"), ("on", "ngram"))
    }
    mlx = None
    if not args.skip_mlx_lm:
        mlx = {w: MlxLm(loaded[0], n) for w in prompts}
        for w, prompt in prompts.items():
            mlx[w].prefill(prompt)  # the KV cache each decode starts from
    for engine in engines.values():  # warm-up: compiles, and caches the prompts' pages
        for prompt in prompts.values():
            engine.decode(prompt, 1, 2)
    raw = measure(plan, engines, mlx)
    meta = metadata(
        args.model,
        page_size=16,
        backend=detect_backend().name,
        runs=args.runs,
        decode_tokens=n,
        prompt_tokens={w: len(p) for w, p in prompts.items()},
        speculative_tokens=engines["speculation on"].llm.engine.config.speculative_tokens,
    )
    notes = (
        "Decode rates are aggregate tokens per second once every request has its first token; mean ± sd "
        "over the runs; the ratios are taken run by run (the engines of a run measure one after the other, "
        "so a busy machine slows them alike), mean ± sd. Acceptance is the share of drafted tokens accepted. Speculation drafts only while at "
        "most 4 requests decode (minivllm.engine.scheduler.SPEC_MAX_DECODES), and the drafts of one step "
        "share speculative_tokens (8)."
    )
    paths = write_results(result_name("speculative", args), rows_of(raw), meta, raw=raw, notes=notes,
                          out_dir=args.out, allow_dirty=args.allow_dirty)  # fmt: skip
    print_report(paths)


if __name__ == "__main__":
    main()
