"""Graph nodes of one decode step by batch size, minivllm against mlx-lm, on the same model.

    python -m benchmarks.step_nodes [--tiny-layers 24 | --model DIR] [--batches 1,2,4,8] [--quick]

A GPU backend launches a step's nodes one kernel at a time, so where a step's arithmetic is small (a
0.5B model on a large GPU) its node count sets much of its time. minivllm runs attention per sequence
(kernels/paged_attention.py), so its decode graph grows with each request in the batch; mlx-lm's batched
decode (`BatchGenerator`) runs each layer once for the whole batch. Counted on the CPU backend: for short
contexts a decode step's attention there is the same per-sequence ops as on a GPU backend; its rope and
norms take CPU-only paths with other node counts, once per layer whatever the batch. Each row: the median
over the decode steps of `--tokens` tokens, after the prompts' prefill.

--tiny-layers N: a tiny random Qwen2 model of N layers (tests/tiny_model.py) instead of --model. A larger
model's CPU step evaluates parts of its graph early (numpy element-wise work, kernels.activations), so
its count is not a GPU's; a tiny model's whole step is one graph, as on a GPU.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import statistics
import tempfile

from mlx_lm.generate import BatchGenerator

from benchmarks.harness.graph_nodes import nodes_per_async_eval
from benchmarks.harness.models import resolve_model
from benchmarks.harness.results import engine_metadata, print_report, write_results
from benchmarks.harness.runner import base_parser, parse_on_clean_tree, result_name
from minivllm import LLM, SamplingParams
from minivllm.models.loader import load_model
from tests.tiny_model import make_tiny_model


def prompts(batch: int) -> list[list[int]]:
    """Distinct prompts of different lengths (24 to 24 + 5 * (batch - 1) tokens), as a batch has."""
    return [[3 + i] * 8 + list(range(10, 26 + 5 * i)) for i in range(batch)]


def minivllm_nodes(llm: LLM, batch: int, tokens: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    seqs = [engine.add_request(f"b{batch}-{i}", p, params) for i, p in enumerate(prompts(batch))]
    while not all(s.output_token_ids for s in seqs):
        engine.step()
    with nodes_per_async_eval() as counts:
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(counts)


def mlx_lm_nodes(model, batch: int, tokens: int) -> float:
    generator = BatchGenerator(model, max_tokens=tokens)
    generator.insert(prompts(batch), [tokens] * batch)
    while not any(generator.next_generated() or []):  # the prompts' prefill, to the first tokens
        pass
    with nodes_per_async_eval() as counts:
        while generator.next_generated():
            pass
    generator.close()
    return statistics.median(counts)


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated")
    p.add_argument("--tokens", type=int, default=16, help="decoded tokens per request")
    p.add_argument("--tiny-layers", type=int, help="count on a tiny random Qwen2 model of this many layers")
    args = parse_on_clean_tree(p, argv)
    if args.tiny_layers:  # no default model is fetched
        args.model = make_tiny_model(tempfile.mkdtemp(prefix="step-nodes-"), num_layers=args.tiny_layers)
    args.model = resolve_model(args.model)
    batches = [1, 2] if args.quick else [int(b) for b in args.batches.split(",")]
    tokens = 4 if args.quick else args.tokens
    llm = LLM(str(args.model), max_num_seqs=max(batches), kv_cache_bytes=256 << 20)
    mlx_lm_model = load_model(str(args.model))[0]
    raw = {"minivllm": {}, "mlx-lm": {}}
    for batch in batches:
        raw["minivllm"][batch] = minivllm_nodes(llm, batch, tokens)
        raw["mlx-lm"][batch] = mlx_lm_nodes(mlx_lm_model, batch, tokens)
    first = batches[0]
    rows = [
        {
            "batch": batch,
            "minivllm nodes": f"{raw['minivllm'][batch]:.0f}",
            "mlx-lm nodes": f"{raw['mlx-lm'][batch]:.0f}",
            "minivllm / mlx-lm": f"{raw['minivllm'][batch] / raw['mlx-lm'][batch]:.2f}x",
            f"minivllm nodes per request beyond batch {first}": (
                f"{(raw['minivllm'][batch] - raw['minivllm'][first]) / (batch - first):.0f}"
                if batch > first
                else ""
            ),
        }
        for batch in batches
    ]
    meta = engine_metadata(args.model, 1, tokens=tokens, tiny_layers=args.tiny_layers)
    paths = write_results(
        result_name("step_nodes", args), rows, meta, out_dir=args.out, raw=raw, allow_dirty=args.allow_dirty
    )
    print_report(paths)


if __name__ == "__main__":
    main()
