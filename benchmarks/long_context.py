"""Long contexts: decode tok/s at batch 1 and 8 with 1k, 4k and 16k tokens of context, and prefill tok/s of
512-, 4k- and 16k-token prompts; minivllm against mlx-lm and the hardware's limits, and optionally against
another minivllm checkout or itself with the CPU backend's attention on MLX ops.

    python -m benchmarks.long_context [--model DIR] [--runs 3] [--quick] [--baseline COMMIT_OR_DIR]
        [--contexts 1024,16384] [--prefill 512] [--batch 1]  (a subset: its own file, long_context-b1)
        [--tag prefill]  (appended to the file name: long_context-b1-prefill)
        [--mlx-attention]  (adds minivllm with MINIVLLM_CPU_ATTENTION=mlx: the compiled kernel off)
        [--mlx-matmul]  (adds minivllm with MINIVLLM_CPU_MATMUL=mlx: decode reads the float32 weights)
        [--kernel-max-rows 8]  (products of up to this many rows read the levels; the engine's: 4)
        [--peer-max-context 16384]  (mlx-lm and the MLX-attention engine only up to this context)

The limits (benchmarks/harness/limits.py) are measured in the same run: the float32 matmul rate over a
prefill's FLOPs, one batch-1 pass over the weight matrices plus the context's K/V for a decode step.

All engines live in this process. On the CPU backend minivllm's engines share one copy of the weights
(float32, and a quantized checkpoint's levels, which its decode steps read: MINIVLLM_CPU_MATMUL); mlx-lm
and the `--mlx-matmul` engine share a second copy, float32 only (MLX's own quantized CPU kernels are
slower than that: mlx-lm runs best on this CPU from float32 weights). Every every measurement is taken for each engine in turn before the next one, so
a busy machine slows them alike and the ratios hold. `--baseline` adds the engine of another commit (a
temporary git worktree is made for it) or checkout: its `minivllm` and `kernels` packages are imported
under their own names beside this checkout's (it is given the loaded model, so none of its lazy imports
are needed).

How the contexts are made, identically for every engine: one long prompt (the largest context) is
prefilled once; that prefill is the largest prefill measurement. A decode context of L tokens is that
prompt's first L tokens: minivllm restores them from its prefix cache (the last <= 16 tokens are
recomputed) and its 8 concurrent requests share those pages; mlx-lm gets a copy of its KV cache trimmed
to L - 1 tokens (8 copies for batch 8) and runs the last token through the model. Decode rates start
once every request has its first token. The other prefill sizes use fresh prompts (no prefix hit).
mlx-lm's batch-1 decode is its own `generate_step`; its batch 8 is its model and KVCache stepped by
the same pipelined loop (`mx.async_eval` of step n+1 before step n's tokens are read).

Repetitions: every measurement `--runs` times except the largest prefill (once per engine: it takes
minutes on a CPU). With `--peer-max-context` below the largest context, every engine first prefills the
context's first that many tokens, and the uncapped engines then the rest of it (restoring the first part
from the prefix cache): the row "prefill A..B" is the rate of positions A to B.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import contextlib
import copy
import gc
import importlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import mlx.core as mx
from tqdm import tqdm

from benchmarks.harness.checkouts import checkout
from benchmarks.harness.engine_timing import decode_rate
from benchmarks.harness.limits import Limits, measure_limits
from benchmarks.harness.prompts import filler_text, load_tokenizer
from benchmarks.harness.results import mean_sd, metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from kernels import cpu_quantized_matmul
from minivllm.models.backend import detect_backend
from minivllm.models.loader import load_model

SIZES = {  # (contexts, prefill prompts, decode tokens, batch sizes)
    "full": ([1024, 4096, 16384], [512, 4096], 32, [1, 8]),
    "quick": ([128, 512], [64, 256], 8, [1, 8]),
}
PACKAGES = ("minivllm", "kernels")  # what a checkout's engine is made of
MLX_ATTENTION = "minivllm, MLX attention"  # this checkout with MINIVLLM_CPU_ATTENTION=mlx
MLX_MATMUL = "minivllm, float32 decode"  # this checkout with MINIVLLM_CPU_MATMUL=mlx


# -- minivllm, this checkout's or another's -------------------------------------------------------------
class Minivllm:
    def __init__(
        self, packages: dict, loaded: tuple, model_dir: str, plan: dict, max_context=None, **settings
    ):
        """packages: the checkout's modules by name; loaded: (model, tokenizer, config) to run; settings:
        more of its engine settings; max_context: measured at contexts up to this only."""
        self.max_context = max_context
        self.SamplingParams = packages["minivllm"].SamplingParams
        engine_module = packages["minivllm.engine.llm_engine"]
        with mock.patch.object(engine_module, "load_model", lambda *args, **kw: loaded):
            # lru: the default s3fifo does not cache a prompt longer than its small queue on first sight
            self.llm = packages["minivllm"].LLM(
                model_dir,
                max_num_seqs=max(plan["batch"]),
                kv_cache_bytes=plan["kv_cache_mib"] << 20,
                eviction="lru",
                single_flight="off",
                **settings,
            )
        self.n = plan["n"]

    def prefill(self, prompt: list[int], cached: int = 0) -> float:
        """tok/s of the prompt's tokens past the first `cached` (which its prefix cache holds)."""
        t = time.perf_counter()
        self.llm.generate([prompt], self.SamplingParams(max_tokens=1, ignore_eos=True))
        return (len(prompt) - cached) / (time.perf_counter() - t)

    def decode(self, prompt: list[int], batch: int) -> float:
        """Aggregate decode tok/s of `batch` requests of one prompt, once each has its first token."""
        engine = self.llm.engine
        params = self.SamplingParams(max_tokens=self.n + 1, ignore_eos=True)
        seqs = [engine.add_request(f"d{time.monotonic_ns()}-{i}", prompt, params) for i in range(batch)]
        return decode_rate(engine, seqs)


