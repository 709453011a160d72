"""Engine checks: exact model-state bytes, gathered units at a time, collective counts, and
results that stay exact when every collective completes late (catches missing waits)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from dist import patched, run_ranks
from models import Block, batch, make_stack
from torch import nn

from fullshard.engine.hooks import fsdp_state


def _wrap(strategy: str = "FULL_SHARD", **kw):
    from fullshard import FSDP, ShardingStrategy
    from fullshard.frontend.wrap import ModuleWrapPolicy

    ref = make_stack()
    model = FSDP(
        copy.deepcopy(ref),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kw,
    )
    return ref, model


def _assert_like(model, ref, what: str) -> None:
    """The wrapper's full state dict is the unsharded reference's, to rounding."""
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{what}, {k}: {msg}")


class _Detour(torch.nn.Module):
    """(batch, 6) -> (batch, 3); ``side=True`` adds a branch through ``side`` (5 rows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a = torch.nn.Linear(6, 6)
        self.side = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        y = self.a(x)
        return self.head(y + self.side(x).mean(-1, keepdim=True) if side else y)


def _step(model, opt, rank: int, world: int, step: int = 0) -> None:
    x, y = batch(step, 12)
    n = 12 // world
    loss = torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
    opt.zero_grad()
    loss.backward()
    opt.step()


def memory_body(rank: int, world: int) -> dict:
    from fullshard import model_state_bytes, probes

    ref, model = _wrap()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _step(model, opt, rank, world)
    _step(ref, ref_opt, 0, 1)
    got, full = model_state_bytes(model, opt), model_state_bytes(ref, ref_opt)
    units = [m.unit for m in model.fsdp_modules(model)]
    n_params = sum(len(u.params) for u in units)
    local_numel = sum(sp.spec.local_numel for u in units for sp in u.params)
    # Padding: how far this rank's padded shards exceed an exact 1/N of the parameters.
    padding = sum(u.sharded_nbytes for u in units) - full["params"] / world
    step_bytes = 4 * n_params  # AdamW's 0-dim `step` tensor per parameter, not shardable
    # Exact: shards and gradients are the units' padded local flat buffers; optimizer state
    # is two fp32 moments per local element plus the step counters.
    assert got["params"] == sum(u.sharded_nbytes for u in units), got
    assert got["grads"] == sum(u.sharded_nbytes for u in units), got
    assert got["optim"] == 2 * 4 * local_numel + step_bytes, got
    # params, grads and two moments are each at most the padded shard size.
    bound = (full["total"] - step_bytes) / world + step_bytes + 4 * padding
    assert got["total"] <= bound, (got, full, bound)

    # Units holding gathered parameters during forward: root + one nested unit at a time.
    root_bytes = model.unit.full_nbytes
    nested_max = max(u.full_nbytes for u in units[1:])
    x, _ = batch(1, 12)
    with probes.enabled() as p:
        out = model(x[: 12 // world])
        forward_peak, forward_bytes = p.gathered.peak, p.gathered.peak_bytes
        out.sum().backward()
    assert forward_peak == 2, forward_peak
    assert forward_bytes <= root_bytes + nested_max, (forward_bytes, root_bytes, nested_max)
    return {"got": got, "full": full, "forward_peak": forward_peak}


def prefetch_peak_body(rank: int, world: int) -> tuple[int, int]:
    from fullshard import probes

    _, model = _wrap(forward_prefetch=True)
    x, _ = batch(0, 12)
    for _ in range(2):  # the first iteration records the forward order
        with probes.enabled() as p:
            out = model(x[: 12 // world])
            fwd = p.gathered.peak
            p.gathered.reset_peak()
            out.sum().backward()
            bwd = p.gathered.peak
    return fwd, bwd


@pytest.mark.timeout(200)
def test_model_state_bytes_and_gathered_units_world4() -> None:
    results = run_ranks(memory_body, 4, timeout=180)
    r = results[0]
    assert r["got"]["total"] < r["full"]["total"] / 2  # a quarter plus this tiny model's padding


@pytest.mark.timeout(200)
def test_prefetch_keeps_at_most_one_more_unit_gathered() -> None:
    fwd, bwd = run_ranks(prefetch_peak_body, 2, timeout=180)[0]
    assert fwd == 3  # root + current + the prefetched next unit
    assert bwd <= 3  # root + current + BACKWARD_PRE's prefetch


def count_body(rank: int, world: int) -> dict[str, dict]:
    from fullshard import probes

    counts = {}
    for strategy in _EXPECTED_COLLECTIVES:
        _, model = _wrap(strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, opt, rank, world, 0)
        with probes.enabled() as p:
            _step(model, opt, rank, world, 1)
        counts[strategy] = dict(p.collectives.calls)
    return counts


_EXPECTED_COLLECTIVES = {
    # 5 units (root + 4 blocks). FULL_SHARD gathers each nested unit again for backward but
    # the last of forward (BACKWARD_PRE would gather it at once: hooks.keeps_last_gathered);
    # the root stays gathered from forward into backward.
    "FULL_SHARD": {"all_gather": 8, "reduce_scatter": 5},
    "SHARD_GRAD_OP": {"all_gather": 5, "reduce_scatter": 5},
    "NO_SHARD": {"all_reduce": 5},
}


@pytest.mark.timeout(200)
def test_collectives_per_step() -> None:
    """Every strategy's collectives in its second step, counted on both ranks (one process group)."""
    counts = run_ranks(count_body, 2, timeout=180)
    assert counts[0] == counts[1] == _EXPECTED_COLLECTIVES, counts


class _LateWork:
    """A collective whose result lands in the caller's tensor only at wait(), after a delay."""

    def __init__(self, work, dst: torch.Tensor, tmp: torch.Tensor) -> None:
        self.work, self.dst, self.tmp = work, dst, tmp

    def wait(self, timeout: object = None) -> bool:  # torch's Work.wait(timeout=...) signature
        time.sleep(0.02)
        self.work.wait()
        self.dst.copy_(self.tmp)
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _make_late(real):
    def late(output, input, *args, async_op: bool = False, **kwargs):
        tmp = torch.empty_like(output)
        work = real(tmp, input, *args, async_op=True, **kwargs)
        output.fill_(float("nan"))  # a reader that skips wait() sees NaN
        w = _LateWork(work, output, tmp)
        if async_op:
            return w
        w.wait()
        return None

    return late


def _late_all_reduce(real):
    def late(tensor, *args, async_op: bool = False, **kwargs):
        tmp = tensor.clone()
        work = real(tmp, *args, async_op=True, **kwargs)
        tensor.fill_(float("nan"))
        w = _LateWork(work, tensor, tmp)
        if async_op:
            return w
        w.wait()
        return None

    return late


def late_body(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from fullshard.comm import collectives

    late_collectives = patched(
        collectives,
        _all_gather_fn=_make_late(collectives._all_gather_fn),
        _reduce_scatter_fn=_make_late(collectives._reduce_scatter_fn),
    )
    late_dist = patched(
        dist, all_to_all_single=_make_late(dist.all_to_all_single), all_reduce=_late_all_reduce(dist.all_reduce)
    )
    with late_collectives, late_dist:  # the kept rank process runs later tests: the real ones come back
        return _late_steps(rank, world)


def _late_steps(rank: int, world: int) -> list[str]:
    done = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for kw in ({}, {"forward_prefetch": True}):
            ref, model = _wrap(strategy, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
            for step in range(2):  # the second step runs on momentum and the recorded prefetch order
                _step(model, opt, rank, world, step)
                _step(ref, ref_opt, 0, 1, step)
            full = model.state_dict()
            for name, want in ref.state_dict().items():
                torch.testing.assert_close(
                    full[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{strategy} {kw} {name}: {m}"
                )
            done.append(strategy)
    return done


@pytest.mark.timeout(300)
def test_exact_when_collectives_complete_late() -> None:
    assert len(run_ranks(late_body, 2, timeout=280)[0]) == 6


def features_body(rank: int, world: int) -> list[str]:
    from torch import nn

    from fullshard import FSDP
    from fullshard.engine.sharded_param import is_sharded
    from fullshard.engine.unit import TrainingState
    from fullshard.frontend.wrap import ModuleWrapPolicy

    done = []
    n = 12 // world
    # no_sync: k micro-batches accumulated locally + one synced backward == one step on all.
    ref, model = _wrap()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    micro = [batch(s, 12) for s in range(3)]
    opt.zero_grad()
    with model.no_sync():
        for x, y in micro[:2]:
            torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
    x, y = micro[2]
    torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
    opt.step()
    ref_opt.zero_grad()
    for x, y in micro:
        torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)
    done.append("no_sync")

    # A zero_grad after a no_sync backward drops what it accumulated (torch FSDP1 with
    # use_orig_params): all of it, or one parameter's when only its .grad was set to None.
    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor, part: bool) -> torch.Tensor:
        s = slice(rank * n, (rank + 1) * n) if part else slice(None)
        return torch.nn.functional.mse_loss(m(x[s]), y[s])

    for how in ("opt", "opt set_to_none=False", "module", "one parameter"):
        ref, model = _wrap()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        first = next(name for name, _ in model.named_parameters())
        for m, part in ((model, True), (ref, False)):
            with model.no_sync():
                loss(m, *micro[0], part).backward()
            if how == "one parameter":
                dict(m.named_parameters())[first].grad = None
            elif how == "module":
                m.zero_grad()
            else:
                (opt if m is model else ref_opt).zero_grad(set_to_none=how == "opt")
            loss(m, *micro[1], part).backward()
        opt.step()
        ref_opt.step()
        _assert_like(model, ref, how)
    done.append("zero_grad after no_sync")

    # A unit that only the no_sync micro-batch ran (a branch the synced one skips): its sum is
    # reduced at the end of the synced backward, not held until its next backward.
    ref = _Detour()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        (x0, y0), (x1, y1) = micro[step], micro[step + 1]
        with model.no_sync():
            loss(lambda t: model(t, side=True), x0, y0, True).backward()
        loss(model, x1, y1, True).backward()
        opt.step()
        opt.zero_grad()
        loss(lambda t: ref(t, side=True), x0, y0, False).backward()
        loss(ref, x1, y1, False).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _assert_like(model, ref, f"detour {step}")
    done.append("unit run only without sync")

    # A root that owns no parameters (every Linear is its own unit).
    plain = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    empty_root = FSDP(copy.deepcopy(plain), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    assert empty_root.unit.shard_numel == 0
    x, _ = batch(0, 12)
    empty_root(x).sum().backward()
    assert all(s is TrainingState.IDLE for s in empty_root.training_states())
    torch.testing.assert_close(empty_root.state_dict()["2.weight"], plain[2].weight)
    done.append("empty root")

    # ignored_modules: their parameters stay whole and are not reduced.
    m = make_stack()
    head = m.head
    wrapped = FSDP(m, ignored_modules=[head])
    assert not is_sharded(head.weight) and head.weight.shape == (3, 13)
    assert all(is_sharded(p) for name, p in wrapped.named_parameters() if not name.startswith("head."))
    assert "head.weight" in wrapped.state_dict()
    done.append("ignored")

    # An exception inside forward leaves the model usable.
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.fail = True

        def forward(self, x):
            y = self.lin(x)
            if self.fail:
                raise RuntimeError("boom")
            return y

    boom = FSDP(Boom())
    try:
        boom(torch.ones(2, 4))
    except RuntimeError:
        pass
    boom.module.fail = False
    boom(torch.ones(2, 4)).sum().backward()
    assert boom.training_states() == [TrainingState.IDLE]
    done.append("exception")

    # `param.data = ...` on a shard: the next all-gather uses the new values.
    ref, model = _wrap()
    with torch.no_grad():
        for p, (name, q) in zip(model.parameters(), ref.named_parameters()):
            p.data = p.data + 1.0
            q.add_(1.0)
    torch.testing.assert_close(model(batch(0, 4)[0]), ref(batch(0, 4)[0]), rtol=1e-5, atol=1e-6)
    assert all(
        p.data_ptr() == ptr
        for m in model.fsdp_modules(model)
        for p, ptr in zip((sp.shard for sp in m.unit.params), m.unit.shard_ptrs)
        if p.numel()
    )
    done.append("data replaced")
    return done


@pytest.mark.timeout(200)
def test_no_sync_empty_root_ignored_modules_and_exceptions() -> None:
    assert run_ranks(features_body, 2, timeout=180)[0] == [
        "no_sync",
        "zero_grad after no_sync",
        "unit run only without sync",
        "empty root",
        "ignored",
        "exception",
        "data replaced",
    ]


def nested_init_body(rank: int, world: int) -> tuple[int, int, bool]:
    from fullshard import FSDP

    inits: list[nn.Module] = []
    real_init = FSDP.__init__

    def counting_init(self, module, *args, **kwargs) -> None:
        inits.append(module)
        real_init(self, module, *args, **kwargs)

    with patched(FSDP, __init__=counting_init):
        _, model = _wrap()
    wrappers = FSDP.fsdp_modules(model)
    return len(inits), len(wrappers), all(w.module in inits for w in wrappers)


def test_nested_wrappers_run_init() -> None:
    """Wrappers the policy builds go through ``FullyShardedDataParallel.__init__`` like the root."""
    inits, wrappers, all_seen = run_ranks(nested_init_body, 2, timeout=100)[0]
    assert wrappers > 1  # the root and its nested blocks
    assert (inits, all_seen) == (wrappers, True)


def test_buffer_pool_reuses_whole_buffers_only() -> None:
    from fullshard.comm.buffers import BufferPool

    pool = BufferPool(per_size=1)
    a = pool.acquire(10, torch.float32, torch.device("cpu"))
    pool.release(a)
    assert pool.acquire(10, torch.float32, torch.device("cpu")) is a  # the same buffer comes back
    assert pool.acquire(10, torch.float32, torch.device("cpu")) is not a  # and only once
    assert pool.held_sizes() == set()
    pool.release(a)
    assert pool.held_sizes() == {(10, torch.float32)}
    pool.release(torch.empty(10))  # over per_size: dropped
    assert pool.nbytes == 40
    pool.release(torch.empty(20)[:10])  # a view of a larger buffer is never pooled
    assert pool.acquire(10, torch.float64, torch.device("cpu")).dtype == torch.float64  # keyed by dtype too
    pool.release(torch.empty(10, device="meta"))  # stands in for a GPU buffer
    pool.clear(keep_cpu=True)  # after a backward: CPU memory stays for the next step, the rest goes
    assert [t.device.type for t in pool.buffers()] == ["cpu"]
    pool.clear()
    assert pool.nbytes == 0


def _worker_settings() -> tuple[str | None, str | None, int]:
    import os

    return os.environ.get("THP_MEM_ALLOC_ENABLE"), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def _worker_variables() -> tuple[str | None, str | None, str | None]:
    import os

    return tuple(os.environ.get(k) for k in ("THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS", "FULLSHARD_TEST_ASKED"))  # type: ignore[return-value]


def _threads() -> int:
    """This process's gloo threads (its run loops and its TCP loop), counted by name."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return sum("gloo" in n for n in names)


def _train_once() -> object:
    """Wrap, step once, gather an object (as the jobs do last); return a weak ref to a unit."""
    import weakref

    from fullshard.comm import collectives

    _, model = _wrap()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = collectives.group_rank(collectives.default_group())
    _step(model, opt, rank, collectives.group_size(collectives.default_group()))
    collectives.all_gather_object(rank, collectives.default_group())
    return weakref.ref(fsdp_state(model).unit)


def _settings_and_threads_around_a_job() -> tuple[tuple[str | None, str | None, int], tuple[int, int, int, bool]]:
    """The worker's launch settings, then its gloo threads before, during and after a job."""
    from fullshard.jobs import launch

    settings = _worker_settings()
    before = _threads()  # 0
    launch.init_process_group()
    unit = _train_once()
    during = _threads()
    launch.destroy_process_group()
    return settings, (before, during, _threads(), unit() is None)  # type: ignore[operator]


@pytest.fixture(scope="module")
def two_worker_job() -> tuple[dict, bool]:
    """One 2-worker launch (a 4-core machine, no thread or huge-page variables set by the caller)
    that both launch tests read; and whether the launch left any variable in the caller's
    environment. The caller's environment is the suite's again afterwards (kept ranks stay valid)."""
    import os

    from fullshard.jobs import launch

    if launch._SERVER_ENVIRON is None:
        # The first launch of this process starts its forkserver, with the launcher's environment
        # of then: let that be the suite's, not the one below (later benchmark launches in this
        # xdist worker fork only from a server that has the suite's THP_MEM_ALLOC_ENABLE).
        launch.launch(_worker_variables, (), 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
        mp.delenv("OMP_NUM_THREADS", raising=False)
        mp.setattr(os, "cpu_count", lambda: 4)  # read in this process, where launch decides
        results = launch.launch(_settings_and_threads_around_a_job, (), 2)
        leaked = "THP_MEM_ALLOC_ENABLE" in os.environ or "OMP_NUM_THREADS" in os.environ
    return results, leaked


@pytest.mark.timeout(240)  # the shared launch runs in this test's setup
def test_launch_sets_threads_and_asked_variables_for_workers_only(
    two_worker_job: tuple[dict, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from fullshard.jobs import launch

    results, leaked = two_worker_job
    settings = {rank: r[0] for rank, r in results.items()}
    assert {rank: s[2] for rank, s in settings.items()} == {0: 2, 1: 2}  # 4 cores, 2 workers: 2 threads each
    assert settings[0][:2] == (None, "2")  # huge pages: the caller's choice
    assert not leaked  # the caller's left as it was
    # The caller chose huge pages off; the bench asks them on plus one more variable of its own.
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    asked = {"THP_MEM_ALLOC_ENABLE": "1", "FULLSHARD_TEST_ASKED": "yes"}
    assert launch.launch(_worker_variables, (), 1, env=asked)[0] == (
        "0",  # an explicit choice is kept
        "4",  # 4 cores, 1 worker
        "yes",  # as the bench asks, where the caller has not chosen
    )
    assert "FULLSHARD_TEST_ASKED" not in os.environ and "OMP_NUM_THREADS" not in os.environ  # for workers only


@pytest.mark.timeout(120)
def test_destroy_process_group_frees_units_and_ends_gloo_threads(two_worker_job: tuple[dict, bool]) -> None:
    """A unit is collectable once its model is dropped, and destroying the groups joins gloo's
    threads then, not at interpreter exit (where one releasing a finished collective's tensors
    aborted the process: "terminate called without an active exception")."""
    results, _ = two_worker_job
    assert sorted(results) == [0, 1]
    for _, (before, during, after, unit_freed) in results.values():
        assert unit_freed
        assert during > before
        assert after == before, (before, during, after)


def collectives_body(rank: int, world: int) -> int:
    """All-gather and reduce-scatter on gloo against their definitions, each path of each."""
    from fullshard.comm import collectives

    group = collectives.default_group()
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for s in (1, 5, 4096):
            inputs = [torch.arange(s, dtype=torch.float32).add(1000 * r).to(dtype) for r in range(world)]
            want = torch.cat(inputs)
            for async_op in (False, True):
                out = torch.full((world * s,), float("nan"), dtype=dtype)
                h = collectives.all_gather(out, inputs[rank].clone(), group, async_op=async_op)
                if h is not None:
                    h.wait()
                assert torch.equal(out, want), (dtype, s, async_op)
                # In place: the input is this rank's slice of the output.
                out = torch.full((world * s,), float("nan"), dtype=dtype)
                out[rank * s : (rank + 1) * s] = inputs[rank]
                collectives.all_gather(out, out[rank * s : (rank + 1) * s], group)
                assert torch.equal(out, want), (dtype, s, "in place")
                # Reduce-scatter: rank r's input is (r+1) * [0, 1, ...]; chunk k of the sum kept on rank k.
                full = torch.arange(world * s, dtype=torch.float32)
                grads = full.mul(rank + 1).to(dtype)
                red = torch.full((s,), float("nan"), dtype=dtype)
                h = collectives.reduce_scatter(red, grads, group, divide_by=world, async_op=async_op)
                if h is not None:
                    h.wait()
                expect = (full[rank * s : (rank + 1) * s] * (world + 1) / 2).to(dtype)
                torch.testing.assert_close(red, expect, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
                checked += 1
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_their_definitions(world: int) -> None:
    assert run_ranks(collectives_body, world, timeout=100) == [12] * world
