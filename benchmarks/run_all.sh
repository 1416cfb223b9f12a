#!/usr/bin/env bash
# Run every benchmark on the default model, one after another (they share the CPU), writing
# benchmarks/results/*.{json,md,png}. About two and a half hours on a 2-core CPU machine (long_context alone ~45 min: its 16k-token prefills).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m benchmarks.throughput "$@"
python -m benchmarks.decode_profile "$@"
python -m benchmarks.pool_scaling "$@"
python -m benchmarks.long_context "$@"
python -m benchmarks.cpu_settings "$@"
python -m benchmarks.prefix_reuse --plot "$@"
python -m benchmarks.concurrent_population --plot "$@"
python -m benchmarks.single_flight --plot "$@"
python -m benchmarks.single_flight --scenario churn "$@"
python -m benchmarks.peer "$@"
python -m benchmarks.structured "$@"
python -m benchmarks.speculative "$@"
python -m benchmarks.quality --plot "$@"
python -m benchmarks.replay_sweep
python -m benchmarks.replay_tiers
python -m benchmarks.kv_tier "$@"
