"""Shared benchmark harness: start a server, stream chat requests, build prompts, write results.

Every scenario script uses only this module, so switching `ServerSpec.name` between "minivllm" and
"mlx-lm" is all it takes to point a scenario at the other server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
SERVER_NAMES = ("minivllm", "mlx-lm")
T = TypeVar("T")


# ---------------------------------------------------------------- servers


@dataclass
class ServerSpec:
    name: str  # "minivllm" | "mlx-lm"
    model: Path
    env: dict[str, str] = field(default_factory=dict)  # MINIVLLM_* overrides; ignored by mlx-lm
    port: int = 0  # 0: pick a free port
    label: str = ""  # names the log file, e.g. "prefix-cache-off"
    extra_args: list[str] = field(default_factory=list)  # extra CLI args (mlx-lm only)
    startup_timeout_s: float = 900.0  # the real model on CPU dequantizes at load


@dataclass
class Server:
    spec: ServerSpec
    base_url: str  # http://127.0.0.1:P
    model_id: str  # the `model` field to send
    served_model: Path  # the directory the server actually loaded
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def is_cpu_backend() -> bool:
    from minivllm.backend import detect_backend

    return not detect_backend().is_gpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    # Connect rather than bind: a port in TIME_WAIT from the previous server is fine to reuse.
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def served_model_dir(spec: ServerSpec) -> Path:
    """The peer must run the same weights at the same dtype as minivllm.

    On CPU minivllm dequantizes a 4-bit dir to float32 at load, while mlx_lm.server would run the
    4-bit weights through quantized_matmul (unusably slow on CPU), so the peer gets a float32 copy.
    """
    if spec.name == "mlx-lm" and is_cpu_backend() and _is_quantized(spec.model):
        return float32_copy(spec.model)
    return spec.model


def _server_command(spec: ServerSpec, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if spec.name == "minivllm":
        env.update({"MINIVLLM_MODEL": str(model), **spec.env})
        return [sys.executable, "-m", "uvicorn", "server.app:app", *host], env
    if spec.name == "mlx-lm":
        if is_cpu_backend() and OPENBLAS.exists():
            # MLX's bundled reference BLAS is ~50x slower for float32 matmul; minivllm loads OpenBLAS too.
            env["LD_PRELOAD"] = ":".join(p for p in (str(OPENBLAS), env.get("LD_PRELOAD", "")) if p)
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), *host, *spec.extra_args]
        return cmd, env
    raise ValueError(f"unknown server {spec.name!r}; expected one of {SERVER_NAMES}")


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with code {proc.returncode}; log {log_path}:\n{_log_tail(log_path)}"
            )
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log {log_path}:\n{_log_tail(log_path)}")


def _model_id(spec: ServerSpec, base_url: str, model: Path) -> str:
    if spec.name == "mlx-lm":
        return "default_model"  # mlx_lm.server maps this to its --model; other ids trigger a load
    data = httpx.get(base_url + "/v1/models", timeout=5.0).json().get("data") or []
    return data[0]["id"] if data else str(model)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@contextlib.contextmanager
def running_server(spec: ServerSpec) -> Iterator[Server]:
    """Start the server as a subprocess, wait until it is healthy, always stop it on exit."""
    port = spec.port or free_port()
    if _port_in_use(port):
        raise RuntimeError(f"port {port} is already in use: refusing to benchmark someone else's server")
    model = served_model_dir(spec)
    cmd, env = _server_command(spec, model, port)
    log_dir = RESULTS_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_path = log_dir / f"{spec.name}{'-' + spec.label if spec.label else ''}-{stamp}-{port}.log"
    base_url = f"http://127.0.0.1:{port}"
    health = base_url + ("/health" if spec.name == "minivllm" else "/v1/models")
    with open(log_path, "w") as log:
        log.write(f"# {' '.join(cmd)}\n# env overrides: {spec.env}\n")
        log.flush()
        # New session: a Ctrl-C in the terminal reaches only us; we stop the server ourselves.
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_healthy(proc, health, log_path, spec.startup_timeout_s)
            yield Server(spec, base_url, _model_id(spec, base_url, model), model, log_path)
        finally:
            _stop(proc)


# ---------------------------------------------------------------- requests


@dataclass
class RequestResult:
    ttft_s: float  # send -> first chunk with non-empty content (nan if none)
    latency_s: float  # send -> end of stream
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: restored prompt tokens
    text: str
    sent_at: float  # time.perf_counter() at send
    first_token_at: float
    finished_at: float


def make_client(server: Server, timeout_s: float = 3600.0):
    import openai

    # No retries: a retried request would silently add its first attempt's time to the measurement.
    return openai.AsyncOpenAI(base_url=server.api_url, api_key="x", timeout=timeout_s, max_retries=0)


async def stream_chat(
    client,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    model: str = "default_model",
    first_token: asyncio.Event | None = None,
    **kw: Any,
) -> RequestResult:
    """One streamed greedy chat completion, timed on the client. `first_token` is set on first content."""
    sent = time.perf_counter()
    first = math.nan
    parts: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content = choice.delta.content if choice.delta else None
            if content:
                if not parts:
                    first = time.perf_counter()
                    if first_token is not None:
                        first_token.set()
                parts.append(content)
    end = time.perf_counter()
    if first_token is not None:
        first_token.set()  # never leave a waiter hanging on an empty completion
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return RequestResult(
        ttft_s=first - sent,
        latency_s=end - sent,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else len(parts),
        cached_tokens=(getattr(details, "cached_tokens", None) or 0) if details else 0,
        text="".join(parts),
        sent_at=sent,
        first_token_at=first,
        finished_at=end,
    )


async def chat_burst(
    client, prompts: list[list[dict[str, str]]], max_tokens: int, **kw: Any
) -> list[RequestResult]:
    """Send all prompts at the same moment and wait for all of them."""
    return list(await asyncio.gather(*(stream_chat(client, p, max_tokens, **kw) for p in prompts)))


async def warmup(client, model: str) -> None:
    # The first request pays one-off costs (graph building, allocations); keep them out of the numbers.
    await stream_chat(client, [{"role": "user", "content": "Hi"}], 4, model=model)


def fetch_metrics(base_url: str) -> dict[str, float]:
    """Prometheus samples summed over labels, by sample name; {} when /metrics is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(base_url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return values


# ---------------------------------------------------------------- statistics and repetition


def mean_sd(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def fmt_ms(values: list[float]) -> str:
    """Seconds in, 'mean ± sd' in milliseconds out."""
    m, s = mean_sd(values)
    return f"{m * 1e3:,.1f} ± {s * 1e3:,.1f}"


def reduction(base: float, new: float) -> float:
    """Percent lower than base (negative: worse)."""
    return (1.0 - new / base) * 100.0 if base and not math.isnan(base) else math.nan


async def repeat_runs(runs: int, fn: Callable[[int], Awaitable[T]], desc: str) -> list[T]:
    from tqdm import tqdm

    out = []
    for r in tqdm(range(runs), desc=desc, unit="run", file=sys.stderr):
        out.append(await fn(r))
    return out


# ---------------------------------------------------------------- models


def resolve_model(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    from minivllm.default_model import default_model_dir  # written elsewhere; only needed without --model

    return Path(default_model_dir())


def _config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def _is_quantized(model_dir: Path) -> bool:
    cfg = _config(model_dir)
    return "quantization" in cfg or "quantization_config" in cfg


def _safetensors_dtypes(model_dir: Path) -> dict[str, int]:
    # Read only the JSON headers: the dtype census of a 2 GB model costs microseconds.
    counts: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                counts[info["dtype"]] = counts.get(info["dtype"], 0) + 1
    return counts


def model_dtype(model_dir: Path) -> str:
    q = _config(model_dir).get("quantization")
    dtypes = "+".join(sorted(_safetensors_dtypes(model_dir))) or "?"
    return f"{q.get('bits')}-bit (group {q.get('group_size')}), tensors {dtypes}" if q else dtypes


def float32_copy(model_dir: Path) -> Path:
    """A dequantized float32 copy of model_dir, written once as `<dir>-float32` and reused."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model, load_model, save_config, save_model

    model_dir = Path(model_dir).resolve()
    dst = model_dir.with_name(model_dir.name + "-float32")
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model, config = load_model(model_dir)
    model = dequantize_model(model)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    save_model(tmp, model)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config["torch_dtype"] = "float32"
    save_config(config, tmp / "config.json")
    for f in model_dir.iterdir():  # tokenizer, chat template, generation config
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)  # atomic: a half-written copy is never mistaken for a finished one
    return dst


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    cfg = _config(model_dir)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


# ---------------------------------------------------------------- prompts

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but "
    "all were when we there can more if will one about so out up into has them these its some would "
    "cache page token prefix request leader follower batch kernel memory latency throughput decode "
    "prefill attention model layer weight matrix vector queue scheduler engine server client stream "
    "river mountain forest city harbor market garden window library bridge tower island valley desert "
    "quickly slowly carefully quietly brightly often rarely always never again together apart "
    "red green blue yellow silver golden ancient modern small large narrow wide heavy light "
    "build measure compare reuse publish evict restore compute wait release admit finish begin"
).split()
QUESTION = "Summarize the document above in one sentence."


@dataclass
class Prompt:
    messages: list[dict[str, str]]
    token_ids: list[int]  # the templated prompt as the client's tokenizer sees it
    shared_tokens: int = 0  # leading tokens identical to the prompt it was built from

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def load_tokenizer(model_dir: Path):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _messages(document: str) -> list[dict[str, str]]:
    # The document goes first, in a system message: prompts from different seeds then share only the
    # "<|im_start|>system\n" header (fewer than 16 tokens, so never a whole cache page).
    return [{"role": "system", "content": document}, {"role": "user", "content": QUESTION}]


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def filler_text(seed: int, n_chars: int) -> str:
    """Deterministic varied prose: different seeds differ from their first word."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(10, 9999)))
        sentence = " ".join(words).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Largest x in [lo, hi] with ok(x), assuming ok is (near) monotone and ok(lo) holds."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_prompt(
    tokenizer, n_tokens: int, seed: int, *, share: Prompt | None = None, fraction: float = 0.0
) -> Prompt:
    """A chat prompt of about n_tokens templated tokens (at most n_tokens, usually within 1-2).

    With `share`, the prompt starts with the first `fraction` of share's tokens (page-exactness is not
    promised; `shared_tokens` reports the actual common prefix) and continues with seed's own text.
    fraction 1.0 returns share itself: an identical request.
    """
    if share is not None and fraction >= 1.0:
        return Prompt(share.messages, share.token_ids, share.n_tokens)
    head = ""
    if share is not None and fraction > 0.0:
        base = share.messages[0]["content"]
        target = round(fraction * share.n_tokens)
        probe = filler_text(seed, 400)

        def shared(c: int) -> int:
            return _common_prefix(chat_token_ids(tokenizer, _messages(base[:c] + probe)), share.token_ids)

        head = base[: _largest(0, len(base), lambda c: shared(c) <= target)]
    # Estimate characters per token from a sample, then over-generate and trim by binary search.
    sample = filler_text(seed, 2000)
    chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample, add_special_tokens=False)))
    own = filler_text(seed, int(n_tokens * chars_per_token * 1.5) + 200)

    def length(c: int) -> int:
        return len(chat_token_ids(tokenizer, _messages(head + own[:c])))

    cut = _largest(0, len(own), lambda c: length(c) <= n_tokens)
    messages = _messages(head + own[:cut])
    ids = chat_token_ids(tokenizer, messages)
    return Prompt(messages, ids, _common_prefix(ids, share.token_ids) if share else 0)


