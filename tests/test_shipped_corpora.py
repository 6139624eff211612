"""The shipped corpora: both load through `load_dataset`, and the fine-tuning corpus's validation split is unseen."""

from __future__ import annotations

import gzip

from hf_hybrid.data import SHIPPED_CORPORA, load_shipped_corpus


def test_fine_tuning_corpus_loads_and_its_splits_share_no_paragraph():
    corpus = load_shipped_corpus("transformers-docs")
    assert corpus["train"].num_rows > 5 * corpus["validation"].num_rows > 0
    files = SHIPPED_CORPORA["transformers-docs"]
    paragraphs = {split: set(gzip.open(files[split], "rt").read().split("\n\n")) for split in ("train", "validation")}
    assert not paragraphs["train"] & paragraphs["validation"]
