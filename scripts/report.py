"""The benchmark's report, in the parent process: each arm's summary (time to the target eval loss, throughput, MFU,
seconds per phase), the printed tables and the eval-loss-against-wall-clock PNG."""

from __future__ import annotations

import json
import math
import statistics
from itertools import accumulate
from pathlib import Path

from arms import ArmResult
from presets import PEER_ARMS

H100_BF16_FLOPS = 989e12


SECONDS, UPDATES = 1, 3  # columns of an eval: [step, train_seconds, eval_loss, updates spent]


def time_to(evals: list, target: float, column: int = SECONDS) -> float | None:
    """Training time (or with `column=UPDATES`, gradient updates spent) at which eval loss first reaches `target`,
    interpolated linearly between the two evals that bracket the crossing (evals are many steps apart; taking the
    later one would round every arm up)."""
    previous = None
    for entry in evals:
        t, loss = entry[column], entry[2]
        if loss <= target:
            if previous is None or previous[1] <= loss:
                return t
            t0, loss0 = previous
            return t0 + (t - t0) * (loss0 - target) / (loss0 - loss)
        previous = (t, loss)
    return None


def speedups(report: dict, arm: str, key: str = "time_to_target") -> list:
    """The baseline's time (or updates) to the target over the arm's, per pair; None where the arm never got there."""
    return [b[key] / a[key] if a[key] else None for b, a in zip(report["baseline"], report[arm])]


def equal_evals(baseline: dict, arm: dict) -> list[int]:
    """[evaluations, in order, whose loss equals the baseline's bit for bit; evaluations compared]. Both arms evaluate
    on counted steps, so the k-th evaluations stand for the same count of the Trainer's updates."""
    pairs = list(zip(baseline["evals"], arm["evals"]))
    return [sum(b[2] == a[2] for b, a in pairs), len(pairs)]


def jump_cost(step_seconds: list[float], phases: list[str]) -> dict | None:
    """The predicted steps' seconds apart from the first, which also allocates the jump's buffers (pinned on a GPU, a
    one-time cost), and the real step after each, which starts the next cycle (the new anchor's copy out)."""
    at = [i for i, p in enumerate(phases) if p == "predict"]
    if not at:
        return None
    after = [step_seconds[i + 1] for i in at if i + 1 < len(phases) and phases[i + 1] != "predict"]
    return {"predicted": len(at), "first": step_seconds[at[0]],
            "median": statistics.median(step_seconds[i] for i in at[1:] or at),
            "next_median": statistics.median(after) if after else float("nan")}


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
        "updates_to_target": time_to(arm.evals, target, UPDATES) if target is not None else None,
        "tokens_per_second": tokens_per_step * (arm.steps - undone) / arm.train_seconds,
        "median_real_step_seconds": statistics.median(real) if real else None,
        # The clocked hooks' and guard's median on a real step: their steady cost, without the run's one-time and rare
        # costs (the first pinned allocations, a snapshot every 50 steps) that their totals carry.
        "median_real_step_hook_seconds": statistics.median(
            h for h, p in zip(arm.hook_seconds, arm.phases) if p != "predict") if arm.hook_seconds and real else None,
        "seconds_per_phase": per_phase,
        "jump_cost": jump_cost(arm.step_seconds, arm.phases),
        "timing": arm.timing,
        "cuda": arm.cuda,
        "peak_memory_mb": arm.peak_memory_mb,
        "peak_pinned_mb": arm.peak_pinned_mb,
        "hybrid_stats": arm.hybrid_stats,
        "evals": arm.evals,
    }


def add_swept_target(report: dict, swept_targets: list[float], arms: list[str]) -> None:
    """The second target, the swept Trainer's final loss per pair: each arm's time to it, and its speedup over the
    baseline at the swept LR (the `swept` arm), which is what a user gains against running the tuned LR."""
    report["swept_targets"] = swept_targets
    for arm in arms:
        for summary, target in zip(report[arm], swept_targets):
            summary["time_to_swept_target"] = time_to(summary["evals"], target)
    report["swept_target_speedups"] = {
        arm: [w["time_to_swept_target"] / s["time_to_swept_target"] if s["time_to_swept_target"] else None
              for w, s in zip(report["swept"], report[arm])]
        for arm in arms
    }


