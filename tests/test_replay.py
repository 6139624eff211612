"""Batch replay on its own: order, short units at an epoch's end, the cap, checkpoints, the token count."""

from __future__ import annotations

import torch

from hf_hybrid.loop.replay import BatchReplay


def unit(n: int, micro: int = 2):
    return [{"input_ids": torch.full((1, 3), n * 10 + i)} for i in range(micro)], torch.tensor(micro * 3)


def first_id(u) -> int:
    return int(u[0][0]["input_ids"][0, 0]) // 10


def test_a_rolled_back_jump_hands_its_units_out_again_in_order():
    replay = BatchReplay()
    handed = [first_id(replay.hand_out(unit(0), new_jump=False, trains=True))]
    handed += [first_id(replay.hand_out(unit(n), new_jump=n == 1, trains=True)) for n in (1, 2, 3)]  # a 3-step jump
    replay.give_back()
    handed += [first_id(replay.hand_out(unit(n), new_jump=False, trains=True)) for n in range(4, 10)]
    # Real steps see 1, 2, 3 again, then 4, 5, 6: the Trainer's order, three steps late.
    assert handed == [0, 1, 2, 3, 1, 2, 3, 4, 5, 6]
    assert [first_id(u) for u in replay.queue] == [7, 8, 9]


def test_a_kept_jump_is_not_replayed_and_a_short_unit_passes_straight_through():
    replay = BatchReplay()
    replay.hand_out(unit(1), new_jump=True, trains=True)
    replay.settle()
    replay.give_back()  # nothing open any more
    assert not replay.queue
    replay.hand_out(unit(2), new_jump=True, trains=True)
    replay.give_back()
    short = unit(3, micro=1)  # the last step of an epoch
    assert replay.hand_out(short, new_jump=False, trains=True) is short
    assert [first_id(u) for u in replay.queue] == [2]


def test_the_queue_is_capped_and_survives_a_checkpoint():
    replay = BatchReplay(max_units=2)
    for n in range(3):
        replay.hand_out(unit(n), new_jump=n == 0, trains=True)
    replay.give_back()
    assert [first_id(u) for u in replay.queue] == [0, 1]
    replay.hand_out(unit(5), new_jump=True, trains=True)
    restored = BatchReplay(max_units=2)
    restored.load_state_dict(replay.state_dict(), torch.device("cpu"))
    assert [first_id(u) for u in restored.queue] == [first_id(u) for u in replay.queue]
    assert [first_id(u) for u in restored.open] == [first_id(u) for u in replay.open]
    assert torch.equal(restored.queue[0][1], replay.queue[0][1])


def test_a_unit_counts_its_tokens_once_when_trained_on_though_handed_out_again():
    """A Predict step's unit counts when it is trained on after a rollback; an undone trial's units, trained on
    before the undo, do not count again when they come back, after a checkpoint too."""
    replay = BatchReplay()
    counts = []

    def hand(n: int, new_jump: bool = False, trains: bool = True) -> int:
        handed = first_id(replay.hand_out(unit(n), new_jump=new_jump, trains=trains))
        counts.append(replay.counts_tokens)
        return handed

    hand(0, new_jump=True, trains=False)  # a one-step jump's Predict step
    replay.give_back()
    hand(1)  # trains on 0; 1 waits
    replay.begin_trial()  # the undo point: before this step's update
    hand(2)  # trains on 1
    replay.undo_trial()
    restored = BatchReplay()
    restored.load_state_dict(replay.state_dict(), torch.device("cpu"))
    replay = restored
    assert [hand(n) for n in (3, 4, 5)] == [0, 1, 2]
    assert counts == [False, True, True, False, False, True]
