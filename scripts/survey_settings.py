"""The LR autopilot's survey (issue 49): settings that differ in what matters to a learning rate, split once into a
tuning half and a report half before any gate, cap or cadence is chosen on them. The report half is not to be looked
at while tuning; the split is fixed here, in the same commit that first wrote it. A third group, "fresh", came after
the tuning ended: settings no gate, cap or cadence was ever chosen with in view.

Every setting is a benchmark preset (`survey-NAME`). Its `user_lr` is the LR a user types: `TrainingArguments`' 5e-5
for fine-tuning, and a tenth of the setting's swept LR from scratch (`None` until its sweep is run: scripts/survey.py
reads it from the sweep's report). Corpora are the shipped ones and one built from torch's source; the Python
standard library's source is kept out.
The GPU suite's two parts at the user's LR (docs/gpu-suite.md) belong to the report half too.
"""

from __future__ import annotations

FINETUNE_LR = 5e-5  # TrainingArguments' default
SCRATCH_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
# Up to 300x the user's 5e-5: two fine-tunes' sweeps (finetune-docs-wsd, lora8-docs-linear) ended best at 5e-3, the
# top of a grid that stopped there, and a check at 3x the swept LR needs the Trainer there too.
FINETUNE_GRID = (5e-5, 1.5e-4, 5e-4, 1.5e-3, 5e-3, 1.5e-2)


def _schedule_kwargs(scheduler: str, steps: int) -> dict:
    """Warmup-stable-decay decays over the last fifth; the other schedules take no arguments."""
    return dict(num_decay_steps=steps // 5) if scheduler == "warmup_stable_decay" else {}


def _scratch(n_layer: int, n_embd: int, n_head: int, corpus: str, scheduler: str, warmup: int, steps: int,
             batch: int = 8, accum: int = 1) -> dict:
    return dict(model=dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=64), corpus=corpus,
                block_size=64, batch_size=batch, grad_accum=accum, max_steps=steps, eval_steps=steps // 10,
                early_eval_steps=steps // 100, eval_blocks=128, learning_rate=1e-3, warmup_steps=warmup,
                weight_decay=0.1, optim="adamw_torch",
                bf16=False, scheduler=scheduler, scheduler_kwargs=_schedule_kwargs(scheduler, steps), hybrid=dict(),
                grid=SCRATCH_GRID, user_lr=None)


def _llama(setting: dict) -> dict:
    """The same setting with a Llama of the same shape in place of the GPT-2 (scripts/model_and_data.py)."""
    return dict(setting, model=dict(setting["model"], architecture="llama"))


def _finetune(finetune: dict, scheduler: str, warmup: int, steps: int, batch: int = 8, accum: int = 1,
              lora_r: int = 0) -> dict:
    setting = dict(finetune, batch_size=batch, grad_accum=accum, max_steps=steps, eval_steps=steps // 10,
                   early_eval_steps=steps // 100,
                   scheduler=scheduler, scheduler_kwargs=_schedule_kwargs(scheduler, steps), warmup_steps=warmup,
                   grid=FINETUNE_GRID, user_lr=FINETUNE_LR)
    if lora_r:
        setting["lora"] = dict(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                               target_modules=["c_attn", "c_proj", "c_fc"])
    return setting


