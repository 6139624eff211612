"""A/B benchmark: the plain `Trainer` against `HybridHFTrainer`, by wall-clock time to the same eval loss.

    python scripts/benchmark.py --preset cpu-small            # the README's main job
    python scripts/benchmark.py --preset gpt2-124m            # on a GPU
    python scripts/benchmark.py --preset cpu-small --mode overhead   # hybrid with prediction off
    python scripts/benchmark.py --preset gpt2-124m --mode memory --max_steps 2000   # peak memory, forced prediction
    python scripts/benchmark.py --preset cpu-small --mode faults     # the guard against injected faults (faults.py)

Both arms share the model init, data order, seed and settings. Each arm runs in its own process (clean
timing and peak memory), arms alternate, and `--repeats` pairs are run; medians are reported. The
target is the baseline's final eval loss; the hybrid may run up to `--hybrid_budget` times the
baseline's steps to reach it. Training time excludes evaluation. Both arms are evaluated every `eval_steps`
applied updates (for the hybrid, predicted steps do not count). Writes JSON and a PNG to --output_dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PRESETS = {
    # A small GPT-2 with the real 50257-token vocabulary, on the shipped corpus: minutes on 2 CPU cores.
    "cpu-small": dict(
        model=dict(n_layer=2, n_embd=128, n_head=4, n_positions=64),
        block_size=64, batch_size=8, grad_accum=1, max_steps=300, eval_steps=30, eval_blocks=128,
        learning_rate=2e-3, warmup_steps=20, weight_decay=0.1, optim="adamw_torch", bf16=False,
        # The library's default schedule (warmup 100, Full 20); runs 5 and 7 in docs/benchmarks.md compare it with
        # an earlier one (40, 10) that attempted jumps more often.
        hybrid=dict(hybrid_max_predict_steps=8, hybrid_min_predict_steps=2, hybrid_correct_steps=2,
                    hybrid_confidence_threshold=0.5, hybrid_monitor_interval=4),
    ),
    # For a seconds-long CI smoke run of this script.
    "smoke": dict(
        model=dict(n_layer=1, n_embd=32, n_head=2, n_positions=32),
        block_size=32, batch_size=4, grad_accum=1, max_steps=12, eval_steps=6, eval_blocks=8,
        learning_rate=3e-3, warmup_steps=2, weight_decay=0.0, optim="adamw_torch", bf16=False,
        hybrid=dict(hybrid_warmup_steps=3, hybrid_full_steps=2, hybrid_max_predict_steps=3,
                    hybrid_min_predict_steps=1, hybrid_correct_steps=1, hybrid_confidence_threshold=0.0),
    ),
    # GPT2Config defaults (124M), from scratch, on the tuned GPU baseline: bf16, fused AdamW, SDPA. The shipped corpus
    # has about 1.2M training tokens, so 600 steps of 4096 tokens are two epochs: longer runs would measure
    # overfitting, not training speed.
    "gpt2-124m": dict(
        model=dict(),
        block_size=512, batch_size=8, grad_accum=1, max_steps=600, eval_steps=50, eval_blocks=128,
        learning_rate=6e-4, warmup_steps=50, weight_decay=0.1, optim="adamw_torch_fused", bf16=True,
        hybrid=dict(hybrid_warmup_steps=100, hybrid_full_steps=20, hybrid_max_predict_steps=10,
                    hybrid_min_predict_steps=2, hybrid_correct_steps=2, hybrid_confidence_threshold=0.5),
    ),
}


# The fine-tuning regimes: the cpu-small GPT-2, pretrained on the shipped Shakespeare by the project's own recipe (run
# on first use, then kept as a checkpoint), fine-tuned on the shipped transformers docstrings with the Trainer's default
# linear decay. Learning rates: the sweeps in docs/benchmarks.md. The hybrid runs the library's defaults.
FINETUNE = dict(
    pretrained="runs/pretrained/gpt2-cpu-shakespeare", pretrain_recipe="recipes/configs/gpt2-cpu-pretrain.yaml",
    corpus="transformers-docs", block_size=64, batch_size=8, grad_accum=1, max_steps=400, eval_steps=40,
    eval_blocks=128, learning_rate=3e-3, warmup_steps=20, weight_decay=0.0, optim="adamw_torch", bf16=False,
    scheduler="linear", hybrid=dict(),
)
PRESETS.update({
    "cpu-finetune": FINETUNE,
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

H100_BF16_FLOPS = 989e12
MEMORY_SAMPLE_EVERY = 100  # steps between samples of the CUDA peak-memory curve

# Both arms, as part of the tuned CPU baseline: glibc otherwise maps and unmaps the large gradient buffers
# (the 25 MB tied embedding on cpu-small) every step. Measured on cpu-small, 80 steps: median step 0.38 s
# (baseline) and 0.46 s (hybrid, whose extra buffers change the heap layout) fell to 0.27 s and 0.28 s.
TUNED_HOST_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


@dataclass
class ArmResult:
    arm: str
    evals: list = field(default_factory=list)  # [step, train_seconds, eval_loss]
    steps: int = 0
    train_seconds: float = 0.0
    tokens: int = 0
    step_seconds: list = field(default_factory=list)  # per optimizer step, training time only
    phases: list = field(default_factory=list)  # per optimizer step
    timing: dict = field(default_factory=dict)  # forward/backward/optimizer seconds
    peak_memory_mb: float = 0.0
    memory_curve: list = field(default_factory=list)  # [step, peak allocated MB so far, reserved MB] (CUDA)
    n_params: int = 0
    cuda: bool = False
    hybrid_stats: dict | None = None
    reached_step: int | None = None


# ---- one arm, in its own process ----------------------------------------------------------------


def build_model_and_data(preset: dict, seed: int):
    """The preset's GPT-2, initialized from `seed` or loaded from its pretrained checkpoint (the same start in every
    arm), optionally wrapped in LoRA adapters, with the preset's shipped corpus in blocks and the evaluation subset."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from hf_hybrid.data import build_lm_datasets, load_shipped_corpus, load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    datasets = build_lm_datasets(load_shipped_corpus(preset.get("corpus", "shakespeare")), tokenizer,
                                 preset["block_size"])
    eval_set = datasets["validation"].select(range(min(preset["eval_blocks"], len(datasets["validation"]))))
    torch.manual_seed(seed)
    if "pretrained" in preset:
        model = AutoModelForCausalLM.from_pretrained(pretrained_checkpoint(preset))
    else:
        config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, **preset["model"])
        model = GPT2LMHeadModel(config)
    if torch.cuda.is_available():
        model.config._attn_implementation = "sdpa"
    if "lora" in preset:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", fan_in_fan_out=True, **preset["lora"]))
    return model, datasets, eval_set


