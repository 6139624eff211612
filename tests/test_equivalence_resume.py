"""`--hybrid false` is the plain Trainer bit for bit; a run resumed mid-Predict equals an uninterrupted one; what the
hybrid state holds changes only with its layout's version."""

from __future__ import annotations

import hashlib
import json

import torch
from transformers import Trainer, TrainingArguments

from hf_hybrid import HybridHFTrainer
from hf_hybrid.checkpoint import FORMAT_VERSION, find_hybrid_state, load_hybrid_state, save_hybrid_state

from .conftest import hybrid_args, make_trainer, reject_every_jump, tiny_gpt2, token_dataset


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_hybrid_false_is_the_plain_trainer(tmp_path):
    common = dict(per_device_train_batch_size=8, learning_rate=3e-3, max_steps=25, report_to="none", seed=0,
                  use_cpu=True, disable_tqdm=True, save_strategy="no", max_grad_norm=1.0)
    plain_model = tiny_gpt2()
    Trainer(model=plain_model, args=TrainingArguments(output_dir=str(tmp_path / "a"), **common),
            train_dataset=token_dataset()).train()
    hybrid_model = tiny_gpt2()
    off = HybridHFTrainer(model=hybrid_model, args=hybrid_args(tmp_path / "b", hybrid=False, **common),
                          train_dataset=token_dataset())
    off.train()
    assert_bit_identical(state(plain_model), state(hybrid_model))
    assert off._hybrid is None and not (tmp_path / "b" / "hybrid_trace.jsonl").exists()
    assert off.hybrid_stats()["backward_steps"] == 25
    # ...and the hybrid on does change the trajectory, so the comparison above can fail.
    on_model = tiny_gpt2()
    on = HybridHFTrainer(model=on_model, args=hybrid_args(tmp_path / "c", **common), train_dataset=token_dataset())
    on.train()
    assert on.hybrid_stats().keys() == off.hybrid_stats().keys()
    assert not torch.equal(state(on_model)["transformer.h.0.mlp.c_fc.weight"],
                           state(plain_model)["transformer.h.0.mlp.c_fc.weight"])


def test_resume_mid_predict_is_bit_identical(tmp_path):
    check_resume_mid_predict(tmp_path)


def test_resume_mid_predict_then_rollback_is_bit_identical(tmp_path, monkeypatch):
    """A checkpoint inside a jump that is then rejected: the resumed run rewinds the learning-rate schedule the
    checkpoint kept for it, and makes up the same steps."""
    reject_every_jump(monkeypatch)
    full_run, resumed = check_resume_mid_predict(tmp_path)
    undone = full_run.hybrid_stats()["undone_steps"]
    assert undone > 0
    assert resumed.state.global_step == full_run.state.global_step == 30 + undone

    # Resumed after a rollback: the Trainer sets max_steps from the arguments again, and the steps made up so far
    # must be added back.
    trace = [json.loads(line) for line in (tmp_path / "full" / "hybrid_trace.jsonl").read_text().splitlines()]
    after = next(r["step"] for r in trace if r["rollback"]) + 1
    resumed_model = tiny_gpt2(seed=123)
    settings = dict(max_steps=30, save_strategy="steps", save_steps=1, hybrid_payoff_check=True)
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "after", **settings),
                              train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{after}"))
    assert resumed.state.global_step == full_run.state.global_step
    assert_bit_identical(state(full_run.model), state(resumed_model))


