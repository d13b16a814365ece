"""Fixtures of the data-stage tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    """The tiny model's tokenizer, as the data stage loads it."""
    from data.tokens import load_tokenizer, read_tokenizer_files

    return load_tokenizer(read_tokenizer_files(str(tiny_model_dir))[1])