def survey_settings(finetune: dict) -> dict[str, dict]:
    """name -> preset, with `half` ("tune" or "report"); `finetune` is the fine-tuning base (presets.FINETUNE)."""
    tune = {
        "scratch-2x128-docs-constant": _scratch(2, 128, 4, "transformers-docs", "constant_with_warmup", 10, 200),
        "scratch-2x64-shakespeare-cosine": _scratch(2, 64, 2, "shakespeare", "cosine", 20, 300),
        "scratch-4x128-shakespeare-wsd-accum2": _scratch(4, 128, 4, "shakespeare", "warmup_stable_decay", 20, 300,
                                                          accum=2),
        "finetune-docs-linear": _finetune(finetune, "linear", 0, 300),
        "finetune-docs-constant-batch16": _finetune(finetune, "constant_with_warmup", 10, 200, batch=16),
        "lora16-docs-cosine": _finetune(finetune, "cosine", 20, 300, lora_r=16),
    }
    report = {
        "scratch-2x128-shakespeare-linear": _scratch(2, 128, 4, "shakespeare", "linear", 20, 300),
        "scratch-3x96-docs-wsd-accum4": _scratch(3, 96, 3, "transformers-docs", "warmup_stable_decay", 20, 300,
                                                 batch=4, accum=4),
        "scratch-4x64-docs-constant-batch16": _scratch(4, 64, 2, "transformers-docs", "constant_with_warmup", 20, 200,
                                                       batch=16),
        "finetune-docs-cosine-accum2": _finetune(finetune, "cosine", 20, 300, batch=4, accum=2),
        "finetune-docs-wsd": _finetune(finetune, "warmup_stable_decay", 10, 300),
        "lora8-docs-linear": _finetune(finetune, "linear", 0, 300, lora_r=8),
    }
    # Written after behaviour version 8 was fixed, from combinations neither half has (a LoRA of rank 4 under a
    # constant schedule, a from-scratch run of batch 4 under cosine decay), and run once: nothing is tuned on them.
    # lora4-docs-constant's miss has since been read to choose behaviour version 9's ramped raise (docs/benchmarks.md),
    # so for raises past 4x it is no longer fresh.
    fresh = {
        "scratch-3x64-shakespeare-cosine-batch4": _scratch(3, 64, 2, "shakespeare", "cosine", 10, 300, batch=4),
        "lora4-docs-constant": _finetune(finetune, "constant_with_warmup", 10, 200, lora_r=4),
        # Written after behaviour version 10 (the 5-step ramp) was fixed, as a held-out check of it: a LoRA under
        # warmup-stable-decay with gradient accumulation, which no other setting combines.
        "lora8-docs-wsd-accum2": _finetune(finetune, "warmup_stable_decay", 10, 300, batch=4, accum=2, lora_r=8),
        # Written in session 54, after version 10: a classifier fine-tune, the Trainer's most common use, which no
        # other setting is (a new head on the pretrained body, a cross-entropy over two classes, not over tokens).
        # 100 updates: in 300 the Trainer at 5e-5 reaches the labels' noise floor too (0.318 against 0.310 at the
        # best LR), where the time to its final loss measures the noise, not the learning rate.
        "classify-source-linear": dict(_finetune(finetune, "linear", 0, 100), task="corpus-source", eval_blocks=512),
        # Written in session 55, after version 10: a fine-tune on code, a domain no other setting trains on (the
        # Python source of the installed torch, scripts/model_and_data.py), at TrainingArguments' defaults: linear
        # decay, no warmup.
        "finetune-code-linear": dict(_finetune(finetune, "linear", 0, 300), corpus="torch-source"),
        # And from scratch on the same code at TrainingArguments' defaults (5e-5, linear, no warmup, no weight decay):
        # what a user gets who sets none, where the other from-scratch settings take a tenth of their swept LR.
        "scratch-2x128-code-linear": dict(_scratch(2, 128, 4, "torch-source", "linear", 0, 300),
                                          weight_decay=0.0, grid=FINETUNE_GRID, user_lr=FINETUNE_LR),
        # Written in session 56, after version 12 was fixed, as a held-out check of its first-descent hold: from
        # scratch at TrainingArguments' defaults again, on another corpus and width.
        "scratch-2x96-docs-linear": dict(_scratch(2, 96, 3, "transformers-docs", "linear", 0, 300),
                                         weight_decay=0.0, grid=FINETUNE_GRID, user_lr=FINETUNE_LR),
        # Written in session 57, after version 12, as a held-out check at a depth no other setting has: 6 layers, where
        # every setting before it has 2-4. A from-scratch user's usual schedule (cosine after a warmup), at a tenth of
        # its swept LR as the other from-scratch settings.
        "scratch-6x256-docs-cosine": _scratch(6, 256, 4, "transformers-docs", "cosine", 20, 300),
        # Written in session 62, after version 12, as a held-out check at the widest and deepest body yet: 8 layers of
        # 512 (GPT-2's 64-wide heads; 51M parameters against the 6x256 setting's 17.6M), under the Trainer's default
        # linear decay after a warmup.
        "scratch-8x512-docs-linear": _scratch(8, 512, 8, "transformers-docs", "linear", 20, 300),
        # Written in session 65, after version 12, as a held-out check on the architecture most users now train: a
        # Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention, tied embedding) in the 6x256 setting's
        # shape, corpus and schedule, so that the two differ in the architecture alone.
        "scratch-llama-6x256-docs-cosine": _llama(_scratch(6, 256, 4, "transformers-docs", "cosine", 20, 300)),
    }
    return {name: dict(setting, half=half) for half, group in (("tune", tune), ("report", report), ("fresh", fresh))
            for name, setting in group.items()}


def evaluated_as_now(report: dict, setting: dict) -> bool:
    """Whether a report at the user's LR was evaluated on the setting's current schedule. Its early evaluations
    (every `early_eval_steps` updates before the first `eval_steps`, and one at the start) time an arm that reaches the
    target inside the first spacing; without them such an arm counts as reaching it at the first evaluation, which
    understates the swept Trainer's speedup and so overstates every arm's G."""
    return (report.get("preset_settings") or {}).get("early_eval_steps") == setting.get("early_eval_steps")


def at_current_version(report: dict) -> bool:
    """Whether a report was measured (or carried) at the library's behaviour version: a report from before a change
    to what runs do no longer counts."""
    from hf_hybrid import BEHAVIOUR_VERSION

    return (report.get("environment") or {}).get("behaviour_version") == BEHAVIOUR_VERSION


def counts_now(report: dict, setting: dict) -> bool:
    """Whether a report at the user's LR counts in the survey's table and the README's: current, and evaluated on the
    setting's current schedule."""
    return at_current_version(report) and evaluated_as_now(report, setting)
