"""Prefill and decode throughput, minivllm against mlx-lm, in one process on the same model and dtype.

    python -m benchmarks.throughput [--model DIR] [--runs 3] [--quick]

minivllm runs through its synchronous engine; mlx-lm through `stream_generate` (batch 1) and
`batch_generate` (batch 8). On the CPU backend both use float32 weights dequantized from the same
directory, with OpenBLAS loaded. Rates exclude model loading; decode rates exclude prefill.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import batch_generate, stream_generate
from tqdm import tqdm

from benchmarks.harness.engine_timing import decode_rate
from benchmarks.harness.results import mean_sd, metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from minivllm import LLM, SamplingParams
from minivllm.models.backend import detect_backend
from minivllm.models.loader import dequantize_to_float32


def prompt_ids(tokenizer, n: int, seed: int) -> list[int]:
    words = ["alpha", "beta", "gamma", "delta", "kernel", "page", "cache", "token", "batch", "queue", "model"]
    text = " ".join(words[(seed * 7 + i * 3 + i * i) % len(words)] for i in range(n * 2))
    return tokenizer.encode(text)[:n]


# -- minivllm ---------------------------------------------------------------------------------------------
def minivllm_prefill(llm: LLM, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - t)


def minivllm_decode(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Aggregate decode tok/s once every request has its first token (prefill excluded)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    seqs = [llm.engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params) for i, p in enumerate(prompts)]
    return decode_rate(llm.engine, seqs)


# -- mlx-lm -----------------------------------------------------------------------------------------------
def load_mlx_lm(model_dir: str):
    model, tokenizer = mlx_lm.load(model_dir)
    if not detect_backend().is_gpu:  # the same float32 weights minivllm runs on the CPU
        model = dequantize_to_float32(model)
    return model, tokenizer


def mlx_lm_prefill(model, tokenizer, prompt: list[int]) -> float:
    *_, last = stream_generate(model, tokenizer, prompt, max_tokens=1)
    return last.prompt_tps


def mlx_lm_decode(model, tokenizer, prompts: list[list[int]], n: int) -> float:
    if len(prompts) == 1:
        *_, last = stream_generate(model, tokenizer, prompts[0], max_tokens=n)
        return last.generation_tps
    return batch_generate(model, tokenizer, prompts, max_tokens=n).stats.generation_tps


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument(
        "--kv-cache-mib", type=int, default=256, help="minivllm's KV pool (counted in its peak memory)"
    )
    args = parse_args(p, argv)
    decode_n = 16 if args.quick else args.decode_tokens
    model_dir = str(args.model)

    # raw compute: no prefix cache, so repeated runs of the same prompt are computed again
    llm = LLM(
        model_dir,
        max_num_seqs=8,
        kv_cache_bytes=args.kv_cache_mib << 20,
        enable_prefix_caching=False,
        single_flight="off",
    )
    tok = llm.tokenizer
    long_prompt = prompt_ids(tok, args.prefill_tokens, 0)
    short = [prompt_ids(tok, 32, s) for s in range(8)]
    mx.reset_peak_memory()
    llm.generate([short[0]], SamplingParams(max_tokens=2))  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in ("prefill", "decode1", "decode8")}
    for _ in tqdm(range(args.runs), desc="minivllm"):
        rates["prefill"].append(minivllm_prefill(llm, long_prompt))
        rates["decode1"].append(minivllm_decode(llm, short[:1], decode_n))
        rates["decode8"].append(minivllm_decode(llm, short, decode_n))
    ours = {k: mean_sd(v) for k, v in rates.items()}
    ours_peak = mx.get_peak_memory() / 2**30
    del llm

    model, tokenizer = load_mlx_lm(model_dir)
    mx.reset_peak_memory()
    mlx_lm_decode(model, tokenizer, short[:1], 2)  # warm-up
    rates = {k: [] for k in ("prefill", "decode1", "decode8")}
    for _ in tqdm(range(args.runs), desc="mlx-lm"):
        rates["prefill"].append(mlx_lm_prefill(model, tokenizer, long_prompt))
        rates["decode1"].append(mlx_lm_decode(model, tokenizer, short[:1], decode_n))
        rates["decode8"].append(mlx_lm_decode(model, tokenizer, short, decode_n))
    theirs = {k: mean_sd(v) for k, v in rates.items()}
    theirs_peak = mx.get_peak_memory() / 2**30

    labels = {
        "prefill": f"prefill tok/s ({len(long_prompt)}-token prompt)",
        "decode1": "decode tok/s, batch 1",
        "decode8": "decode tok/s, 8 concurrent (aggregate)",
    }
    rows = [
        {
            "metric": labels[k],
            "minivllm": f"{ours[k][0]:.1f} ± {ours[k][1]:.1f}",
            "mlx-lm": f"{theirs[k][0]:.1f} ± {theirs[k][1]:.1f}",
            "minivllm / mlx-lm": f"{ours[k][0] / theirs[k][0]:.2f}x",
        }
        for k in labels
    ]
    rows.append(
        {
            "metric": "peak memory GiB",
            "minivllm": f"{ours_peak:.2f}",
            "mlx-lm": f"{theirs_peak:.2f}",
            "minivllm / mlx-lm": f"{ours_peak / theirs_peak:.2f}x",
        }
    )
    rows.append(
        {
            "metric": "minivllm batch-8 / batch-1 decode",
            "minivllm": f"{ours['decode8'][0] / ours['decode1'][0]:.2f}x",
            "mlx-lm": f"{theirs['decode8'][0] / theirs['decode1'][0]:.2f}x",
            "minivllm / mlx-lm": "",
        }
    )
    meta = metadata(
        args.model,
        page_size=16,
        backend=detect_backend().name,
        blas=detect_backend().blas,
        runs=args.runs,
        decode_tokens=decode_n,
        kv_cache_mib=args.kv_cache_mib,
    )
    print_report(
        write_results(
            result_name("throughput", args), rows, meta, out_dir=args.out, allow_dirty=args.allow_dirty
        )
    )


if __name__ == "__main__":
    main()
