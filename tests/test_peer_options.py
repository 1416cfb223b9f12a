"""benchmarks.peer's ways to run the peer and to time it, on the tiny random model."""

import json

import pytest

from benchmarks import peer
from benchmarks.harness import client, models, servers


def test_peer_blas_decides_the_openblas_preload(tiny_model_dir, monkeypatch):
    if not (models.is_cpu_backend() and models.OPENBLAS.exists()):
        pytest.skip("OpenBLAS is preloaded for the peer only on the CPU backend")
    monkeypatch.setenv("LD_PRELOAD", f"{models.OPENBLAS}:/lib/other.so")
    spec = servers.ServerSpec("mlx-lm", tiny_model_dir)
    _, env = servers._server_command(spec, tiny_model_dir, 8123)
    assert str(models.OPENBLAS) in env["LD_PRELOAD"].split(":")
    plain = servers.ServerSpec("mlx-lm", tiny_model_dir, peer_blas="bundled")
    _, env = servers._server_command(plain, tiny_model_dir, 8123)
    assert env["LD_PRELOAD"] == "/lib/other.so"  # an inherited OpenBLAS preload is taken out too


def test_peer_weights_as_given_serves_the_quantized_dir(tiny_model_dir, tmp_path):
    from mlx_lm.convert import convert

    q4 = tmp_path / "tiny-q4"
    convert(str(tiny_model_dir), str(q4), quantize=True, q_bits=4, q_group_size=64)
    assert servers.served_model_dir(servers.ServerSpec("mlx-lm", q4, peer_weights="as-given")) == q4
    if models.is_cpu_backend():
        assert servers.served_model_dir(servers.ServerSpec("mlx-lm", q4)) == tmp_path / "tiny-q4-float32"


@pytest.mark.parametrize("field", ["peer_weights", "peer_blas"])
def test_unknown_peer_settings_are_refused(tiny_model_dir, field):
    with pytest.raises(ValueError, match=field):
        servers.ServerSpec("mlx-lm", tiny_model_dir, **{field: "fast"})


def test_parse_peers():
    assert peer.parse_peers("float32+openblas,as-given+bundled") == [
        peer.Peer(),
        peer.Peer("as-given", "bundled"),
    ]
    assert [p.label for p in peer.parse_peers("float32+openblas,as-given+openblas")] == [
        "mlx-lm",
        "mlx-lm as-given+openblas",
    ]
    for bad in ("float32", "float16+openblas", "float32+mkl"):
        with pytest.raises(ValueError, match="--peers"):
            peer.parse_peers(bad)


def test_ttft_definitions():
    r = client.RequestResult(0.0, 0.0, 1, 1, 0, "x", sent_at=10.0, first_token_at=12.5, finished_at=13.0,
                             first_chunk_at=11.0)  # fmt: skip
    assert peer.ttft_s(r, "first-content") == 2.5
    assert peer.ttft_s(r, "first-chunk") == 1.0


def test_peer_variants_side_by_side(tiny_model_dir, tmp_path):
    """Two peers, the first-chunk TTFT and one scenario: one results file, one ratio column per peer."""
    argv = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--allow-dirty"]
    argv += [
        "--peers",
        "float32+openblas,float32+bundled",
        "--ttft",
        "first-content,first-chunk",
        "--scenarios",
        "cold-warm",
    ]
    peer.main(argv)
    (path,) = tmp_path.glob("peer-variants-quick*.json")
    data = json.loads(path.read_text())
    assert set(data["raw"]) == {"minivllm", "mlx-lm", "mlx-lm float32+bundled"}
    assert data["metadata"]["peers"]["mlx-lm float32+bundled"] == {"weights": "float32", "blas": "bundled"}
    assert [row["metric"] for row in data["rows"]] == [
        "cold/warm: prompt tokens",
        "cold/warm: cold TTFT ms",
        "cold/warm: cold TTFT ms (first-chunk)",
        "cold/warm: warm TTFT ms",
        "cold/warm: warm TTFT ms (first-chunk)",
        "cold/warm: warm cached tokens",
    ]
    assert {"minivllm/mlx-lm", "minivllm/mlx-lm float32+bundled"} <= set(data["rows"][1])
    for runs in data["raw"].values():
        cold, warm = runs[0]["raw"]["cold_warm"]
        for r in (cold, warm):
            assert r["sent_at"] < r["first_chunk_at"] <= r["first_token_at"]
        metrics = runs[0]["metrics"]
        assert metrics["cold/warm: cold TTFT ms"] == pytest.approx(
            (cold["first_token_at"] - cold["sent_at"]) * 1e3
        )
        first_chunk = (cold["first_chunk_at"] - cold["sent_at"]) * 1e3
        assert metrics["cold/warm: cold TTFT ms (first-chunk)"] == pytest.approx(first_chunk)
        assert warm["cached_tokens"] > 0
