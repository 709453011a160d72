"""torch.compile on fully_shard models, against torch's own fully_shard in the same process group;
and on FullyShardedDataParallel (FSDP1) models, against the same wrapper uncompiled.

fullshard's FSDP hooks run outside dynamo (as torch's FSDP2 hooks do), so:

- per-block ``block.compile(fullgraph=True)`` (torchtitan's way) traces each transformer block
  whole: no graph break inside a block (``fullgraph=True`` would raise at one), and no more
  graphs than torch's run compiles (a recompilation every step or every block would add some);
- ``torch.compile(model)`` breaks its graphs only where a unit's hooks run: as many breaks as
  torch's FSDP2 gives, which is at most torch's count plus the number of units.

Each run trains a small pre-norm transformer (TinyLM: embeddings, norm and output in the root
unit, each block attention + MLP its own unit) for a few steps at 2 ranks, first on torch's
fully_shard, then on fullshard's, with dynamo's caches and counters reset in between; losses and
parameters must be torch's bitwise (fp32, 2 ranks: the same reductions). The backend is
"aot_eager" for the blocks (dynamo and AOT autograd: compiled forward and backward graphs, no
code generation) and "eager" for the whole model (graph breaks are dynamo's alone): inductor
needs 2-3 minutes of C++ compilation for one tiny block on this machine.

The FSDP1 wrapper's pre- and post-forward run outside dynamo as well (torch's FSDP1 breaks its
graphs around its hooks too): ``torch.compile`` of a wrapped TinyLM, one unit or one per block,
trains as the uncompiled wrapper does.

Beyond the model: ``torch.compile(optimizer.step)`` and one compiled function per training step
(forward, ``backward()``, clip, step) compile what torch's do, and nothing of fullshard's engine
(the optimizer's swap to local shards, the autograd functions and hooks the eager backward calls,
the clip's collectives) is traced; compiled autograd is refused by name.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from models import TinyLM, tokens


class UnrolledLM(TinyLM):
    """TinyLM whose forward calls its two blocks one by one (no loop): dynamo then compiles the
    root's own code around the blocks, and breaks its graph at each block call, where the
    block's unit hooks run."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        h = self.layers[0](h)
        h = self.layers[1](h)
        return self.output(self.norm(h)).float()


