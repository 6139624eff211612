"""A preset's model and data: the same starting point in every benchmark arm, in the faults mode and in jump_lab.py.
Imports the training stack only when called, so that importing this module stays cheap."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path


def build_model_and_data(preset: dict, seed: int):
    """The preset's model (a GPT-2, or from scratch a Llama: `scratch_model`), initialized from `seed` or loaded from
    its pretrained checkpoint (the same start in every arm), optionally wrapped in LoRA adapters, with the preset's
    shipped corpus in blocks and the evaluation subset.
    A preset with a `task` fine-tunes the pretrained body with a sequence-classification head on that task."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    if preset.get("task") == "corpus-source":
        datasets = corpus_source_task(preset["block_size"])
    else:
        datasets = tokenized_corpus(preset.get("corpus", "shakespeare"), preset["block_size"])
    eval_set = datasets["validation"].select(range(min(preset["eval_blocks"], len(datasets["validation"]))))
    torch.manual_seed(seed)
    if "task" in preset:  # the pretrained body with a new classification head, initialized from `seed`
        model = AutoModelForSequenceClassification.from_pretrained(
            pretrained_checkpoint(preset), num_labels=2, pad_token_id=tokenizer.eos_token_id)
    elif "pretrained" in preset:
        model = AutoModelForCausalLM.from_pretrained(pretrained_checkpoint(preset))
    else:
        model = scratch_model(preset["model"], tokenizer)
    if torch.cuda.is_available():
        # The fused attention kernels' backward need not be deterministic; the matrix products of eager attention are,
        # under the cuBLAS settings full_determinism makes.
        model.config._attn_implementation = "eager" if preset.get("full_determinism") else "sdpa"
    if "lora" in preset:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", fan_in_fan_out=True, **preset["lora"]))
    return model, datasets, eval_set


def scratch_model(shape: dict, tokenizer):
    """A model from scratch in GPT-2's shape keys (n_layer, n_embd, n_head, n_positions): GPT-2 by default, or with
    `architecture` "llama" a Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention with half as many
    key-value heads, the embedding tied to the head as small Llama-family models tie it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    shape = dict(shape)
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if shape.pop("architecture", "gpt2") == "gpt2":
        return GPT2LMHeadModel(GPT2Config(**ids, **shape))
    width, heads = shape["n_embd"], shape["n_head"]
    config = AutoConfig.for_model("llama", **ids, hidden_size=width, intermediate_size=8 * width // 3 // 8 * 8,
                                  num_hidden_layers=shape["n_layer"], num_attention_heads=heads,
                                  num_key_value_heads=max(heads // 2, 1),
                                  max_position_embeddings=shape["n_positions"], tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


@functools.lru_cache
def tokenized_corpus(corpus: str, block_size: int):
    """A shipped corpus (or `torch-source`) in blocks, tokenized once per process however many arms train on it."""
    from hf_hybrid.data import build_lm_datasets, load_shipped_corpus, load_shipped_tokenizer, load_text_dataset

    raw = load_text_dataset(torch_source_files()) if corpus == "torch-source" else load_shipped_corpus(corpus)
    return build_lm_datasets(raw, load_shipped_tokenizer(), block_size)


SOURCE_CHARS = {"train": 2_500_000, "validation": 250_000}  # the docstrings corpus's sizes (build_docs_corpus.py)


def torch_source_files() -> dict[str, str]:
    """A code corpus, built here on first use and not shipped: the Python source of the installed torch (2.13.0 by the
    Makefile, BSD-3-Clause), whole files, in an order and a train/validation split (one file in 20) both drawn from a
    hash of each file's path, so that the corpus spans the package. The Python standard library's source stays out."""
    import hashlib

    import torch

    out = Path(__file__).resolve().parent.parent / "runs" / "corpora" / f"torch-{torch.__version__}-source"
    files = {split: out / f"{split}.txt" for split in SOURCE_CHARS}
    if not all(path.exists() for path in files.values()):
        root = Path(torch.__file__).parent
        digest = {path: hashlib.sha1(path.relative_to(root).as_posix().encode()).hexdigest()
                  for path in root.rglob("*.py")}
        texts: dict[str, list[str]] = {split: [] for split in SOURCE_CHARS}
        sizes = dict.fromkeys(SOURCE_CHARS, 0)
        for path in sorted(digest, key=digest.get):
            split = "validation" if int(digest[path], 16) % 20 == 0 else "train"
            if sizes[split] < SOURCE_CHARS[split]:
                texts[split].append(path.read_text(encoding="utf-8"))
                sizes[split] += len(texts[split][-1])
        out.mkdir(parents=True, exist_ok=True)
        for split, path in files.items():
            path.write_text("\n".join(texts[split]), encoding="utf-8")
    return {split: str(path) for split, path in files.items()}


LABEL_NOISE = 0.1  # as real labels are: without it the task is learnt to 0.001, where no two LRs differ (0.0006-0.005)


def corpus_source_task(block_size: int):
    """A two-class task made from the shipped corpora, as a classifier fine-tune's data: each block labelled by the
    corpus it comes from (0: Shakespeare, 1: the transformers docstrings), as many of each per split, in an order
    shuffled once (seed 0), with a tenth of the labels flipped, drawn per block from its split and position."""
    import random

    from datasets import DatasetDict, concatenate_datasets

    def flip(example: dict, index: int, split: str) -> dict:
        noisy = random.Random(f"{split}-{index}").random() < LABEL_NOISE
        return {"labels": 1 - example["labels"] if noisy else example["labels"]}

    corpora = [tokenized_corpus(name, block_size) for name in ("shakespeare", "transformers-docs")]
    splits = {}
    for split in ("train", "validation"):
        size = min(len(corpus[split]) for corpus in corpora)
        parts = [corpus[split].select(range(size)).map(lambda _, label=label: {"labels": label}, desc="Labelling")
                 for label, corpus in enumerate(corpora)]
        splits[split] = concatenate_datasets(parts).shuffle(seed=0).flatten_indices().map(
            flip, with_indices=True, fn_kwargs={"split": split}, desc="Flipping")
    return DatasetDict(splits)


def pretrained_checkpoint(preset: dict) -> str:
    """The preset's pretrained checkpoint; trained by the project's recipe the first time (a few minutes on CPU)."""
    root = Path(__file__).resolve().parent.parent
    path = root / preset["pretrained"]
    if not (path / "config.json").exists():
        print(f"pretraining the checkpoint {path} with {preset['pretrain_recipe']} (first use only)", flush=True)
        subprocess.run([sys.executable, str(root / "recipes" / "train_clm.py"), "--config",
                        str(root / preset["pretrain_recipe"]), "--output_dir", str(path)], check=True)
    return str(path)


def plain_training_args(preset: dict, learning_rate: float, out_dir: str, seed: int = 0, **extra):
    """The preset's `TrainingArguments` for a plain Trainer on the CPU at `learning_rate` and `seed`, logging nothing:
    the experiments that watch a run from a callback (early_lines.py, raise_ceiling.py)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, max_steps=preset["max_steps"], per_device_train_batch_size=preset["batch_size"],
        gradient_accumulation_steps=preset["grad_accum"], learning_rate=learning_rate,
        lr_scheduler_type=preset["scheduler"], lr_scheduler_kwargs=preset["scheduler_kwargs"],
        warmup_steps=preset["warmup_steps"], weight_decay=preset["weight_decay"], optim=preset["optim"],
        save_strategy="no", report_to="none", seed=seed, data_seed=seed, disable_tqdm=True, use_cpu=True,
        logging_steps=10**6, **extra)
