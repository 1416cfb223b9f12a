"""The CPU weight layout: linear layers swapped for transposed ones where chosen, the same greedy tokens,
no second copy of the weights, and the per-machine measurement cache (read, ignored when corrupt)."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from minivllm import LLM, SamplingParams
from minivllm.config import CPU_WEIGHT_LAYOUTS, EngineConfig
from minivllm.models import cpu_layout
from minivllm.models.backend import Backend
from minivllm.models.cpu_layout import LAYOUTS, ShapeTiming, TransposedLinear, apply_layout, machine_key
from minivllm.models.loader import load_model
from server.settings import Settings, SettingsError
from tests.test_engine import random_prompts

CPU = Backend("cpu", "test")


def linear_kinds(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, TransposedLinear))}


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def test_the_config_and_the_module_list_the_same_layouts():
    assert CPU_WEIGHT_LAYOUTS == LAYOUTS


def test_transposed_layout_swaps_every_linear_and_keeps_greedy_tokens(tiny_model_dir, reference):
    prompts = random_prompts([1, 17, 40], seed=5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = {}
    for layout in ("native", "transposed"):
        llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, max_num_seqs=4, cpu_weight_layout=layout)
        kinds = set(linear_kinds(llm.engine.model).values())
        assert kinds == ({TransposedLinear} if layout == "transposed" else {nn.Linear}), layout
        outputs[layout] = [c.token_ids for c in llm.generate(prompts, params)]
    assert outputs["transposed"] == outputs["native"] == [reference.greedy(p, 20) for p in prompts]


def test_the_swap_leaves_no_second_copy_of_the_weights(tiny_model_dir):
    native, _, _ = load_model(str(tiny_model_dir), CPU, "native")
    before_bytes = parameter_bytes(native)
    active = mx.get_active_memory()
    chosen = apply_layout(native, "transposed", Path("/nonexistent/unused.json"), "test")
    assert set(chosen.values()) == {"transposed"}
    mx.clear_cache()
    # the same bytes of parameters, and every old [out, in] weight freed: memory did not grow
    assert parameter_bytes(native) == before_bytes
    assert mx.get_active_memory() <= active
    swapped = [m for _, m in native.named_modules() if isinstance(m, TransposedLinear)]
    assert swapped and all("weight" not in m for m in swapped)


def test_a_transposed_layer_computes_what_the_linear_did():
    for bias in (False, True):
        linear = nn.Linear(48, 80, bias=bias)
        swapped = TransposedLinear(mx.contiguous(linear.weight.T), linear.get("bias"))
        x = mx.random.normal((5, 48))
        # the same product; OpenBLAS may sum it in another order for the other layout (on some CPUs its
        # kernels for A @ B and A @ B.T round differently), so to float32's rounding, not bit for bit
        assert mx.allclose(swapped(x), linear(x), rtol=1e-6, atol=1e-6).item(), bias


def timing(decode_native: float, decode_transposed: float, prefill_native=10.0, prefill_transposed=10.0):
    return ShapeTiming(
        native={"1": decode_native, "8": decode_native, "512": prefill_native},
        transposed={"1": decode_transposed, "8": decode_transposed, "512": prefill_transposed},
    )


def test_transposed_only_when_faster_for_decode_and_not_slower_for_prefill():
    assert timing(10.0, 7.0).prefers_transposed()
    assert not timing(10.0, 9.8).prefers_transposed()  # within the noise: stays as it is
    assert not timing(7.0, 10.0).prefers_transposed()
    assert not timing(10.0, 7.0, prefill_native=10.0, prefill_transposed=12.0).prefers_transposed()


def shapes_of(model_dir) -> list[str]:
    model, _, _ = load_model(str(model_dir), CPU, "native")
    return sorted(
        {
            f"{m.weight.shape[0]}x{m.weight.shape[1]}"
            for _, m in model.named_modules()
            if isinstance(m, nn.Linear)
        }
    )


def test_auto_follows_the_cached_measurement_without_measuring(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_layout, "MIN_MEASURED_BYTES", 0)  # the tiny model's matrices count here
    shapes = shapes_of(tiny_model_dir)
    faster = shapes[0]  # one shape measured faster transposed, the others not
    entries = {s: vars(timing(10.0, 5.0 if s == faster else 10.0)) for s in shapes}
    cache = {"version": cpu_layout.CACHE_VERSION, "machines": {machine_key(CPU.blas): entries}}
    (tmp_path / "cpu_weight_layout.json").write_text(json.dumps(cache))
    monkeypatch.setattr(cpu_layout, "measure_shape", lambda *a: pytest.fail("measured despite the cache"))
    model, _, config = load_model(str(tiny_model_dir), CPU, "auto")
    assert config["_weight_layouts"] == {s: "transposed" if s == faster else "native" for s in shapes}
    for name, layer in model.named_modules():
        if isinstance(layer, TransposedLinear):
            assert f"{layer.weight_t.shape[1]}x{layer.weight_t.shape[0]}" == faster, name
        elif isinstance(layer, nn.Linear):
            assert f"{layer.weight.shape[0]}x{layer.weight.shape[1]}" != faster, name


ENTRY_OF_ANOTHER_FORM = {"version": 1, "machines": {machine_key(CPU.blas): {"64x64": {"native": {"1": "x"}}}}}


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"version": 1, "machines": [1, 2]}', '["a list"]', json.dumps(ENTRY_OF_ANOTHER_FORM)],
)
def test_a_corrupt_cache_file_is_ignored_and_rewritten(tiny_model_dir, tmp_path, monkeypatch, content):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_layout, "MIN_MEASURED_BYTES", 0)
    (tmp_path / "cpu_weight_layout.json").write_text(content)
    measured = []

    def fake_measure(out_features, in_features):
        measured.append(f"{out_features}x{in_features}")
        return timing(10.0, 5.0)

    monkeypatch.setattr(cpu_layout, "measure_shape", fake_measure)
    _, _, config = load_model(str(tiny_model_dir), CPU, "auto")
    assert sorted(measured) == sorted(config["_weight_layouts"]) and set(
        config["_weight_layouts"].values()
    ) == {"transposed"}
    saved = json.loads((tmp_path / "cpu_weight_layout.json").read_text())
    assert sorted(saved["machines"][machine_key(CPU.blas)]) == sorted(measured)
    measured.clear()
    load_model(str(tiny_model_dir), CPU, "auto")  # the second load reads the cache back
    assert measured == []


def test_auto_is_the_default_and_keeps_small_matrices_native_unmeasured(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Matrices under MIN_MEASURED_BYTES fit the caches: their layout cannot change a weight-streaming
    decode and timing them is noise, so auto leaves them as nn.Linear has them, measuring nothing."""
    assert EngineConfig().cpu_weight_layout == "auto"
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_layout, "measure_shape", lambda *a: pytest.fail("measured a small matrix"))
    model, _, config = load_model(str(tiny_model_dir), CPU, "auto")
    assert set(config["_weight_layouts"].values()) == {"native"}
    assert not any(isinstance(m, TransposedLinear) for _, m in model.named_modules())


def test_a_real_measurement_times_every_row_count_of_both_layouts():
    t = cpu_layout.measure_shape(32, 48, repeats=1)
    expected = {str(r) for r in (*cpu_layout.DECODE_ROWS, cpu_layout.PREFILL_ROWS)}
    assert set(t.native) == set(t.transposed) == expected
    assert all(v > 0 for v in (*t.native.values(), *t.transposed.values()))


def test_a_gpu_backend_keeps_its_layers(tiny_model_dir):
    model, _, config = load_model(str(tiny_model_dir), Backend("metal", "test"), "transposed")
    assert config["_weight_layouts"] == {} and TransposedLinear not in set(linear_kinds(model).values())


def test_bad_layout_settings_name_the_parameter():
    with pytest.raises(ValueError, match="cpu_weight_layout"):
        EngineConfig(cpu_weight_layout="rows")
    with pytest.raises(SettingsError, match="MINIVLLM_CPU_WEIGHT_LAYOUT"):
        Settings.from_env({"MINIVLLM_CPU_WEIGHT_LAYOUT": "rows"})
    assert (
        Settings.from_env({"MINIVLLM_CPU_WEIGHT_LAYOUT": "Native"}).engine_config().cpu_weight_layout
        == "native"
    )
