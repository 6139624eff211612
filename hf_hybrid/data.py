"""The files this package ships, and run_clm-style causal-LM preprocessing.

No hub is reachable on the machines this project is built on, so the package ships the real GPT-2
tokenizer (vocab.json and merges.txt, MIT, from the openai-whisper 20230308 source archive) and a
public-domain corpus (Project Gutenberg's Shakespeare plays as packaged in shakespeare 0.6: Hamlet and
The Tempest are the validation split), and a fine-tuning corpus of another domain (the de-duplicated
docstrings of transformers, Apache-2.0, built by scripts/build_docs_corpus.py). They load through the
ordinary APIs, `from_pretrained` and `load_dataset`, so swapping in a Hub name changes nothing else.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import DatasetDict
    from transformers import BatchEncoding, GPT2TokenizerFast, PreTrainedTokenizerBase

ASSETS = Path(__file__).parent / "assets"
SHIPPED_TOKENIZER_DIR = ASSETS / "gpt2"
SHIPPED_CORPORA = {
    name: {split: str(ASSETS / name / f"{split}.txt.gz") for split in ("train", "validation")}
    for name in ("shakespeare", "transformers-docs")
}
SHIPPED_CORPUS_FILES = SHIPPED_CORPORA["shakespeare"]


def load_shipped_tokenizer() -> GPT2TokenizerFast:
    """The real GPT-2 byte-level BPE tokenizer, from the shipped vocab.json and merges.txt."""
    from transformers import GPT2TokenizerFast

    # transformers 5.x: GPT2TokenizerFast(vocab_file=..., merges_file=...) silently builds an empty
    # tokenizer; from_pretrained on the directory reads the files properly.
    return GPT2TokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER_DIR))


def load_text_dataset(data_files: dict[str, str], keep_linebreaks: bool = True) -> DatasetDict:
    """`load_dataset("text", ...)` over local (optionally gzipped) files, as run_clm does."""
    from datasets import load_dataset

    return load_dataset("text", data_files=data_files, keep_linebreaks=keep_linebreaks)


def load_shipped_corpus(name: str = "shakespeare") -> DatasetDict:
    """A shipped corpus (`shakespeare` or `transformers-docs`) as a `DatasetDict` with `train` and `validation`."""
    return load_text_dataset(SHIPPED_CORPORA[name])


def group_texts(examples: dict[str, list[Any]], block_size: int) -> dict[str, list[Any]]:
    """Concatenate tokenized texts and cut them into `block_size` chunks; labels are the inputs."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total_length = (len(concatenated["input_ids"]) // block_size) * block_size
    result = {k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


def build_lm_datasets(raw_datasets: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int,
                      num_proc: int | None = None) -> DatasetDict:
    """Tokenize a text `DatasetDict` and group it into fixed-length causal-LM blocks."""
    column_names = list(raw_datasets["train"].features)

    def tokenize(examples: dict[str, list[str]]) -> BatchEncoding:
        return tokenizer(examples["text"])

    tokenized = raw_datasets.map(
        tokenize, batched=True, num_proc=num_proc, remove_columns=column_names, desc="Tokenizing"
    )
    return tokenized.map(
        group_texts, batched=True, num_proc=num_proc, fn_kwargs={"block_size": block_size}, desc="Grouping"
    )
