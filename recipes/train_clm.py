#!/usr/bin/env python
"""Train a causal language model with hybrid predictive training, the way transformers' run_clm.py does.

    python recipes/train_clm.py --config recipes/configs/gpt2-tiny-cpu.yaml
    python recipes/train_clm.py --config recipes/configs/gpt2-small.yaml --max_steps 100 --output_dir runs/x
    python recipes/train_clm.py args.json
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/train_clm.py --config ...

The flags are run_clm's (`--model_name_or_path`, `--dataset_name`, `--train_file`, `--block_size`, ...) plus every
`HybridTrainingArguments` field (recipes/clm_arguments.py). With no model, tokenizer or data named, a GPT-2
(`--model_type`, resized by `--config_overrides`) is trained from scratch with the GPT-2 tokenizer and the Shakespeare
corpus that hf_hybrid ships, so the recipe runs without the Hugging Face Hub. Names that must come from the Hub fail
with one line on stderr (exit code 2) when it cannot be reached.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

import datasets
import transformers
from clm_arguments import DataTrainingArguments, ModelArguments, check_arguments, exit_with_error, parse_args
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from hf_hybrid import HybridHFTrainer, HybridTrainingArguments
from hf_hybrid.data import SHIPPED_CORPUS_FILES, SHIPPED_TOKENIZER_DIR, build_lm_datasets, load_text_dataset

logger = logging.getLogger("train_clm")

T = TypeVar("T")

# Where take_blocks starts doubling: a few thousand tokens of typical text, enough for a smoke test's blocks.
FIRST_PREFIX_LINES = 1000


def load_or_exit(load: Callable[[], T], what: str, instead: str) -> T:
    """Run `load`; when `what` cannot be loaded (Hub unreachable, misspelt, not a local path) exit with one line
    saying why and what to pass `instead`, not a traceback.

    The Hub clients report unreachable or missing names as OSError (ConnectionError, FileNotFoundError and
    friends) and unknown configurations as ValueError.
    """
    try:
        return load()
    except (OSError, ValueError) as err:
        reason = textwrap.shorten(" ".join(str(err).split()), width=240, placeholder=" ...")
        exit_with_error(f"cannot load {what}: {reason} -- {instead}")


def resolve_checkpoint(training_args: HybridTrainingArguments, overwrite_output_dir: bool) -> str | None:
    """The checkpoint to resume from: `--resume_from_checkpoint` if given, else the last one in output_dir
    unless `--overwrite_output_dir` asks for a fresh start."""
    if training_args.resume_from_checkpoint is not None:
        return training_args.resume_from_checkpoint
    if overwrite_output_dir or not os.path.isdir(training_args.output_dir):
        return None
    return get_last_checkpoint(training_args.output_dir)


def load_raw_datasets(data_args: DataTrainingArguments) -> DatasetDict:
    """The text splits, with a validation split carved from the training one when the source has none."""
    if data_args.dataset_name:
        name = data_args.dataset_name
        raw = load_or_exit(
            lambda: load_dataset(name, data_args.dataset_config_name),
            f"dataset {name!r}",
            "drop --dataset_name to use the shipped corpus, or pass --train_file",
        )
    elif data_args.train_file:
        files = {"train": data_args.train_file}
        if data_args.validation_file:
            files["validation"] = data_args.validation_file
        raw = load_text_dataset(files, keep_linebreaks=data_args.keep_linebreaks)
    else:
        raw = load_text_dataset(SHIPPED_CORPUS_FILES, keep_linebreaks=data_args.keep_linebreaks)
    if "validation" not in raw:
        held_out = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, shuffle=False)
        raw = DatasetDict(train=held_out["train"], validation=held_out["test"])
    return raw


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        return AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER_DIR))
    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    return load_or_exit(
        lambda: AutoTokenizer.from_pretrained(name),
        f"tokenizer {name!r}",
        f"drop {flag} to use the shipped GPT-2 tokenizer, or pass a local tokenizer directory",
    )


def load_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    name = model_args.model_name_or_path
    if name is not None:
        model = load_or_exit(
            lambda: AutoModelForCausalLM.from_pretrained(name),
            f"model {name!r}",
            "drop --model_name_or_path to train a GPT-2 from scratch, or pass a local model directory",
        )
    else:

        def build_config():
            config = AutoConfig.for_model(model_args.model_type)
            if model_args.config_overrides:
                config.update_from_string(model_args.config_overrides)
            return config

        config = load_or_exit(
            build_config,
            f"config for --model_type {model_args.model_type} --config_overrides {model_args.config_overrides!r}",
            "pass a model type transformers knows and key=value overrides of its config fields",
        )
        model = AutoModelForCausalLM.from_config(config)
    # A tokenizer with added tokens needs rows the checkpoint's embedding lacks.
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return model


def take_blocks(
    raw_split: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    max_blocks: int | None,
    num_proc: int | None = None,
) -> Dataset:
    """The first `max_blocks` blocks of `raw_split` (all of them when None), tokenizing only the lines they need.

    run_clm tokenizes and groups a whole split before truncating it, which costs seconds per megabyte of text: too
    slow for smoke tests. This tokenizes a prefix of the lines instead, doubling it until it yields enough blocks.
    Grouping cuts each map batch of lines into blocks from the batch's start, so a prefix of the lines groups into a
    prefix of the full split's blocks and the result is run_clm's. With `num_proc` the lines are sharded first, which
    moves the batch boundaries: the blocks are then still a prefix of the text but may differ slightly.
    """
    lines = FIRST_PREFIX_LINES if max_blocks is not None else len(raw_split)
    while True:
        prefix = raw_split.select(range(min(lines, len(raw_split))))
        blocks = build_lm_datasets(DatasetDict(train=prefix), tokenizer, block_size, num_proc=num_proc)["train"]
        if max_blocks is None or len(blocks) >= max_blocks or len(prefix) == len(raw_split):
            return blocks if max_blocks is None else blocks.select(range(min(max_blocks, len(blocks))))
        lines *= 2


def flatten(stats: dict[str, Any]) -> dict[str, Any]:
    """`stats` with nested mappings spread into `outer.inner` keys, which `Trainer.log_metrics` can print."""
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": inner_value for inner, inner_value in value.items()})
        else:
            flat[key] = value
    return flat


def setup_logging(training_args: HybridTrainingArguments) -> None:
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
        level=logging.INFO if training_args.should_log else logging.WARNING,
    )
    log_level = training_args.get_process_log_level()
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse_args(argv)
    check_arguments(model_args, data_args)
    if not (training_args.do_train or training_args.do_eval):
        # Unlike run_clm, a bare command line does something useful.
        training_args.do_train = training_args.do_eval = True
    setup_logging(training_args)
    set_seed(training_args.seed)

    # Everything that may need the Hub comes first, so an offline failure costs no tokenizing or training.
    raw = load_raw_datasets(data_args)
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, tokenizer)
    logger.info("Model: %s with %.1fM parameters", model.config.model_type, model.num_parameters() / 1e6)

    block_size = min(data_args.block_size or 1024, tokenizer.model_max_length)
    if data_args.block_size and block_size < data_args.block_size:
        logger.warning("--block_size %d exceeds the tokenizer's maximum; using %d", data_args.block_size, block_size)
    num_proc = data_args.preprocessing_num_workers
    # The main process tokenizes first and the others then read its cached result.
    with training_args.main_process_first(desc="tokenizing"):
        train_dataset = eval_dataset = None
        if training_args.do_train:
            train_dataset = take_blocks(raw["train"], tokenizer, block_size, data_args.max_train_samples, num_proc)
        if training_args.do_eval:
            eval_dataset = take_blocks(raw["validation"], tokenizer, block_size, data_args.max_eval_samples, num_proc)

    trainer = HybridHFTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        checkpoint = resolve_checkpoint(training_args, data_args.overwrite_output_dir)
        if checkpoint is not None:
            logger.info("Resuming from %s", checkpoint)
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        stats = trainer.hybrid_stats()
        trainer.log_metrics("hybrid", flatten(stats))
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "hybrid_stats.json"), "w", encoding="utf-8") as handle:
                json.dump(stats, handle, indent=2, sort_keys=True)

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
