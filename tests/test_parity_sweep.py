"""fullshard against torch's own FSDP on configurations drawn, not picked: the estimator sweep's
generator (model family and shape, strategy, activation checkpointing, precision), each run at
2 ranks with both front ends (the FSDP1 wrapper alone for NO_SHARD, which ``fully_shard``
lacks), with SGD for even draws and AdamW for odd ones, whose steps are two micro-batches each
(gradient sync off for the first: ``no_sync()``, ``set_requires_gradient_sync(False)``). A sum
of two gradients is the same in either order, so fullshard's losses and parameters must be
torch's bit for bit (``fully_shard``, and torch's FSDP1 on CPU with ``device_id``), and as close
to the fp32 unsharded reference as torch's. ``tools/parity_sweep.py`` runs the same comparison
at 1, 2 and 4 ranks over more draws."""

from __future__ import annotations

import dataclasses

import pytest
from dist import run_ranks

pytest.importorskip("transformers")

from fullshard.jobs.planning import parity, sweep  # noqa: E402

SEED, COUNT = 20261128, 4


def _compare(rank: int, world: int, index: int, api: str) -> parity.Result | None:
    c = dataclasses.replace(sweep.config_at(SEED, index), world=world, api=api)
    return parity.compare_rank(c, rank, steps=2, optim=parity.OPTIMIZERS[index % 2], accumulate=1 + index % 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(COUNT))
def test_drawn_configuration_is_torchs_bit_for_bit(index: int) -> None:
    c = sweep.config_at(SEED, index)
    for api in ("fsdp1", "fsdp2") if c.strategy != "no_shard" else ("fsdp1",):
        result = run_ranks(_compare, 2, index, api, timeout=280)[0]
        what = (dataclasses.replace(c, world=2, api=api).describe(), parity.OPTIMIZERS[index % 2], result)
        assert result is not None and result.bitwise, what
        assert result.update_error[0] == result.update_error[1], what
