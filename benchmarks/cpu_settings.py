"""CPU defaults: OpenBLAS threads, the prefill chunk (max_num_batched_tokens) and overlap, measured setting by setting.

    python -m benchmarks.cpu_settings [--model DIR] [--runs 3] [--quick] [--threads 1,2] [--chunks 256,512,1024,2048]

One engine; the settings change between measurements (OpenBLAS through `openblas_set_num_threads`, the
chunk through the engine's config, which the scheduler reads every step), and every run goes through all
of them in turn (in reversed order every other run), so a busy machine slows them alike. Per setting:
prefill tok/s of a fresh prompt longer than any chunk; the gap between a decoding request's tokens while
that prompt is prefilled beside it (the price of a large chunk); decode tok/s at batch 1 and 8 per
thread count (the chunk does not matter there), with overlap (step n+1 queued before step n is read
back) on and off.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import ctypes
import itertools
import time

from tqdm import tqdm

from benchmarks.harness.engine_timing import decode_rate
from benchmarks.harness.prompts import filler_text
from benchmarks.harness.results import mean_sd, metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from minivllm import LLM, SamplingParams
from minivllm.models.backend import OPENBLAS_PATH, detect_backend


def blas_threads(n: int | None = None) -> int:
    """OpenBLAS's thread count, after setting it to n if given."""
    lib = ctypes.CDLL(OPENBLAS_PATH)
    if n is not None:
        lib.openblas_set_num_threads(n)
    return lib.openblas_get_num_threads()


class Probe:
    def __init__(self, llm: LLM, prompt_tokens: int, decode_tokens: int):
        self.llm, self.engine = llm, llm.engine
        self.prompt_tokens, self.n = prompt_tokens, decode_tokens
        self.seed = 0

    def prompt(self, n: int) -> list[int]:
        self.seed += 1  # fresh text every time: no prefix hit even with the cache on
        return self.llm.tokenizer.encode(filler_text(self.seed, n * 8))[:n]

    def prefill_with_decode(self) -> tuple[float, float]:
        """Prefill tok/s of a long prompt, and the longest gap (ms) between the tokens of a request
        decoding beside it."""
        decoding = self.engine.add_request(f"bg{self.seed}", self.prompt(32), SamplingParams(max_tokens=None, ignore_eos=True))  # fmt: skip
        while not decoding.output_token_ids:
            self.engine.step()
        long = self.engine.add_request(f"long{self.seed}", self.prompt(self.prompt_tokens), SamplingParams(max_tokens=1, ignore_eos=True))  # fmt: skip
        gaps, start = [], time.perf_counter()
        while not long.is_finished:
            t = time.perf_counter()
            self.engine.step()
            gaps.append(time.perf_counter() - t)
        rate = self.prompt_tokens / (time.perf_counter() - start)
        self.engine.abort_request(decoding.request_id)
        self.engine.step()
        return rate, max(gaps) * 1e3

    def decode(self, batch: int) -> float:
        params = SamplingParams(max_tokens=self.n + 1, ignore_eos=True)
        seqs = [self.engine.add_request(f"d{self.seed}-{i}", self.prompt(64), params) for i in range(batch)]
        return decode_rate(self.engine, seqs)


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="OpenBLAS thread counts")
    p.add_argument("--chunks", default="256,512,1024,2048", help="max_num_batched_tokens values")
    p.add_argument(
        "--prompt-tokens", type=int, default=2048, help="the prefilled prompt (longer than a chunk)"
    )
    args = parse_args(p, argv)
    if not OPENBLAS_PATH:
        raise SystemExit("OpenBLAS is not loaded: nothing to set (this script is for the CPU backend)")
    threads = [int(x) for x in args.threads.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    prompt_tokens, decode_tokens = (256, 8) if args.quick else (args.prompt_tokens, 32)
    llm = LLM(str(args.model), max_num_seqs=9, max_num_batched_tokens=max(chunks), enable_prefix_caching=False,
              single_flight="off", kv_cache_bytes=1 << 30)  # fmt: skip
    probe = Probe(llm, prompt_tokens, decode_tokens)
    settings = [(t, c) for t in threads for c in chunks]
    raw: dict[str, list[float]] = {}
    probe.decode(1)  # warm-up
    default_threads, default_overlap = blas_threads(), llm.engine.overlap
    try:
        for run in tqdm(range(args.runs), desc="runs"):
            for t, c in settings[:: -1 if run % 2 else 1]:
                assert blas_threads(t) == t
                llm.engine.config.max_num_batched_tokens = c
                rate, gap = probe.prefill_with_decode()
                raw.setdefault(f"prefill {t} {c}", []).append(rate)
                raw.setdefault(f"gap {t} {c}", []).append(gap)
                if c == chunks[0]:
                    for b, overlap in itertools.product((1, 8), (True, False)):
                        llm.engine.overlap = overlap
                        raw.setdefault(f"decode{b} {t} {overlap}", []).append(probe.decode(b))
                    llm.engine.overlap = default_overlap  # prefill gaps are measured at the default
    finally:
        blas_threads(default_threads)
    rows = []
    for t, c in settings:
        row = {"OpenBLAS threads": t, "max_num_batched_tokens": c}
        for label, key in (("prefill tok/s", f"prefill {t} {c}"), ("longest decode gap ms", f"gap {t} {c}")):
            m, s = mean_sd(raw[key])
            row[label] = f"{m:.1f} ± {s:.1f}"
        for b, overlap in itertools.product((1, 8), (True, False)):
            m, s = mean_sd(raw[f"decode{b} {t} {overlap}"])
            row[f"decode b{b} tok/s" + ("" if overlap else ", no overlap")] = f"{m:.2f} ± {s:.2f}"
        rows.append(row)
    meta = metadata(args.model, page_size=16, backend=detect_backend().name, blas=detect_backend().blas,
                    runs=args.runs, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                    default_blas_threads=default_threads)  # fmt: skip
    paths = write_results(result_name("cpu_settings", args), rows, meta, raw=raw, out_dir=args.out,
                          allow_dirty=args.allow_dirty)  # fmt: skip
    print_report(paths)


if __name__ == "__main__":
    main()
