"""Where a prefill chunk's and a decode step's time goes at a long context on the CPU backend, for each
attention path (the compiled kernel, MLX ops), beside the hardware's limits measured in the same run.

    python -m benchmarks.long_context_profile [--model DIR] [--context 16384] [--chunk 512] [--runs 3]

Two engines sharing one copy of the weights (MINIVLLM_CPU_ATTENTION=compiled and mlx) prefill the same
context of --context tokens once. Each run then times, engine by engine:
  - prefill chunk: the step that computes --chunk new tokens after the restored context (a fresh tail each
    run);
  - decode step: the median step of a request decoding at that context.
Both load the weights as the engine does (a quantized checkpoint's decode products read its levels:
MINIVLLM_CPU_MATMUL). Then the same step again with every linear product and every layer's attention timed
by wrappers that evaluate their inputs first (so each timer holds its own work only; the extra evaluations
make the wrapped step a little slower than the plain one):
  - linear layers: every projection and MLP product;
  - attention: each layer's paged attention (for the kernel: its call, the host round trip included);
  - the rest: norms, rope, activations, K/V writes, logits, sampling, graph building and the engine's own
    work (the wrapped step's time minus the two).
And one layer's attention at the context on its own, split: with MLX ops, its QK^T product, mask, softmax
(numpy's for a prefill block, as the engine runs it) and PV product; for the kernel, the BLAS products of
the same shapes called alone, and the rest (softmax, copies, the call).
The limits: the chunk's FLOPs at the matmul rate; a decode step's weights and K/V at the weight pass's
bandwidth (benchmarks/harness/limits.py).
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import contextlib
import ctypes
import random
import time
from collections import defaultdict
from dataclasses import asdict
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from benchmarks.harness.engine_timing import median_seconds
from benchmarks.harness.limits import measure_limits
from benchmarks.harness.results import mean_sd, metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from benchmarks.long_context import Minivllm, kv_bytes_per_token, this_checkout
from kernels import activations, cpu_attention
from kernels import paged_attention as pa
from minivllm.models import layers
from minivllm.models.backend import OPENBLAS_PATH, detect_backend
from minivllm.models.cpu_layout import TransposedLinear
from minivllm.models.loader import load_model
from minivllm.models.quantized_linear import DecodeQuantizedLinear

PATHS = ("compiled", "mlx")  # MINIVLLM_CPU_ATTENTION
LABELS = {"compiled": "compiled kernel", "mlx": "MLX ops"}


class Timers:
    """Wrappers around the model's linear products and attention that time each (inputs evaluated first)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.inside = False  # a timed call's own inner calls (a quantized layer's float32 copy) are its time

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if self.inside:
                return fn(*args, **kwargs)
            mx.eval([a for a in args if isinstance(a, mx.array)])
            start = time.perf_counter()
            self.inside = True
            try:
                out = fn(*args, **kwargs)
                mx.eval(out)
            finally:
                self.inside = False
            self.seconds[name] += time.perf_counter() - start
            return out

        return timed

    @contextlib.contextmanager
    def installed(self):
        linear, transposed, quantized = (
            nn.Linear.__call__,
            TransposedLinear.__call__,
            DecodeQuantizedLinear.__call__,
        )
        with (
            mock.patch.object(layers, "paged_attention", self.wrap("attention", pa.paged_attention)),
            mock.patch.object(nn.Linear, "__call__", self.wrap("linear layers", linear)),
            mock.patch.object(TransposedLinear, "__call__", self.wrap("linear layers", transposed)),
            mock.patch.object(DecodeQuantizedLinear, "__call__", self.wrap("linear layers", quantized)),
        ):
            yield


def fresh_tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab // 8, vocab // 2) for _ in range(n)]  # ordinary tokens, no special ones


def time_chunk(llm: Minivllm, context: list[int], chunk: int, seed: int) -> float:
    """Seconds of the step computing `chunk` new tokens after the cached context."""
    engine = llm.llm.engine
    prompt = context + fresh_tokens(chunk, seed, engine.vocab_size)
    seq = engine.add_request(f"chunk-{seed}", prompt, llm_params(llm, 1))
    start = time.perf_counter()  # the step restores the context (no model work) and computes the chunk
    while not seq.output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    _finish(engine)
    return elapsed


def time_decode(
    llm: Minivllm, context: list[int], steps: int, seed: int, timers: "Timers | None" = None
) -> float:
    """The mean seconds of a decode step at the context (timers, if given, wrap the decode steps only)."""
    engine = llm.llm.engine
    prompt = context + fresh_tokens(16, seed, engine.vocab_size)
    seq = engine.add_request(f"decode-{seed}", prompt, llm_params(llm, steps + 1))
    while not seq.output_token_ids:
        engine.step()
    with timers.installed() if timers else contextlib.nullcontext():
        start = time.perf_counter()
        _finish(engine)
        elapsed = time.perf_counter() - start
    if timers:
        timers.seconds = {name: s / steps for name, s in timers.seconds.items()}
    return elapsed / steps


def llm_params(llm: Minivllm, max_tokens: int):
    return llm.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def profile_steps(llm: Minivllm, label: str, context: list[int], args, seed: int, samples: dict) -> None:
    """One run's plain and wrapped prefill chunk and decode step of one engine, into samples."""
    samples["prefill chunk"][f"{label}: step"].append(time_chunk(llm, context, args.chunk, seed))
    samples["decode step"][f"{label}: step"].append(time_decode(llm, context, args.decode_steps, seed))
    for kind in ("prefill chunk", "decode step"):
        timers = Timers()
        if kind == "prefill chunk":
            with timers.installed():
                total = time_chunk(llm, context, args.chunk, 100 + seed)
        else:
            total = time_decode(llm, context, args.decode_steps, 100 + seed, timers)
        parts = {"wrapped step": total, **timers.seconds, "the rest": total - sum(timers.seconds.values())}
        for name, seconds in parts.items():
            samples[kind][f"{label}: {name}"].append(seconds)


def one_layer_attention(model, context: int, rows: int, repeats: int) -> dict[str, float]:
    """Seconds of one layer's attention of `rows` queries at the end of a context, on each path, split."""
    args = model.args
    heads, heads_kv = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    scale = head_dim**-0.5
    k_pool = mx.random.normal((heads_kv, context, head_dim))
    v_pool = mx.random.normal((heads_kv, context, head_dim))
    q = mx.random.normal((rows, heads, head_dim))
    mx.eval(k_pool, v_pool, q)
    runs, start = [(0, context)], context - rows
    layout = pa.AttentionLayout([pa.SequenceContext(start, rows, runs)], 16, mx.zeros(1), mx.zeros(1))
    out = {
        "compiled kernel: the call": median_seconds(
            lambda: cpu_attention.attention(q, k_pool, v_pool, start, runs, scale, None), repeats
        ),
        "MLX ops: the call": median_seconds(
            lambda: mx.eval(pa.paged_attention(q, k_pool, v_pool, layout, scale)), repeats
        ),
    }
    out |= _blas_parts(q, k_pool, v_pool, start, rows, scale, repeats)
    out |= _mlx_parts(q, k_pool, v_pool, start, rows, scale, repeats)
    return out


def _blocks(start: int, rows: int):
    """The causal blocks of the chunk: (first row, rows, keys seen), as both paths cut them."""
    for r0 in range(0, rows, pa.BLOCK):
        r1 = min(rows, r0 + pa.BLOCK)
        yield r0, r1 - r0, start + r1


def _blas_parts(q, k_pool, v_pool, start, rows, scale, repeats) -> dict[str, float]:
    """The kernel's products alone: cblas_sgemm of its shapes (QK^T and PV per block and KV head)."""
    sgemm = ctypes.CDLL(OPENBLAS_PATH).cblas_sgemm
    heads_kv, _, head_dim = k_pool.shape
    rep = q.shape[1] // heads_kv
    k, v = np.asarray(k_pool), np.asarray(v_pool)
    few = rep * min(rows, pa.BLOCK) <= cpu_attention.FEW_ROWS  # decode: plain loops, not BLAS
    if few:
        return {}
    qs = np.ones((rep * pa.BLOCK, head_dim), np.float32)
    scores = np.empty((rep * pa.BLOCK, start + rows), np.float32)
    o = np.empty((rep * pa.BLOCK, head_dim), np.float32)
    f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p

    def products():
        for _, n, keys in _blocks(start, rows):
            m = rep * n
            for g in range(heads_kv):
                kg, vg = k[g].ctypes.data, v[g].ctypes.data
                sgemm(i(101), i(111), i(112), i(m), i(keys), i(head_dim), f(scale), p(qs.ctypes.data),
                      i(head_dim), p(kg), i(head_dim), f(0), p(scores.ctypes.data), i(keys))  # fmt: skip
                sgemm(i(101), i(111), i(111), i(m), i(head_dim), i(keys), f(1), p(scores.ctypes.data),
                      i(keys), p(vg), i(head_dim), f(0), p(o.ctypes.data), i(head_dim))  # fmt: skip

    return {"compiled kernel: BLAS products (QK^T, PV)": median_seconds(products, repeats)}


def _mlx_parts(q, k_pool, v_pool, start, rows, scale, repeats) -> dict[str, float]:
    """The MLX-ops path's steps alone, block by block as it runs them: QK^T, mask, softmax, PV."""
    heads_kv = k_pool.shape[0]
    rows_, heads, head_dim = q.shape
    rep = heads // heads_kv
    blocks = []
    for r0, n, keys in _blocks(start, rows):
        qb = (q[r0 : r0 + n] * scale).transpose(1, 0, 2).reshape(1, heads_kv, rep, n, head_dim)
        kb, vb = k_pool[None, :, None, :keys], v_pool[None, :, None, :keys]
        blocks.append((qb, kb, vb, n, keys))
    mx.eval([b[0] for b in blocks])
    scores = [qb @ kb.swapaxes(-1, -2) for qb, kb, _, _, _ in blocks]
    mx.eval(scores)
    masked = [mx.where(pa._visible(n, keys, None), s, -1e30) for s, (_, _, _, n, keys) in zip(scores, blocks)]
    mx.eval(masked)
    numpy_softmax = rows > 1 and activations.on_numpy(q.dtype, rows * heads * (start + rows))

    def softmax(s):
        return activations.softmax_numpy(s) if numpy_softmax else mx.softmax(s, axis=-1, precise=True)

    probs = [softmax(s) for s in masked]
    mx.eval(probs)

    def mask():
        return [mx.where(pa._visible(b[3], b[4], None), s, -1e30) for s, b in zip(scores, blocks)]

    parts = {"MLX ops: QK^T products": lambda: [qb @ kb.swapaxes(-1, -2) for qb, kb, *_ in blocks]}
    if rows > 1:  # a decode token sees every key: no mask
        parts["MLX ops: mask"] = mask
    parts["MLX ops: softmax" + (" (numpy)" if numpy_softmax else "")] = lambda: [softmax(s) for s in masked]
    parts["MLX ops: PV products"] = lambda: [p @ b[2] for p, b in zip(probs, blocks)]
    return {name: median_seconds(lambda fn=fn: mx.eval(fn()), repeats) for name, fn in parts.items()}


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=16384, help="tokens of context (default 16384)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512, the engine's)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per measurement")
    args = parse_args(p, argv)
    if args.quick:
        args.context, args.chunk, args.decode_steps = min(args.context, 512), min(args.chunk, 64), 3
    assert detect_backend().name == "cpu", "a profile of the CPU backend"
    loaded = load_model(str(args.model), cpu_matmul="compiled")  # as the engine loads it
    model = loaded[0]
    plan = {"batch": [1], "n": args.decode_steps, "kv_cache_mib": 0}
    plan["kv_cache_mib"] = max(
        64, int((args.context + 4 * args.chunk) * kv_bytes_per_token(args.model) * 1.3) >> 20
    )
    settings = {"max_num_batched_tokens": args.chunk}
    engines = {
        path: Minivllm(this_checkout(), loaded, str(args.model), plan, cpu_attention=path, **settings)
        for path in PATHS
    }
    context = fresh_tokens(args.context, 0, engines["compiled"].llm.engine.vocab_size)
    for engine in tqdm(engines.values(), desc="context prefills"):
        engine.llm.generate([context], llm_params(engine, 1))
    limits = measure_limits(model, kv_bytes_per_token(args.model))
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in tqdm(range(args.runs), desc="runs"):
        for path in PATHS[:: -1 if run % 2 else 1]:
            profile_steps(engines[path], LABELS[path], context, args, 1 + run, samples)
        for rows, kind in (
            (args.chunk, "one layer's attention, prefill chunk"),
            (1, "one layer's attention, decode"),
        ):
            for name, seconds in one_layer_attention(model, args.context, rows, 5).items():
                samples[kind][name].append(seconds)
    rows = []
    limit_ms = {
        "prefill chunk": 1e3 * args.chunk / limits.prefill(args.context, args.context + args.chunk),
        "decode step": 1e3 / limits.decode(args.context),
    }
    for kind, named in samples.items():
        for name, values in named.items():
            mean, sd = mean_sd([1e3 * v for v in values])
            row = {"what": kind, "part": name, "ms": f"{mean:.1f} ± {sd:.1f}"}
            row["limit ms"] = f"{limit_ms[kind]:.1f}" if kind in limit_ms and name.endswith(": step") else ""
            rows.append(row)
    meta = metadata(
        args.model,
        context=args.context,
        chunk=args.chunk,
        runs=args.runs,
        backend=detect_backend().name,
        blas=detect_backend().blas,
        limits=asdict(limits),
    )
    notes = (
        "The wrapped step evaluates each op's inputs before timing it, so it is a little slower than the plain "
        "one; its parts are its linear layers, its attention and the rest. The limit "
        "of a prefill chunk is its FLOPs (linear layers and attention) at the matmul rate of this run; of a "
        "decode step, one pass over the weights and the context's K/V at the weight pass's bandwidth."
    )
    name = result_name(f"long_context_profile-{args.context // 1024}k", args)
    paths = write_results(name, rows, meta, notes=notes, out_dir=args.out, allow_dirty=args.allow_dirty)
    print_report(paths)


if __name__ == "__main__":
    main()