def test_a_run_with_dropout_resumed_near_an_epoch_start_draws_the_same_masks(tmp_path, monkeypatch):
    """Rejected jumps leave batches waiting for replay, so each epoch's DataLoader seed draw is deferred past the
    epoch's first fetch (loop/epoch_seed.py). Resumed mid-epoch after the draw was made, the checkpoint's RNG holds it
    and the resumed run's own iterator adds none; resumed while it is still deferred, the checkpoint carries it. Both
    end at the uninterrupted run's weights bit for bit: dropout draws every mask from the same RNG."""
    reject_every_jump(monkeypatch)
    settings = dict(max_steps=40, save_strategy="steps", save_steps=1, hybrid_payoff_check=True)
    examples = 128  # 16 steps per epoch

    full_run = make_trainer(tmp_path / "full", model=tiny_gpt2(dropout=0.1), dataset=token_dataset(examples),
                            **settings)
    full_run.train()
    saved = {int(path.name.split("-")[1]): find_hybrid_state(str(path), 0)["engine"]
             for path in (tmp_path / "full").glob("checkpoint-*")}
    deferred = min(step for step, state in saved.items() if state["epoch_seed"]["queued_at"] is not None)
    made = min(step for step, state in saved.items()
               if step > deferred and state["replay"]["queue"] and state["epoch_seed"]["queued_at"] is None)
    for step in (deferred, made):
        resumed_model = tiny_gpt2(seed=123, dropout=0.1)
        resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / f"resumed-{step}", **settings),
                                  train_dataset=token_dataset(examples))
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        assert_bit_identical(state(full_run.model), state(resumed_model))


def test_a_run_resumed_while_an_evaluation_waits_for_a_jump_evaluates_where_the_uninterrupted_one_does(
        tmp_path, monkeypatch):
    """Evaluations due inside a chain of kept jumps wait for the chain's end (loop/step_veto.py). A checkpoint saved
    while one waits must carry that it is owed: a resumed run that took the last multiple of eval_steps for done skipped
    it (the jumps here are `velocity`'s, open through their Correct steps)."""
    from hf_hybrid.jumps.payoff import PayoffMeter

    verdict = PayoffMeter.verdict
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: verdict(self, 1e6))  # every jump kept
    settings = dict(max_steps=30, save_strategy="steps", save_steps=1, hybrid_payoff_check=True,
                    eval_strategy="steps", eval_steps=5)
    evaluation = token_dataset(16, seed=1)
    full_run = make_trainer(tmp_path / "full", eval_dataset=evaluation, **settings)
    full_run.train()
    evals = [(h["step"], h["eval_loss"]) for h in full_run.state.log_history if "eval_loss" in h]
    resume_at = 21
    # At the resume the full run owed an evaluation (due since the 10th update, none since the 5th) and took it once
    # the jumps let it, off the schedule's multiples: the case a resumed run skipped.
    assert [step for step, _ in evals if 5 < step <= resume_at] == [], evals
    waiting = [step for step, _ in evals if step > resume_at]
    assert waiting and waiting[0] % 5 != 0, evals

    resumed = HybridHFTrainer(model=tiny_gpt2(seed=123), args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset(), eval_dataset=evaluation)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{resume_at}"))
    resumed_evals = [(h["step"], h["eval_loss"]) for h in resumed.state.log_history if "eval_loss" in h]
    assert [e for e in resumed_evals if e[0] > resume_at] == [e for e in evals if e[0] > resume_at]
    assert_bit_identical(state(full_run.model), state(resumed.model))


def check_resume_mid_predict(tmp_path, **extra) -> tuple[HybridHFTrainer, HybridHFTrainer]:
    settings = dict(max_steps=30, save_strategy="steps", save_steps=1, hybrid_payoff_check=True, **extra)
    full_run = make_trainer(tmp_path / "full", **settings)
    full_run.train()
    trace = [json.loads(line) for line in (tmp_path / "full" / "hybrid_trace.jsonl").read_text().splitlines()]
    # A checkpoint taken after a Predict step that is followed by another Predict step: mid-phase.
    mid = next(r["step"] for r, nxt in zip(trace, trace[1:]) if r["phase"] == nxt["phase"] == "predict")
    checkpoint = tmp_path / "full" / f"checkpoint-{mid}"
    whole = find_hybrid_state(str(checkpoint), 0)
    # One entry per stateful part of the run, each its own state_dict.
    assert set(whole) - {"format_version"} == set(full_run._stateful_parts()) >= {"engine", "guard"}
    saved = whole["engine"]
    assert saved["controller"]["phase"] == "predict" and saved["snapshot"]["valid"]

    resumed_model = tiny_gpt2(seed=123)  # different init: everything must come from the checkpoint
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_bit_identical(state(full_run.model), state(resumed_model))
    assert resumed.hybrid_stats() == full_run.hybrid_stats()
    return full_run, resumed