def sweep_fraction(report: dict, arm: str) -> dict:
    """G, per pair, in updates and in wall clock: the log of the arm's speedup to the same-LR Trainer's final loss over
    the log of the swept Trainer's. 1 is what running the swept LR buys; None where the arm or the swept Trainer never
    reached that loss, or where the swept LR bought nothing."""
    def ratio(arm_speedup: float | None, swept_speedup: float | None) -> float | None:
        if not arm_speedup or not swept_speedup or swept_speedup <= 1.0:
            return None
        return math.log(arm_speedup) / math.log(swept_speedup)

    return {unit: [ratio(a, s) for a, s in zip(speedups(report, arm, key), speedups(report, "swept", key))]
            for unit, key in (("updates", "updates_to_target"), ("wall", "time_to_target"))}


def print_peers(report: dict) -> None:
    """One line per arm: final loss and time-to-target speedup against the baseline at the same LR, and against the
    swept Trainer's loss."""
    print(f"\narms at lr {report['learning_rate']:g} (x{report['lr_scale']:g} the preset's), time-to-target speedup "
          "over the Trainer, per pair:")
    swept = report.get("swept_target_speedups", {})
    for arm in ("hybrid", *PEER_ARMS):
        if arm not in report:
            continue
        label = "HybridHFTrainer" if arm == "hybrid" else PEER_ARMS[arm]
        line = (f"  {label:32} final {statistics.median(r['final_eval_loss'] for r in report[arm]):.4f}  "
                f"vs same-LR Trainer: {_speedups(speedups(report, arm))} "
                f"({_speedups(speedups(report, arm, 'updates_to_target'))} in updates)")
        if arm in swept:
            line += f"  | vs swept Trainer's loss: {_speedups(swept[arm])}"
        if arm in report.get("sweep_fraction", {}):
            g = report["sweep_fraction"][arm]
            line += f"  | G {_fractions(g['updates'])} in updates, {_fractions(g['wall'])} in wall clock"
        print(line)
    for arm, reason in report.get("failed_arms", {}).items():
        print(f"  {PEER_ARMS[arm]:32} failed: {reason}")


def _speedups(values: list) -> str:
    return ", ".join("not reached" if s is None else f"{s:.2f}x" for s in values)


def _fractions(values: list) -> str:
    return ", ".join("-" if g is None else f"{g:.2f}" for g in values)


def _host_part(timing: dict, key: str, real_seconds: float) -> str:
    """On a GPU: how much of a synchronized hook clock was the host's own work, and how much the bare waits were."""
    if "idle_synchronize" not in timing or key + "_host" not in timing:
        return ""
    waits = timing[key + "_calls"] * timing["idle_synchronize"]
    return (f" (host {100 * timing[key + '_host'] / real_seconds:.2f}%; {timing[key + '_calls']} clocked calls, "
            f"whose bare waits at {1e6 * timing['idle_synchronize']:.0f} us each make "
            f"{100 * waits / real_seconds:.2f}%)")


