"""Connection attacks against a real server process: idle connections opened as fast as a client can, and
requests whose bodies stall, while a prober checks that /health and a short chat still answer.

    python -m benchmarks.connection_attack [--mode serve|uvicorn|both] [--idle 15000] [--stalled 1100]
                                           [--big-stalled 17] [--seconds 40] [--model DIR]

The server runs as `minivllm serve` or as `uvicorn server.app:app` (same settings) on a tiny random model
unless --model. An attacker process opens --idle connections that send nothing, --stalled ones that send
POST headers announcing a 1,000-byte body and then 10 bytes of it, and --big-stalled ones that send all but
the last byte of a 4 MiB body (16 of them hold the 64 MiB budget of bodies in flight), and holds them
for --seconds; meanwhile
the prober asks GET /health every 0.25 s and a 2-token chat every second (5 s timeout each). Printed per
mode: the probes' latency (p50, p99, max) and failures during the attack, the server's most open file
descriptors, the seconds from the attack's end until /health and the chat both answer within 1 s, and
the seconds from SIGTERM to the server's exit while a client holds a body that never ends (with
MINIVLLM_SHUTDOWN_TIMEOUT=5 and the body timeout far away). Writes benchmarks/results/connection_attack.{json,md}
(from a clean tree; --allow-dirty to try changes).
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import asyncio
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import results
from benchmarks.harness.results import metadata
from benchmarks.harness.servers import free_port
from server.launch import wait_healthy

PROBE_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0
CONNECTS_IN_FLIGHT = 500  # the attacker's concurrent connects: a burst, as many clients make
STALLED_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n" + b'{"model": '
)


def attack(port: int, idle: int, stalled: int, big: int, seconds: float, ready) -> None:
    """The attacker (its own process): open the connections as fast as it can, hundreds at a time, hold
    them until --seconds are up, then close them all."""
    asyncio.run(_attack(port, idle, stalled, big, seconds))
    ready.set()


async def _attack(port: int, idle: int, stalled: int, big: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    held: list[asyncio.StreamWriter] = []
    in_flight = asyncio.Semaphore(CONNECTS_IN_FLIGHT)

    async def connect(head: bytes) -> None:
        async with in_flight:
            if time.monotonic() > deadline:
                return
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            except (OSError, asyncio.TimeoutError):
                return  # refused, timed out, or out of descriptors: the attack goes on
            writer.write(head)
            held.append(writer)

    for _ in range(big):  # one after the other, each sent before the next: together they fill the budget
        await connect(BIG_STALLED_HEAD)
        if held:
            await held[-1].drain()
    await asyncio.gather(*(connect(head) for head in [b""] * idle + [STALLED_HEAD] * stalled))
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    for writer in held:
        writer.transport.abort()


BIG_BODY = 4 << 20  # MINIVLLM_MAX_REQUEST_BYTES's default: the largest body a request may have
BIG_STALLED_HEAD = (
    (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {BIG_BODY}\r\n\r\n"
    ).encode()
    + b'{"model": "'
    + b"x" * (BIG_BODY - 12)  # all but its last byte
)


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


async def probe(client: httpx.AsyncClient, model: str, chat: bool) -> float | None:
    """Seconds to a 200 answer, or None (an error or past the timeout)."""
    start = time.perf_counter()
    try:
        if chat:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = await client.post("/v1/chat/completions", json=body)
        else:
            r = await client.get("/health")
    except httpx.HTTPError:
        return None
    return time.perf_counter() - start if r.status_code == 200 else None


async def probe_until(url: str, model: str, pid: int, stop) -> dict:
    """Probe until stop() is true: latencies (None for a failure) and the most descriptors seen."""
    out: dict = {"health": [], "chat": [], "fds": 0}
    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per probe, as a new client makes
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_TIMEOUT_S, limits=limits) as client:
        tick = 0
        while not stop():
            tasks = [probe(client, model, chat=False)]
            if tick % 4 == 0:
                tasks.append(probe(client, model, chat=True))
            started = time.perf_counter()
            results = await asyncio.gather(*tasks)
            out["health"].append(results[0])
            if len(results) > 1:
                out["chat"].append(results[1])
            out["fds"] = max(out["fds"], open_fds(pid))
            tick += 1
            await asyncio.sleep(max(0.0, 0.25 - (time.perf_counter() - started)))
    return out


async def recovery_s(url: str, model: str) -> float:
    """Seconds until /health and the chat both answer within 1 s (probed back to back)."""
    start = time.perf_counter()
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_TIMEOUT_S, limits=limits) as client:
        while True:
            health, chat = await probe(client, model, False), await probe(client, model, True)
            if health is not None and chat is not None and health < 1 and chat < 1:
                return time.perf_counter() - start
            await asyncio.sleep(0.05)


def server_command(mode: str, port: int) -> list[str]:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if mode == "serve":
        return [sys.executable, "-m", "server.cli", "serve", *host]
    return [sys.executable, "-m", "uvicorn", "server.app:app", *host]


def run_mode(mode: str, model: Path, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ,
        MINIVLLM_MODEL=str(model),
        MINIVLLM_LOG_LEVEL="warning",
        MINIVLLM_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S),
        MINIVLLM_BODY_TIMEOUT="3600",  # the stalled body at SIGTERM must not time out before the shutdown
    )
    log = open(Path(tempfile.gettempdir()) / f"connection_attack-{mode}-{port}.log", "w")
    server = subprocess.Popen(server_command(mode, port), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server)  # fails, naming the exit status, if the server dies while loading
        served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        ready = multiprocessing.Event()
        attacker = multiprocessing.Process(
            target=attack,
            args=(port, args.idle, args.stalled, args.big_stalled, args.seconds, ready),
            daemon=True,
        )
        attacker.start()
        probes = asyncio.run(probe_until(url, served, server.pid, lambda: not attacker.is_alive()))
        recovered = asyncio.run(recovery_s(url, served))
        exit_s = sigterm_exit_s(server, port)
        return {
            "mode": mode,
            **summary(probes),
            "recovery s": f"{recovered:.2f}",
            "SIGTERM to exit s": exit_s,
        }
    finally:
        server.kill()
        server.wait(timeout=60)
        log.close()


def sigterm_exit_s(server: subprocess.Popen, port: int) -> str:
    """Seconds from SIGTERM to the server's exit while a client holds a body that never ends."""
    with socket.create_connection(("127.0.0.1", port)) as stalled:
        stalled.sendall(STALLED_HEAD)
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=PROBE_TIMEOUT_S)
        start = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=SHUTDOWN_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            return f"> {SHUTDOWN_TIMEOUT_S + 60:.0f}"
        return f"{time.perf_counter() - start:.2f}"


