"""fullshard against torch's own FSDP on configurations drawn, not picked: the estimator sweep's
generator (model family and shape, strategy, activation checkpointing, precision), each run at
2 ranks with both front ends (the FSDP1 wrapper alone for NO_SHARD, which ``fully_shard``
lacks), with SGD for even draws and AdamW for odd ones, whose steps are two micro-batches each
(gradient sync off for the first: ``no_sync()``, ``set_requires_gradient_sync(False)``), and
with the options ``parity.draw_extras`` draws for each (clipping, forward and backward prefetch,
CPU offload). A sum of two gradients is the same in either order, so fullshard's losses and
parameters must be torch's bit for bit (``fully_shard``, and torch's FSDP1 on CPU with
``device_id``), and as close to the fp32 unsharded reference as torch's. The one exception is
the FSDP1 wrapper's ``clip_grad_norm_``, whose norm fullshard sums in float64 (torch in the
gradients' dtype): there fullshard's update error must be at most torch's (within 1.5x).
``tools/parity_sweep.py`` runs the same comparison at 1, 2 and 4 ranks over more draws."""

from __future__ import annotations

import dataclasses

import pytest
from dist import run_ranks

pytest.importorskip("transformers")

from fullshard.jobs.planning import parity, sweep  # noqa: E402

SEED, COUNT = 20261128, 4


def _compare(rank: int, world: int, index: int, api: str) -> parity.Result | None:
    c = dataclasses.replace(sweep.config_at(SEED, index), world=world, api=api)
    optim, accumulate = parity.OPTIMIZERS[index % 2], 1 + index % 2
    return parity.compare_rank(c, rank, steps=2, optim=optim, accumulate=accumulate, extras=parity.draw_extras(c))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(COUNT))
def test_drawn_configuration_is_torchs_bit_for_bit(index: int) -> None:
    c = sweep.config_at(SEED, index)
    for api in ("fsdp1", "fsdp2") if c.strategy != "no_shard" else ("fsdp1",):
        result = run_ranks(_compare, 2, index, api, timeout=280)[0]
        ran = dataclasses.replace(c, world=2, api=api)
        extras = parity.draw_extras(ran)
        what = (ran.describe(), extras.describe(), parity.OPTIMIZERS[index % 2], result)
        assert result is not None, what
        if extras.clip is not None and api == "fsdp1":
            assert result.update_error[0] <= 1.5 * result.update_error[1] + 1e-7, what
            continue
        assert result.bitwise, what
        assert result.update_error[0] == result.update_error[1], what


def _compare_hybrid(rank: int, world: int, seed: int, index: int) -> parity.Result | None:
    c = dataclasses.replace(sweep.config_at(seed, index), world=world)
    return parity.compare_rank(c, rank, steps=2, optim="sgd", extras=parity.draw_extras(c))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [3, 13])  # seed 7272: #3 the FSDP1 wrapper, #13 fully_shard
def test_drawn_hybrid_configuration_is_torchs_bit_for_bit(index: int) -> None:
    """At 4 ranks on a (2, 2) mesh each reduction is a sum of two within the shard group, then
    of two across replicas, in the same order on both sides: bitwise torch's (these two draws
    do not clip)."""
    c = dataclasses.replace(sweep.config_at(7272, index), world=4)
    extras = parity.draw_extras(c)
    assert extras.hybrid and extras.clip is None, extras
    result = run_ranks(_compare_hybrid, 4, 7272, index, timeout=280)[0]
    assert result is not None and result.bitwise, (c.describe(), extras.describe(), result)
