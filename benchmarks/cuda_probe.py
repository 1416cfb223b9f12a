"""Which MLX op fails on a GPU backend, and under which settings: each probe in a fresh process (after
a failed launch, MLX 0.32's CUDA command encoder fails later calls too).

    python -m benchmarks.cuda_probe [--budget SECONDS] | tee benchmarks/results/cuda/gpu-check-probe.log

Run where benchmarks/gpu_check.sh runs (its WHEELS install, MLX_ENABLE_TF32=0). The probes, in order:
  - the engine test that failed first in the GPU check (eight prompts in one batch), alone, after the
    single-prompt test, and with CUDA graphs off (MLX_USE_CUDA_GRAPHS=0);
  - the same two tests with every `mx.fast` op and the common `mx` ops evaluated as soon as they are
    built: the first op that fails is printed (FAILOP) with its arguments' shapes;
  - mlx-lm's own model (the reference) decoding batches of 8 to 512 tokens of one context;
  - `mx.fast.rope` alone on [tokens, heads, 1, dims] with one offset a token (the engine's per-token
    rope), over shapes around the failures;
  - the GPU check's engine tests with CUDA graphs off.
"""

import argparse
import os
import subprocess
import sys
import time

EIGHT = "tests/test_engine.py::test_eight_prompts_in_one_continuous_batch_match_mlx_lm"
SEQUENCE = ["tests/test_engine.py", "-k", "single_prompt_matches or eight_prompts"]
# the engine tests benchmarks/gpu_check.sh runs (its list, in shell), with the run stopped sooner
GPU_TESTS = [
    f"tests/test_{name}.py"
    for name in (
        "engine", "speculative", "overlap", "sampling", "paged_attention", "families", "hybrid",
        "long_context", "prefix_cache", "single_flight", "preemption", "kv_disk",
    )
] + ["-k", "not harmony and not through_the_server", "--maxfail=5"]  # fmt: skip
# evaluates each op's result as soon as it is built and names the first that fails
EAGER = r"""
import functools, sys
import minivllm, mlx.core as mx

def shapes(args):
    return [tuple(a.shape) + (str(a.dtype),) if isinstance(a, mx.array) else a for a in args]

def eager(ns, name):
    op = getattr(ns, name)
    @functools.wraps(op)
    def run(*args, **kwargs):
        out = op(*args, **kwargs)
        try:
            mx.eval(out)
        except Exception as e:
            if "function transformations" in str(e):
                return out  # inside mx.compile: evaluated with the compiled function
            print("FAILOP", name, shapes(args), {k: shapes([v])[0] for k, v in kwargs.items()}, str(e)[:120])
            sys.exit(7)
        return out
    setattr(ns, name, run)

for name in ("rope", "scaled_dot_product_attention", "rms_norm", "layer_norm"):
    eager(mx.fast, name)
for name in ("take", "take_along_axis", "put_along_axis", "argmax", "softmax", "concatenate", "repeat",
             "matmul", "addmm", "quantized_matmul", "where", "slice_update", "gather_mm", "gather_qmm",
             "logsumexp", "topk", "argpartition", "sort", "argsort", "stack", "pad", "cumsum"):
    if hasattr(mx, name):
        eager(mx, name)
"""
IN_PROCESS_PYTEST = "\nimport pytest\nsys.exit(pytest.main({args!r}))\n"
REFERENCE_BATCHES = """
import tempfile
import minivllm, mlx.core as mx
from tests.reference import MlxLmReference
from tests.test_engine import random_prompts
from tests.test_speculative import next_token_logits
from tests.tiny_model import make_tiny_model

reference = MlxLmReference(make_tiny_model(tempfile.mkdtemp()))
for batch in (8, 64, 256, 512):
    logits = next_token_logits(reference, random_prompts([24], seed=56)[0], list(range(batch)))
    mx.eval(mx.argmax(logits, axis=-1))
    print("PROBE reference batch", batch, "ok", flush=True)
"""
ROPE_SHAPE = """
import sys
import minivllm, mlx.core as mx

tokens, heads, dims = (int(v) for v in sys.argv[1].split(","))
x = mx.random.normal((tokens, heads, 1, dims))
try:
    mx.eval(mx.fast.rope(x, dims, traditional=False, base=1e4, scale=1.0, offset=mx.arange(tokens)))
    print("PROBE rope", sys.argv[1], "ok")
except RuntimeError as e:
    print("PROBE rope", sys.argv[1], "FAIL", str(e)[:80])
"""
ROPE_SHAPES = [
    "64,4,16",
    "128,4,16",
    "256,4,16",
    "512,2,16",
    "750,2,16",
    "1024,1,16",
    "750,2,64",
    "750,14,64",
]
KEEP = ("FAILOP", "PROBE", "passed", "failed", "Error", "TIMEOUT")


class Prober:
    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.monotonic(), budget_s

    def run(self, name: str, args: list[str], env: dict | None = None, timeout: float = 90) -> None:
        spent = time.monotonic() - self.start
        if spent > self.budget_s:
            print(f"## {name}: skipped (budget)", flush=True)
            return
        t = time.monotonic()
        try:
            done = subprocess.run(
                args,
                env=os.environ | (env or {}),
                capture_output=True,
                text=True,
                timeout=min(timeout, self.budget_s + 15 - spent),
            )
            lines, rc = (done.stdout + done.stderr).strip().splitlines(), done.returncode
        except subprocess.TimeoutExpired:
            lines, rc = ["TIMEOUT"], -1
        kept = [line for line in lines if any(k in line for k in KEEP)] or lines[-5:]
        print(f"## {name}: rc={rc} {time.monotonic() - t:.0f}s", flush=True)
        for line in kept[-8:]:
            print("   ", line[:400], flush=True)


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=float, default=400, help="seconds; later probes are skipped")
    args = parser.parse_args(argv)
    probe = Prober(args.budget)
    graphs_off = {"MLX_USE_CUDA_GRAPHS": "0"}
    probe.run("eight prompts alone", pytest(EIGHT))
    probe.run("single then eight", pytest(*SEQUENCE))
    probe.run("single then eight, CUDA graphs off", pytest(*SEQUENCE), graphs_off)
    eager_sequence = ["-q", "-p", "no:cacheprovider", *SEQUENCE]
    probe.run("single then eight, eager ops", python(EAGER + IN_PROCESS_PYTEST.format(args=eager_sequence)))
    probe.run("mlx-lm reference, batches 8 to 512", python(REFERENCE_BATCHES))
    for shape in ROPE_SHAPES:
        probe.run(f"rope tokens,heads,dims={shape}", python(ROPE_SHAPE, shape), timeout=30)
    probe.run("GPU check's tests, CUDA graphs off", pytest(*GPU_TESTS), graphs_off, timeout=170)


if __name__ == "__main__":
    main()
