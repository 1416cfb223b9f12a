"""What the cache advice costs decode: tokens/s with the advice on (each request's page hashes recorded, the
recorded stream replayed every --interval seconds in its low-priority worker process, each "on" run starting
while a replay runs, which the engine's requests must pause) and off, interleaved in one process on the same
engine; and, since a loaded machine's A/B spread hides a 1% difference, the
recording's own time per request against one decode step of the same run (a request records once and
decodes at least one step, so this share bounds what recording costs decode), and the replay's time.

The stream starts with --stream-requests synthetic requests (--stream-pages pages each, sharing prefixes),
so that every replay has a long stream's work to do while the engine decodes.

    python -m benchmarks.shadow_cost [--model DIR] [--batch 4] [--tokens 48] [--repeats 4]
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import random
import time

from benchmarks.harness import models, results, runner
from minivllm import LLM, SamplingParams
from minivllm.cache.hash_stream import HashStream
from minivllm.shadow import ShadowReplay, shadow_rates


def synthetic_stream(stream: HashStream, requests: int, pages: int, page_size: int) -> None:
    rng = random.Random(0)
    for _ in range(requests):
        shared = rng.randrange(20)  # one of 20 system prompts, then the request's own pages
        own = [rng.getrandbits(64) for _ in range(pages // 2)]
        hashes = [(shared * 1000 + i).to_bytes(8, "little") for i in range(pages - len(own))]
        stream.record(hashes + [h.to_bytes(8, "little") for h in own], pages * page_size)


def decode_rate(llm: LLM, batch: int, tokens: int, round_: int) -> float:
    """Generated tokens per second for a batch of short distinct prompts (prefill is a small share)."""
    prompts = [[3 + (round_ * batch + i) % 500] * 8 + list(range(10, 26)) for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)


def record_seconds(page_size: int, pages: int, calls: int = 2000) -> float:
    """One record() of a request of `pages` full pages, into a full stream (so each also drops one)."""
    stream = HashStream(calls // 2)
    hashes = [i.to_bytes(32, "little") for i in range(pages)]
    start = time.perf_counter()
    for _ in range(calls):
        stream.record(hashes, pages * page_size)
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between replays (the server's: 30)")
    p.add_argument("--stream-requests", type=int, default=2000)
    p.add_argument("--stream-pages", type=int, default=64)
    p.add_argument(
        "--record-pages", type=int, default=512, help="pages of the request whose recording is timed"
    )
    args = runner.parse_on_clean_tree(p, argv)
    model = models.resolve_model(args.model)
    llm = LLM(str(model))
    engine, page_size = llm.engine, llm.engine.config.page_size
    stream = engine.hash_stream
    synthetic_stream(stream, args.stream_requests, args.stream_pages, page_size)
    decode_rate(llm, args.batch, 4, 0)  # warm up
    rates: dict[str, list[float]] = {"off": [], "on": []}
    replays = pauses = 0
    for r in range(args.repeats):
        for mode in ("on", "off") if r % 2 else ("off", "on"):
            if mode == "off":
                engine.hash_stream = None
                rates[mode].append(decode_rate(llm, args.batch, args.tokens, r))
                continue
            engine.hash_stream = stream
            shadow = ShadowReplay(
                stream, engine.num_pages, engine.config.eviction, page_size, args.interval,
                busy=engine.has_unfinished_requests,
            )  # fmt: skip
            shadow.start()
            while shadow.replayed < stream.recorded:  # its worker is up and has replayed once
                time.sleep(0.1)
            synthetic_stream(stream, 1, args.stream_pages, page_size)  # a new replay is due
            while not shadow.replaying:  # decode starts while the worker replays: it must pause it
                time.sleep(0.01)
            first = shadow.runs
            rates[mode].append(decode_rate(llm, args.batch, args.tokens, r))
            shadow.close()
            replays += shadow.runs - first
            pauses += shadow.pauses
    engine_pages, eviction = engine.num_pages, engine.config.eviction
    llm.close()
    rows = []
    for mode, values in rates.items():
        mean, sd = results.mean_sd(values)
        rows.append(
            {
                "measure": f"decode, advice {mode}",
                "value": mean,
                "sd": sd,
                "unit": "tok/s",
                "runs": len(values),
            }
        )
    rows.append(
        {"measure": "decode, advice on / off", "value": rows[1]["value"] / rows[0]["value"], "unit": "x"}
    )
    step_s = args.batch / max(rates["off"])  # the fastest off run's decode step (a batch's token per step)
    record_s = record_seconds(page_size, args.record_pages)
    rows.append(
        {
            "measure": f"recording one request of {args.record_pages} pages",
            "value": record_s * 1e6,
            "unit": "us",
        }
    )
    rows.append({"measure": "decode step, batch of the run", "value": step_s * 1e3, "unit": "ms"})
    rows.append({"measure": "recording / one decode step", "value": 100 * record_s / step_s, "unit": "%"})
    start = time.perf_counter()
    shadow_rates(stream.snapshot(), engine_pages, eviction, page_size)
    rows.append(
        {
            "measure": f"one replay of the stream ({len(stream.snapshot())} requests), in-process",
            "value": time.perf_counter() - start,
            "unit": "s",
        }
    )
    meta = results.metadata(
        model, batch=args.batch, tokens=args.tokens, interval_s=args.interval,
        stream_requests=args.stream_requests, stream_pages=args.stream_pages,
        replays_while_on=replays,
        pauses_while_on=pauses,
    )  # fmt: skip
    results.print_report(results.write_results("shadow_cost", rows, meta, allow_dirty=args.allow_dirty))


if __name__ == "__main__":
    main()