def expected_restore(shared_tokens: int, prompt_tokens: int, page_size: int) -> int:
    """The restore rule: whole pages of the shared prefix, and never the prompt's last token."""
    return (min(shared_tokens, prompt_tokens - 1) // page_size) * page_size


# ---------------------------------------------------------------- metadata and results


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _code_changed() -> bool:
    """Uncommitted changes outside benchmarks/results (results written by earlier scripts don't count)."""
    return bool(_git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"))


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(pkg: str) -> str:
    try:
        return importlib_metadata.version(pkg)
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


def metadata(model_dir: Path, page_size: int | None = None, **extra: Any) -> dict[str, Any]:
    from minivllm.backend import detect_backend  # noqa: I001  (first: it preloads OpenBLAS before mlx)
    import mlx.core as mx

    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": _processor(),
            "cpu_count": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "mlx": {
            "default_device": str(mx.default_device()),
            "metal_available": mx.metal.is_available(),
            "backend": detect_backend().name,
            "mlx_version": _version("mlx"),
            "mlx_lm_version": _version("mlx-lm"),
            "openblas_preload_for_peer": is_cpu_backend() and OPENBLAS.exists(),
        },
        "model": {"dir": str(model_dir), "dtype": model_dtype(model_dir)},
        "page_size": page_size,
        "git": {"commit": _git("rev-parse", "--short", "HEAD"), "dirty": _code_changed()},
        **extra,
    }


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:,.1f}"
    return "—" if v is None else str(v)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    *,
    out_dir: Path = RESULTS_DIR,
    raw: Any = None,
    notes: str = "",
) -> tuple[Path, Path]:
    """Write <name>.json (rows, metadata, raw per-request data) and <name>.md (metadata header + table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(
        json.dumps(
            {"name": name, "metadata": meta, "rows": rows, "raw": raw}, indent=2, default=_json_default
        )
    )
    header = [f"# {name}", ""] + [f"- **{k}**: {_meta_line(v)}" for k, v in meta.items()]
    md_path.write_text("\n".join(header + ["", markdown_table(rows), ""] + ([notes, ""] if notes else [])))
    return json_path, md_path


def _meta_line(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_meta_line(x)}" for k, x in v.items())
    return str(v)


def save_plot(
    name: str, groups: list[str], series: dict[str, list[float]], ylabel: str, *, out_dir: Path = RESULTS_DIR
) -> Path:
    """A grouped bar chart, <name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(name)
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _json_default(o: Any) -> Any:
    # Raw data may hold RequestResults and Paths: dataclasses become dicts, anything else a string.
    return asdict(o) if is_dataclass(o) and not isinstance(o, type) else str(o)


