"""Prefill and decode throughput, minivllm against mlx-lm and the weight-streaming limit, in one process.

    python -m benchmarks.throughput [--model DIR] [--runs 3] [--quick]

Three engines on the same float32 weights (dequantized from the same directory on the CPU backend, with
OpenBLAS loaded): minivllm as configured (`cpu_weight_layout=auto`), minivllm with nn.Linear's layout
(`native`: the code before the layout choice) and mlx-lm (`stream_generate` at batch 1, `batch_generate`
at batch 8); the last two share one copy of the weights (minivllm's own, when it swapped no layer).
Each run measures every engine in turn, in a rotated order, so a busy machine slows them alike. The limit is one batch-1 pass over the model's own
weight matrices, each evaluated alone, in whichever of the two layouts is faster in that run (a decode
step reads each matrix once: no engine decodes faster than 1000 / limit-ms tokens a second); each
engine's batch-1 rate is shown as a share of it. Rates exclude model loading; decode rates exclude
prefill. Memory: the parameters of minivllm's model, the memory in use once it is loaded, and the peak
while loading it.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import math
import time
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import batch_generate, stream_generate
from tqdm import tqdm

from benchmarks.harness.engine_timing import decode_rate
from benchmarks.harness.results import engine_metadata, mean_sd, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from minivllm import LLM, SamplingParams
from minivllm.engine import llm_engine
from minivllm.models.cpu_layout import TransposedLinear
from minivllm.models.loader import load_model

METRICS = ("prefill", "decode1", "decode8")
LIMIT_CHUNK_BYTES = 512 << 20  # transposed copies alive at once while the limit is measured


def prompt_ids(tokenizer, n: int, seed: int) -> list[int]:
    words = ["alpha", "beta", "gamma", "delta", "kernel", "page", "cache", "token", "batch", "queue", "model"]
    text = " ".join(words[(seed * 7 + i * 3 + i * i) % len(words)] for i in range(n * 2))
    return tokenizer.encode(text)[:n]


class Minivllm:
    def __init__(self, model_dir: str, kv_cache_mib: int, layout: str, loaded: tuple | None = None):
        """loaded: (model, tokenizer, config) to run instead of loading the directory again."""
        settings = dict(max_num_seqs=8, kv_cache_bytes=kv_cache_mib << 20, cpu_weight_layout=layout)
        # raw compute: no prefix cache, so repeated runs of the same prompt are computed again
        settings.update(enable_prefix_caching=False, single_flight="off")
        if loaded is None:
            self.llm = LLM(model_dir, **settings)
        else:
            with mock.patch.object(llm_engine, "load_model", lambda *args, **kw: loaded):
                self.llm = LLM(model_dir, **settings)

    def prefill(self, prompt: list[int]) -> float:
        t = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        return len(prompt) / (time.perf_counter() - t)

    def decode(self, prompts: list[list[int]], n: int) -> float:
        """Aggregate decode tok/s once every request has its first token (prefill excluded)."""
        engine, params = self.llm.engine, SamplingParams(max_tokens=n, ignore_eos=True)
        seqs = [engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params) for i, p in enumerate(prompts)]
        return decode_rate(engine, seqs)


class MlxLm:
    def __init__(self, model: nn.Module, tokenizer):
        self.model, self.tokenizer = model, tokenizer  # mlx-lm's model and TokenizerWrapper

    def prefill(self, prompt: list[int]) -> float:
        *_, last = stream_generate(self.model, self.tokenizer, prompt, max_tokens=1)
        return last.prompt_tps

    def decode(self, prompts: list[list[int]], n: int) -> float:
        if len(prompts) == 1:
            *_, last = stream_generate(self.model, self.tokenizer, prompts[0], max_tokens=n)
            return last.generation_tps
        return batch_generate(self.model, self.tokenizer, prompts, max_tokens=n).stats.generation_tps


# -- the limit --------------------------------------------------------------------------------------------
def weight_pass_ms(products: list) -> float:
    """One pass of batch-1 products, each evaluated alone (as a step's layers run one after another)."""
    start = time.perf_counter()
    for product in products:
        mx.eval(product())
    return (time.perf_counter() - start) * 1e3


def limit_ms(native: nn.Module) -> tuple[float, float]:
    """One batch-1 pass over the model's weight matrices, [out, in] as x @ W.T and [in, out] as x @ W.
    The transposed copies are made a chunk at a time and freed after it (memory stays one model): each
    chunk is timed in the order it was copied, so the matrices it reads have left the caches. NaN where
    the model keeps no float matrices (GPU backends keep quantized layers, and there a product evaluated
    alone times its launch and synchronisation, not the reading of its weights: no limit)."""
    weights = [m.weight for _, m in native.named_modules() if isinstance(m, nn.Linear)]
    if not weights:
        return math.nan, math.nan
    rows = {w.shape[1]: mx.ones((1, w.shape[1])) for w in weights}
    native_ms = weight_pass_ms([lambda w=w: rows[w.shape[1]] @ w.T for w in weights])
    transposed_ms, chunk = 0.0, []
    for i, w in enumerate(weights):
        chunk.append(mx.contiguous(w.T))
        if i == len(weights) - 1 or sum(c.nbytes for c in chunk) + weights[i + 1].nbytes > LIMIT_CHUNK_BYTES:
            mx.eval(chunk)
            transposed_ms += weight_pass_ms([lambda w=w: rows[w.shape[0]] @ w for w in chunk])
            chunk = []
    return native_ms, transposed_ms


def parameter_gib(model: nn.Module) -> float:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 2**30


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="minivllm's KV pool")
    args = parse_args(p, argv)
    decode_n = 16 if args.quick else args.decode_tokens
    model_dir = str(args.model)

    mx.reset_peak_memory()
    ours = Minivllm(model_dir, args.kv_cache_mib, "auto")
    ours_model = ours.llm.engine.model
    memory = {
        "parameters": parameter_gib(ours_model),
        "active": mx.get_active_memory() / 2**30,
        "peak": mx.get_peak_memory() / 2**30,
    }
    layouts = ours.llm.engine.model_config["_weight_layouts"]
    swapped = sum(isinstance(m, TransposedLinear) for _, m in ours_model.named_modules())
    # the weights in nn.Linear's layout, shared by minivllm-native and mlx-lm: minivllm's own when it
    # swapped no layer (one copy of the weights in memory), else loaded again
    engine = ours.llm.engine
    loaded = (
        load_model(model_dir, cpu_weight_layout="native")
        if swapped
        else (ours_model, engine.tokenizer, engine.model_config)
    )
    engines = {
        "minivllm": ours,
        "minivllm-native": Minivllm(model_dir, args.kv_cache_mib, "native", loaded),
        "mlx-lm": MlxLm(loaded[0], loaded[1].wrapper),
    }
    tok = ours.llm.tokenizer
    long_prompt = prompt_ids(tok, args.prefill_tokens, 0)
    short = [prompt_ids(tok, 32, s) for s in range(8)]
    for engine in engines.values():
        engine.decode(short[:1], 2)  # warm-up
    rates = {name: {k: [] for k in METRICS} for name in engines}
    limits: dict[str, list[float]] = {"native": [], "transposed": []}
    names = list(engines)
    for run in tqdm(range(args.runs), desc="runs"):
        order = names[run % len(names) :] + names[: run % len(names)]
        native_ms, transposed_ms = limit_ms(loaded[0])
        limits["native"].append(native_ms)
        limits["transposed"].append(transposed_ms)
        for metric in METRICS:
            for name in order:
                engine = engines[name]
                if metric == "prefill":
                    rates[name][metric].append(engine.prefill(long_prompt))
                else:
                    batch = short[:1] if metric == "decode1" else short
                    rates[name][metric].append(engine.decode(batch, decode_n))
    rows = report_rows(rates, limits, memory, len(long_prompt))
    meta = engine_metadata(
        args.model,
        args.runs,
        decode_tokens=decode_n,
        kv_cache_mib=args.kv_cache_mib,
        weight_layouts=layouts,
        transposed_layers=swapped,
    )
    raw = {"rates": rates, "limit_ms": limits, "memory_gib": memory}
    paths = write_results(
        result_name("throughput", args), rows, meta, out_dir=args.out, raw=raw, allow_dirty=args.allow_dirty
    )
    print_report(paths)


