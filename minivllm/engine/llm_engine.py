"""The synchronous engine: requests in, one step at a time, outputs out.

LLMEngine owns the model runner, the page pool and the scheduler. Everything that touches them runs on
one thread (the caller's, or the async engine's stepping thread); the disk tier's reads and writes run on
its own threads, on bytes the stepping thread copies out of and into the pools between steps.
"""

import logging
import random
import time
from dataclasses import replace
from pathlib import Path

from llguidance import LLMatcher

from kernels import cpu_attention
from minivllm.cache.disk_tier import DiskTier, DiskTierBusy, default_capacity
from minivllm.cache.hash_stream import HashStream
from minivllm.cache.hints import CacheHints
from minivllm.cache.kv_manager import KVManager
from minivllm.cache.kv_request import KVRequest
from minivllm.cache.page_file import TierIdentity
from minivllm.cache.state_snapshots import StateSnapshots
from minivllm.config import EngineConfig, default_kv_cache_bytes
from minivllm.engine.grammar import GrammarCompiler, MaskCounters
from minivllm.engine.model_runner import (
    KV_LAYOUT_VERSION,
    STATE_LAYOUT_VERSION,
    KVGeometry,
    LaunchedStep,
    ModelRunner,
)
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.scheduler import ScheduledStep, Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.token_gaps import TokenGaps
from minivllm.engine.validation import RequestError, check_request
from minivllm.models.backend import OPENBLAS_PATH, detect_backend
from minivllm.models.families import architecture_of
from minivllm.models.identity import model_digest
from minivllm.models.linear_attention import state_nbytes
from minivllm.models.loader import activation_dtype, cache_dir, load_model, module_arrays
from minivllm.outputs import EngineStats, FinishReason, QueueFull, RequestOutput

logger = logging.getLogger(__name__)

# Overlap on the CPU: a decode step of a model this small is mostly host work (building and queueing its
# graph), which overlap hides as mlx-lm's generate_step does (benchmarks/families.py: the tiny models'
# batch-1 decode went from 0.41-0.80x to 0.72-0.92x mlx-lm's);
# a larger model's step is its matmuls, where overlap changes decode by -1% / +1% (the 0.5B default,
# benchmarks/cpu_settings.py) and a request arriving meanwhile waits one step more.
OVERLAP_CPU_MAX_WEIGHT_BYTES = 32 << 20
DISK_WAIT_S = 0.05  # with nothing to step but disk reads, wait this long at most for one (new requests too)