# ---------------------------------------------------------------- command line


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="model dir (default: minivllm.default_model.default_model_dir())")
    p.add_argument("--runs", type=int, default=3, help="repeated runs per configuration")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    p.add_argument("--quick", action="store_true", help="1 run, small prompts and bursts: a smoke test")
    p.add_argument("--plot", action="store_true", help="also write a PNG chart")
    p.add_argument("--page-size", type=int, default=16, help="MINIVLLM_PAGE_SIZE")
    p.add_argument(
        "--server",
        choices=SERVER_NAMES,
        default="minivllm",
        help="server to measure; mlx-lm ignores the MINIVLLM_* configurations (useful to smoke-test the script)",
    )
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra MINIVLLM_* setting")
    return p


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.quick:
        args.runs = 1
    args.model = resolve_model(args.model)
    args.env = dict(kv.split("=", 1) for kv in args.env)
    return args


def spec_for(
    args: argparse.Namespace, label: str, env: dict[str, str] | None = None, name: str = ""
) -> ServerSpec:
    """The server for one configuration: page size, script-level env, then the configuration's env."""
    merged = {"MINIVLLM_PAGE_SIZE": str(args.page_size), **args.env, **(env or {})}
    return ServerSpec(name or args.server, args.model, merged, args.port, label)


