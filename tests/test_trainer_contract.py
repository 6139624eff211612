"""The private Trainer methods this package overrides must exist with the expected signatures.

If a transformers release renames them, this fails loudly instead of the hybrid silently doing nothing.
"""

from __future__ import annotations

import inspect

from transformers import Trainer


def test_overridden_trainer_methods_exist():
    expected = {
        "training_step": ["self", "model", "inputs", "num_items_in_batch"],
        "_clip_grad_norm": ["self", "model"],
        "_get_grad_norm": ["self", "model", "grad_norm"],
        "_save_optimizer_and_scheduler": ["self", "output_dir"],
        "_load_optimizer_and_scheduler": ["self", "checkpoint"],
        "log": ["self", "logs", "start_time"],
        "_track_num_input_tokens": ["self", "inputs"],
        "_prepare_inputs": ["self", "inputs"],  # called, not overridden: the probes prepare batches with it
        "_get_num_items_in_batch": ["self", "batch_samples", "device"],  # called: a compiled model's probe counts
    }
    for name, params in expected.items():
        method = getattr(Trainer, name, None)
        assert method is not None, f"transformers.Trainer.{name} is gone"
        assert list(inspect.signature(method).parameters) == params, name


def test_loop_still_calls_the_hooks_we_rely_on():
    source = inspect.getsource(Trainer._run_epoch)
    for needle in ("self._clip_grad_norm(model)", "self._get_grad_norm(model", "on_pre_optimizer_step",
                   "self.optimizer.step()", "on_optimizer_step", "_set_sync_gradients(do_sync_step)",
                   "self._track_num_input_tokens(inputs)"):
        assert needle in source, needle
