"""Where a batch-1 decode step's time goes, against one pass over the model's weight matrices.

    python -m benchmarks.decode_profile [--model DIR | --family NAME] [--runs 3] [--quick]

--family: the tiny random model of a supported family (tests/tiny_model.FAMILY_OPTIONS, as
benchmarks/families.py), whose step is mostly per-step host work rather than matmuls.

One engine, one request decoding; each run times every probe below in a rotated order (a busy machine
slows them alike), `--steps` times each, and the table gives the mean over runs of each probe's median:
  - step: `LLMEngine.step()` as the server runs it (scheduling, the graph, its evaluation, bookkeeping);
  - step, OpenBLAS 1 thread: the same with OpenBLAS's threads set to one for the step;
  - graph build: the Python work of building the step's forward and sampling graph, not evaluated;
  - forward + argmax: that graph evaluated, without the engine around it;
  - mlx-lm forward + argmax: mlx-lm's own `model(token, cache)` on the same modules and weights, built
    and evaluated (its cache holds the request's context and grows by one token a call);
  - weight pass, each matrix alone: a batch-1 product with every linear layer's weight (in the layout the
    engine keeps it), evaluated one by one: the bandwidth limit of a step;
  - weight pass, one graph: the same products evaluated together;
  - lm_head + argmax: the output layer and the greedy sample over the vocabulary alone;
  - 100 tiny nodes: a chain of 100 additions on a 4-element array, built and evaluated: what a graph node
    costs to dispatch whatever its size (on the CPU backend, from the evaluating thread).
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from benchmarks.harness.limits import in_out_weight
from benchmarks.harness.results import engine_metadata, mean_sd, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_args, result_name
from kernels.paged_attention import build_layout
from minivllm import LLM, SamplingParams
from minivllm.models.backend import OPENBLAS_PATH
from minivllm.models.cpu_layout import TransposedLinear
from minivllm.models.layers import forward
from tests.tiny_model import FAMILY_OPTIONS, make_tiny_family_model


class Probes:
    def __init__(self, llm: LLM):
        self.engine = engine = llm.engine
        prompt = llm.tokenizer.encode("def fibonacci(n): the kernel reads pages of the cache " * 4)[:32]
        params = SamplingParams(max_tokens=engine.max_model_len - len(prompt), ignore_eos=True)
        self.seq = engine.add_request("profiled", prompt, params)
        while not self.seq.output_token_ids:
            engine.step()
        self.blas = ctypes.CDLL(OPENBLAS_PATH) if OPENBLAS_PATH else None
        layers = [m for _, m in engine.model.named_modules() if isinstance(m, (nn.Linear, TransposedLinear))]
        self.products = [_batch1_product(m) for m in layers]
        self.head = getattr(engine.model, "lm_head", None) or engine.model.model.embed_tokens.as_linear
        self.hidden = mx.ones((1, engine.model.args.hidden_size))
        mx.eval(self.hidden)
        self.cache = make_prompt_cache(engine.model)
        engine.model(mx.array([self.seq.token_ids[:-1]]), cache=self.cache)
        mx.eval([(c.keys, c.values) for c in self.cache])
        self.last = mx.array([self.seq.token_ids[-1:]])
        self.tiny = mx.ones((4,))
        mx.eval(self.tiny)

    def all(self) -> dict[str, Callable[[], None]]:
        probes = {
            "step": self.engine.step,
            "graph build (Python)": self.build,
            "forward + argmax": self.forward_argmax,
            "mlx-lm forward + argmax": self.mlx_lm_forward_argmax,
            "weight pass, each matrix alone": lambda: [mx.eval(p()) for p in self.products],
            "weight pass, one graph": lambda: mx.eval([p() for p in self.products]),
            "lm_head + argmax": lambda: mx.eval(mx.argmax(self.head(self.hidden), axis=-1)),
            "100 tiny nodes": self.tiny_nodes,
        }
        if self.blas is not None:
            probes["step, OpenBLAS 1 thread"] = self.step_one_thread
        return probes

    def build(self) -> mx.array:
        """A decode token's forward: the request's last computed token again (its K/V rewritten, equal)."""
        seq, runner = self.seq, self.engine.runner
        n = seq.num_computed_tokens - 1
        layout = build_layout([seq.cache.page_table], [n], [1], runner.page_size)
        return forward(
            runner.architecture, runner.model, mx.array(seq.token_ids[n : n + 1]), runner.kv, layout, [0]
        )

    def forward_argmax(self) -> None:
        kv = self.engine.runner.kv
        mx.eval(mx.argmax(self.build(), axis=-1), kv.keys, kv.values)  # as the step evaluates it

    def tiny_nodes(self) -> None:
        x = self.tiny
        for _ in range(100):
            x = x + self.tiny
        mx.eval(x)

    def mlx_lm_forward_argmax(self) -> None:
        logits = self.engine.model(self.last, cache=self.cache)
        mx.eval(mx.argmax(logits[:, -1], axis=-1), [(c.keys, c.values) for c in self.cache])

    def step_one_thread(self) -> None:
        threads = self.blas.openblas_get_num_threads()
        self.blas.openblas_set_num_threads(1)
        try:
            self.engine.step()
        finally:
            self.blas.openblas_set_num_threads(threads)


def _batch1_product(layer: nn.Module) -> Callable[[], mx.array]:
    weight = in_out_weight(layer)
    x = mx.ones((1, weight.shape[0]))
    return lambda: x @ weight


def median_ms(fn: Callable[[], object], times: int) -> float:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timings of each probe per run")
    p.add_argument("--layout", default="auto", help="MINIVLLM_CPU_WEIGHT_LAYOUT")
    p.add_argument("--family", choices=sorted(FAMILY_OPTIONS), help="a family's tiny random model instead")
    args = parse_args(p, argv)
    if args.family:
        root = Path(tempfile.mkdtemp(prefix="minivllm-decode-profile-"))
        args.model = make_tiny_family_model(root / args.family, args.family, **FAMILY_OPTIONS[args.family])
    steps = 3 if args.quick else args.steps
    llm = LLM(
        str(args.model),
        max_num_seqs=1,
        kv_cache_bytes=256 << 20,
        enable_prefix_caching=False,
        single_flight="off",
        cpu_weight_layout=args.layout,
    )
    probes = Probes(llm)
    named = probes.all()
    samples: dict[str, list[float]] = {name: [] for name in named}
    names = list(named)
    for fn in named.values():
        fn()  # warm-up: first-call compilation and allocation
    for run in tqdm(range(args.runs), desc="runs"):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            samples[name].append(median_ms(named[name], steps))
    step = statistics.fmean(samples["step"])
    digits = 3 if step < 10 else 1  # a tiny model's step is under a millisecond
    rows = []
    for name, values in samples.items():
        mean, sd = mean_sd(values)
        rows.append(
            {
                "probe": name,
                "ms": f"{mean:.{digits}f} ± {sd:.{digits}f}",
                "share of a step": f"{100 * mean / step:.0f}%",
            }
        )
    meta = engine_metadata(
        args.model,
        args.runs,
        steps=steps,
        weight_layouts=llm.engine.model_config["_weight_layouts"],
    )
    print_report(
        write_results(
            result_name("decode_profile" + (f"-{args.family}" if args.family else ""), args),
            rows,
            meta,
            out_dir=args.out,
            allow_dirty=args.allow_dirty,
        )
    )


if __name__ == "__main__":
    main()
