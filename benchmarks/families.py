"""Model families: prefill and batch-1 decode tok/s of minivllm against mlx-lm, per family, on tiny models.

    python -m benchmarks.families [--runs 3] [--tokens 128] [--prompt 512] [--quick]

Each supported family is built with mlx-lm's own class and the options tests/test_families.py checks
(tests/tiny_model.FAMILY_OPTIONS: 2 or 3 layers, hidden size 128, random weights). On models this small a
step is mostly per-step host work, so the ratios show each family's forward overhead, not its compute.
minivllm and mlx-lm live in this process and share one copy of the weights; each run measures them one
after the other (in reversed order every other run), so a busy machine slows both alike.

  - prefill: a fresh `--prompt`-token prompt (never in the prefix cache), from its submission to its first
    token: minivllm's engine steps (one 512-token chunk by default) against mlx-lm's `generate_step`;
  - decode: `--tokens` tokens at batch 1 after the prompt (benchmarks.harness.engine_timing.decode_rate)
    against mlx-lm's `generate_step` from a copy of the prompt's KV cache (benchmarks.long_context.MlxLm);
  - decode CPU: the same decodes as tokens per second of this process's CPU time (all threads), which
    other processes on a shared machine do not change (it includes the decode's one-token prefill step);
  - graph nodes: the median number of nodes of the graph each decode step hands to mx.async_eval (after
    the timed runs, in a decode of its own): on the CPU each costs its dispatch, whatever its size.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from tqdm import tqdm

from benchmarks.harness.engine_timing import decode_rate
from benchmarks.harness.graph_nodes import nodes_per_async_eval
from benchmarks.harness.results import RESULTS_DIR, metadata, print_report, write_results
from benchmarks.harness.runner import add_allow_dirty, parse_on_clean_tree
from benchmarks.long_context import MlxLm
from minivllm.models.backend import detect_backend
from minivllm.models.loader import load_model
from tests.tiny_model import FAMILY_OPTIONS, make_tiny_family_model

VOCAB = 362  # the tiny models' tokenizer
UNITS = {"decode CPU": "tok/CPU-s", "graph nodes": "per decode step"}


class Minivllm:
    def __init__(self, loaded: tuple, model_dir: Path):
        import minivllm.engine.llm_engine as engine_module

        with mock.patch.object(engine_module, "load_model", lambda *args, **kw: loaded):
            self.llm = minivllm.LLM(str(model_dir), max_num_seqs=1, kv_cache_bytes=64 << 20)

    def prefill(self, prompt: list[int]) -> float:
        engine = self.llm.engine
        start = time.perf_counter()
        seq = engine.add_request(f"p{time.monotonic_ns()}", prompt, minivllm.SamplingParams(max_tokens=1))
        while not seq.output_token_ids:
            engine.step()
        rate = len(prompt) / (time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
        return rate

    def decode(self, prompt: list[int], n: int) -> float:
        engine = self.llm.engine
        params = minivllm.SamplingParams(max_tokens=n + 1, ignore_eos=True)
        return decode_rate(engine, [engine.add_request(f"d{time.monotonic_ns()}", prompt, params)])


def measure_family(model_dir: Path, plan: dict, seed: int) -> dict:
    """raw[phase][engine] -> rates, one per run."""
    loaded = load_model(str(model_dir))  # dequantized as minivllm runs it; mlx-lm steps the same modules
    engines = {"minivllm": Minivllm(loaded, model_dir), "mlx-lm": MlxLm(loaded[0], plan["n"])}
    rng = random.Random(seed)
    fresh = lambda: [rng.randrange(VOCAB) for _ in range(plan["prompt"])]  # noqa: E731
    decode_prompt = fresh()
    engines["mlx-lm"].prefill(decode_prompt)  # the KV cache its decodes start from
    engines["minivllm"].decode(decode_prompt, 2)  # warm-up; caches the prompt's pages
    raw: dict = {"prefill": {}, "decode": {}, "decode CPU": {}}
    for run in range(plan["runs"]):
        for name in list(engines)[:: -1 if run % 2 else 1]:
            engine = engines[name]
            raw["prefill"].setdefault(name, []).append(engine.prefill(fresh()))
            cpu = time.process_time()
            # mlx-lm's decode takes the batch size (its n was fixed above), minivllm's the token count
            rate = engine.decode(decode_prompt, 1 if name == "mlx-lm" else plan["n"])
            raw["decode"].setdefault(name, []).append(rate)
            # this process's CPU seconds (all its threads) per decoded token, as tokens per CPU second:
            # what another process's load on a shared machine does not change
            raw["decode CPU"].setdefault(name, []).append(plan["n"] / (time.process_time() - cpu))
            gc.collect()
    raw["graph nodes"] = {}
    for name, engine in engines.items():
        with nodes_per_async_eval() as counts:
            engine.decode(decode_prompt, 1 if name == "mlx-lm" else plan["n"])
        raw["graph nodes"][name] = [statistics.median(counts)]
    return raw


def _median_spread(values: list[float]) -> tuple[float, float, float]:
    """The median and the interquartile range's ends: on a shared machine a few runs are far off."""
    q1, median, q3 = (
        statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    )
    return median, q1, q3