# The keys of the hybrid state each layout saves (a run with the defaults: the guard, the autopilot, the outer jumps),
# as a digest of `key_paths`. A change to what any part saves changes it; then raise checkpoint.FORMAT_VERSION, so an
# older checkpoint is refused by name instead of failing on a missing key, and record the new digest here.
# Layout 8 holds layout 7's keys, the autopilot's start weights moved from each rank's file to the tensors file.
LAYOUT_DIGESTS = {3: "4a397d8a72dc07a7", 4: "2ec0e85ca1381da8", 5: "b7e519160ff6955e", 6: "3dffda9559e09cdd",
                  7: "bc1a1aed2dc09f9a", 8: "bc1a1aed2dc09f9a"}


def key_paths(value, prefix: str = "") -> set[str]:
    """Every key path in nested dicts, lists of dicts marked `[]`; tensors and plain values end a path."""
    if isinstance(value, dict):
        return set().union(*({f"{prefix}.{key}"} | key_paths(item, f"{prefix}.{key}") for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return set().union(*(key_paths(item, f"{prefix}[]") for item in value))
    return set()


def test_what_the_hybrid_state_holds_changes_only_with_its_format_version(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=12, save_strategy="steps", save_steps=12)
    trainer.train()
    paths = sorted(key_paths(find_hybrid_state(str(tmp_path / "checkpoint-12"), 0)))
    assert {".engine", ".guard", ".lr_autopilot.alignment", ".format_version"} <= set(paths)
    digest = hashlib.sha256("\n".join(paths).encode()).hexdigest()[:16]
    assert LAYOUT_DIGESTS.get(FORMAT_VERSION) == digest, (
        f"the hybrid state's keys are not layout {FORMAT_VERSION}'s (digest {digest}): raise FORMAT_VERSION in "
        "hf_hybrid/checkpoint.py and record the digest in LAYOUT_DIGESTS")


def test_the_autopilots_start_weights_are_written_once_per_job_beside_the_other_parameter_sized_state(tmp_path):
    """Saved in the autopilot's first 10 steps, its copy of the start weights (1x the parameters) goes to the tensors
    file, which under DDP one rank writes for all, not into each rank's own file; every rank reads it back."""
    start = {"valid": True, "tensors": [torch.ones(4)]}
    state = {"engine": {"predictor": {"buf": [torch.zeros(4)]}, "snapshot": None, "step": 3}, "guard": {"n": 1},
             "lr_autopilot": {"alignment": {"window": [0.1, 2.0], "closed": False, "start": start}, "read_every": 10}}
    for rank in (0, 1):  # DDP: every rank saves; rank 0 writes what they hold alike
        save_hybrid_state(str(tmp_path), rank, state, sharded=False, writes_replicated=rank == 0)
    assert state["lr_autopilot"]["alignment"]["start"] is start and "predictor" in state["engine"]  # left whole
    own = load_hybrid_state(str(tmp_path / "hybrid_state_rank1.pt"))
    assert "start" not in own["lr_autopilot"]["alignment"] and "predictor" not in own["engine"]
    for rank in (0, 1):
        loaded = find_hybrid_state(str(tmp_path), rank)
        assert torch.equal(loaded["lr_autopilot"]["alignment"]["start"]["tensors"][0], torch.ones(4))
        assert loaded["engine"]["step"] == 3 and torch.equal(loaded["engine"]["predictor"]["buf"][0], torch.zeros(4))
        assert loaded["lr_autopilot"]["read_every"] == 10 and loaded["guard"] == {"n": 1}
