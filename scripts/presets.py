"""The benchmark's presets and the settings every arm runs under: data only, in one place, shared by benchmark.py,
its faults mode and jump_lab.py."""

from survey_settings import survey_settings

PRESETS = {
    # A small GPT-2 with the real 50257-token vocabulary, on the shipped corpus: minutes on 2 CPU cores.
    "cpu-small": dict(
        model=dict(n_layer=2, n_embd=128, n_head=4, n_positions=64),
        block_size=64, batch_size=8, grad_accum=1, max_steps=300, eval_steps=30, eval_blocks=128,
        learning_rate=2e-3, warmup_steps=20, weight_decay=0.1, optim="adamw_torch", bf16=False,
        # The library's default schedule (warmup 100, Full 20); runs 5 and 7 in docs/benchmarks-history.md compare it
        # with an earlier one (40, 10) that attempted jumps more often.
        hybrid=dict(hybrid_max_predict_steps=8, hybrid_min_predict_steps=2, hybrid_correct_steps=2,
                    hybrid_confidence_threshold=0.5, hybrid_monitor_interval=4),
    ),
    # For seconds-long CI smoke runs of benchmark.py and jump_lab.py.
    "smoke": dict(
        model=dict(n_layer=1, n_embd=32, n_head=2, n_positions=32),
        block_size=32, batch_size=4, grad_accum=1, max_steps=12, eval_steps=6, eval_blocks=8,
        learning_rate=3e-3, warmup_steps=2, weight_decay=0.0, optim="adamw_torch", bf16=False,
        hybrid=dict(hybrid_warmup_steps=3, hybrid_outer_period=3, hybrid_full_steps=2, hybrid_max_predict_steps=3,
                    hybrid_min_predict_steps=1, hybrid_correct_steps=1, hybrid_confidence_threshold=0.0),
    ),
    # GPT2Config defaults (124M), from scratch, on the tuned GPU baseline: bf16, fused AdamW, SDPA. The shipped corpus
    # has about 1.2M training tokens, so 600 steps of 4096 tokens are two epochs: longer runs would measure
    # overfitting, not training speed. The hybrid runs the library's defaults (runs 15-18 ran an earlier schedule
    # with the `velocity` predictor).
    "gpt2-124m": dict(
        model=dict(),
        block_size=512, batch_size=8, grad_accum=1, max_steps=600, eval_steps=50, early_eval_steps=10, eval_blocks=128,
        learning_rate=6e-4, warmup_steps=50, weight_decay=0.1, optim="adamw_torch_fused", bf16=True, hybrid=dict(),
    ),
    # gpt2-124m's model and arms on 2 CPU cores: blocks of 64 tokens (a step of 512 tokens, against the GPU's 4096),
    # 150 steps. Its learning_rate is the GPU preset's tuned one; at this batch 2e-4 ends lower (docs/benchmarks.md,
    # "GPT-2 124M's shape at the LR a user types, on the CPU").
    "cpu-124m": dict(
        model=dict(),
        block_size=64, batch_size=8, grad_accum=1, max_steps=150, eval_steps=25, early_eval_steps=10, eval_blocks=64,
        learning_rate=6e-4, warmup_steps=15, weight_decay=0.1, optim="adamw_torch", bf16=False, hybrid=dict(),
    ),
    # GPT-2 medium's shape (355M), from scratch as gpt2-124m; its learning_rate is GPT-3's for this size, unswept.
    "gpt2-355m": dict(
        model=dict(n_layer=24, n_embd=1024, n_head=16),
        block_size=512, batch_size=8, grad_accum=1, max_steps=300, eval_steps=50, eval_blocks=128,
        learning_rate=3e-4, warmup_steps=50, weight_decay=0.1, optim="adamw_torch_fused", bf16=True, hybrid=dict(),
    ),
}


