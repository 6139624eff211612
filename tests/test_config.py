"""Flags: visible in --help, validated at construction with the flag's name, defaults for plain args."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from transformers import HfArgumentParser, TrainingArguments

from hf_hybrid import HybridHFTrainer, HybridTrainingArguments
from hf_hybrid.config import HYBRID_FIELDS, HybridConfig, PredictorName, hybrid_config
from hf_hybrid.jumps.predictors import PREDICTORS

from .conftest import tiny_gpt2, token_dataset


def test_flags_show_in_help(capsys):
    parser = HfArgumentParser(HybridTrainingArguments)
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--help"])
    help_text = capsys.readouterr().out
    for name in ("hybrid", "hybrid_warmup_steps", "hybrid_full_steps", "hybrid_max_predict_steps",
                 "hybrid_correct_steps", "hybrid_confidence_threshold", "hybrid_predictor"):
        assert f"--{name}" in help_text
    assert "{velocity,adam,outer}" in help_text
    assert all(f.metadata.get("help") for f in HYBRID_FIELDS)


def test_cli_parses_hybrid_false(tmp_path):
    (args,) = HfArgumentParser(HybridTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--hybrid", "false", "--hybrid_predictor", "adam"]
    )
    assert args.hybrid is False and args.hybrid_predictor == "adam"


@pytest.mark.parametrize(
    "flag,value",
    [
        ("hybrid_confidence_threshold", 1.5),
        ("hybrid_confidence_threshold", -0.1),
        ("hybrid_warmup_steps", -1),
        ("hybrid_correct_steps", -2),
        ("hybrid_max_predict_steps", -3),
        ("hybrid_full_steps", 0),
        ("hybrid_predictor", "crystal_ball"),
        ("hybrid_velocity_beta", 1.0),
        ("hybrid_outer_lr", 0.0),
        ("hybrid_monitor_interval", 0),
        ("hybrid_probe_noise_margin", -1.0),
        ("hybrid_guard_window", 0),
        ("hybrid_guard_threshold", 0.0),
        ("hybrid_vram_min_free_mb", -1.0),
    ],
)
def test_bad_values_raise_naming_the_flag(tmp_path, flag, value):
    with pytest.raises(ValueError, match=f"--{flag}: .* \\(got {value!r}\\)"):
        HybridTrainingArguments(output_dir=str(tmp_path), **{flag: value})


def test_plain_training_arguments_get_hybrid_defaults(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = HybridHFTrainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset(16))
    assert trainer.hybrid_config == hybrid_config(HybridTrainingArguments(output_dir=str(tmp_path)))


def test_flags_the_active_predictor_does_not_read_are_named_in_one_warning(tmp_path, caplog):
    def warnings(**flags) -> list[str]:
        caplog.clear()
        args = HybridTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **flags)
        with caplog.at_level("WARNING", logger="hf_hybrid"):
            HybridHFTrainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset(16))
        return [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]

    assert warnings(hybrid_full_steps=5, hybrid_monitor_interval=2, hybrid_outer_period=7) == [
        "hf_hybrid: --hybrid_predictor outer does not read --hybrid_full_steps, --hybrid_monitor_interval: they have "
        "no effect on this run."
    ]
    assert warnings(hybrid_predictor="velocity", hybrid_outer_lr=0.3, hybrid_full_steps=5) == [
        "hf_hybrid: --hybrid_predictor velocity does not read --hybrid_outer_lr: they have no effect on this run."
    ]
    assert warnings() == [] and warnings(hybrid_predict=False, hybrid_full_steps=5) == []


def test_each_flag_is_read_by_exactly_one_capability_setting():
    # One owner per fact: a flag's default lives in HybridTrainingArguments, its value in one typed field.
    read = HybridConfig.flag_names()
    assert sorted(read) == sorted(f.name for f in HYBRID_FIELDS)
    assert len(read) == len(set(read))


def test_the_predictor_flag_offers_exactly_the_predictors_there_are():
    assert set(get_args(PredictorName)) == set(PREDICTORS)


def test_the_typed_settings_carry_the_flags_values(tmp_path):
    args = HybridTrainingArguments(output_dir=str(tmp_path), hybrid_guard_window=17, hybrid_outer_lr=0.5,
                                   hybrid_max_predict_steps=9, hybrid_lr_autopilot=False, hybrid_probe_noise_margin=1.5)
    config = hybrid_config(args)
    assert (config.guard.window, config.jumps.predictor.outer_lr, config.jumps.schedule.max_predict_steps,
            config.autopilot.enabled, config.jumps.checks.probe_noise_margin) == (17, 0.5, 9, False, 1.5)


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_the_flag_docs_state_each_default_the_config_has():
    # The default has one owner, the field; its docstring line and docs/usage.md's tables restate it, so both are
    # checked against it here.
    defaults = {f.name: f.default for f in HYBRID_FIELDS}
    docstring = dict(re.findall(r"^\s+(hybrid\w*) \(`\w+`, defaults to `\"?([^`\"]+)\"?`\)",
                                HybridTrainingArguments.__doc__, re.M))
    assert {name: docstring.get(name) for name in defaults} == {n: str(v) for n, v in defaults.items()}
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    table = dict(re.findall(r"^\| `--(hybrid\w*)` \| `?([^`|]+?)`? \|", usage, re.M))
    assert set(table) == set(defaults)
    assert {n: float(v) if v[0].isdigit() else v for n, v in table.items()} == {
        n: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _shown(v)
        for n, v in defaults.items()}
