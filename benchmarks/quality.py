"""Quality of the GGUF conversions against the GGUF itself: KL divergence, top-1 agreement, perplexity.

    python -m benchmarks.quality [--gguf PATH] [--tokens 1024] [--plot] [--quick]

The reference is the GGUF's own dequantization (`gguf.quants.dequantize`) as a float32 mlx-lm model.
Each variant is the directory `minivllm convert` writes (the default transcode, or uniform
re-quantization with --bits), loaded the way minivllm loads it on this backend (float32 on the CPU).
On the first --tokens tokens of each text in benchmarks/texts (code and prose) it reports the mean
KL(reference || variant) of the next-token distributions, how often both pick the same top-1 token,
and the perplexity of the text; plus the model's bytes (its safetensors) and the weight bytes a decode
step reads when the weights stay quantized (GPU backends): every tensor but the embedding table, of
which a step reads one row per token. On the CPU backend every variant runs as float32 weights, so
it reads the same float32 bytes per step. Deterministic: no timing, so any machine gives the same table.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import gc
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from benchmarks.harness.models import tensor_bytes
from benchmarks.harness.results import (
    RESULTS_DIR,
    metadata,
    print_report,
    save_plot,
    write_results,
)
from benchmarks.harness.runner import add_allow_dirty, parse_on_clean_tree
from minivllm.models.default_model import cache_root, fetch_gguf
from minivllm.models.gguf_import import UniformQuantization, convert_gguf, load_float_model
from minivllm.models.loader import load_model

TEXTS = Path(__file__).resolve().parent / "texts"
TEXT_NAMES = ("code", "prose")
# Variant name -> None (the default transcode) or a uniform re-quantization (`minivllm convert --bits`).
VARIANTS: dict[str, UniformQuantization | None] = {
    "transcode (default)": None,
    "4-bit g32": UniformQuantization(4, 32),
    "4-bit g64": UniformQuantization(4, 64),
    "4-bit g64, f32 scales (old default)": UniformQuantization(4, 64, "float32"),
    "8-bit g64": UniformQuantization(8, 64),
}
QUICK_VARIANTS = ("transcode (default)", "4-bit g64")
CHUNK = 128  # positions compared at a time (bounds the float temporaries to ~80 MB per array)


@dataclass
class TextScore:
    kl: float  # mean KL(reference || variant) in nats per position
    top1: float  # fraction of positions where both pick the same most likely token
    perplexity: float  # of the text's next tokens under the variant


def log_probs(model, ids: list[int]) -> mx.array:
    """Next-token log-probabilities at every position but the last, shape (len(ids) - 1, vocab)."""
    logits = model(mx.array(ids)[None])[0, :-1].astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def score(reference: np.ndarray, variant: mx.array, ids: list[int]) -> TextScore:
    """Compare a variant's log-probabilities with the reference's, CHUNK positions at a time."""
    kl = nll = 0.0
    agree = 0
    targets = np.array(ids[1:])
    for start in range(0, len(targets), CHUNK):
        ref = np.asarray(reference[start : start + CHUNK], dtype=np.float64)
        var = np.array(variant[start : start + CHUNK]).astype(np.float64)
        kl += float((np.exp(ref) * (ref - var)).sum())
        agree += int((ref.argmax(-1) == var.argmax(-1)).sum())
        nll -= float(var[np.arange(len(var)), targets[start : start + CHUNK]].sum())
    n = len(targets)
    return TextScore(kl / n, agree / n, math.exp(nll / n))


def weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(all tensors, tensors a decode step reads): the step reads one embedding row, not the table."""
    sizes = tensor_bytes(model_dir)
    per_step = sum(b for name, b in sizes.items() if not name.startswith("model.embed_tokens."))
    return sum(sizes.values()), per_step


def row(variant: str, scores: dict[str, TextScore], model_bytes: int, step_bytes: int) -> dict:
    out: dict = {"variant": variant}
    for key, fmt in (("kl", "{:.2g}"), ("top1", "{:.1%}"), ("perplexity", "{:.2f}")):
        label = {"kl": "KL", "top1": "top-1 agreement", "perplexity": "perplexity"}[key]
        out[f"{label} (code / prose)"] = " / ".join(fmt.format(getattr(scores[t], key)) for t in TEXT_NAMES)
    out["model MB"] = f"{model_bytes / 1e6:,.0f}"
    out["weights read per decode step MB (quantized)"] = f"{step_bytes / 1e6:,.0f}"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="GGUF file (default: the offline default model's)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of each text to score")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--plot", action="store_true", help="also write quality.png (KL per variant)")
    p.add_argument("--quick", action="store_true", help="two variants, 64 tokens: a smoke test")
    add_allow_dirty(p)
    args = parse_on_clean_tree(p, argv)
    if args.gguf is None:
        root = cache_root()
        root.mkdir(parents=True, exist_ok=True)
        args.gguf = fetch_gguf(root)  # assembled and sha256-checked once, then reused from the cache
    n_tokens = 64 if args.quick else args.tokens
    variants = {k: v for k, v in VARIANTS.items() if not args.quick or k in QUICK_VARIANTS}

    with tempfile.TemporaryDirectory(prefix="minivllm-quality-") as tmp:
        work = Path(tmp)
        # The reference's log-probabilities wait on disk (~0.6 GB per 1,024 tokens) while variants run.
        model, tokenizer = load_float_model(args.gguf)
        texts = {t: tokenizer.encode((TEXTS / f"{t}.txt").read_text()).ids[:n_tokens] for t in TEXT_NAMES}
        reference = {}
        for t, ids in texts.items():
            lp = log_probs(model, ids)
            reference[t] = np.lib.format.open_memmap(work / f"{t}.npy", "w+", np.float32, lp.shape)
            reference[t][:] = np.array(lp)
            del lp
        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        embedding = model.model.embed_tokens.weight.size
        del model
        gc.collect()

        rows = [
            row(
                "float32 reference (the GGUF dequantized)",
                {t: score(reference[t], mx.array(reference[t][:]), ids) for t, ids in texts.items()},
                4 * params,
                4 * (params - embedding),
            )
        ]
        raw = {}
        meta = None
        for name, uniform in tqdm(variants.items(), desc="variants", unit="variant"):
            model_dir = convert_gguf(args.gguf, work / "variant", uniform=uniform)
            model, _, _ = load_model(str(model_dir))
            scores = {t: score(reference[t], log_probs(model, ids), ids) for t, ids in texts.items()}
            del model
            gc.collect()
            rows.append(row(name, scores, *weight_bytes(model_dir)))
            raw[name] = {t: vars(s) for t, s in scores.items()}
            if uniform is None:
                meta = metadata(
                    model_dir,
                    gguf=str(args.gguf),
                    tokens_per_text={t: len(ids) for t, ids in texts.items()},
                    texts="benchmarks/texts (see its README)",
                )
            shutil.rmtree(model_dir)

    name = "quality" + ("-quick" if args.quick else "")
    paths = write_results(name, rows, meta or {}, out_dir=args.out, raw=raw, allow_dirty=args.allow_dirty)
    print_report(paths)
    if args.plot:
        series = {t: [raw[v][t]["kl"] for v in variants] for t in TEXT_NAMES}
        labels = [v.replace(", ", "\n").replace(" (", "\n(") for v in variants]
        path = save_plot(
            paths[0].stem, labels, series, "KL vs the GGUF (nats/token)", out_dir=args.out, log_y=True
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