def rows_of(raw: dict) -> list[dict]:
    rows = []
    for family, phases in raw.items():
        row = {"family": family}
        for phase, cells in phases.items():
            unit = UNITS.get(phase, "tok/s")
            for name, rates in cells.items():
                median, q1, q3 = _median_spread(rates)
                row[f"{phase} {name} ({unit})"] = f"{median:,.0f} ({q1:,.0f}–{q3:,.0f})"
            median, q1, q3 = _median_spread([a / b for a, b in zip(cells["minivllm"], cells["mlx-lm"])])
            row[f"{phase} minivllm / mlx-lm"] = f"{median:.2f}x ({q1:.2f}–{q3:.2f})"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9, help="repeated runs per family (default 9)")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement (default 64)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--families", default=",".join(sorted(FAMILY_OPTIONS)), help="comma-separated")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    p.add_argument("--quick", action="store_true", help="1 run, short prompt and decode: a smoke test")
    add_allow_dirty(p)
    args = parse_on_clean_tree(p, argv)
    plan = {"runs": 1, "n": 8, "prompt": 64} if args.quick else {}
    plan = {"runs": args.runs, "n": args.tokens, "prompt": args.prompt} | plan
    families = args.families.split(",")
    root = Path(tempfile.mkdtemp(prefix="minivllm-families-"))
    raw = {}
    for i, family in enumerate(tqdm(families, desc="families", file=sys.stderr)):
        model_dir = make_tiny_family_model(root / family, family, **FAMILY_OPTIONS[family])
        raw[family] = measure_family(model_dir, plan, seed=i)
    meta = metadata(
        root / families[0],  # every family's model is float32 (its dtype is what the metadata reads)
        page_size=16,
        backend=detect_backend().name,
        runs=plan["runs"],
        decode_tokens=plan["n"],
        prompt_tokens=plan["prompt"],
        load_average=os.getloadavg(),
        models="tests/tiny_model.FAMILY_OPTIONS on TINY_FAMILY_CONFIG (random weights, float32)",
    )
    notes = (
        "Rates: median (interquartile range) over the runs; ratios taken run by run (minivllm and mlx-lm "
        "measure one after the other), median (interquartile range). Batch 1; decode excludes the prefill; "
        "prefill is a fresh prompt's time to its first token. load_average: the machine's when the results were written. "
        "Graph nodes: of one decode step (its median over a decode), counted once."
    )
    name = "families" + ("-quick" if args.quick else "")
    paths = write_results(name, rows_of(raw), meta, raw=raw, notes=notes, out_dir=args.out,
                          allow_dirty=args.allow_dirty)  # fmt: skip
    print_report(paths)


if __name__ == "__main__":
    main()