def report_rows(rates: dict, limits: dict, memory: dict, prompt_len: int) -> list[dict]:
    """One row per metric: each engine's mean ± sd, minivllm's ratios to mlx-lm and to the native layout;
    then the limit and each engine's share of it (where there is one: CPU backends), then memory."""
    labels = {
        "prefill": f"prefill tok/s ({prompt_len}-token prompt)",
        "decode1": "decode tok/s, batch 1",
        "decode8": "decode tok/s, 8 concurrent (aggregate)",
    }
    stats = {name: {k: mean_sd(v) for k, v in by_metric.items()} for name, by_metric in rates.items()}
    rows = []
    for k, label in labels.items():
        row = {"metric": label}
        row.update({name: f"{s[k][0]:.2f} ± {s[k][1]:.2f}" for name, s in stats.items()})
        row["minivllm / mlx-lm"] = f"{stats['minivllm'][k][0] / stats['mlx-lm'][k][0]:.2f}x"
        row["minivllm / native"] = f"{stats['minivllm'][k][0] / stats['minivllm-native'][k][0]:.2f}x"
        rows.append(row)
    if any(math.isnan(ms) for ms in limits["native"]):
        return rows + [memory_row(memory, rates)]
    # per run: the faster layout's pass; shares are of the mean limit rate
    best = [min(a, b) for a, b in zip(limits["native"], limits["transposed"])]
    limit_rate = mean_sd([1000 / ms for ms in best])
    blank = blank_row(rates)
    for layout in ("native", "transposed"):
        ms = mean_sd(limits[layout])
        rows.append(
            blank | {"metric": f"limit pass ms, {layout} layout", "minivllm": f"{ms[0]:.1f} ± {ms[1]:.1f}"}
        )
    rows.append(
        blank
        | {
            "metric": "limit tok/s, batch 1 (faster layout)",
            "minivllm": f"{limit_rate[0]:.2f} ± {limit_rate[1]:.2f}",
        }
    )
    share = {name: f"{100 * stats[name]['decode1'][0] / limit_rate[0]:.0f}%" for name in rates}
    rows.append(blank | {"metric": "batch-1 decode, share of the limit"} | share)
    return rows + [memory_row(memory, rates)]


def blank_row(rates: dict) -> dict:
    """A row with every engine's and ratio's cell empty: the limit's and memory's rows fill one."""
    return {name: "" for name in rates} | {"minivllm / mlx-lm": "", "minivllm / native": ""}


def memory_row(memory: dict, rates: dict) -> dict:
    return blank_row(rates) | {
        "metric": "minivllm memory GiB: parameters / in use after load / peak while loading",
        "minivllm": f"{memory['parameters']:.2f} / {memory['active']:.2f} / {memory['peak']:.2f}",
    }


if __name__ == "__main__":
    main()
