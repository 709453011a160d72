"""torchao's float8 training under fullshard's ``fully_shard``, against torch's, on CPU.

``torchao.float8.convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True`` makes
each Linear's weight a tensor subclass whose ``fsdp_pre_all_gather`` casts the shard to float8
(one byte per element, with its scale) and whose ``fsdp_post_all_gather`` builds the float8
weight the matmul uses (torch 2.13 has ``_scaled_mm`` on CPU). The same seeded model is sharded
by torch's ``fully_shard`` and by fullshard's in one process group; losses and parameters must
be equal bit for bit, with and without ``precompute_float8_dynamic_scale_for_fsdp`` (the scales
of all weights computed in one all-reduce after the optimizer step, as torchtitan does), and
the weights' all-gathers must carry float8 bytes.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from torch import nn

pytest.importorskip("torchao.float8")


def _model() -> nn.Sequential:
    """Dimensions multiples of 16, as ``_scaled_mm`` needs; 80 rows do not divide by 3."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 80), nn.ReLU(), nn.Linear(80, 32))


def _train(fully_shard, rank: int, precompute: bool) -> tuple[list[float], list[torch.Tensor], set[str]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, force_recompute_fp8_weight_in_bwd=True)
    m = convert_to_float8_training(_model(), config=config)
    for i in (0, 2):
        fully_shard(m[i])
    fully_shard(m)
    kinds = {type(p.to_local()).__name__ for p in m.parameters() if p.dim() == 2}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(m)
        losses.append(loss.item())
    return losses, [p.full_tensor() for p in m.parameters()], kinds


def _float8_body(rank: int, world: int) -> list[str]:
    import torch.distributed.fsdp as tf

    import fullshard
    from fullshard.comm.flight_recorder import RECORDER

    done = []
    for precompute in (False, True):
        theirs = _train(tf.fully_shard, rank, precompute)
        RECORDER.entries.clear()
        ours = _train(fullshard.fully_shard, rank, precompute)
        assert ours[0] == theirs[0], (precompute, ours[0], theirs[0])
        assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1])), precompute
        assert ours[2] == theirs[2] == {"WeightWithDynamicFloat8CastTensor"}, (ours[2], theirs[2])
        # Each step's forward gathers the three weights as float8: one byte per element (and a
        # scale), about a quarter of their float32 bytes.
        weights = 64 * 128 + 128 * 80 + 80 * 32
        gathered = sum(e.nbytes for e in RECORDER.entries if e.op == "all_gather" and e.phase == "forward")
        sent_per_step = gathered / 4
        assert weights / world * 0.9 < sent_per_step < weights / world * 1.5 + 4096, (sent_per_step, weights)
        done.append(f"precompute={precompute}")
    return done


@pytest.mark.timeout(200)
def test_float8_all_gather_matches_torch() -> None:
    assert run_ranks(_float8_body, 2, timeout=180)[0] == ["precompute=False", "precompute=True"]