def summary(probes: dict) -> dict:
    out = {}
    for kind in ("health", "chat"):
        ok = [x for x in probes[kind] if x is not None]
        failed = len(probes[kind]) - len(ok)
        every = sorted(x if x is not None else PROBE_TIMEOUT_S for x in probes[kind])
        p99 = every[min(len(every) - 1, int(0.99 * len(every)))] if every else float("nan")
        median = statistics.median(every) if every else float("nan")
        out[kind] = f"p50 {median * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, failed {failed} of {len(every)}"
    out["most fds"] = probes["fds"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["serve", "uvicorn", "both"], default="both")
    p.add_argument("--idle", type=int, default=15_000)
    p.add_argument("--stalled", type=int, default=1_100)
    p.add_argument(
        "--big-stalled", type=int, default=17, help="connections stalling a byte short of a 4 MiB body"
    )
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--model", type=Path, help="model dir (default: a tiny random model)")
    p.add_argument("--out", type=Path, default=results.RESULTS_DIR, help="directory for the results")
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    results.require_clean_tree(args.allow_dirty)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from tests.tiny_model import make_tiny_model

            args.model = make_tiny_model(Path(tmp) / "tiny")
        modes = ["serve", "uvicorn"] if args.mode == "both" else [args.mode]
        rows = [run_mode(mode, args.model, args) for mode in modes]
        meta = metadata(
            args.model,
            idle=args.idle,
            stalled=args.stalled,
            big_stalled=args.big_stalled,
            seconds=args.seconds,
        )
    notes = (
        f"{args.idle} idle, {args.stalled} stalled and {args.big_stalled} stalled a byte short of a 4 MiB "
        f"body for {args.seconds:g} s against the default "
        f"MINIVLLM_MAX_CONNECTIONS (1000); SIGTERM with MINIVLLM_SHUTDOWN_TIMEOUT={SHUTDOWN_TIMEOUT_S:g}."
    )
    paths = results.write_results(
        "connection_attack", rows, meta, out_dir=args.out, notes=notes, allow_dirty=args.allow_dirty
    )
    results.print_report(paths)


if __name__ == "__main__":
    main()