def new_sequence(
    request_id: str, token_ids: list[int], params: SamplingParams, cache: CacheHints | None = None, **fields
) -> Sequence:
    """A request, with the KV cache's record of it (which shares its token list)."""
    seq = Sequence(request_id, token_ids, params, **fields)
    seq.cache = KVRequest(request_id, seq.token_ids, len(token_ids), cache or CacheHints())
    return seq


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.backend = detect_backend()
        self.model, self.tokenizer, self.model_config = load_model(
            config.model, self.backend, config.cpu_weight_layout, config.cpu_matmul
        )
        self.overlap = config.overlap if config.overlap is not None else self._overlap_by_default()
        self.vocab_size = self.model_config["vocab_size"]
        geometry = KVGeometry.of(self.model, activation_dtype(self.model))
        self.hybrid = architecture_of(self.model).num_linear_layers > 0
        if self.hybrid and config.speculative != "off":
            # a rejected draft would leave its trace in the recurrent state
            logger.warning("speculative decoding off: a hybrid model's recurrent state cannot roll back")
            self.config = config = replace(config, speculative="off")
        snapshots = StateSnapshots(self._state_cache_bytes()) if self.hybrid else None
        self.num_pages = num_pages = self._num_pages(geometry, snapshots)
        disk, state_disk = self._open_disk_tier(geometry)
        self.kv = KVManager(
            num_pages,
            config.page_size,
            config.eviction,
            config.enable_prefix_caching,
            disk,
            snapshots=snapshots,
            snapshot_every=self._snapshot_every(geometry),
            state_disk=state_disk,
        )
        self.max_model_len = self._max_model_len(num_pages * config.page_size)
        # what the cache advice replays (minivllm.shadow): each request's page hashes, no tokens
        self.hash_stream = HashStream(config.shadow_requests) if config.shadow_requests else None
        self.mask_counters = MaskCounters()
        self.runner = ModelRunner(
            self.model,
            geometry,
            num_pages,
            config.page_size,
            self.mask_counters,
            self._cpu_kernel(),
            self.kv.state_points,
        )
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(
            config, self.kv, self.eos_token_ids, self.max_model_len, self.mask_counters
        )
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.in_flight: LaunchedStep | None = None  # queued on the device, completed by the next step()
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps launched before the previous one was read back
        self.token_gaps = TokenGaps()  # steps between a request's tokens (fair steps: 1 while it decodes)
        logger.info(
            "KV pool: %d pages of %d tokens (%.1f MiB, %s); prefix cache %s, eviction %s, publication %s, "
            "single flight %s, speculative %s",
            num_pages,
            config.page_size,
            num_pages * config.page_size * geometry.bytes_per_token / 2**20,
            geometry.dtype,
            config.enable_prefix_caching,
            config.eviction,
            config.publication,
            config.single_flight,
            config.speculative,
        )

        if self.hybrid:
            logger.info(
                "hybrid model: recurrent-state snapshots of %.2f MiB, %.1f MiB for them, one every %d tokens",
                state_nbytes(self.model, geometry.dtype) / 2**20,
                snapshots.capacity_bytes / 2**20,
                self.kv.snapshot_every,
            )

    def _overlap_by_default(self) -> bool:
        """On a GPU backend; on the CPU for models of at most OVERLAP_CPU_MAX_WEIGHT_BYTES."""
        weights = sum(x.nbytes for x in module_arrays(self.model))
        return self.backend.is_gpu or weights <= OVERLAP_CPU_MAX_WEIGHT_BYTES

    def _cpu_kernel(self) -> bool:
        """Whether long-context attention runs in kernels.cpu_attention: on the CPU backend, unless
        cpu_attention is "mlx", where the kernel can be built and loaded (it is, once per machine)."""
        if self.backend.is_gpu or self.config.cpu_attention != "compiled":
            return False
        return cpu_attention.load(OPENBLAS_PATH, cache_dir() / "kernels")

    def _kv_budget(self) -> int:
        return self.config.kv_cache_bytes or default_kv_cache_bytes(self.config.kv_cache_fraction)

    def _state_cache_bytes(self) -> int:
        """A hybrid model's snapshots' share of the KV budget: state_cache_fraction of it."""
        return int(self._kv_budget() * self.config.state_cache_fraction)

    def _snapshot_every(self, geometry: KVGeometry) -> int:
        """Tokens between a hybrid model's periodic snapshots: the setting, else as many pages as hold one
        snapshot's bytes of KV, so the snapshots of a long prefix take at most as much memory as its KV
        (a tiny model's every few pages, a real one's every several hundred tokens)."""
        if self.config.state_snapshot_tokens:
            return self.config.state_snapshot_tokens
        size = self.config.page_size
        pages = -(-state_nbytes(self.model, geometry.dtype) // (geometry.bytes_per_token * size))
        return max(1, pages) * size

    def _num_pages(self, geometry: KVGeometry, snapshots: StateSnapshots | None) -> int:
        budget = self._kv_budget() - (snapshots.capacity_bytes if snapshots is not None else 0)
        num_pages = budget // (geometry.bytes_per_token * self.config.page_size)
        if num_pages < 2:
            raise ValueError(
                f"kv_cache_bytes={budget} holds fewer than 2 pages of {self.config.page_size} tokens"
            )
        return num_pages

    def _open_disk_tier(self, geometry: KVGeometry) -> tuple[DiskTier | None, DiskTier | None]:
        """The disk tier config.kv_disk_dir names, or None; and a hybrid model's state tier in its states/
        directory (state_cache_fraction of the budget). A directory another process holds is an error; one
        that cannot be used (unwritable, not a directory) leaves the engine serving from RAM alone, with a
        warning."""
        if self.config.kv_disk_dir is None:
            return None, None
        directory = Path(self.config.kv_disk_dir).expanduser()
        start = time.perf_counter()
        identity = TierIdentity(
            model=model_digest(
                self.model_config["_resolved_path"], f"{self.backend.name} {self.model_config['_weights']}"
            ),
            page_size=self.config.page_size,
            dtype=str(geometry.dtype).removeprefix("mlx.core."),
            layout=KV_LAYOUT_VERSION,
            page_bytes=geometry.bytes_per_token * self.config.page_size,
        )
        logger.info(
            "model digest for the disk tier: %s (%.2f s)", identity.model.hex(), time.perf_counter() - start
        )
        try:
            directory.mkdir(parents=True, exist_ok=True)
            capacity = self.config.kv_disk_bytes or default_capacity(directory)
            if not self.hybrid:
                return DiskTier(directory, capacity, identity), None
            states = int(capacity * self.config.state_cache_fraction)
            nbytes = state_nbytes(self.model, geometry.dtype)
            state_identity = replace(identity, layout=STATE_LAYOUT_VERSION, page_bytes=nbytes)
            return DiskTier(directory, capacity - states, identity), DiskTier(
                directory / "states", states, state_identity
            )
        except DiskTierBusy:
            raise
        except ValueError as e:  # the budget holds no page
            if self.config.kv_disk_bytes:
                raise  # a budget set too small: the setting is wrong
            logger.warning("KV disk tier off: %s (10%% of the free disk); serving from the RAM pool alone", e)
            return None, None
        except OSError as e:
            logger.warning(
                "KV disk tier off: cannot use %s (%s); serving from the RAM pool alone", directory, e
            )
            return None, None

    def close(self) -> None:
        """Write the disk tier's queued pages and release its directory (the engine steps no more)."""
        self.kv.close()

    def _max_model_len(self, pool_tokens: int) -> int:
        """The context length: the setting, at most the model's, at most what the pool holds for one sequence
        (a longer request could never finish; clamped here so that it is refused up front)."""
        model_len = self.model_config.get("max_position_embeddings", 32768)
        wanted = min(self.config.max_model_len or model_len, model_len)
        if wanted > pool_tokens:
            logger.warning(
                "max_model_len %d is more than the KV pool holds for one sequence (%d tokens); using %d "
                "(raise kv_cache_bytes for longer contexts)",
                wanted,
                pool_tokens,
                pool_tokens,
            )
        return min(wanted, pool_tokens)

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        matcher: LLMatcher | None = None,
        cache: CacheHints | None = None,
    ) -> Sequence:
        """Validate and queue a request (RequestError names the parameter at fault). matcher:
        params.structured_output compiled by `self.grammars.matcher` off this thread (the async engine
        does); without it, a structured-output request compiles here. cache: its cache domain and pins."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}", param="request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = self.validate(token_ids, params)
        if self.scheduler.num_queued() >= self.config.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.config.max_waiting} requests)")
        if params.structured_output is not None and matcher is None:
            matcher = self.grammars.matcher(params.structured_output, cache.salt if cache else None)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = new_sequence(request_id, token_ids, params, cache, seed=seed, matcher=matcher)
        if self.hash_stream is not None:
            self.hash_stream.record(seq.cache.full_page_hashes(self.config.page_size), len(token_ids))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Every rule a request must pass (minivllm.engine.validation); the params with max_tokens
        resolved (None: up to the context's end)."""
        check_request(token_ids, params.max_tokens, params.logit_bias, self.vocab_size, self.max_model_len)
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - len(token_ids))
        return params

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        self.scheduler.finish(seq, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, record what it computed; the outputs of one step. With overlap on, the
        next step is built and queued before this one's tokens are read back, when the scheduler can
        choose it without them (Scheduler.schedule_ahead); the next call completes it. A fault anywhere
        fails the requests of the steps involved (every request, if it faulted before it had any) and
        the engine goes on."""
        outputs: dict[str, RequestOutput] = {}
        step, self.in_flight = self.in_flight, None
        # schedule() fills it: the requests a fault in this step fails
        self.scheduler.step_seqs = list(step.seqs) if step else []
        try:
            if step is None:
                self.kv.expire_pins()
                self._apply_disk_restores()
                scheduled = self.scheduler.schedule()
                step = self.runner.launch(scheduled.seqs, scheduled.num_tokens) if scheduled else None
            if step is None:
                self.kv.write_behind(
                    self.runner.page_payloads, self.runner.state_payloads
                )  # pages of a request stopped in schedule()
                self.kv.wait_for_restores(DISK_WAIT_S)
                return self._collect(outputs)
            if self.overlap:
                ahead = self.scheduler.schedule_ahead(ScheduledStep(step.seqs, step.num_tokens))
                if ahead:
                    self.in_flight = self.runner.launch(ahead.seqs, ahead.num_tokens, after=step)
                    self.num_steps_ahead += 1
            step_outputs = self.runner.collect(step)
            self.num_steps += 1
            # a request that ended while its step was in flight (aborted, or by its previous token) drops it
            kept = [i for i, seq in enumerate(step.seqs) if not seq.is_finished]
            seqs, outs = [step.seqs[i] for i in kept], [step_outputs[i] for i in kept]
            before = [(len(seq.token_ids), len(seq.logprobs)) for seq in seqs]
            self.scheduler.postprocess(ScheduledStep(seqs, [step.num_tokens[i] for i in kept]), outs)
            # after the evaluation: the pages it published, to disk (with overlap on, this waits for
            # the step in flight, once per page boundary)
            self.kv.write_behind(self.runner.page_payloads, self.runner.state_payloads)
            for seq, (length, num_logprobs) in zip(seqs, before):
                if len(seq.token_ids) > length:  # one new token, or several from a verified draft
                    self._record_gap(seq)
                    tokens, logprobs = seq.token_ids[length:], seq.logprobs[num_logprobs:]
                    outputs[seq.request_id] = self._output(seq, tokens, logprobs)
            return self._collect(outputs)
        except Exception as e:
            failed = self.scheduler.step_seqs or list(self.requests.values())
            logger.exception("step failed; failing %d requests", len(failed))
            return self.fail(failed, e)

    def _record_gap(self, seq: Sequence) -> None:
        """seq got tokens in this step: the steps since its previous tokens (none before its first)."""
        if seq.last_token_step:
            self.token_gaps.record(self.num_steps - seq.last_token_step)
        seq.last_token_step = self.num_steps

    def _apply_disk_restores(self) -> None:
        """Pages the disk tier has read for waiting requests go into the pools; they can run now."""
        for req, tokens in self.kv.apply_restores(self.runner.write_pages, self.runner.state_from_payload):
            self.scheduler.restored_from_disk(self.requests[req.request_id], tokens)

    def fail(self, seqs: list[Sequence], error: Exception) -> list[RequestOutput]:
        """End seqs with reason ERROR and the fault as detail. A fault may have left the pool's
        bookkeeping or the KV pools half-updated (MLX is lazy: a broken graph may sit in them), so the
        other running requests are requeued to recompute, and the pool and the KV start afresh."""
        detail = f"{type(error).__name__}: {error}"
        self.in_flight = None  # its graph writes into the KV pools dropped below
        # a fresh pool first: nothing is released through the broken one (page tables are forgotten)
        self.kv.reset([s.cache for s in seqs + self.scheduler.running])
        for seq in seqs:
            seq.finish_detail = detail
            try:
                self.scheduler.finish(seq, FinishReason.ERROR)
            except Exception:  # the request is finished all the same; only its flight bookkeeping failed
                logger.exception("while failing request %s", seq.request_id)
            # also when it finished earlier in the faulted step (its last output was lost), but an abort
            # stays an abort: nobody waits for that request's output
            if seq.finish_reason != FinishReason.ABORT:
                seq.finish_reason = FinishReason.ERROR
        for seq in reversed(self.scheduler.running):  # newest first, so the oldest ends up first in line
            self.scheduler.requeue(seq)
        self.runner.reset_kv()
        return self._collect({})

    def _collect(self, outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        """The step's outputs, plus the last output of every request that ended (finished, aborted,
        stopped or failed); ended requests leave the engine."""
        for seq in self.scheduler.finished:
            self.requests.pop(seq.request_id, None)
            outputs.setdefault(seq.request_id, self._output(seq, []))
        self.scheduler.finished.clear()
        return list(outputs.values())

    def _output(self, seq: Sequence, tokens: list[int], logprobs=()) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_logprobs=list(logprobs),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            prefix_miss=seq.cache.prefix_miss,
            pins=list(seq.cache.pins),
            num_computed_prompt_tokens=seq.num_computed_prompt_tokens,
            num_pages_published=seq.cache.num_pages_published,
            num_published_prompt_tokens=seq.cache.num_published_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            flight_role=seq.flight_role,
            stop_token_id=seq.stop_token_id,
            error=seq.finish_detail if seq.is_finished else None,
            error_param=seq.error_param if seq.is_finished else None,
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants([s.cache for s in self.scheduler.running])

    def stats(self) -> EngineStats:
        c, p, pages = self.scheduler.counters, self.kv.counters, self.kv.state()
        stats = EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            pages_total=pages.total,
            pages_free=pages.free,
            pages_cached=pages.cached,
            pages_in_use=pages.in_use,
            prefix_lookups=c.lookups,
            prefix_query_tokens=c.query_tokens,
            prefix_hit_tokens=c.hit_tokens,
            prefix_hit_tokens_ram=c.hit_tokens - c.disk_hit_tokens,
            prefix_hit_tokens_disk=c.disk_hit_tokens,
            computed_prompt_tokens=c.computed_prompt_tokens,
            preemptions=c.preemptions,
            prefix_waiters=c.prefix_waiters,
            pages_published=p.pages_published,
            pages_evicted=p.pages_evicted,
            pages_unreachable=p.pages_unreachable,
            pages_restored=p.pages_restored,
            pages_from_disk=p.pages_from_disk,
            pages_pinned=self.kv.pins.num_pages,
            pins=self.kv.pins.num_pins,
            pins_made=self.kv.pin_counters.pins_made,
            pins_refreshed=self.kv.pin_counters.pins_refreshed,
            pins_expired=self.kv.pin_counters.pins_expired,
            pins_given_way=self.kv.pin_counters.pins_given_way,
            steps=self.num_steps,
            steps_ahead=self.num_steps_ahead,
            token_gap_buckets=self.token_gaps.cumulative(),
            token_gap_steps=self.token_gaps.total_steps,
            spec_draft_tokens=self.scheduler.spec_counters.draft_tokens,
            spec_accepted_tokens=self.scheduler.spec_counters.accepted_tokens,
            grammar_masks=self.mask_counters.masks,
            grammar_mask_seconds=self.mask_counters.seconds,
            **self.kv.disk_stats(),
        )
        if self.kv.snapshots is not None:
            snaps, c = self.kv.snapshots, self.kv.snapshots.counters
            stats.state_snapshots, stats.state_snapshot_bytes = len(snaps), snaps.nbytes
            stats.state_snapshot_capacity_bytes = snaps.capacity_bytes
            stats.state_snapshots_kept, stats.state_snapshots_dropped = c.snapshots_kept, c.snapshots_dropped
            stats.state_snapshots_restored = c.snapshots_restored
            stats.state_disk_snapshots = self.kv.state_disk.num_pages if self.kv.state_disk else None
        if self.scheduler.flights:
            f = self.scheduler.flights.counters
            stats.flights_opened = f.flights_opened
            stats.followers_coalesced = f.followers_coalesced
            stats.leader_handovers = f.leader_handovers
            stats.follower_wait_seconds = f.follower_wait_seconds
        return stats
