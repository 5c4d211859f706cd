"""The rehearsal of ``make gpu-check`` (scripts/gpu_check.py) on this CPU machine: tiny seeded shapes, the CPU
device, small counts, every check run as the GPU machine will run it, so that its first GPU run is not its
first run. Also the seeded GGUF it makes: a model the server loads, with the bundled model's tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from reference_server.model.gguf_loader import load_gguf
from reference_server.model.text import TextCodec
from reference_server.model_files import default_model_path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_models  # noqa: E402
import gpu_check_plan  # noqa: E402

pytestmark = pytest.mark.rehearsal  # make test-rehearsal, a step of .ci/run


def test_a_seeded_model_has_its_shape_and_the_bundled_tokenizer(tmp_path):
    tok = tmp_path / "tokenizer.gguf"
    gpu_check_models.export_tokenizer(default_model_path(), tok)
    reader = gguf.GGUFReader(str(tok))
    assert len(reader.tensors) == 0 and "llama.block_count" not in reader.fields
    assert tok.stat().st_size < 4 * 2**20  # carried with a device call: a few MB, not the 98 MB model
    shape = gpu_check_models.SHAPES["tiny"]
    path = gpu_check_models.write_seeded_gguf(tok, tmp_path / "m.gguf", "tiny", shape, seed=5, device="cpu")
    spec, w = load_gguf(path)
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.ffn) == (2, 128, 4, 2, 256)
    assert spec.vocab == 49152 and spec.head_dim == 32 and "output.weight" not in w  # a tied head
    text = "<|im_start|>user\nHello, 12 seas!<|im_end|>"
    assert TextCodec(path).tokenizer.encode(text).ids == TextCodec(default_model_path()).tokenizer.encode(text).ids
    again = gpu_check_models.write_seeded_gguf(tok, tmp_path / "again.gguf", "tiny", shape, seed=5, device="cpu")
    assert again.read_bytes() == path.read_bytes()  # seeded: the same file twice
    other = load_gguf(gpu_check_models.write_seeded_gguf(tok, tmp_path / "o.gguf", "tiny", shape, seed=6, device="cpu"))[1]
    assert not (other["blk.0.attn_q.weight"] == w["blk.0.attn_q.weight"]).all()


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--rehearse", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert (out / "gpu_check.log").is_file(), proc.stderr[-3000:]
    return proc, json.loads((out / "gpu_check.json").read_text()) | {"out": str(out)}


def test_the_rehearsal_runs_every_check(rehearsal):
    proc, res = rehearsal
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    checks = res["checks"]
    assert list(checks) == list(gpu_check_plan.CHECKS)
    assert all(c["ok"] is True for c in checks.values()), {k: c.get("error") for k, c in checks.items()}
    assert res["environment"]["device"] == "cpu" and res["environment"]["nvml"] == []
    assert res["models"]["small"] == "tiny" and res["models"]["big"] == "tiny-wide"
    # the engine tests ran by pytest on the seeded model
    assert checks["pytest"]["passed"] == len(gpu_check_plan.REHEARSAL_PLAN.pytest) and checks["pytest"]["failed"] == 0
    ident = checks["identity"]
    assert ident["fp32_cpu_vs_device"]["identical"] == ident["fp32_cpu_vs_device"]["of"] == 4
    assert ident["fp32_device_batched_vs_alone"]["identical"] == 4
    assert 0 <= ident["device_default_vs_fp32"]["identical"] <= 4


def test_the_rehearsal_measures_what_the_gpu_run_reports(rehearsal):
    _, res = rehearsal
    checks, acc = res["checks"], res["acceptance"]
    dec = checks["decode"]
    assert dec["copy_bandwidth_gbs"] > 0
    assert dec["judged"] == "tiny-deep"  # the plan's last decode shape: written for the check alone
    assert not Path(res["out"], "work", "tiny-deep.gguf").exists()
    for label in gpu_check_plan.REHEARSAL_PLAN.decode:
        steps = dec[label]["steps"]
        assert set(steps) == {"c1_graphs", "c1_eager", "c4_graphs", "c4_eager"}
        assert all(p["wall_ms"] > 0 for p in steps.values())
        assert steps["c4_graphs"]["mean_context"] > gpu_check_plan.REHEARSAL_PLAN.prompt  # measured while decoding
        assert dec[label]["bound_ms"] > 0 and dec[label]["gpu_over_bound"] is None  # GPU time needs a GPU
    bat = checks["batching"]
    assert bat["engine_tok_s"]["varied"] > 0 and bat["static_tok_s"]["varied"] > 0
    sweep = checks["sweep"]
    assert [p["point"] for p in sweep["points"]] == ["c001", "c004"] and sweep["errors"] == 0
    assert all(p["requests"] > 0 and p["output_tok_s"] > 0 for p in sweep["points"])
    assert sweep["nvml_ok"] is None and Path(res["out"], "sweep_report.html").is_file()
    # the verdicts the GPU run is judged by are there, unmeasured where they need a GPU
    assert acc["engine_tests_on_device"] is True and acc["greedy_identity_cpu_eq_device"] is True
    assert acc["decode_gpu_within_2x_bound"] is None and acc["nvml_series_in_report"] is None
    assert acc["continuous_at_least_3x_static"] in (True, False) and acc["sweep_zero_errors"] is True