def this_checkout() -> dict:
    importlib.import_module("minivllm.engine.llm_engine")
    return _modules()


def _modules() -> dict:
    return {name: m for name, m in sys.modules.items() if name.split(".")[0] in PACKAGES}


def import_checkout(root: Path) -> dict:
    """Another checkout's minivllm and kernels modules, imported beside this checkout's."""
    ours = this_checkout()
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        importlib.import_module("minivllm.engine.llm_engine")
        theirs = _modules()
        origin = Path(theirs["minivllm"].__file__).resolve()
        assert origin.is_relative_to(root.resolve()), f"imported {origin}, not from {root}"
    finally:
        sys.path.remove(str(root))
        for name in _modules():
            del sys.modules[name]
        sys.modules.update(ours)
    return theirs


# -- mlx-lm -------------------------------------------------------------------------------------------
class MlxLm:
    def __init__(self, model, n: int, max_context: int | None = None):
        self.model = model
        self.n = n
        self.max_context = max_context
        self.context: list | None = None  # KV cache of the longest prompt prefilled so far
        self.context_prompt: list[int] = []  # that prompt
        self.built: tuple[int, list] | None = None  # (tokens, each layer's state) of a cache built again

    def prefill(self, prompt: list[int], cached: int = 0) -> float:
        assert cached == 0, "mlx-lm's prompt caches are not kept between prompts here"
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        t = time.perf_counter()
        next(generate_step(mx.array(prompt), self.model, max_tokens=1, prompt_cache=cache))
        rate = len(prompt) / (time.perf_counter() - t)
        if self.context is None or len(prompt) > len(self.context_prompt):
            self.context, self.context_prompt = cache, prompt
        return rate

    def _cache(self, length: int, batch: int) -> list:
        """Copies of the context cache holding its first `length` tokens, `batch` rows. A cache that is not
        plain K/V (a hybrid's recurrent state, a sliding window's ring buffer) cannot be cut: it is built
        again from the prompt's first `length` tokens (batch 1)."""
        from mlx.utils import tree_map
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        if any(type(layer) is not KVCache for layer in self.context):
            assert batch == 1, "only plain K/V caches are copied into a batch"
            if self.built is None or self.built[0] != length:
                cache = make_prompt_cache(self.model)
                self.model(mx.array(self.context_prompt[:length])[None], cache=cache)
                mx.eval([layer.state for layer in cache])
                self.built = length, [(type(layer), layer.state) for layer in cache]
            copy_of = lambda a: mx.array(a) if isinstance(a, mx.array) else a  # noqa: E731
            # a copy of it, as mlx-lm loads a saved prompt cache
            return [kind.from_state(tree_map(copy_of, state)) for kind, state in self.built[1]]
        caches = []
        for layer in self.context:
            c = copy.copy(layer)
            keys, values = layer.keys[..., :length, :], layer.values[..., :length, :]
            c.keys = mx.repeat(keys, batch, axis=0) if batch > 1 else mx.array(keys)
            c.values = mx.repeat(values, batch, axis=0) if batch > 1 else mx.array(values)
            c.offset = length
            caches.append(c)
        mx.eval([(c.keys, c.values) for c in caches])
        return caches

    def decode(self, prompt: list[int], batch: int) -> float:
        from mlx_lm.generate import generate_step

        cache = self._cache(len(prompt) - 1, batch)
        if batch == 1:
            steps = generate_step(
                mx.array(prompt[-1:]), self.model, max_tokens=self.n + 1, prompt_cache=cache
            )
            next(steps)
            t = time.perf_counter()
            count = sum(1 for _ in steps)
            return count / (time.perf_counter() - t)
        return self._batch_decode(mx.array([prompt[-1:]] * batch), cache)

    def _batch_decode(self, tokens: mx.array, cache: list) -> float:
        def step(y: mx.array) -> mx.array:
            return mx.argmax(self.model(y, cache=cache)[:, -1], axis=-1)[:, None]

        y = step(tokens)
        y.tolist()  # every row has its first token
        t = time.perf_counter()
        for _ in range(self.n):
            next_y = step(y)
            mx.async_eval(next_y)
            y.tolist()
            y = next_y
        y.tolist()
        return tokens.shape[0] * self.n / (time.perf_counter() - t)


