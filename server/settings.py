"""Server settings: one table maps each setting to its environment variable, its CLI flag and EngineConfig.

`Settings.from_env()` reads the environment once; `add_serve_arguments` / `settings_from_args` build the
`minivllm serve` flags from the same table (server.serve runs the server with them).
"""

import argparse
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, make_dataclass, replace

from minivllm.config import (
    CPU_ATTENTION_MODES,
    CPU_MATMUL_MODES,
    CPU_WEIGHT_LAYOUTS,
    EVICTION_POLICIES,
    PUBLICATION_MODES,
    SINGLE_FLIGHT_MODES,
    SPECULATIVE_MODES,
    EngineConfig,
    default_kv_cache_bytes,
)

DEFAULT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


class SettingsError(ValueError):
    """A setting with a bad value; the message names the variable (or flag)."""


def _parse_int(raw: str) -> int:
    try:
        return int(raw.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _parse_bytes(raw: str) -> int:
    """An integer number of bytes, optionally with a K/M/G/T suffix (binary: 4M = 4 MiB)."""
    text = raw.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _SIZE_SUFFIXES.get(text[-1:], 1)
    try:
        return int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise ValueError(f"expected a byte count such as 4194304 or 4M, got {raw!r}") from None


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1/0/true/false, got {raw!r}")


def _parse_seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"expected seconds >= 0, got {raw!r}")
    return value


