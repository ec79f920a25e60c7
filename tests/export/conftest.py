"""Session fixtures for the export tests; the models and tokenizer come from export_models.py."""

from __future__ import annotations

import pytest

from export_models import make_model, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def saved_model(tmp_path_factory, tokenizer):
    """arch -> a directory holding that tiny model and the tokenizer, as save_pretrained writes it."""
    cache = {}

    def save(arch: str):
        if arch not in cache:
            directory = tmp_path_factory.mktemp(arch) / "merged"
            make_model(arch).save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            cache[arch] = directory
        return cache[arch]

    return save
