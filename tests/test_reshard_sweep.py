"""Checkpoints that reshard, on configurations drawn, not picked: two fixed rows of
``tools/reshard_sweep.py`` (``fullshard.jobs.planning.reshard``), each saved by fullshard at 3
ranks after two steps and loaded at 2 into a model initialized from another seed. The full
parameters and every kind of optimizer state gathered after the load must be the saved ones bit
for bit, and the next step's loss and parameters torch's own FSDP's, loaded from the same
checkpoint through the same path (a sum of two gradients is the same in either order)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from dist import run_ranks

pytest.importorskip("transformers")

from fullshard.jobs.planning import reshard, sweep  # noqa: E402

SEED = 59001
# #0: opt, the FSDP1 wrapper's SHARDED_STATE_DICT with FSDP.optim_state_dict, SGD with momentum;
# #2: qwen3 under fully_shard in bf16 with activation checkpointing, DCP, Adagrad
ROWS = {0: reshard.Case(3, 2, "sgd", "sharded"), 2: reshard.Case(3, 2, "adagrad", "dcp")}


def _save(rank: int, world: int, c: sweep.Config, case: reshard.Case, directory: str) -> reshard.State:
    return reshard.save_rank(c, case, directory, rank)


def _load(rank: int, world: int, c: sweep.Config, case: reshard.Case, directory: str) -> tuple:
    return reshard.load_rank(c, case, directory, rank)


def test_cases_are_drawn_from_the_configuration_alone() -> None:
    configs = sweep.draw(SEED, 40)
    cases = [reshard.draw_case(c) for c in configs]
    assert cases == [reshard.draw_case(c) for c in sweep.draw(SEED, 40)]
    assert {ROWS[i] == cases[i] for i in ROWS} == {True}
    for c, case in zip(configs, cases):
        assert case.path in (reshard.PATHS if c.api == "fsdp1" else ("fullshard", "dcp")), (c, case)
        assert 1 <= case.saved <= 4 and 1 <= case.loaded <= 4 and case.optim in reshard.OPTIMIZERS
    assert sum(case.saved != case.loaded for case in cases) >= 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", sorted(ROWS))
def test_drawn_checkpoint_reshards_bit_for_bit(tmp_path: Path, index: int) -> None:
    case = reshard.draw_case(sweep.config_at(SEED, index))
    c = dataclasses.replace(sweep.config_at(SEED, index), world=case.saved)
    saved = run_ranks(_save, case.saved, c, case, str(tmp_path), timeout=100)[0]
    ours, theirs = run_ranks(_load, case.loaded, c, case, str(tmp_path), timeout=100)[0]
    result = reshard.compare(c, case, saved, ours, theirs)
    what = (c.describe(), case.describe(), result)
    assert result.params == 0.0 and result.optim, what
    assert set(result.optim) == {"sgd": {"momentum_buffer"}, "adagrad": {"step", "sum"}}[case.optim], what
    assert result.bitwise, what
    assert result.reference == "torch" and result.torch_load, what
    assert result.update_error == 0.0 and result.loss_error == 0.0, what