def _fully_shard(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    import fullshard

    return fullshard.fully_shard


def _train(model, opt, rank: int, world: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """``steps`` steps on this rank's share of the global batch; the losses, and every parameter's
    local shard after each step."""
    losses, params = [], []
    for step in range(steps):
        x = tokens(step, 2 * world)[rank * 2 : (rank + 1) * 2]
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append([_local(p).detach().clone() for p in model.parameters()])
    return losses, params


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard: a fully_shard parameter's local tensor, an FSDP1 parameter itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def _optimizer(model: torch.nn.Module, optim: str) -> torch.optim.Optimizer:
    if optim == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _dynamo_result(losses: list[torch.Tensor], params: list[list[torch.Tensor]]) -> dict:
    from torch._dynamo.utils import counters

    return {
        "losses": losses,
        "params": params,
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": list(counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],
        "ops": counters["stats"]["calls_captured"],
    }


def _run(impl: str, base: TinyLM, mode: str, backend: str, rank: int, world: int, optim: str, steps: int = 3) -> dict:
    """Shard a copy of ``base`` with ``impl``'s fully_shard, compile it per ``mode`` and train it
    from fresh dynamo caches and counters; the results and dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fullshard.engine.hooks import fsdp_state

    torch._dynamo.reset()
    counters.clear()
    fully_shard = _fully_shard(impl)
    model = copy.deepcopy(base)
    for block in model.layers:
        if mode == "compile, then shard blocks":
            block.compile(fullgraph=True, backend=backend)
        fully_shard(block)
        if mode == "shard, then compile blocks":
            block.compile(fullgraph=True, backend=backend)
    fully_shard(model)
    compiled = torch.compile(model, backend=backend) if mode == "compile model" else model
    losses, params = _train(compiled, _optimizer(model, optim), rank, world, steps)
    if impl == "fullshard":
        states = {fsdp_state(m).unit.training_state.name for m in model.modules() if fsdp_state(m) is not None}
        assert states == {"IDLE"}, states
    result = _dynamo_result(losses, params)
    torch._dynamo.reset()
    return result


def _assert_same_training(ours: dict, ref: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
        assert torch.equal(a, b), f"{what}: step {step} loss {a.item()} vs torch's {b.item()}"
    for step, (ps, qs) in enumerate(zip(ours["params"], ref["params"])):
        for i, (p, q) in enumerate(zip(ps, qs)):
            assert torch.equal(p, q), f"{what}: step {step} parameter #{i} differs by {(p - q).abs().max():.3e}"


def block_compile_body(rank: int, world: int, backend: str) -> list[str]:
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = _run("torch", base, "shard, then compile blocks", backend, rank, world, "adamw")
    assert ref["graphs"] >= 1 and ref["graph_breaks"] == 0, ref
    done = []
    for mode in ("shard, then compile blocks", "compile, then shard blocks"):
        ours = _run("fullshard", base, mode, backend, rank, world, "adamw")
        # fullgraph=True raises at a graph break; the counter stays 0 as well.
        assert ours["graph_breaks"] == 0, (mode, ours["break_reasons"])
        # One graph for the block's code, as torch's: nothing recompiles per block or per step.
        assert (ours["graphs"], ours["ops"]) == (ref["graphs"], ref["ops"]), (mode, ours, ref)
        _assert_same_training(ours, ref, f"{backend}, {mode}")
        done.append(mode)
    return done


@pytest.mark.timeout(600)
def test_block_compile_fullgraph_matches_torch() -> None:
    """torchtitan's per-block ``block.compile(fullgraph=True)``, before or after each block's
    fully_shard, then fully_shard(model): no graph break in a block, torch's numbers bitwise."""
    done = run_ranks(block_compile_body, 2, "aot_eager", timeout=600)
    assert done[0] == ["shard, then compile blocks", "compile, then shard blocks"]


# Graph breaks of torch.compile(model) with fullgraph=False, per model, as torch 2.13's dynamo
# gives them for torch's FSDP2 and for fullshard alike:
# - TinyLM calls its blocks in a loop: a break in a loop makes dynamo run that frame eagerly
#   (not counted as a graph break) and compile each block's forward as its own frame: 0 breaks.
# - UnrolledLM: one break at each of its 2 block calls (the block unit's forward hooks): 2.
# The bound the issue sets is torch's count plus the number of units (3: two blocks, the root).
EXPECTED_MODEL_BREAKS = {"TinyLM": 0, "UnrolledLM": 2}
UNITS = 3


def model_compile_body(rank: int, world: int) -> dict[str, int]:
    counts = {}
    for cls, optim in ((TinyLM, "sgd"), (UnrolledLM, "adamw")):
        torch.manual_seed(0)
        base = cls(layers=2)
        ref = _run("torch", base, "compile model", "eager", rank, world, optim, steps=2)
        ours = _run("fullshard", base, "compile model", "eager", rank, world, optim, steps=2)
        name = cls.__name__
        assert ours["graph_breaks"] <= ref["graph_breaks"] + UNITS, (name, ours["break_reasons"])
        assert ours["graph_breaks"] == ref["graph_breaks"] == EXPECTED_MODEL_BREAKS[name], (
            name,
            ours["graph_breaks"],
            ref["graph_breaks"],
            ours["break_reasons"],
        )
        # Every break is at a unit's forward hook, skipped whole: none inside fullshard's engine.
        assert all("torch.compiler.disable()" in reason for reason in ours["break_reasons"]), ours["break_reasons"]
        assert ours["graphs"] == ref["graphs"] and ours["ops"] == ref["ops"], (name, ours, ref)
        _assert_same_training(ours, ref, f"torch.compile({name})")
        counts[name] = ours["graph_breaks"]
    return counts


@pytest.mark.timeout(600)
def test_model_compile_breaks_only_at_units() -> None:
    """``torch.compile(model)`` on the whole sharded model (fullgraph=False): torch's numbers
    bitwise, and graph breaks only where units' hooks run, exactly as many as torch's FSDP2."""
    counts = run_ranks(model_compile_body, 2, timeout=600)
    assert counts[0] == EXPECTED_MODEL_BREAKS


# torch.compile(model) of a FullyShardedDataParallel model: (units, sharding strategy, backend,
# optimizer). The wrapper's pre- and post-forward run outside dynamo, as fully_shard's hooks do.
# Dynamo must trace each wrapper's forward past a graph break at a nested unit's hooks: it gives
# up on a frame at a graph break inside a try block, and then on every wrapper's forward (they
# share one code object), compiling only what user-defined modules' own frames hold.
FSDP1_CASES = (
    ("whole model", "SHARD_GRAD_OP", "eager", "sgd"),
    ("each block", "FULL_SHARD", "aot_eager", "adamw"),
)


def _run_fsdp1(base: TinyLM, units: str, strategy: str, backend: str | None, rank: int, world: int, optim: str) -> dict:
    """Wrap a copy of ``base`` in fullshard's FullyShardedDataParallel (one unit, or one per
    block as well), compile it with ``backend`` (None: not at all) and train it from fresh
    dynamo caches and counters; the results and dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import fullshard
    from fullshard.wrap import ModuleWrapPolicy

    torch._dynamo.reset()
    counters.clear()
    policy = ModuleWrapPolicy({type(base.layers[0])}) if units == "each block" else None
    model = fullshard.FSDP(
        copy.deepcopy(base), auto_wrap_policy=policy, sharding_strategy=fullshard.ShardingStrategy[strategy]
    )
    compiled = model if backend is None else torch.compile(model, backend=backend)
    losses, params = _train(compiled, _optimizer(model, optim), rank, world, steps=3)
    assert {s.name for s in model.training_states()} == {"IDLE"}, model.training_states()
    result = _dynamo_result(losses, params)
    torch._dynamo.reset()
    return result


def fsdp1_compile_body(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    done = []
    for units, strategy, backend, optim in FSDP1_CASES:
        what = f"torch.compile(FSDP(TinyLM)), {units}, {strategy}, {backend}, {optim}"
        ref = _run_fsdp1(base, units, strategy, None, rank, world, optim)
        ours = _run_fsdp1(base, units, strategy, backend, rank, world, optim)
        # Something compiled, and every break is at a unit's hooks, skipped whole: none inside
        # fullshard's engine. Dynamo traced the wrapper's forward through to its post-forward
        # (having given up on it at the first hook, it would never reach the second).
        reasons = ours["break_reasons"]
        assert ours["graphs"] >= 1 and ours["ops"] >= 1, (what, ours)
        assert all("torch.compiler.disable()" in reason for reason in reasons), reasons
        assert all(any(f"function {hook} at" in r for r in reasons) for hook in ("_pre_forward", "_post_forward")), (
            reasons
        )
        for step, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{what}: step {step} loss")
        for step, (ps, qs) in enumerate(zip(ours["params"], ref["params"])):
            for i, (p, q) in enumerate(zip(ps, qs)):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"{what}: step {step} parameter #{i}")
        done.append(units)
    return done


@pytest.mark.timeout(600)
def test_compiled_fsdp1_model_trains_as_the_uncompiled_one() -> None:
    """``torch.compile`` of a FullyShardedDataParallel model, one unit or nested ones, trains at
    2 ranks as the uncompiled wrapper does: the wrapper's hooks (the first forward's unit check
    is a collective of Python objects) run outside dynamo, and the wrapped modules compile."""
    done = run_ranks(fsdp1_compile_body, 2, timeout=600)
    assert done[0] == [units for units, *_ in FSDP1_CASES]


def test_bench_compile_refuses_a_warmup_that_would_time_compilation() -> None:
    from fullshard.jobs.bench import compiled

    with pytest.raises(ValueError, match="--warmup 1 would time compilation"):
        compiled.run("tiny", "eager", steps=1, warmup=1, rounds=1, nproc=2)


_LATE_COMPILE = """
import copy, socket, sys
import torch, torch.distributed as dist
import fullshard
from fullshard.wrap import ModuleWrapPolicy
from models import TinyLM, tokens

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
base = TinyLM(layers=2)
wrapped = fullshard.FSDP(copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({type(base.layers[0])}))
wrapped(tokens(0, 2)).logsumexp(-1).mean().backward()
print("dynamo imported by FSDP1 training:", "torch._dynamo" in sys.modules)
for compile_blocks in (False, True):
    model = copy.deepcopy(base)
    for block in model.layers:
        fullshard.fully_shard(block)
    fullshard.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        if step == 1 and compile_blocks:  # dynamo is imported by now (DTensor's constructor imports it)
            for block in model.layers:
                block.compile(fullgraph=True, backend="aot_eager")
        loss = model(tokens(step, 2)).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("compiled" if compile_blocks else "eager", step, repr(loss.item()))
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_a_model_sharded_before_dynamo_is_imported_compiles_whole_blocks() -> None:
    """Importing fullshard and training with the FSDP1 wrapper never import dynamo (2.6 s per
    process; DTensor's constructor imports it for fully_shard); hooks made before dynamo was
    imported still run outside the graph of a block compiled with fullgraph=True (which raises
    at any graph break), and the block trains as the eager one does."""
    tests = Path(__file__).parent
    r = subprocess.run([sys.executable, "-c", _LATE_COMPILE], cwd=tests, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "dynamo imported by FSDP1 training: False" in lines, r.stdout
    words = [line.split() for line in lines]
    losses = {(w[0], w[1]): float(w[2]) for w in words if w[0] in ("eager", "compiled")}
    assert len(losses) == 4, r.stdout
    assert losses["compiled", "0"] == losses["eager", "0"]
    assert losses["compiled", "1"] == pytest.approx(losses["eager", "1"], rel=1e-6)


def _compiled_step_run(impl: str, base: TinyLM, optim: str, rank: int, world: int) -> dict:
    """Shard a copy of ``base`` with ``impl``'s fully_shard (eager forward and backward) and train
    it with ``torch.compile(optimizer.step)``; the results and dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fully_shard = _fully_shard(impl)
    model = copy.deepcopy(base)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = _optimizer(model, optim)
    step = torch.compile(opt.step, backend="eager")
    losses, params = [], []
    for i in range(3):
        x = tokens(i, 2 * world)[rank * 2 : (rank + 1) * 2]
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        step()
        opt.zero_grad()
        losses.append(loss.detach())
        params.append([_local(p).detach().clone() for p in model.parameters()])
    result = _dynamo_result(losses, params)
    torch._dynamo.reset()
    return result


def compiled_step_body(rank: int, world: int) -> dict[str, int]:
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    breaks = {}
    for optim in ("adamw", "sgd"):
        ref = _compiled_step_run("torch", base, optim, rank, world)
        ours = _compiled_step_run("fullshard", base, optim, rank, world)
        assert ours["break_reasons"] == ref["break_reasons"], (optim, ours["break_reasons"], ref["break_reasons"])
        assert (ours["graph_breaks"], ours["graphs"]) == (ref["graph_breaks"], ref["graphs"]), (optim, ours, ref)
        _assert_same_training(ours, ref, f"torch.compile(opt.step), {optim}")
        breaks[optim] = ours["graph_breaks"]
    return breaks


@pytest.mark.timeout(300)
def test_compiled_optimizer_step_breaks_only_where_torchs_does() -> None:
    """``torch.compile(optimizer.step)`` on fully_shard parameters: dynamo traces the global step
    hooks into the step, where fullshard's swap to plain local shards broke the graph 17 times
    (a ``sys.modules`` look-up, DTensors built from their specs) against torch's 1 (AdamW's lazy
    state). Under compile the step runs on the DTensors, as torch's: the same breaks, graphs and
    bits as torch's fully_shard, AdamW and SGD with momentum."""
    breaks = run_ranks(compiled_step_body, 2, timeout=280)
    assert breaks[0] == breaks[1]


def compiled_autograd_body(rank: int, world: int) -> list[str]:
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    import fullshard
    from fullshard.engine.hooks import fsdp_state

    refused = []
    for reshard in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLM(layers=2)
        for block in model.layers:
            fullshard.fully_shard(block, reshard_after_forward=reshard)
        fullshard.fully_shard(model)
        x = tokens(0, 2 * world)[rank * 2 : (rank + 1) * 2]
        loss = model(x).logsumexp(-1).mean()
        with pytest.raises(RuntimeError, match=r"backward under compiled autograd .* is not supported") as caught:
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
        refused.append(str(caught.value).split(":")[0])
        # The eager backward of the next step trains, every unit back to idle after it.
        model.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        states = {fsdp_state(m).unit.training_state.name for m in model.modules() if fsdp_state(m) is not None}
        assert states == {"IDLE"}, states
        assert all(p.grad is not None for p in model.parameters())
    torch._dynamo.reset()
    return refused


@pytest.mark.timeout(300)
def test_compiled_autograd_is_refused_by_name() -> None:
    """A backward under compiled autograd fails at once with an error naming it, whether the
    units resharded after forward (compiled autograd unpacks their saved full parameters before
    any hook gathers them: the freed-memory check used to fire, blaming the model) or not (the
    hooks ran from inside its graph and training went on with other numbers than eager's, as
    torch 2.13's own fully_shard does under it)."""
    refused = run_ranks(compiled_autograd_body, 2, timeout=280)
    # Resharded: the error names a block whose saved tensors compiled autograd unpacked first;
    # kept: the root, whose output's hook compiled autograd's graph calls first.
    assert [name.split("'")[1].split(".")[0] for name in refused[0]] == ["layers", "<root>"], refused


def _compiled_train_step_run(impl: str, base: TinyLM, rank: int, world: int) -> dict:
    """Shard a copy of ``base`` with ``impl``'s fully_shard and train it with one compiled function
    per step (forward, loss, ``backward()``, AdamW step, ``zero_grad``); results and counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fully_shard = _fully_shard(impl)
    model = copy.deepcopy(base)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = _optimizer(model, "adamw")

    @torch.compile(backend="eager")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses, params = [], []
    for i in range(3):
        losses.append(train_step(tokens(i, 2 * world)[rank * 2 : (rank + 1) * 2]))
        params.append([_local(p).detach().clone() for p in model.parameters()])
    result = _dynamo_result(losses, params)
    torch._dynamo.reset()
    return result


def compiled_train_step_body(rank: int, world: int) -> dict[str, int]:
    graphs = {}
    for frozen in (False, True):
        torch.manual_seed(0)
        base = TinyLM(layers=2)
        if frozen:
            base.layers[0].requires_grad_(False)  # a unit with nothing to reduce: its own backward path
        ref = _compiled_train_step_run("torch", base, rank, world)
        ours = _compiled_train_step_run("fullshard", base, rank, world)
        what = f"compiled training step, {'first block frozen' if frozen else 'all trainable'}"
        # The backward runs eagerly from the compiled step (a graph break at backward()); the
        # hooks and autograd functions it calls are never traced, so dynamo compiles the same
        # graphs with as many breaks as torch's fully_shard.
        assert (ours["graphs"], ours["graph_breaks"]) == (ref["graphs"], ref["graph_breaks"]), (
            what,
            ours["break_reasons"],
            ref["break_reasons"],
        )
        _assert_same_training(ours, ref, what)
        graphs[what] = ours["graphs"]
    return graphs


@pytest.mark.timeout(300)
def test_compiled_training_step_traces_no_fullshard_code() -> None:
    """One ``torch.compile``'d function per training step (forward, ``loss.backward()``,
    ``optimizer.step()``, ``zero_grad()``), as some users write it: dynamo runs the backward
    eagerly after a graph break, and every Python frame the autograd engine calls from there is
    dynamo's to compile. fullshard's autograd functions, gradient hooks and engine handle used
    to be traced there (16 graphs for torch's 4, storage swaps and gradient packing in graphs);
    now the same graphs, breaks and bits as torch's fully_shard, with a frozen unit too."""
    graphs = run_ranks(compiled_train_step_body, 2, timeout=280)
    assert graphs[0] == graphs[1]


def _fsdp1_clipping_step_run(impl: str, base: TinyLM, rank: int, world: int) -> dict:
    """Wrap a copy of ``base`` in ``impl``'s FullyShardedDataParallel (one unit per block) and
    train it with one compiled function per step that clips with ``model.clip_grad_norm_``."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch._dynamo.reset()
    counters.clear()
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel

        kwargs = {"device_id": torch.device("cpu"), "use_orig_params": True}
    else:
        from fullshard import FullyShardedDataParallel  # type: ignore[assignment]

        kwargs = {}
    model = FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({type(base.layers[0])}), **kwargs
    )
    opt = _optimizer(model, "sgd")

    @torch.compile(backend="eager")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        model.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses, params = [], []
    for i in range(2):
        losses.append(train_step(tokens(i, 2 * world)[rank * 2 : (rank + 1) * 2]))
        with FullyShardedDataParallel.summon_full_params(model):
            params.append([p.detach().clone() for p in model.parameters()])
    result = _dynamo_result(losses, params)
    torch._dynamo.reset()
    return result


def fsdp1_clipping_step_body(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = _fsdp1_clipping_step_run("torch", base, rank, world)
    ours = _fsdp1_clipping_step_run("fullshard", base, rank, world)
    # Ours breaks where torch's does (its optimizer, backward()) and at our hooks and the clip,
    # which run whole outside dynamo: nothing of fullshard's (the collectives' clock, the flight
    # recorder's labels) is traced.
    ours_only = [r for r in ours["break_reasons"] if r not in ref["break_reasons"]]
    assert all("torch.compiler.disable()" in r for r in ours_only), ours_only
    assert any("FullyShardedDataParallel.clip_grad_norm_" in r for r in ours_only), ours_only
    # The clip's norm is summed in another order than torch FSDP1's (float64 per gradient, then
    # across ranks): equal to rounding, as in eager.
    for step, (ps, qs) in enumerate(zip(ours["params"], ref["params"])):
        for i, (p, q) in enumerate(zip(ps, qs)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {step} parameter #{i}")
    return ours_only


@pytest.mark.timeout(300)
def test_compiled_fsdp1_step_clips_outside_dynamo() -> None:
    """A compiled training step of a FullyShardedDataParallel model that calls
    ``model.clip_grad_norm_`` (HF Trainer's order): the clip's all-reduce and its bookkeeping
    (clock reads, recorder labels) used to be traced, breaking the graph at ``time.time`` and a
    context manager; now the clip runs eagerly, and the step trains as torch's FSDP1 does."""
    run_ranks(fsdp1_clipping_step_body, 2, timeout=280)