def pretrained_checkpoint(preset: dict) -> str:
    """The preset's pretrained checkpoint; trained by the project's recipe the first time (a few minutes on CPU)."""
    root = Path(__file__).resolve().parent.parent
    path = root / preset["pretrained"]
    if not (path / "config.json").exists():
        print(f"pretraining the checkpoint {path} with {preset['pretrain_recipe']} (first use only)", flush=True)
        subprocess.run([sys.executable, str(root / "recipes" / "train_clm.py"), "--config",
                        str(root / preset["pretrain_recipe"]), "--output_dir", str(path)], check=True)
    return str(path)


class WeightAverage:
    """An exponential moving average of the trainable weights (fp32), updated after every optimizer step; `swapped_in`
    evaluates it in place of the weights. The early-step decay (1 + n) / (10 + n) keeps it from remembering the
    start."""

    def __init__(self, model, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.average = [p.detach().float().clone() for p in self.params]

    def update(self) -> None:
        import torch

        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            torch._foreach_lerp_(self.average, [p.float() for p in self.params], 1 - decay)

    @contextlib.contextmanager
    def swapped_in(self):
        import torch

        kept = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(self.params, [a.to(p.dtype) for p, a in zip(self.params, self.average)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, kept)


def run_arm(arm: str, preset: dict, out_dir: Path, seed: int, hybrid_overrides: dict, budget: float,
            target: float | None) -> ArmResult:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_hybrid import HybridHFTrainer, HybridTrainingArguments

    cuda = torch.cuda.is_available()
    model, datasets, eval_set = build_model_and_data(preset, seed)

    hybrid = arm == "hybrid"
    # Under a decaying schedule the step count defines the schedule: the hybrid keeps the baseline's, and must reach the
    # target inside it. A constant schedule lets it run on for `budget` times the steps.
    constant = preset.get("scheduler", "constant_with_warmup").startswith("constant")
    max_steps = preset["max_steps"]
    if hybrid and target is not None and constant:
        max_steps = math.ceil(preset["max_steps"] * budget)
    common = dict(
        output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=preset["batch_size"],
        per_device_eval_batch_size=max(preset["batch_size"], 16), gradient_accumulation_steps=preset["grad_accum"],
        learning_rate=preset["learning_rate"], lr_scheduler_type=preset.get("scheduler", "constant_with_warmup"),
        lr_scheduler_kwargs=preset.get("scheduler_kwargs", {}), warmup_steps=preset["warmup_steps"],
        weight_decay=preset["weight_decay"], optim=preset["optim"],
        bf16=preset["bf16"] and cuda, eval_strategy="steps", eval_steps=preset["eval_steps"], logging_steps=25,
        save_strategy="no", report_to="none", seed=seed, data_seed=seed, disable_tqdm=True,
        dataloader_num_workers=0, use_cpu=not cuda,
    )
    result = ArmResult(arm=arm)
    clock = {"t0": 0.0, "paused": 0.0, "last_end": 0.0, "step_begin": 0.0}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["t0"] = clock["last_end"] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            clock["step_begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            result.step_seconds.append(now - clock["step_begin"])
            engine = getattr(trainer, "_hybrid", None)
            result.phases.append(engine.last_record.phase.value if engine is not None else "full")
            if cuda and state.global_step % MEMORY_SAMPLE_EVERY == 0:
                result.memory_curve.append([state.global_step, torch.cuda.max_memory_allocated() / 2**20,
                                            torch.cuda.memory_reserved() / 2**20])
            clock["last_end"] = now

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            # Evaluation is not training: stop the clock for it (it ran since the last step ended).
            loss = metrics["eval_loss"]
            result.evals.append([state.global_step, clock["last_end"] - clock["t0"] - clock["paused"], loss])
            now = time.perf_counter()
            clock["paused"] += now - clock["last_end"]
            clock["last_end"] = now
            print(f"  [{arm:>8}] step {state.global_step:4d}, eval loss {loss:.4f}, "
                  f"{result.evals[-1][1]:6.1f}s of training", flush=True)
            if target is not None and loss <= target and result.reached_step is None:
                result.reached_step = state.global_step
                if hybrid:
                    control.should_training_stop = True

    class Timed:
        """Forward / backward / optimizer seconds, synchronized at each boundary on a GPU."""

        def _tick(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def compute_loss(self, model, *args, **kwargs):
            if not model.training:  # evaluation
                return super().compute_loss(model, *args, **kwargs)
            t = self._tick()
            out = super().compute_loss(model, *args, **kwargs)
            self._fwd = self._tick() - t
            result.timing["forward"] = result.timing.get("forward", 0.0) + self._fwd
            return out

        def training_step(self, *args, **kwargs):
            t = self._tick()
            self._fwd = 0.0
            out = super().training_step(*args, **kwargs)
            engine = getattr(self, "_hybrid", None)
            if engine is None or engine.phase.value != "predict":
                result.timing["backward"] = result.timing.get("backward", 0.0) + self._tick() - t - self._fwd
            return out

    # Two callbacks, so that the clock starts after every other pre-step callback and stops before every other
    # post-step one: the hybrid's hooks on either side of the optimizer step count as hooks, not optimizer time.
    class OptimizerClockStart(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            clock["optimizer_start"] = time.perf_counter()

    class OptimizerClockStop(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - clock["optimizer_start"]
            result.timing["optimizer"] = result.timing.get("optimizer", 0.0) + elapsed

    class RealStepEval(TrainerCallback):
        """Evaluates the hybrid after every `eval_steps` applied updates rather than optimizer steps, so both arms are
        looked at after the same number of gradient updates. Once predicted steps shift the step count, evaluating
        on global steps would compare different iterates, and iterates a few steps apart differ in held-out loss
        by more than a jump gains."""

        updates = 0

        def on_step_end(self, args, state, control, **kwargs):
            record = trainer._hybrid.last_record if trainer._hybrid is not None else None  # None: --set hybrid=false
            if record is None or (record.phase.has_backward and not (record.rollback or record.skipped)):
                self.updates += 1
                control.should_evaluate = self.updates % preset["eval_steps"] == 0

    if hybrid:
        time_hybrid_hooks(result, cuda)
        trainer_cls = type("TimedHybrid", (Timed, HybridHFTrainer), {})
        args = HybridTrainingArguments(**{**common, "eval_strategy": "no"}, **{**preset["hybrid"], **hybrid_overrides})
    else:
        trainer_cls = type("TimedTrainer", (Timed, Trainer), {})
        args = TrainingArguments(**common)
    average = None
    if arm == "ema":
        average = WeightAverage(model, EMA_DECAY)
        trainer_cls = averaged(trainer_cls, average)
    trainer = trainer_cls(model=model, args=args, train_dataset=datasets["train"], eval_dataset=eval_set)
    trainer.remove_callback(PrinterCallback)  # one progress line per evaluation instead of the log dicts
    # Added after construction so they run after the hybrid's own hooks: its per-step work is timed too.
    if hybrid:
        trainer.add_callback(RealStepEval())
    if average is not None:

        class AverageUpdate(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                average.update()

        trainer.add_callback(AverageUpdate())  # before the clock's step end: its cost is training time
    trainer.add_callback(Clock())
    trainer.add_callback(OptimizerClockStart())
    trainer.callback_handler.callbacks.insert(0, OptimizerClockStop())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result.steps = trainer.state.global_step
    result.n_params = sum(p.numel() for p in model.parameters())
    result.cuda = cuda
    result.train_seconds = clock["last_end"] - clock["t0"] - clock["paused"]
    result.tokens = result.steps * preset["batch_size"] * preset["grad_accum"] * preset["block_size"]
    if not result.evals or result.evals[-1][0] != result.steps:
        metrics = trainer.evaluate()
        result.evals.append([result.steps, result.train_seconds, metrics["eval_loss"]])
    if cuda:
        result.peak_memory_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        import resource

        result.peak_memory_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if hybrid:
        result.hybrid_stats = trainer.hybrid_stats()
    return result


def averaged(trainer_cls: type, average: WeightAverage) -> type:
    """`trainer_cls`, evaluating the weight average instead of the weights."""

    class Averaged(trainer_cls):
        def evaluate(self, *args, **kwargs):
            with average.swapped_in():
                return super().evaluate(*args, **kwargs)

    return Averaged


def time_hybrid_hooks(result: ArmResult, cuda: bool) -> None:
    """Seconds spent in the engine's per-step work, split by real and predicted steps: the hybrid's overhead,
    measured inside one run rather than as a difference of two noisy runs. On a predicted step it includes
    applying the delta."""
    import functools

    import torch

    from hf_hybrid.engine import HybridEngine
    from hf_hybrid.trainer import HybridMixin

    def timed(method, key_of):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = method(self, *args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            key = key_of(self)
            result.timing[key] = result.timing.get(key, 0.0) + time.perf_counter() - t
            return out

        return wrapper

    def engine_key(engine) -> str:
        record = engine.record if engine.record is not None else engine.last_record
        return "hybrid_hooks_predict" if record.phase.value == "predict" else "hybrid_hooks_real"

    for name in ("begin_step", "check_predict_step", "check_real_step", "before_optimizer_step",
                 "after_optimizer_step", "end_step"):
        setattr(HybridEngine, name, timed(getattr(HybridEngine, name), engine_key))
    # The guard's verdict (and, every few steps, its snapshot) happens in the trainer, on real steps only.
    HybridMixin._guard_vetoes = timed(HybridMixin._guard_vetoes, lambda trainer: "guard")


# ---- orchestration ------------------------------------------------------------------------------


def time_to(evals: list, target: float) -> float | None:
    """Training time at which eval loss first reaches `target`, interpolated linearly between the two evals that
    bracket the crossing (evals are many steps apart; taking the later one would round every arm up)."""
    previous = None
    for _, t, loss in evals:
        if loss <= target:
            if previous is None or previous[1] <= loss:
                return t
            t0, loss0 = previous
            return t0 + (t - t0) * (loss0 - target) / (loss0 - loss)
        previous = (t, loss)
    return None


def launch(arm: str, args, out_dir: Path, target: float | None, overrides: dict,
           learning_rate: float | None = None) -> ArmResult:
    # The memory mode needs no eval curve: one evaluation at the end keeps its long runs short.
    eval_at_end = args.mode == "memory"
    spec = dict(arm=arm, preset=args.preset, seed=args.seed, budget=args.hybrid_budget, target=target,
                overrides=overrides, out_dir=str(out_dir), max_steps=args.max_steps, eval_at_end=eval_at_end,
                learning_rate=learning_rate or args.learning_rate)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--_arm", json.dumps(spec)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **TUNED_HOST_ALLOCATOR}
    print(f"{arm} arm:", flush=True)
    done = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)  # its progress lines go to the screen
    if done.returncode != 0:
        sys.exit(f"benchmark: the {arm} arm failed:\n{done.stderr[-4000:]}")
    return ArmResult(**json.loads((out_dir / "arm_result.json").read_text()))


def arm_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    preset = dict(PRESETS[spec["preset"]])
    if spec["max_steps"]:
        preset["max_steps"] = spec["max_steps"]
    if spec["eval_at_end"]:
        preset["eval_steps"] = preset["max_steps"]
    if spec["learning_rate"]:
        preset["learning_rate"] = spec["learning_rate"]
    out_dir = Path(spec["out_dir"])
    result = run_arm(spec["arm"], preset, out_dir, spec["seed"], spec["overrides"], spec["budget"], spec["target"])
    (out_dir / "arm_result.json").write_text(json.dumps(asdict(result)))


def summarize(arm: ArmResult, target: float | None) -> dict:
    real = [s for s, p in zip(arm.step_seconds, arm.phases) if p != "predict"]
    per_phase: dict[str, float] = {}
    for seconds, phase in zip(arm.step_seconds, arm.phases):
        per_phase[phase] = per_phase.get(phase, 0.0) + seconds
    real_steps = sum(p != "predict" for p in arm.phases)
    tokens_per_step = arm.tokens / max(arm.steps, 1)
    # A rolled-back jump's batches are trained on again (replay) and its steps made up: count them once.
    undone = (arm.hybrid_stats or {}).get("undone_steps", 0)
    # 6 N FLOPs per trained token (forward + backward), against the H100's dense bf16 peak; predicted steps
    # train no token, so they count for nothing here.
    mfu = 6 * arm.n_params * tokens_per_step * real_steps / arm.train_seconds / H100_BF16_FLOPS if arm.cuda else None
    return {
        "mfu": mfu,
        "steps": arm.steps,
        "train_seconds": arm.train_seconds,
        "final_eval_loss": arm.evals[-1][2],
        "final_perplexity": math.exp(arm.evals[-1][2]),
        "time_to_target": time_to(arm.evals, target) if target is not None else None,
        "tokens_per_second": tokens_per_step * (arm.steps - undone) / arm.train_seconds,
        "median_real_step_seconds": statistics.median(real) if real else None,
        "seconds_per_phase": per_phase,
        "timing": arm.timing,
        "peak_memory_mb": arm.peak_memory_mb,
        "hybrid_stats": arm.hybrid_stats,
        "evals": arm.evals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--mode", choices=["speed", "overhead", "memory", "faults", "sweep"], default="speed",
                        help="speed: time to the baseline's eval loss; overhead: hybrid with prediction off; memory: "
                             "the same steps in both arms, the hybrid forced to predict as often as it can (CUDA peak "
                             "memory curve); faults: clean Trainer, Trainer and hybrid with injected faults; sweep: "
                             "the Trainer alone at each of --learning_rates (the baseline's tuning)")
    parser.add_argument("--arms", default="baseline,hybrid",
                        help="speed mode: the arms after the baseline, from hybrid and ema (the Trainer, evaluated on "
                             f"an exponential moving average of its weights, decay {EMA_DECAY})")
    parser.add_argument("--learning_rate", type=float, default=0.0, help="override the preset's, in every arm")
    parser.add_argument("--learning_rates", default="", help="sweep mode: comma-separated learning rates")
    parser.add_argument("--faults", default="window,spike,nan",
                        help="faults mode: which faults to inject, from window, spike, nan")
    parser.add_argument("--repeats", type=int, default=2, help="baseline/hybrid pairs, run alternately")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=0, help="override the preset's baseline steps")
    parser.add_argument("--hybrid_budget", type=float, default=1.5,
                        help="the hybrid may run this many times the baseline's steps to reach the target")
    parser.add_argument("--set", nargs="*", default=[], metavar="FLAG=VALUE",
                        help="hybrid flag overrides, e.g. hybrid_predictor=adam hybrid_monitor_interval=4")
    parser.add_argument("--output_dir", default="runs/benchmark")
    parser.add_argument("--_arm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._arm:
        return arm_main(args._arm)
    if args.mode == "faults":
        import faults

        return faults.main(args, dict(PRESETS[args.preset]), build_model_and_data)

    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value not in ("velocity", "adam") else value
    if args.mode == "overhead":
        overrides["hybrid_confidence_threshold"] = 1.0
    if args.mode == "memory":
        overrides.update(hybrid_confidence_threshold=0.0, hybrid_payoff_check=False)
    root = Path(args.output_dir) / f"{args.preset}-{args.mode}"
    if args.mode == "sweep":
        return sweep(args, root)
    baselines, hybrids, averages = [], [], []
    for r in range(args.repeats):
        base = launch("baseline", args, root / f"baseline-{r}", target=None, overrides={})
        target = base.evals[-1][2]
        baselines.append(base)
        if "ema" in args.arms.split(","):
            averages.append(launch("ema", args, root / f"ema-{r}", target=None, overrides={}))
            print(f"[pair {r}] weight average: eval {averages[-1].evals[-1][2]:.4f}", flush=True)
        # Outside the speed mode both arms run the same steps; in it the hybrid chases the target.
        hyb = launch("hybrid", args, root / f"hybrid-{r}", target=target if args.mode == "speed" else None,
                     overrides=overrides)
        hybrids.append(hyb)
        print(f"[pair {r}] baseline {base.train_seconds:.1f}s eval {target:.4f} | hybrid {hyb.train_seconds:.1f}s "
              f"eval {hyb.evals[-1][2]:.4f} reached={hyb.reached_step}", flush=True)

    # Each pair has its own target, its baseline's final eval loss: on a GPU, runs with the same seed still differ
    # in the last digits (non-deterministic kernels), so one pair's target is not another's.
    targets = [b.evals[-1][2] for b in baselines]
    report = {"preset": args.preset, "mode": args.mode, "repeats": args.repeats, "target_eval_loss": targets[0],
              "targets": targets, "overrides": overrides, "preset_settings": PRESETS[args.preset],
              "baseline": [summarize(b, t) for b, t in zip(baselines, targets)],
              "hybrid": [summarize(h, t) for h, t in zip(hybrids, targets)]}
    if averages:
        report["ema"] = [summarize(a, t) for a, t in zip(averages, targets)]
        report["ema_speedups"] = [b["time_to_target"] / a["time_to_target"] if a["time_to_target"] else None
                                  for b, a in zip(report["baseline"], report["ema"])]
    if args.mode == "memory":
        report["memory_curves"] = {"baseline": [b.memory_curve for b in baselines],
                                   "hybrid": [h.memory_curve for h in hybrids]}
    if args.mode == "overhead":
        ratios = [h["median_real_step_seconds"] / b["median_real_step_seconds"]
                  for b, h in zip(report["baseline"], report["hybrid"])]
        report["step_time_ratio_median"] = statistics.median(ratios)
        report["step_time_ratios"] = ratios
    else:
        speedups = []
        for b, h in zip(report["baseline"], report["hybrid"]):
            speedups.append(b["time_to_target"] / h["time_to_target"] if h["time_to_target"] else None)
        report["speedups"] = speedups
        reached = [s for s in speedups if s is not None]
        report["speedup_median"] = statistics.median(reached) if len(reached) == len(speedups) else None
    (root / "report.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    plot(root, baselines[0], hybrids[0], target)


def sweep(args, root: Path) -> None:
    """The Trainer alone at each learning rate: the baseline's tuning, recorded before any A/B."""
    rows = []
    for lr in (float(x) for x in args.learning_rates.split(",")):
        arm = launch("baseline", args, root / f"lr-{lr:g}", target=None, overrides={}, learning_rate=lr)
        rows.append({"learning_rate": lr, "final_eval_loss": arm.evals[-1][2], "best_eval_loss": min(
            e[2] for e in arm.evals), "train_seconds": arm.train_seconds, "evals": arm.evals})
    best = min(rows, key=lambda row: row["final_eval_loss"])
    (root / "sweep.json").write_text(json.dumps({"preset": args.preset, "seed": args.seed, "runs": rows,
                                                 "best_learning_rate": best["learning_rate"]}, indent=2))
    print(f"\n{args.preset} learning-rate sweep, seed {args.seed} (final eval loss):")
    for row in rows:
        print(f"  lr {row['learning_rate']:<8g} {row['final_eval_loss']:.4f}{'  <- best' if row is best else ''}")
    print(f"wrote {root / 'sweep.json'}")


def print_table(report: dict) -> None:
    def med(arm: str, key: str):
        values = [r[key] for r in report[arm] if r[key] is not None]
        return statistics.median(values) if values else None

    rows = [
        ("train wall time (s, median)", med("baseline", "train_seconds"), med("hybrid", "train_seconds"), ".1f"),
        ("optimizer steps", report["baseline"][0]["steps"], report["hybrid"][0]["steps"], "d"),
        ("final eval loss", report["baseline"][0]["final_eval_loss"], report["hybrid"][0]["final_eval_loss"], ".4f"),
        ("final perplexity", report["baseline"][0]["final_perplexity"], report["hybrid"][0]["final_perplexity"],
         ".2f"),
        ("time to target (s, median)", med("baseline", "time_to_target"), med("hybrid", "time_to_target"), ".1f"),
        ("tokens/s (median)", med("baseline", "tokens_per_second"), med("hybrid", "tokens_per_second"), ".0f"),
        ("median real step (ms)", 1000 * med("baseline", "median_real_step_seconds"),
         1000 * med("hybrid", "median_real_step_seconds"), ".1f"),
        ("peak memory (MB)", med("baseline", "peak_memory_mb"), med("hybrid", "peak_memory_mb"), ".0f"),
    ]
    if report["baseline"][0]["mfu"] is not None:
        rows.append(("MFU (trained tokens)", med("baseline", "mfu"), med("hybrid", "mfu"), ".3f"))
    print(f"\n{report['preset']} ({report['mode']}), {report['repeats']} alternating pairs; "
          f"target eval loss per pair {', '.join(f'{t:.4f}' for t in report['targets'])}")
    print(f"{'':32}{'Trainer':>14}{'HybridHFTrainer':>18}")
    for name, a, b, fmt in rows:
        fa = "-" if a is None else format(a, fmt)
        fb = "-" if b is None else format(b, fmt)
        print(f"{name:32}{fa:>14}{fb:>18}")
    stats = report["hybrid"][0]["hybrid_stats"] or {}
    if stats:
        print(f"phase steps: {stats['phase_steps']}")
        print(f"backward reduction: {stats['backward_reduction']:.3f}, rollbacks: {stats['rollbacks']}, "
              f"divergences: {stats['divergences']}")
        print(f"guard: {stats.get('guard_outliers', 0)} steps flagged, {stats.get('guard_rollbacks', 0)} rollbacks")
    timing = report["baseline"][0]["timing"]
    if timing:
        print("baseline split (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timing.items()))
    hybrid_timing = report["hybrid"][0]["timing"]
    hook_seconds = hybrid_timing.get("hybrid_hooks_real", 0.0)
    real_seconds = sum(v for k, v in report["hybrid"][0]["seconds_per_phase"].items() if k != "predict")
    if real_seconds:
        print(f"hybrid hook time on real steps: {hook_seconds:.2f}s = {100 * hook_seconds / real_seconds:.2f}% "
              "of real-step time")
        guard_seconds = hybrid_timing.get("guard", 0.0)
        print(f"guard time (verdicts and snapshots): {guard_seconds:.2f}s = "
              f"{100 * guard_seconds / real_seconds:.2f}% of real-step time")
    print("hybrid seconds per phase: " + ", ".join(
        f"{k} {v:.1f}" for k, v in report["hybrid"][0]["seconds_per_phase"].items()))
    if report["mode"] == "memory":
        print_memory(report)
    elif report["mode"] == "overhead":
        print(f"hybrid/baseline median real-step time: {report['step_time_ratio_median']:.3f} "
              f"(pairs: {', '.join(f'{r:.3f}' for r in report['step_time_ratios'])})")
    else:
        speedups = ", ".join("not reached" if s is None else f"{s:.2f}x" for s in report["speedups"])
        median = report["speedup_median"]
        print(f"time-to-target speedup: {'-' if median is None else f'{median:.2f}x'} (pairs: {speedups})")
    if "ema" in report:
        ema = report["ema"][0]
        speedups = ", ".join("not reached" if s is None else f"{s:.2f}x" for s in report["ema_speedups"])
        print(f"weight average (EMA {EMA_DECAY}): final eval loss {ema['final_eval_loss']:.4f}, time-to-target "
              f"speedup over the Trainer: {speedups}")


def print_memory(report: dict) -> None:
    """Peak allocated memory of both arms over the run: the hybrid's extra, and whether it grows."""
    base, hyb = report["memory_curves"]["baseline"][0], report["memory_curves"]["hybrid"][0]
    if not base or not hyb:
        print("memory mode: no CUDA peak-memory curve (CPU run)")
        return
    print("step  baseline peak MB  hybrid peak MB  hybrid reserved MB")
    for (step, b_peak, _), (_, h_peak, h_reserved) in zip(base, hyb):
        print(f"{step:5d}{b_peak:17.0f}{h_peak:16.0f}{h_reserved:20.0f}")
    # Growth over the second half: the first samples may predate the first Predict phase, and its undo snapshot.
    mid = hyb[len(hyb) // 2]
    last = hyb[-1]
    print(f"hybrid peak / baseline peak at the end: {last[1] / base[-1][1]:.3f}; hybrid peak growth from step "
          f"{mid[0]} to {last[0]}: {last[1] - mid[1]:+.0f} MB ({100 * (last[1] - mid[1]) / mid[1]:+.2f}%)")


def plot(root: Path, baseline: ArmResult, hybrid: ArmResult, target: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install hf-hybrid[plot])")
        return
    from hf_hybrid.plotting import shade_phases

    trace_path = root / "hybrid-0" / "hybrid_trace.jsonl"
    trace = [json.loads(line) for line in trace_path.read_text().splitlines()] if trace_path.exists() else []
    # The trace's clock includes evaluation pauses; put each step on the training-only clock of the arm.
    train_clock, elapsed = [], 0.0
    for seconds in hybrid.step_seconds:
        elapsed += seconds
        train_clock.append(elapsed)
    for row, t in zip(trace, train_clock):
        row["time"] = t
    fig, ax = plt.subplots(figsize=(9, 5))
    if trace:
        shade_phases(ax, trace, x="time")
    for arm, style in ((baseline, "k-o"), (hybrid, "C3-s")):
        ax.plot([t for _, t, _ in arm.evals], [loss for _, _, loss in arm.evals], style, ms=3,
                label="Trainer" if arm.arm == "baseline" else "HybridHFTrainer")
    ax.axhline(target, color="grey", ls="--", lw=1, label="target (baseline final)")
    ax.set_xlabel("training wall clock (s, evaluation excluded)")
    ax.set_ylabel("eval loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(root / "eval_loss_vs_wallclock.png", dpi=120)
    print(f"wrote {root / 'report.json'} and {root / 'eval_loss_vs_wallclock.png'}")


if __name__ == "__main__":
    main()
