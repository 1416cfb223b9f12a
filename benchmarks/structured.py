"""Structured output's cost: 8 concurrent requests, half constrained by a JSON schema, against 8 free ones.

    python -m benchmarks.structured [--model DIR] [--runs 3] [--decode-tokens 64] [--quick]

Both batches run through minivllm's synchronous engine on the same 8 chat prompts, greedy: aggregate
decode tok/s once every request has its first token (prefill excluded), all free, then 4 free + 4
constrained (llguidance token masks applied in the batched sampler, one step for all 8). The schema asks
for more items than the run decodes, so constrained requests run exactly as long as the free ones. The two
batches alternate run by run, so load drift on a shared machine hits both, and the ratio is taken per pair.
Also reported: host time per token mask (computing it and advancing the matcher), and its share of the
constrained batch's decode time.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import time

from tqdm import tqdm

from benchmarks.harness.results import mean_sd, metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from minivllm import LLM, SamplingParams, StructuredOutput
from minivllm.models.backend import detect_backend

SCHEMA = {
    "type": "array",
    "minItems": 200,  # more than any run decodes: the grammar never lets a request end early
    "items": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    },
}
TOPICS = ["Europe", "Asia", "Africa", "South America", "North America", "Oceania", "islands", "capitals"]


def chat_prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"List large cities of {topic} as JSON: city, country, population.",
                }
            ],
            add_generation_prompt=True,
        )
        for topic in TOPICS
    ]


def decode_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float]:
    """(aggregate decode tok/s, seconds of that decode) once every request has its first token."""
    engine = llm.engine
    seqs = [
        engine.add_request(f"s{time.monotonic_ns()}-{i}", p, sp)
        for i, (p, sp) in enumerate(zip(prompts, params))
    ]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    start, done = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    assert all(s.finish_reason == "length" for s in seqs), [s.finish_reason for s in seqs]
    return (sum(len(s.output_token_ids) for s in seqs) - done) / seconds, seconds


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    args = parse_args(p, argv)
    n = 16 if args.quick else args.decode_tokens
    llm = LLM(
        str(args.model),
        max_num_seqs=8,
        kv_cache_bytes=args.kv_cache_mib << 20,
        enable_prefix_caching=False,  # every run computes its prompts again
        single_flight="off",
    )
    prompts = chat_prompts(llm)
    spec = StructuredOutput(json_schema=SCHEMA)
    free = SamplingParams(max_tokens=n, ignore_eos=True)
    constrained = SamplingParams(max_tokens=n, ignore_eos=True, structured_output=spec)
    mixed = [free, constrained] * 4
    start = time.perf_counter()
    llm.engine.grammars.matcher(spec)  # the grammar tokenizer and the schema, compiled once before timing
    compile_s = time.perf_counter() - start
    decode_rate(llm, prompts, mixed)  # warm-up

    counters = llm.engine.mask_counters
    rates: dict[str, list[float]] = {"free": [], "mixed": []}
    mask_us, mask_share = [], []
    for run in tqdm(range(args.runs), desc="structured"):
        for batch in ("free", "mixed") if run % 2 == 0 else ("mixed", "free"):  # alternate which goes first
            masks, mask_s = counters.masks, counters.seconds
            rate, seconds = decode_rate(llm, prompts, mixed if batch == "mixed" else [free] * 8)
            rates[batch].append(rate)
            if batch == "mixed":
                mask_us.append((counters.seconds - mask_s) / (counters.masks - masks) * 1e6)
                mask_share.append((counters.seconds - mask_s) / seconds * 100)
    ratios = [m / f for m, f in zip(rates["mixed"], rates["free"])]

    def pm(values: list[float], digits: int = 1) -> str:
        mean, sd = mean_sd(values)
        return f"{mean:.{digits}f} ± {sd:.{digits}f}"

    rows = [
        {"metric": "decode tok/s, 8 free (aggregate)", "value": pm(rates["free"])},
        {"metric": "decode tok/s, 4 free + 4 JSON-schema constrained", "value": pm(rates["mixed"])},
        {"metric": "constrained batch / free batch (per run pair)", "value": pm(ratios, 3)},
        {"metric": "mask host time per constrained token, us", "value": pm(mask_us)},
        {"metric": "mask host time, % of the constrained batch's decode time", "value": pm(mask_share, 2)},
        {"metric": "grammar tokenizer + schema compile, s (once)", "value": f"{compile_s:.2f}"},
        {"metric": "target: ratio >= 0.90", "value": "met" if mean_sd(ratios)[0] >= 0.9 else "not met"},
    ]
    meta = metadata(
        args.model,
        page_size=16,
        backend=detect_backend().name,
        blas=detect_backend().blas,
        runs=args.runs,
        decode_tokens=n,
        batch=8,
        constrained=4,
        ratios=[round(r, 4) for r in ratios],
    )
    print_report(
        write_results(
            result_name("structured", args), rows, meta, out_dir=args.out, allow_dirty=args.allow_dirty
        )
    )


if __name__ == "__main__":
    main()
