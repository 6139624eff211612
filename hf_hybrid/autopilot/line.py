"""The learning-rate autopilot's evidence: the probe batch's loss along the optimizer's own next step.

Adam's next step is -lr * m_hat / (sqrt(v_hat) + eps), read from its state with no gradient. The probe loss at W,
W + c*step and W + 2c*step puts a parabola along it; where it bottoms out, in steps, is how many of today's steps
the current direction is worth. At a fixed point that number scales as 1 / lr (the step is proportional to the LR,
the curvature it meets to its square), so it reads the LR itself, where the line an outer cycle travelled does not
(docs/benchmarks-history.md, "the autopilot reads Adam's next step instead of the cycle's line").

Three forwards, two moves along the step and one copy of the weights (the autopilot's own scratch copy, placed as a
jump's undo copy is and held only while in use), made after the optimizer step, when the gradients it stands in for are
freed; the weights come back bit for bit. At a reading that also judges a raise, the first forward keeps each sequence's
loss at W: the verdict (autopilot/verdict.py) reads the raised weights from it instead of running that forward again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..loop.forward_checks import probe_loss, probe_loss_by_sequence
from ..memory.shards import local_shard
from ..memory.snapshot import WeightSnapshot

if TYPE_CHECKING:
    from ..loop.seam import HybridTrainer

SPACING = 4.0  # c: the line is read at 0, 4 and 8 of today's steps, far enough to see a line several steps long
# On an accelerator, elements per multi-tensor list where the largest parameter is smaller: a move's two temporaries
# stay at 64 MiB each in fp32 (at GPT-2's shapes the embedding is larger, and they are no larger than its copies).
CHUNK_ELEMENTS = 2**24


def _step_groups(optimizer: torch.optim.Optimizer, lists: bool) -> list[tuple[dict, list[tuple[torch.Tensor, dict]]]]:
    """The parameters Adam's next step moves, as (parameter group, [(parameter, its state)]) with one step count per
    list. With `lists` (an accelerator, where each kernel launch costs host time), each list holds as many parameters
    as fit in the group's largest parameter or CHUNK_ELEMENTS, whichever is more; without (a CPU, where a multi-tensor
    op is a loop over its tensors anyway, and one tensor at a time stays in cache through its eight operations, which
    is faster there), one parameter each. The step counts are tensors: they are read on the host here, once per
    reading."""
    groups = [(group, [(p, optimizer.state[p]) for p in group["params"] if "exp_avg_sq" in optimizer.state.get(p, {})])
              for group in optimizer.param_groups]
    groups = [(group, states) for group, states in groups if states]
    if not groups:
        return []
    steps = iter(torch.stack([state["step"] for _, states in groups for _, state in states]).tolist())
    out = []
    for group, states in groups:
        sizes = [p.numel() for p, _ in states]
        bound = max(*sizes, CHUNK_ELEMENTS) if lists else 0
        out += [(group, [states[i] for i in members])
                for members in _same_step_chunks(sizes, [next(steps) for _ in states], bound)]
    return out


@torch.no_grad()
def _move_along_next_step(step_groups: list, multiple: float) -> None:
    """Add `multiple` x Adam's next step (weight decay aside) to the weights.

    One multi-tensor operation per list of `_step_groups` (one bias correction each) and step of the formula: far
    fewer dispatched operations than one tensor at a time, each a kernel launch's host time on an accelerator while the
    device waits for the reading's next forward (docs/benchmarks-history.md, "a reading's moves in multi-tensor
    lists"). Its two temporaries are a list's size, and its arithmetic is a per-parameter version's, element by
    element."""
    for group, states in step_groups:
        (beta1, beta2), lr = group["betas"], group["lr"]  # lr: a float, or a fused optimizer's tensor
        step = states[0][1]["step"]
        params = [local_shard(p) for p, _ in states]
        device = params[0].device
        m_hat = torch._foreach_div([local_shard(state["exp_avg"]) for _, state in states], (1 - beta1**step).to(device))
        denom = torch._foreach_div([local_shard(state["exp_avg_sq"]) for _, state in states],
                                   (1 - beta2**step).to(device))
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_div_(m_hat, denom)
        torch._foreach_mul_(m_hat, lr)
        torch._foreach_mul_(m_hat, -multiple)
        torch._foreach_add_(params, m_hat)


def _same_step_chunks(sizes: list[int], steps: list[float], bound: int) -> list[list[int]]:
    """Indices grouped by step count, in order, each group split where it would outgrow `bound` elements."""
    chunks: list[list[int]] = []
    filling: dict[float, tuple[list[int], int]] = {}  # per step count: the chunk being filled and its elements
    for i, (size, step) in enumerate(zip(sizes, steps)):
        chunk, elements = filling.get(step, ([], 0))
        if not chunk or elements + size > bound:
            chunk, elements = [], 0
            chunks.append(chunk)
        chunk.append(i)
        filling[step] = (chunk, elements + size)
    return chunks


@torch.no_grad()
def next_step_line(trainer: HybridTrainer, model: torch.nn.Module, shards: list[torch.Tensor], scratch: WeightSnapshot,
                   probe: dict, by_sequence: bool = False) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The probe's loss at the weights W, at W + c*step and at W + 2c*step (c = SPACING), unreduced across ranks, and
    with `by_sequence` each sequence's loss at W (else None; also None where the loss cannot be split by sequence).
    `shards` are the weights (local shards); `scratch` holds W meanwhile, puts it back however the reading ends, and
    is released after."""
    optimizer = trainer.hybrid_engine.optimizer  # the optimizer itself, unwrapped from accelerate's
    step_groups = _step_groups(optimizer, lists=shards[0].device.type != "cpu")
    with scratch.held(shards):
        if by_sequence:
            start, rows = probe_loss_by_sequence(trainer, model, probe)
        else:
            start, rows = probe_loss(trainer, model, probe), None
        losses = [start]
        for _ in range(2):
            _move_along_next_step(step_groups, SPACING)
            losses.append(probe_loss(trainer, model, probe))
    return losses, rows
