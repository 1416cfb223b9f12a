"""A decode step's cost must not grow with the KV pool's size: the scatter of new K/V into the pool reuses
the pool's buffer instead of copying it. Times batch-1 decode steps with a small and a large pool.

    python -m benchmarks.pool_scaling [--model DIR] [--runs 3] [--quick]
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import gc
import statistics
import time

from tqdm import tqdm

from benchmarks.harness.results import metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from minivllm import LLM, SamplingParams
from minivllm.models.backend import detect_backend


def median_step_ms(llm: LLM, prompt: list[int], steps: int) -> float:
    engine = llm.engine
    seq = engine.add_request(
        f"pool-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=steps, ignore_eos=True)
    )
    while not seq.output_token_ids:
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--pools-mib", default="64,1024", help="pool sizes to compare, MiB")
    args = parse_args(p, argv)
    steps = 8 if args.quick else 32
    rows = []
    for mib in tqdm([int(x) for x in args.pools_mib.split(",")], desc="pools"):
        llm = LLM(str(args.model), kv_cache_bytes=mib << 20)
        prompt = llm.tokenizer.encode("The KV pool holds pages of sixteen tokens. " * 8)
        samples = [median_step_ms(llm, prompt, steps) for _ in range(args.runs)]
        rows.append(
            {
                "KV pool MiB": mib,
                "pages": llm.engine.kv.pool.num_pages,
                "decode step ms (median)": f"{statistics.mean(samples):.1f} ± {statistics.pstdev(samples):.1f}",
            }
        )
        del llm
        gc.collect()
    meta = metadata(args.model, page_size=16, backend=detect_backend().name, runs=args.runs, steps=steps)
    print_report(
        write_results(
            result_name("pool_scaling", args), rows, meta, out_dir=args.out, allow_dirty=args.allow_dirty
        )
    )


if __name__ == "__main__":
    main()
