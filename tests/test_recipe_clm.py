"""recipes/train_clm.py end to end on the CPU: the tiny config trains, resumes, and fails in one line offline."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import DatasetDict
from safetensors.torch import load_file

from hf_hybrid.data import build_lm_datasets, load_shipped_corpus, load_shipped_tokenizer

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "train_clm.py"
TINY_CONFIG = REPO / "recipes" / "configs" / "gpt2-tiny-cpu.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

TRAIN_SAMPLES, EVAL_SAMPLES, STEPS = 64, 8, 12
# Few samples and small batches keep tokenizing and training short on a CPU; the hybrid phases are shortened so
# that STEPS optimizer steps get past the dynamics model's warm-up and into prediction.
FAST = [
    "--max_train_samples", str(TRAIN_SAMPLES),
    "--max_eval_samples", str(EVAL_SAMPLES),
    "--per_device_train_batch_size", "2",
    "--save_total_limit", "100",
    "--hybrid_warmup_steps", "2",
    "--hybrid_full_steps", "1",
    "--hybrid_confidence_threshold", "0",
    "--hybrid_max_predict_steps", "2",
    "--hybrid_predictor", "velocity",
]  # fmt: skip


def run_recipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180
    )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def checkpoints(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))


@pytest.fixture(scope="module")
def recipe():
    sys.path.insert(0, str(RECIPE.parent))  # where `python recipes/train_clm.py` finds clm_arguments.py
    spec = importlib.util.spec_from_file_location("train_clm", RECIPE)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the module's string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("tiny")
    result = run_recipe(
        "--config", str(TINY_CONFIG), "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--save_steps", "8",
        *FAST,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_tiny_config_trains_saves_and_evaluates(tiny_run):
    for name in ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.json"):
        assert (tiny_run / name).is_file(), name
    config = read_json(tiny_run / "config.json")
    assert (config["n_layer"], config["n_embd"]) == (2, 64)  # the yaml's config_overrides
    # --max_steps beat the yaml's 40; the steps of rolled-back jumps are made up on top.
    undone = read_json(tiny_run / "hybrid_stats.json")["undone_steps"]
    assert read_json(tiny_run / "trainer_state.json")["global_step"] == STEPS + undone
    assert read_json(tiny_run / "train_results.json")["train_samples"] == TRAIN_SAMPLES
    metrics = read_json(tiny_run / "eval_results.json")
    assert metrics["eval_samples"] == EVAL_SAMPLES
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    # It learned: an untrained GPT-2 (weights at std 0.02) scores within about 0.01 of uniform over the vocabulary.
    assert metrics["eval_loss"] < math.log(50257) - 0.5


def test_tiny_config_trains_hybrid(tiny_run):
    stats = read_json(tiny_run / "hybrid_stats.json")
    # The steps undone by rolled-back jumps are made up on top of max_steps.
    assert sum(stats["phase_steps"].values()) == STEPS + stats["undone_steps"]
    assert stats["predict_steps"] > 0


def test_resume_from_checkpoint_continues_where_it_stopped(tiny_run, tmp_path):
    result = run_recipe(
        "--config", str(TINY_CONFIG), "--output_dir", str(tmp_path), "--max_steps", str(STEPS), "--save_steps", "8",
        "--resume_from_checkpoint", str(tiny_run / "checkpoint-8"), "--do_eval", "false", *FAST,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # A fresh start would have saved checkpoint-8 here too.
    final_step = read_json(tiny_run / "trainer_state.json")["global_step"]
    assert checkpoints(tmp_path) == [f"checkpoint-{final_step}"]
    assert read_json(tmp_path / "trainer_state.json")["global_step"] == final_step
    assert not (tmp_path / "eval_results.json").exists()  # the yaml asks for it; --do_eval false wins
    assert read_json(tmp_path / "hybrid_stats.json") == read_json(tiny_run / "hybrid_stats.json")
    resumed, uninterrupted = load_file(tmp_path / "model.safetensors"), load_file(tiny_run / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in resumed.items():
        assert torch.equal(tensor, uninterrupted[name]), name


def test_last_checkpoint_is_found_unless_overwriting(recipe, tmp_path):
    args = recipe.HybridTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert recipe.resolve_checkpoint(args, overwrite_output_dir=False) is None
    for step in (3, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert recipe.resolve_checkpoint(args, overwrite_output_dir=False) == str(tmp_path / "checkpoint-10")
    assert recipe.resolve_checkpoint(args, overwrite_output_dir=True) is None
    args.resume_from_checkpoint = str(tmp_path / "checkpoint-3")
    assert recipe.resolve_checkpoint(args, overwrite_output_dir=True) == str(tmp_path / "checkpoint-3")


def test_unreachable_dataset_fails_in_one_line(tmp_path):
    result = run_recipe(
        "--dataset_name", "wikitext", "--dataset_config_name", "wikitext-2-raw-v1", "--output_dir", str(tmp_path)
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "wikitext" in lines[0] and "--train_file" in lines[0]
    assert not any(tmp_path.iterdir())


# The remaining tests call the recipe in this process: a subprocess would spend most of its time importing torch.


def test_missing_train_file_fails_in_one_line(recipe, tmp_path, capfd):
    missing = tmp_path / "no-such-corpus.txt"
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--train_file", str(missing), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert str(missing) in lines[0] and "does not exist" in lines[0]


def test_json_arguments_file(recipe, tmp_path):
    args = {
        "output_dir": str(tmp_path / "out"),
        "do_eval": True,
        "config_overrides": "n_layer=1,n_embd=32,n_head=2,n_positions=32",
        "block_size": 32,
        "max_eval_samples": 8,
        "per_device_eval_batch_size": 8,
        "use_cpu": True,
        "report_to": "none",
    }
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps(args))
    recipe.main([str(args_file)])
    assert read_json(tmp_path / "out" / "eval_results.json")["eval_samples"] == 8
    assert not (tmp_path / "out" / "train_results.json").exists()  # do_eval alone: no training


def test_yaml_config_is_overridden_by_flags(recipe):
    model_args, data_args, training_args = recipe.parse_args(
        ["--config", str(TINY_CONFIG), "--max_steps", "3", "--no_hybrid_payoff_check", "--hybrid", "false"]
    )
    assert model_args.config_overrides == "n_layer=2,n_embd=64,n_head=2,n_positions=64"
    assert data_args.block_size == 64
    assert (training_args.max_steps, training_args.hybrid, training_args.hybrid_payoff_check) == (3, False, False)
    assert training_args.hybrid_warmup_steps == 8  # from the yaml


def test_config_with_unknown_key_is_rejected(recipe, tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("max_step: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args(["--config", str(config)])
    assert exit_info.value.code == 2
    assert "max_step" in capsys.readouterr().err


def test_take_blocks_matches_truncating_after_grouping(recipe):
    validation = load_shipped_corpus()["validation"]
    tokenizer = load_shipped_tokenizer()
    everything = build_lm_datasets(DatasetDict(train=validation), tokenizer, block_size=64)["train"]
    for max_blocks in (10, 300):
        taken = recipe.take_blocks(validation, tokenizer, 64, max_blocks)
        assert taken["input_ids"] == everything.select(range(max_blocks))["input_ids"]
    assert len(recipe.take_blocks(validation, tokenizer, 64, None)) == len(everything)