def result_name(base: str, args: argparse.Namespace) -> str:
    # Keep smoke runs and peer-server runs from overwriting the real minivllm results.
    suffix = "" if getattr(args, "server", "minivllm") == "minivllm" else f"-{args.server}"
    return base + suffix + ("-quick" if args.quick else "")


def print_report(paths: tuple[Path, Path]) -> None:
    """Print what write_results wrote: (json_path, md_path)."""
    json_path, md_path = paths
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


# ---------------------------------------------------------------- configurations


@dataclass
class Session:
    """A started server with its client: what a scenario's run function receives."""

    server: Server
    client: Any

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, **kw: Any) -> RequestResult:
        return await stream_chat(self.client, messages, max_tokens, model=self.server.model_id, **kw)

    async def burst(
        self, prompts: list[list[dict[str, str]]], max_tokens: int, **kw: Any
    ) -> list[RequestResult]:
        return await chat_burst(self.client, prompts, max_tokens, model=self.server.model_id, **kw)

    def metrics(self) -> dict[str, float]:
        return fetch_metrics(self.server.base_url)


async def run_configs(
    specs: list[ServerSpec], runs: int, fn: Callable[[Session, int], Awaitable[T]]
) -> dict[str, list[T]]:
    """For each spec: a fresh server (so every configuration starts with a cold cache), a warm-up
    request, then `runs` calls of fn(session, run_index). Results by spec label."""
    out: dict[str, list[T]] = {}
    for spec in specs:
        with running_server(spec) as server:
            client = make_client(server)
            try:
                await warmup(client, server.model_id)
                session = Session(server, client)
                out[spec.label] = await repeat_runs(runs, lambda r, s=session: fn(s, r), desc=spec.label)
            finally:
                await client.close()
    return out