# -- the plan, the same for every engine ----------------------------------------------------------------
def measure(plan: dict, engines: dict) -> dict[str, dict[str, list[float]]]:
    """engines: name -> object with prefill(prompt, cached) and decode(prompt, batch), both tok/s, and
    max_context. Each measurement is taken for every engine in turn (in reversed order every other run)."""
    context = plan["context"]
    # (kind, prompt, batch or the tokens cached before, run)
    steps = [("prefill", context[:cap], 0, -1) for cap in _context_prefills(engines, len(context))]
    for run in range(plan["runs"]):
        steps += [("prefill", p[run], 0, run) for p in plan["prefill"]]
        steps += [("decode", context[:n], b, run) for n in plan["contexts"] for b in plan["batch"]]
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for kind, prompt, arg, run in tqdm(steps, desc="measurements", file=sys.stderr):
        for name in list(engines)[:: -1 if run % 2 else 1]:
            engine = engines[name]
            if len(prompt) > (engine.max_context or len(prompt)):
                continue
            if kind == "prefill":
                cached = _cached_before(engines, len(prompt)) if run < 0 else 0
                key = f"prefill {cached}..{len(prompt)}" if cached else f"prefill {len(prompt)}"
                rate = engine.prefill(prompt, cached)
            else:
                key, rate = f"decode b{arg} ctx {len(prompt)}", engine.decode(prompt, arg)
            rates[name].setdefault(key, []).append(rate)
            gc.collect()
    return rates