# The fine-tuning regimes: the cpu-small GPT-2, pretrained on the shipped Shakespeare by the project's own recipe (run
# on first use, then kept as a checkpoint), fine-tuned on the shipped transformers docstrings with the Trainer's default
# linear decay. Learning rates: the sweeps in docs/benchmarks-history.md. The hybrid runs the library's defaults.
FINETUNE = dict(
    pretrained="runs/pretrained/gpt2-cpu-shakespeare", pretrain_recipe="recipes/configs/gpt2-cpu-pretrain.yaml",
    corpus="transformers-docs", block_size=64, batch_size=8, grad_accum=1, max_steps=400, eval_steps=40,
    eval_blocks=128, learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, optim="adamw_torch", bf16=False,
    scheduler="linear", hybrid=dict(),
)
# GPT-2 124M pretrained on the shipped Shakespeare by a recipe inside the GPU suite's own call (no Hub there), then
# fine-tuned on the transformers docstrings as `TrainingArguments` would by default: linear decay, no warmup, no
# weight decay, at the user's 5e-5 (`--learning_rate`). Its learning_rate, the `swept` arm's, is the from-scratch tuned
# 6e-4: a reference, not a sweep of this fine-tune. Early evaluations (`early_eval_steps`, scripts/arms.py) time the
# arms that reach the target inside the first 25 steps, as the swept LR does in the CPU fine-tunes.
FINETUNE_124M = dict(
    FINETUNE, pretrained="runs/pretrained/gpt2-124m-shakespeare",
    pretrain_recipe="recipes/configs/gpt2-124m-pretrain.yaml", block_size=512, batch_size=8, max_steps=300,
    eval_steps=25, early_eval_steps=5, learning_rate=6e-4, warmup_steps=0, optim="adamw_torch_fused", bf16=True,
)
PRESETS.update({
    "gpt2-124m-finetune": FINETUNE_124M,
    # The same suite on a CPU in seconds (scripts/gpu_session.sh with PRESET=smoke, run by the tests).
    "smoke-finetune": dict(
        FINETUNE, pretrained="runs/pretrained/gpt2-smoke", pretrain_recipe="recipes/configs/gpt2-smoke-pretrain.yaml",
        block_size=32, batch_size=4, max_steps=12, eval_steps=6, early_eval_steps=2, eval_blocks=8, learning_rate=3e-3,
        warmup_steps=0, hybrid=PRESETS["smoke"]["hybrid"],
    ),
    # Schedule-free AdamW's own best LR here (runs 72 and 75, seed 0: 4.3030 at 6e-3, 4.3102 at 1.2e-2), for the
    # sf-swept arm. The other presets have no schedule-free sweep; that arm runs at their swept Trainer LR.
    "cpu-finetune": dict(FINETUNE, sf_learning_rate=6e-3),
    "cpu-lora": dict(FINETUNE, learning_rate=1e-2,
                     lora=dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"])),
    # Pretraining from scratch over a long horizon with a warmup-stable-decay schedule (the last 20% decays), where a
    # long-horizon nowcast has the stable phase to jump in. Narrower than cpu-small so that 3000 steps take minutes.
    "cpu-long": dict(
        model=dict(n_layer=2, n_embd=64, n_head=2, n_positions=64),
        block_size=64, batch_size=8, grad_accum=1, max_steps=3000, eval_steps=150, eval_blocks=128,
        learning_rate=3e-3, warmup_steps=100, weight_decay=0.1, optim="adamw_torch", bf16=False,
        scheduler="warmup_stable_decay", scheduler_kwargs=dict(num_decay_steps=600), hybrid=dict(),
    ),
})
EMA_DECAY = 0.99  # the averaging arm's; about a 100-step window

# Both arms, as part of the tuned CPU baseline: glibc otherwise maps and unmaps the large gradient buffers
# (the 25 MB tied embedding on cpu-small) every step. Measured on cpu-small, 80 steps: median step 0.38 s
# (baseline) and 0.46 s (hybrid, whose extra buffers change the heap layout) fell to 0.27 s and 0.28 s.
TUNED_HOST_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}

# The arms that run beside the baseline and the hybrid (`--arms`), and what each is: the Trainer evaluated on a moving
# average of its weights; schedule-free AdamW at the arm's learning rate and at its own swept one; the Trainer at the
# preset's swept learning rate, whose final loss is the second target when the others run below it (`--lr_scale`).
PEER_ARMS = {
    "ema": f"weight average (EMA {EMA_DECAY})",
    "sf": "schedule-free AdamW",
    "sf-swept": "schedule-free AdamW, swept LR",
    "swept": "Trainer at the swept LR",
    "prodigy": "Prodigy (no LR: lr 1.0, safeguard_warmup)",
    "mechanic": "Mechanic (mechanize(AdamW), lr 1.0)",
}
SCHEDULE_FREE_ARMS = ("sf", "sf-swept")

# `make demo` (scripts/demo.py): cpu-long's narrow GPT-2, fine-tuned-length runs, a minute or so per part on 2 cores.
# Blocks of 32 tokens: a step's time is mostly the 50,257-way output layer's, which grows with the tokens in it.
PRESETS["demo"] = dict(
    model=dict(n_layer=2, n_embd=64, n_head=2, n_positions=64),
    block_size=32, batch_size=8, grad_accum=1, max_steps=150, eval_steps=25, eval_blocks=64,
    learning_rate=3e-3, warmup_steps=10, weight_decay=0.1, optim="adamw_torch", bf16=False,
    hybrid=dict(hybrid_warmup_steps=50),
)  # learning_rate: swept in docs/benchmarks.md, "The demo in under 3 minutes on this machine"
# The demo's speed A/B at the swept LR, quoted on its screen.
DEMO_SWEPT_REPORT = "docs/reports/demo-speed-swept-lr.json"
# The LR autopilot's survey, split into a tuning half and a report half (survey_settings.py, scripts/survey.py).
PRESETS.update({f"survey-{name}": setting for name, setting in survey_settings(FINETUNE).items()})