def _parse_keys(raw: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not keys:
        raise ValueError("expected one or more comma-separated keys")
    return keys


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {raw!r}")
        return value

    return parse


@dataclass(frozen=True)
class Option:
    name: str  # Settings field (and EngineConfig field unless engine_field says otherwise)
    env: str
    type: object  # the field's annotation
    parse: Callable[[str], object]
    default: object
    help: str
    engine_field: str | None = None  # the EngineConfig field it sets; None: a server-only setting

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _engine(name: str, env: str, type_, parse, help_: str, engine_field: str | None = None) -> Option:
    engine_field = engine_field or name
    return Option(name, env, type_, parse, _ENGINE_DEFAULTS[engine_field], help_, engine_field)


OPTIONS: tuple[Option, ...] = (
    _engine(
        "model",
        "MINIVLLM_MODEL",
        str | None,
        str.strip,
        "model directory, .gguf file or Hugging Face repo id; several comma-separated (the flag repeated) "
        "serve side by side, an engine and KV pool each (default: the offline default model)",
    ),
    Option(
        "model_name",
        "MINIVLLM_MODEL_NAME",
        str | None,
        str.strip,
        None,
        "served model id, one per model, comma-separated (default: each model's basename, or "
        f"{DEFAULT_MODEL_NAME} for the default model)",
    ),
    _engine("page_size", "MINIVLLM_PAGE_SIZE", int, _parse_int, "tokens per KV page"),
    _engine(
        "kv_cache_bytes",
        "MINIVLLM_KV_CACHE_BYTES",
        int | None,
        _parse_bytes,
        "KV pool size in bytes, K/M/G suffixes allowed (default: 10%% of memory, at most 2 GiB)",
    ),
    _engine(
        "kv_disk_dir",
        "MINIVLLM_KV_DISK_DIR",
        str | None,
        str.strip,
        "directory of a persistent disk tier under the KV pool (default: none)",
    ),
    _engine(
        "kv_disk_bytes",
        "MINIVLLM_KV_DISK_BYTES",
        int | None,
        _parse_bytes,
        "disk tier size in bytes, K/M/G suffixes allowed (default: 10%% of the free disk, at most 20 GiB)",
    ),
    _engine("max_num_seqs", "MINIVLLM_MAX_NUM_SEQS", int, _parse_int, "most requests running at once"),
    _engine(
        "max_num_batched_tokens",
        "MINIVLLM_MAX_NUM_BATCHED_TOKENS",
        int,
        _parse_int,
        "token budget per step (prefill chunks and decode tokens)",
    ),
    _engine(
        "max_model_len",
        "MINIVLLM_MAX_MODEL_LEN",
        int | None,
        _parse_int,
        "context length, prompt plus output (default: the model's)",
    ),
    _engine(
        "max_waiting",
        "MINIVLLM_MAX_WAITING",
        int,
        _parse_int,
        "requests that may wait beyond the free running slots; past it new requests get HTTP 429",
    ),
    _engine(
        "prefix_cache",
        "MINIVLLM_PREFIX_CACHE",
        bool,
        _parse_bool,
        "reuse cached KV of shared prompt prefixes",
        "enable_prefix_caching",
    ),
    _engine("eviction", "MINIVLLM_EVICTION", str, _choice(EVICTION_POLICIES), "prefix-cache eviction policy"),
    _engine(
        "publication",
        "MINIVLLM_PUBLICATION",
        str,
        _choice(PUBLICATION_MODES),
        "when full KV pages become reusable",
    ),
    Option(
        "single_flight",
        "MINIVLLM_SINGLE_FLIGHT",
        str | None,
        _choice(SINGLE_FLIGHT_MODES),
        None,
        "coalesce concurrent identical prefixes (default: after_prefill, or off without the prefix cache)",
        "single_flight",
    ),
    _engine(
        "overlap",
        "MINIVLLM_OVERLAP",
        bool | None,
        _parse_bool,
        "build and queue the next decode step while the current one runs (default: on a GPU backend, and on a "
        "CPU for models of at most 32 MiB of weights)",
    ),
    _engine(
        "cpu_weight_layout",
        "MINIVLLM_CPU_WEIGHT_LAYOUT",
        str,
        _choice(CPU_WEIGHT_LAYOUTS),
        "CPU backend: float32 weight matrices transposed, native (as nn.Linear), or auto (each shape as measured faster)",
    ),
    _engine(
        "cpu_attention",
        "MINIVLLM_CPU_ATTENTION",
        str,
        _choice(CPU_ATTENTION_MODES),
        "CPU backend: long-context attention in a C++ kernel built on this machine at start-up (compiled; MLX "
        "ops where no compiler or OpenBLAS is found), or MLX ops only (mlx)",
    ),
    _engine(
        "cpu_matmul",
        "MINIVLLM_CPU_MATMUL",
        str,
        _choice(CPU_MATMUL_MODES),
        "CPU backend: decode steps read a quantized model's levels in a C++ kernel built on this machine at "
        "start-up (compiled; its float32 weights where no compiler is found), or float32 weights only (mlx)",
    ),
    _engine(
        "speculative",
        "MINIVLLM_SPECULATIVE",
        str,
        _choice(SPECULATIVE_MODES),
        "speculative decoding: ngram drafts tokens by prompt lookup and verifies them in the step",
    ),
    _engine(
        "speculative_tokens",
        "MINIVLLM_SPECULATIVE_TOKENS",
        int,
        _parse_int,
        "the most tokens drafted in one step (all requests together)",
    ),
    _engine(
        "state_cache_fraction",
        "MINIVLLM_STATE_CACHE_FRACTION",
        float,
        float,
        "hybrid models: the share of the KV budget their recurrent-state snapshots may take",
    ),
    _engine(
        "state_snapshot_tokens",
        "MINIVLLM_STATE_SNAPSHOT_TOKENS",
        int | None,
        _parse_int,
        "hybrid models: tokens between the recurrent-state snapshots a long prompt keeps, a multiple of the page "
        "size (default: the tokens whose KV takes as much memory as one snapshot)",
    ),
    _engine(
        "cache_shadow_requests",
        "MINIVLLM_CACHE_SHADOW_REQUESTS",
        int,
        _parse_int,
        "cache advice: the requests whose page hashes are replayed at other pool sizes (0: off)",
        "shadow_requests",
    ),
    Option(
        "cache_shadow_interval",
        "MINIVLLM_CACHE_SHADOW_INTERVAL",
        float,
        _parse_seconds,
        30.0,
        "cache advice: seconds between replays of the recorded requests (in a worker process)",
    ),
    Option(
        "max_request_bytes",
        "MINIVLLM_MAX_REQUEST_BYTES",
        int,
        _parse_bytes,
        DEFAULT_MAX_REQUEST_BYTES,
        "largest request body in bytes, K/M/G suffixes allowed; larger bodies get HTTP 413 unread",
    ),
    Option(
        "max_inflight_body_bytes",
        "MINIVLLM_MAX_INFLIGHT_BODY_BYTES",
        int,
        _parse_bytes,
        16 * DEFAULT_MAX_REQUEST_BYTES,
        "bytes of request bodies in flight at once, K/M/G suffixes allowed; past it bodies still arriving give way "
        "(HTTP 408, the one whose last piece came longest ago first), then new requests get HTTP 429",
    ),
    Option(
        "max_output_tokens",
        "MINIVLLM_MAX_OUTPUT_TOKENS",
        int | None,
        _parse_int,
        None,
        "most tokens any answer may have (like llama.cpp's --n-predict): a request asking more, or naming no "
        "limit, stops there (default: the room the context leaves)",
    ),
    Option(
        "prompt_lanes",
        "MINIVLLM_PROMPT_LANES",
        bool,
        _parse_bool,
        True,
        "template and tokenize long texts on a second thread with their own tokenizer copy, so short prompts "
        "never wait behind them",
    ),
    Option(
        "max_connections",
        "MINIVLLM_MAX_CONNECTIONS",
        int,
        _parse_int,
        1000,
        "open connections at most; past it the one waiting longest (idle, or stalled in its headers or body) is "
        "closed, or, when all are being served, the new one gets HTTP 503",
    ),
    Option(
        "header_timeout",
        "MINIVLLM_HEADER_TIMEOUT",
        float,
        _parse_seconds,
        10.0,
        "seconds a connection may take to send a request's headers; then it is closed",
    ),
    Option(
        "body_timeout",
        "MINIVLLM_BODY_TIMEOUT",
        float,
        _parse_seconds,
        10.0,
        "seconds a request's body may pause between two of its pieces; then it is answered 408 and closed",
    ),
    Option(
        "keepalive_timeout",
        "MINIVLLM_KEEPALIVE_TIMEOUT",
        float,
        _parse_seconds,
        5.0,
        "seconds an idle connection is kept open after a response",
    ),
    Option(
        "api_key",
        "MINIVLLM_API_KEY",
        str | None,
        str.strip,
        None,
        "require this bearer key on /v1 routes (default: no auth)",
    ),
    Option(
        "api_keys",
        "MINIVLLM_API_KEYS",
        tuple[str, ...] | None,
        _parse_keys,
        None,
        "several accepted keys, comma-separated (with MINIVLLM_API_KEY: either); each key is its own prefix-cache domain",
    ),
    Option(
        "shutdown_timeout",
        "MINIVLLM_SHUTDOWN_TIMEOUT",
        float,
        _parse_seconds,
        30.0,
        "seconds a shutdown (SIGTERM) waits for open streams; then they end with an error event",
    ),
    Option(
        "allowed_hosts",
        "MINIVLLM_ALLOWED_HOSTS",
        tuple[str, ...] | None,
        _parse_keys,
        None,
        "host names the server answers to besides localhost and IP addresses, comma-separated (* for any); "
        "other Host headers get 400, so a web page's DNS rebinding cannot reach it",
    ),
    Option("log_level", "MINIVLLM_LOG_LEVEL", str, _choice(LOG_LEVELS), "info", "log level"),
)
_BY_NAME = {o.name: o for o in OPTIONS}

_SettingsFields = make_dataclass(
    "_SettingsFields", [(o.name, o.type, o.default) for o in OPTIONS], frozen=True
)


class Settings(_SettingsFields):
    """The server's settings; fields and defaults come from OPTIONS."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        values = {o.name: _parse(o, environ.get(o.env), o.env) for o in OPTIONS}
        return cls(**values).validated()

    def validated(self) -> "Settings":
        if self.max_request_bytes < 1:
            raise SettingsError(f"MINIVLLM_MAX_REQUEST_BYTES: must be >= 1, got {self.max_request_bytes}")
        names = self.served_model_names
        if len(names) != len(self.models):
            raise SettingsError(f"MINIVLLM_MODEL_NAME: {len(names)} names for {len(self.models)} models")
        if len(set(names)) != len(names) or not all(names):
            raise SettingsError(f"MINIVLLM_MODEL_NAME: served model ids must be distinct, got {list(names)}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise SettingsError(f"MINIVLLM_MAX_OUTPUT_TOKENS: must be >= 1, got {self.max_output_tokens}")
        if self.max_connections < 1:
            raise SettingsError(f"MINIVLLM_MAX_CONNECTIONS: must be >= 1, got {self.max_connections}")
        if not self.header_timeout > 0:
            raise SettingsError(f"MINIVLLM_HEADER_TIMEOUT: must be > 0, got {self.header_timeout}")
        if not self.body_timeout > 0:
            raise SettingsError(f"MINIVLLM_BODY_TIMEOUT: must be > 0, got {self.body_timeout}")
        self.engine_configs()
        return self

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these settings describe; its validation errors name the variable."""
        values = {o.engine_field: getattr(self, o.name) for o in OPTIONS if o.engine_field}
        if values["single_flight"] is None:
            values["single_flight"] = "after_prefill" if self.prefix_cache else "off"
        try:
            return EngineConfig(**values)
        except ValueError as e:
            raise SettingsError(f"{_option_named_in(str(e))}: {e}") from None

    def engine_configs(self) -> list[EngineConfig]:
        """One EngineConfig per model. Several models split the KV budget equally (MINIVLLM_KV_CACHE_BYTES,
        or by default 10% of memory, at most 2 GiB, in all) and the disk tier's too, each model's pages in
        a subdirectory of MINIVLLM_KV_DISK_DIR named by its served id."""
        base, n = self.engine_config(), len(self.models)
        if n == 1:
            return [base]
        budget = base.kv_cache_bytes or default_kv_cache_bytes(base.kv_cache_fraction)
        configs = []
        for model, name in zip(self.models, self.served_model_names):
            disk = os.path.join(base.kv_disk_dir, disk_subdir(name)) if base.kv_disk_dir else None
            disk_bytes = base.kv_disk_bytes // n if base.kv_disk_bytes else None
            configs.append(
                replace(
                    base, model=model, kv_cache_bytes=budget // n, kv_disk_dir=disk, kv_disk_bytes=disk_bytes
                )
            )
        return configs

    @property
    def models(self) -> tuple[str | None, ...]:
        """The model references, one engine each (MINIVLLM_MODEL's comma-separated list)."""
        if self.model is None:
            return (None,)
        models = tuple(m.strip() for m in self.model.split(","))
        if not all(models):
            raise SettingsError(f"MINIVLLM_MODEL: an empty entry in {self.model!r}")
        return models

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The id each model is served as, in the order of `models`."""
        if self.model_name:
            return tuple(n.strip() for n in self.model_name.split(","))
        return tuple(_served_name(m) for m in self.models)

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        """Every key a /v1 request may carry (none: no auth)."""
        return ((self.api_key,) if self.api_key else ()) + (self.api_keys or ())

    @property
    def served_model_name(self) -> str:
        """The first model's id (the only one, unless several are served)."""
        return self.served_model_names[0]

    def as_dict(self) -> dict:
        return asdict(self)


def _served_name(model: str | None) -> str:
    if model is None or model == "default":
        return DEFAULT_MODEL_NAME
    base = os.path.basename(model.rstrip("/"))
    return base.removesuffix(".gguf") or model


def _parse(option: Option, raw: str | None, source: str):
    if raw is None or not raw.strip():
        return option.default
    try:
        return option.parse(raw)
    except ValueError as e:
        raise SettingsError(f"{source}: {e}") from None


def _option_named_in(message: str) -> str:
    """The env var of the setting an EngineConfig error message starts with."""
    first = message.split()[0] if message else ""
    for o in OPTIONS:
        if first in (o.name, o.engine_field):
            return o.env
    return "settings"


# -- the CLI, from the same table ------------------------------------------------------------------------
REPEATABLE = ("model", "model_name")  # flags given once per model


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per setting (e.g. --page-size); unset flags fall back to the environment, then defaults."""
    group = parser.add_argument_group("engine and server settings")
    for o in OPTIONS:
        default = "" if o.default is None else f"; default {o.default}"
        # several models: the flag repeated (joined with commas, as in the environment variable)
        action = "append" if o.name in REPEATABLE else "store"
        group.add_argument(
            o.flag,
            dest=o.name,
            default=None,
            action=action,
            metavar=o.name.upper(),
            help=f"{o.help} [env {o.env}{default}]",
        )
    return parser


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags override environment variables, which override defaults. Errors name the flag or variable."""
    raws = {o.name: getattr(args, o.name) for o in OPTIONS if getattr(args, o.name, None) is not None}
    raws = {name: ",".join(raw) if name in REPEATABLE else raw for name, raw in raws.items()}
    return _override(Settings.from_env(environ), raws, lambda o: o.flag)


def settings_from_mapping(values: Mapping[str, object], environ: Mapping[str, str] | None = None) -> Settings:
    """Settings by option name (model, kv_cache_bytes, ...), values written as for the flags: the
    application args of a Ray Serve config. Errors name the setting."""
    unknown = sorted(set(values) - set(_BY_NAME))
    if unknown:
        raise SettingsError(f"unknown settings {unknown}; expected names from {sorted(_BY_NAME)}")
    raws = {name: str(value) for name, value in values.items()}
    return _override(Settings.from_env(environ), raws, lambda o: o.name)


def _override(base: Settings, raws: Mapping[str, str], source: Callable[[Option], str]) -> Settings:
    values = base.as_dict()
    for name, raw in raws.items():
        option = _BY_NAME[name]
        values[name] = _parse(option, raw, source(option))
    return Settings(**values).validated()


def disk_subdir(name: str) -> str:
    """A served model name as one directory name inside MINIVLLM_KV_DISK_DIR: itself when it is plain;
    otherwise (a `/`, `..`, a leading dot, other characters) its plain characters and a digest of it, so
    no name reaches outside the directory and different names stay apart."""
    if re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}", name):
        return name
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:80]
    return f"{plain}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"