def _context_prefills(engines: dict, length: int) -> list[int]:
    """The lengths of the context's prefixes prefilled first: each engine's cap below the context's length
    (in order), then the whole context."""
    caps = {e.max_context for e in engines.values() if e.max_context and e.max_context < length}
    return sorted(caps) + [length]


def _cached_before(engines: dict, length: int) -> int:
    """How much of a context prefix of `length` tokens an engine has cached by the time it prefills it:
    the previous context prefill's length (0 for the first)."""
    shorter = [c for c in _context_prefills(engines, 1 << 62) if c < length]
    return max(shorter, default=0)


def make_plan(args: argparse.Namespace, tokenizer) -> dict:
    contexts, prefill, n, batch = SIZES["quick" if args.quick else "full"]
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else contexts
    prefill = [int(x) for x in args.prefill.split(",")] if args.prefill else prefill
    n = args.decode_tokens or n
    batch = [int(x) for x in args.batch.split(",")] if args.batch else batch

    def prompt(length: int, seed: int) -> list[int]:
        ids = tokenizer.encode(filler_text(seed, length * 8))
        assert len(ids) >= length, "filler text too short for the prompt length"
        return ids[:length]

    plan = {
        "contexts": contexts,
        "batch": batch,
        "n": n,
        "runs": args.runs,
        "context": prompt(max(contexts), seed=1000),
        # fresh prompts per run: distinct from their first word, so no prefix hit
        "prefill": [
            [prompt(p, seed=100 * i + run) for run in range(args.runs)] for i, p in enumerate(prefill)
        ],
    }
    # room for the context, every fresh prompt and the decode pages, so LRU never evicts the context
    tokens = max(contexts) + args.runs * sum(prefill) + max(batch) * (n + 32)
    plan["kv_cache_mib"] = max(64, int(tokens * kv_bytes_per_token(args.model) * 1.2) >> 20)
    return plan