def print_table(report: dict) -> None:
    def med(arm: str, key: str):
        values = [r[key] for r in report[arm] if r[key] is not None]
        return statistics.median(values) if values else None

    # On a CPU, the arms' peak RSS under their allocator settings (no trim, no mmap: benchmark.py), which keep freed
    # heap: the same Trainer run peaked at 1818 MB with them and 1018 MB without (runs 239-240 in
    # docs/benchmarks-history.md). What the hybrid adds is scripts/memory_budget.py's to measure.
    memory_label = "peak device memory (MB)" if report["baseline"][0]["cuda"] else "peak RSS, untrimmed heap (MB)"
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
        (memory_label, med("baseline", "peak_memory_mb"), med("hybrid", "peak_memory_mb"), ".0f"),
    ]
    if report["baseline"][0]["mfu"] is not None:
        rows.append(("MFU (trained tokens)", med("baseline", "mfu"), med("hybrid", "mfu"), ".3f"))
    if report["baseline"][0].get("peak_pinned_mb") is not None:
        rows.append(("peak pinned host (MB)", med("baseline", "peak_pinned_mb"), med("hybrid", "peak_pinned_mb"),
                     ".0f"))
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
              f"divergences: {stats['divergences']}, turns to jump passed: {stats.get('turns_passed', 0)}")
        print(f"guard: {stats.get('guard_outliers', 0)} steps flagged, {stats.get('guard_rollbacks', 0)} rollbacks")
        print(f"lr autopilot: scale {stats.get('lr_scale', 1.0):g}, {stats.get('lr_readings', 0)} readings, "
              f"{stats.get('lr_raises_kept', 0)} raises kept, {stats.get('lr_trials_undone', 0)} undone")
    timing = report["baseline"][0]["timing"]
    if timing:
        print("baseline split (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timing.items()))
    hybrid_timing = report["hybrid"][0]["timing"]
    hook_seconds = hybrid_timing.get("hybrid_hooks_real", 0.0)
    real_seconds = sum(v for k, v in report["hybrid"][0]["seconds_per_phase"].items() if k != "predict")
    if "hybrid_hooks_real" not in hybrid_timing:
        print("hybrid hook time: not measured (on a GPU only --mode overhead times the hooks)")
    elif real_seconds:
        print(f"hybrid hook time on real steps: {hook_seconds:.2f}s = {100 * hook_seconds / real_seconds:.2f}% "
              "of real-step time" + _host_part(hybrid_timing, "hybrid_hooks_real", real_seconds))
        guard_seconds = hybrid_timing.get("guard", 0.0)
        print(f"guard time (verdicts and snapshots): {guard_seconds:.2f}s = "
              f"{100 * guard_seconds / real_seconds:.2f}% of real-step time" + _host_part(hybrid_timing, "guard",
                                                                                            real_seconds))
    hook_median = report["hybrid"][0].get("median_real_step_hook_seconds")
    if hook_median is not None:
        step_median = report["hybrid"][0]["median_real_step_seconds"]
        print(f"hooks and guard on the median real step: {1000 * hook_median:.2f} ms = "
              f"{100 * hook_median / step_median:.2f}% of the median real step")
    if "lr_readings" in hybrid_timing:
        train_seconds = report["hybrid"][0]["train_seconds"]
        print(f"lr autopilot readings, verdicts and undos: {hybrid_timing['lr_readings']:.2f}s = "
              f"{100 * hybrid_timing['lr_readings'] / train_seconds:.2f}% of training time")
    print("hybrid seconds per phase: " + ", ".join(
        f"{k} {v:.1f}" for k, v in report["hybrid"][0]["seconds_per_phase"].items()))
    cost = report["hybrid"][0].get("jump_cost")
    if cost:  # with `outer`, a whole jump: the outer state's copies in and out, the probe's forward, the delta
        print(f"predicted steps: {cost['predicted']}, the first {1000 * cost['first']:.1f} ms (its buffers' first "
              f"allocation), the median {1000 * cost['median']:.1f} ms, and the real step after one "
              f"{1000 * cost['next_median']:.1f} ms, against a median real step of "
              f"{1000 * report['hybrid'][0]['median_real_step_seconds']:.1f} ms")
    if report["mode"] == "memory":
        print_memory(report)
    elif report["mode"] == "overhead":
        print(f"hybrid/baseline median real-step time: {report['step_time_ratio_median']:.3f} "
              f"(pairs: {', '.join(f'{r:.3f}' for r in report['step_time_ratios'])})")
    else:
        median = report["speedup_median"]
        print(f"time-to-target speedup: {'-' if median is None else f'{median:.2f}x'} (pairs: "
              f"{_speedups(report['speedups'])}); in updates: {_speedups(report['update_speedups'])}")
        # A pair whose evaluations are all equal bit for bit trained the same weights: 1.00x, whatever the clock says.
        print("evaluations equal to the baseline's bit for bit: "
              + ", ".join(f"{same} of {compared}" for same, compared in report["equal_evals"]))
    if any(arm in report for arm in PEER_ARMS) or report.get("failed_arms"):
        print_peers(report)


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
    from plotting import shade_phases

    trace_path = root / "hybrid-0" / "hybrid_trace.jsonl"
    trace = [json.loads(line) for line in trace_path.read_text().splitlines()] if trace_path.exists() else []
    # The trace's clock includes evaluation pauses; put each step on the training-only clock of the arm.
    for row, t in zip(trace, accumulate(hybrid.step_seconds)):
        row["time"] = t
    fig, ax = plt.subplots(figsize=(9, 5))
    if trace:
        shade_phases(ax, trace, x="time")
    for arm, style in ((baseline, "k-o"), (hybrid, "C3-s")):
        ax.plot([e[SECONDS] for e in arm.evals], [e[2] for e in arm.evals], style, ms=3,
                label="Trainer" if arm.arm == "baseline" else "HybridHFTrainer")
    ax.axhline(target, color="grey", ls="--", lw=1, label="target (baseline final)")
    ax.set_xlabel("training wall clock (s, evaluation excluded)")
    ax.set_ylabel("eval loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(root / "eval_loss_vs_wallclock.png", dpi=120)
    print(f"wrote {root / 'report.json'} and {root / 'eval_loss_vs_wallclock.png'}")
