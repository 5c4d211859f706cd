"""A Hugging Face cache laid out as huggingface_hub writes it, used offline (``tests/test_workloads.py``,
``tests/test_reference_sweep.py``)."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer


def offline_hub_cache(root: Path, repo: str, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``repo``'s ``tokenizer.json`` in a Hugging Face cache under ``root``, which this process then keeps to
    (huggingface_hub reads its settings when imported, so its constants are set too)."""
    import huggingface_hub.constants as hf

    snapshot = root / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    tokenizer.save(str(snapshot / "tokenizer.json"))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
