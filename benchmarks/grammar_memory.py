"""Memory of compiled grammars: RSS over many distinct large JSON schemas, the byte-bounded grammar cache
against an unbounded one, side by side (each in its own process, so their RSS does not mix).

Each schema is an enum of --values distinct strings (a client sending ever new schemas); every one is
compiled as the engine compiles a request's structured output, with the model's tokenizer.

    python -m benchmarks.grammar_memory [--model DIR] [--schemas 300] [--values 5000]
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import models, results


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def compile_many(model: Path, schemas: int, values: int, cache_bytes: int | None) -> dict:
    """In this process: compile `schemas` distinct enum schemas; RSS and cache state afterwards."""
    from tqdm import tqdm

    from minivllm.engine.grammar import CACHE_GRAMMAR_BYTES, GrammarCompiler
    from minivllm.engine.sampling_params import StructuredOutput
    from minivllm.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    bound = CACHE_GRAMMAR_BYTES if cache_bytes is None else cache_bytes
    compiler = GrammarCompiler(tokenizer.hf, vocab, tokenizer.eos_token_ids, cache_bytes=bound)
    assert compiler.tokenizer is not None  # built once, before measuring
    start, t0 = rss_mb(), time.perf_counter()
    for i in tqdm(range(schemas), desc="schemas", disable=not sys.stderr.isatty()):
        compiler.matcher(StructuredOutput(json_schema={"enum": [f"s{i}-v{j}" for j in range(values)]}))
    return {
        "rss_start_mb": start,
        "rss_end_mb": rss_mb(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cached_grammars": len(compiler._cache),
        "cached_bytes": compiler.cached_bytes,
        "cache_bound_bytes": bound,
        "seconds": time.perf_counter() - t0,
    }


def run_in_subprocess(model: Path, schemas: int, values: int, cache_bytes: int | None) -> dict:
    args = [sys.executable, "-m", "benchmarks.grammar_memory", "--child", "--model", str(model)]
    args += ["--schemas", str(schemas), "--values", str(values)]
    if cache_bytes is not None:
        args += ["--cache-bytes", str(cache_bytes)]
    out = subprocess.run(args, capture_output=True, text=True, check=True, cwd=results.REPO_ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model dir (default: the offline default model)")
    p.add_argument("--schemas", type=int, default=300)
    p.add_argument("--values", type=int, default=5000, help="enum values per schema")
    p.add_argument("--cache-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    model = models.resolve_model(args.model)
    if args.child:
        print(json.dumps(compile_many(model, args.schemas, args.values, args.cache_bytes)))
        return
    results.require_clean_tree(args.allow_dirty)
    rows = []
    for label, cache_bytes in (("bounded (default)", None), ("unbounded", 1 << 62)):
        r = run_in_subprocess(model, args.schemas, args.values, cache_bytes)
        rows.append({"cache": label, "schemas": args.schemas, "enum values": args.values, **r})
    meta = results.metadata(model)
    results.print_report(results.write_results("grammar_memory", rows, meta, allow_dirty=args.allow_dirty))


if __name__ == "__main__":
    main()
