"""`bench run` as a user types it, for the live tests: a one-class workload file of fixed lengths, a tokenizer
that is no served model's, and one point run through the CLI whose requests must all succeed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from loadgen.cli.app import app


def fixed_workload(path: Path, prompt: int, output: int) -> Path:
    """A workload file of one class: every prompt ``prompt`` tokens, every answer ``output``."""
    path.write_text(f'[[classes]]\nname = "fixed"\nprompt = {{ dist = "fixed", value = {prompt} }}\n'
                    f'output = {{ dist = "fixed", value = {output} }}\n')  # fmt: skip
    return path


def word_tokenizer(path: Path) -> Path:
    """A word-level ``tokenizer.json`` (every word and punctuation mark one token): another model's tokenizer,
    whose prompts a real model's server counts as longer than meant."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(path))
    return path


def cli_point(url: str, workload: Path, out: Path, run_id: str, n: int, *extra: str) -> tuple[dict, str]:
    """``bench run`` of ``n`` requests at concurrency 1 into ``out/run_id``: it exits 0 with every request
    ok; its point summary, and its output on one line (rich wraps it)."""
    res = CliRunner().invoke(app, [
        "run", "--url", url, "--workload", str(workload), "--concurrency", "1", "--num-requests", str(n),
        "--output-dir", str(out), "--run-id", run_id, *extra,
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    (point,) = json.loads((out / run_id / "summary.json").read_text())["points"]
    assert point["counts"]["ok"] == n and point["counts"]["errors"] == 0, point["errors"]
    return point, " ".join(res.output.split())
