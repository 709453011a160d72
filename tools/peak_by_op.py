"""Which ops made the storages alive at a drawn configuration's peak, at world size 1 on this
machine's device, beside the estimate's total (``fullshard bench estimate --sweep --device``).

    python tools/peak_by_op.py SEED INDEX [INDEX ...] [--device cuda|cpu]

For each configuration ``INDEX`` of ``sweep.draw(SEED, ...)``: the third step's peak live tensor
bytes on the device grouped by the aten op that created each storage (largest first), and the
attention ops the step dispatched (which SDPA kernel ran, and any padding). Run it on CUDA and
on CPU and compare the groups to find what one device allocates that the other does not.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
from typing import Any

import torch

from fullshard.jobs.planning import sweep, sweep_bench, sweep_device
from fullshard.plan import tracker

ATTENTION = ("attention", "constant_pad_nd", "_softmax", "bmm", "baddbmm")


class LiveBytesByOp(tracker.LiveTensorBytes):
    """LiveTensorBytes that remembers each storage's creating op and, at each new peak, the
    live bytes per op (``at_peak``); ``dispatched`` counts the attention-related ops run."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type)
        self._op = "?"
        self.made: dict[int, str] = {}
        self.at_peak: collections.Counter[str] = collections.Counter()
        self.dispatched: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._op = func.overloadpacket.__name__
        if any(a in self._op for a in ATTENTION):
            self.dispatched[self._op] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _register(self, t: torch.Tensor) -> bool:
        new = super()._register(t)
        if new:
            st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
            self.made[id(st)] = self._op
        return new

    def reset_peak(self) -> None:
        super().reset_peak()
        self.at_peak = self._by_op()

    def _by_op(self) -> collections.Counter[str]:
        """Live bytes per creating op, each memory address once (as ``_measure`` counts)."""
        by_op: collections.Counter[str] = collections.Counter()
        seen: set[int] = set()
        for key, ref in list(self._storages.items()):
            st = ref()
            if st is not None and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                by_op[self.made.get(key, "?")] += st.nbytes()
        return by_op

    def _measure(self) -> None:
        before = self.peak
        super()._measure()
        if self.peak > before:
            self.at_peak = self._by_op()


def run(c: sweep.Config, device: torch.device) -> None:
    from fullshard.jobs.planning import families

    make, example, loss_fn, is_unit = families.parts(c.family, c.shape, c.batch, c.seq)
    estimate = sweep_bench.predict(c, "nccl" if device.type == "cuda" else "gloo")
    with LiveBytesByOp(device.type) as live:
        torch.manual_seed(0)
        model = sweep_bench.wrap(c, make().to(device), is_unit)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for step in range(3):
            drawn = families.random_batch(c.family, example, c.shape.vocab, c.shape.classes)
            batch = tuple(t.to(device) for t in drawn)
            if step == 2:
                live.reset_peak()
                live.dispatched.clear()
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    print(
        f"## {sweep_bench.cell(c)}: predicted {estimate.total}, measured {live.peak} on {device.type} "
        f"({estimate.total - live.peak:+d} bytes)"
    )
    print("attention ops (third step):", dict(live.dispatched))
    for op, n in live.at_peak.most_common(14):
        print(f"  {n:>12,d}  {op}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("seed", type=int)
    p.add_argument("index", type=int, nargs="+")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    configs = sweep.draw(args.seed, max(args.index) + 1)
    with sweep_device.one_rank_group(args.device) as device:
        sweep_device.warm_up(device)
        for i in args.index:
            run(dataclasses.replace(configs[i], world=1), device)


if __name__ == "__main__":
    main()
