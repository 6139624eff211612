"""The recipe's command line (recipes/train_clm.py): run_clm's model and data arguments, `HybridTrainingArguments`, and
`--config FILE.yaml`, each value checked before any slow loading; a bad one stops the run with one line on stderr."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser

from hf_hybrid import HybridTrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub name or local directory of a model to fine-tune. Leave unset to train from scratch."},
    )
    model_type: str = field(
        default="gpt2", metadata={"help": "Architecture built by AutoConfig.for_model when training from scratch."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Config changes when training from scratch, e.g. 'n_layer=2,n_embd=64,n_head=2'."},
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub name or local directory of the tokenizer. Defaults to --model_name_or_path, else the GPT-2 "
            "tokenizer shipped with hf_hybrid."
        },
    )


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Dataset to load with datasets.load_dataset. With neither it nor --train_file, the "
            "Shakespeare corpus shipped with hf_hybrid is used."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_file: str | None = field(default=None, metadata={"help": "Plain-text training file (may be gzipped)."})
    validation_file: str | None = field(default=None, metadata={"help": "Plain-text validation file."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Share of the training split held out when there is no validation split."}
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Sequence length of the training blocks. Defaults to the tokenizer's maximum, at most 1024."},
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Keep only the first N training blocks, tokenizing only the lines they need."},
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N evaluation blocks, tokenizing only the lines they need."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks when reading text files."})
    # TrainingArguments dropped this flag in transformers 5; the recipe keeps run_clm's meaning for it.
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start from scratch even when output_dir holds checkpoints (by default training resumes "
            "from the last one)."
        },
    )


def exit_with_error(message: str) -> NoReturn:
    """Stop with one line on stderr and exit code 2, as argparse does for a bad command line."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_config(path: str, known_keys: set[str]) -> dict[str, Any]:
    """The mapping in a YAML (or JSON) config file, with every key checked against the argument fields."""
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as err:
        exit_with_error(f"cannot read config {path}: {' '.join(str(err).split())}")
    if config is None:
        return {}
    if not isinstance(config, dict):
        exit_with_error(f"config {path} must be a mapping of argument names to values")
    unknown = sorted(set(config) - known_keys)
    if unknown:
        exit_with_error(f"config {path} has unknown keys: {', '.join(unknown)}")
    return config


def parse_args(
    argv: list[str] | None = None,
) -> tuple[ModelArguments, DataTrainingArguments, HybridTrainingArguments]:
    """run_clm's command line plus `--config FILE.yaml`.

    The config file's values become the parser's defaults, so any flag also given on the command line wins; string
    values go through the same conversions as typed flags, and the dataclasses check every value. A single `.json`
    argument is read the same way (run_clm's convention for an arguments file).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        argv = ["--config", argv[0]]
    config_flag = argparse.ArgumentParser(add_help=False)
    # SUPPRESS keeps `config` out of the namespace HfArgumentParser hands back, which must hold dataclass fields only.
    config_flag.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE.yaml",
        help="YAML (or JSON) file of argument names and values; flags on the command line override it.",
    )
    dataclass_types = (ModelArguments, DataTrainingArguments, HybridTrainingArguments)
    parser = HfArgumentParser(dataclass_types, parents=[config_flag])
    known, rest = config_flag.parse_known_args(argv)
    if "config" in vars(known):
        field_names = {f.name for dataclass_type in dataclass_types for f in fields(dataclass_type) if f.init}
        parser.set_defaults(**read_config(known.config, field_names))
    try:
        return parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
    except ValueError as err:
        # The argument dataclasses check their values in __post_init__ and name the offending flag.
        exit_with_error(" ".join(str(err).split()))


def check_arguments(model_args: ModelArguments, data_args: DataTrainingArguments) -> None:
    """Reject a bad combination or a missing local file now, before any slow loading."""
    if model_args.model_name_or_path and model_args.config_overrides:
        exit_with_error("--config_overrides only applies when training from scratch; drop --model_name_or_path")
    if data_args.dataset_name and data_args.train_file:
        exit_with_error("pass --dataset_name or --train_file, not both")
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path is not None and not Path(path).is_file():
            exit_with_error(
                f"{flag} {path} does not exist; pass an existing plain-text file, or drop it to use the shipped corpus"
            )