def kv_bytes_per_token(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


# -- report ---------------------------------------------------------------------------------------------
def rows_of(rates: dict[str, dict[str, list[float]]], baseline: str | None, limits: Limits) -> list[dict]:
    """A row per metric: each engine's mean ± sd (— where it was not measured), ratios, the limit."""
    rows = []
    ours = rates["minivllm"]
    for key in ours:
        cells = {name: mean_sd(rates[name][key]) for name in rates if key in rates[name]}
        m = cells["minivllm"][0]
        row = {"metric": f"{key} (tok/s)"}
        row |= {name: "—" for name in rates}
        row |= {name: f"{mean:.2f} ± {sd:.2f}" for name, (mean, sd) in cells.items()}
        others = [("mlx-lm", "mlx-lm"), (MLX_ATTENTION, "MLX attention"), (MLX_MATMUL, "float32 decode")]
        for other, label in [*others, (baseline, "baseline")]:
            if other in rates:
                row[f"minivllm / {label}"] = f"{m / cells[other][0]:.2f}x" if other in cells else "—"
        limit = _limit(key, limits)
        row["limit"] = f"{limit:.2f}"
        row["minivllm / limit"] = f"{m / limit:.2f}"
        rows.append(row)
    return rows


def _limit(key: str, limits: Limits) -> float:
    """The hardware's limit for a metric's name: "prefill N", "prefill A..B" or "decode bB ctx C"."""
    kind, *rest = key.split()
    if kind == "prefill":
        first, _, last = rest[0].rpartition("..")
        return limits.prefill(int(first or 0), int(last))
    return limits.decode(int(rest[2]), int(rest[0][1:]))


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--baseline", help="a commit or a checkout directory whose engine runs too")
    p.add_argument("--contexts", help="decode context lengths, comma-separated (default 1024,4096,16384)")
    p.add_argument("--prefill", help="fresh prompt lengths for prefill, comma-separated (default 512,4096)")
    p.add_argument("--decode-tokens", type=int, help="decode tokens per measurement (default 32)")
    p.add_argument("--batch", help="decode batch sizes, comma-separated (default 1,8)")
    p.add_argument("--skip-mlx-lm", action="store_true", help="only minivllm (and the baseline)")
    p.add_argument(
        "--mlx-attention", action="store_true", help="also minivllm with MINIVLLM_CPU_ATTENTION=mlx"
    )
    p.add_argument("--mlx-matmul", action="store_true", help="also minivllm with MINIVLLM_CPU_MATMUL=mlx")
    p.add_argument(
        "--kernel-max-rows",
        type=int,
        help=f"products of up to this many rows read the quantized levels (default {cpu_quantized_matmul.MAX_ROWS})",
    )
    p.add_argument(
        "--peer-max-context", type=int, help="mlx-lm and the MLX-attention engine only up to this context"
    )
    p.add_argument("--tag", help="suffix of the results' file name, so that a partial run keeps its own file")
    args = parse_args(p, argv)
    if args.kernel_max_rows:  # where the kernel stops paying, measured against --mlx-matmul
        cpu_quantized_matmul.MAX_ROWS = args.kernel_max_rows
    plan = make_plan(args, load_tokenizer(args.model))
    loaded = load_model(
        str(args.model), cpu_matmul="compiled"
    )  # one copy of the weights for minivllm's engines
    with contextlib.ExitStack() as stack:
        engines = {"minivllm": Minivllm(this_checkout(), loaded, str(args.model), plan)}
        baseline = None
        if args.baseline:
            root, commit = stack.enter_context(checkout(args.baseline))
            baseline = f"baseline {commit}"
            engines[baseline] = Minivllm(import_checkout(root), loaded, str(args.model), plan)
        cap = args.peer_max_context
        if args.mlx_attention:
            packages = this_checkout()
            engines[MLX_ATTENTION] = Minivllm(
                packages, loaded, str(args.model), plan, cap, cpu_attention="mlx"
            )
        plain = (
            load_model(str(args.model)) if args.mlx_matmul or not args.skip_mlx_lm else None
        )  # float32 only
        if args.mlx_matmul:
            engines[MLX_MATMUL] = Minivllm(this_checkout(), plain, str(args.model), plan, cpu_matmul="mlx")
        if not args.skip_mlx_lm:
            engines["mlx-lm"] = MlxLm(plain[0], plan["n"], cap)
        for engine in engines.values():  # warm-up
            engine.prefill(plan["prefill"][0][0][:32])
        limits = measure_limits(loaded[0], kv_bytes_per_token(args.model))
        rates = measure(plan, engines)
    meta = metadata(
        args.model,
        page_size=16,
        backend=detect_backend().name,
        blas=detect_backend().blas,
        runs=args.runs,
        decode_tokens=plan["n"],
        kv_cache_mib=plan["kv_cache_mib"],
        baseline=baseline,
        peer_max_context=cap,
        limits=asdict(limits),
        kernel_max_rows=cpu_quantized_matmul.MAX_ROWS,
        openblas_num_threads=os.environ.get("OPENBLAS_NUM_THREADS", "unset"),
    )
    notes = (
        f"The {len(plan['context'])}-token prefill ran once per engine (it builds the decode contexts); "
        "the rest is the mean ± sd of the runs. minivllm's concurrent requests share the context's pages "
        "(prefix cache); mlx-lm's batch holds one copy of the context per row."
    )
    # a run of some batch sizes only gets its own file: it must not replace the full table
    name = result_name("long_context", args) + "".join(f"-b{b}" for b in plan["batch"] if args.batch)
    name += f"-{args.tag}" if args.tag else ""
    paths = write_results(name, rows_of(rates, baseline, limits), meta, raw=rates,
                          notes=notes, out_dir=args.out, allow_dirty=args.allow_dirty)  # fmt: skip
    print_report(paths)


if __name__ == "__main__":
    main()
