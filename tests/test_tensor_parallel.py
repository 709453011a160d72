"""2-D parallelism: tensor parallel (``parallelize_module`` on mesh["tp"]) then ``fully_shard`` on
mesh["dp"], against torch's own ``fully_shard`` on the same 2x2 mesh at world size 4.

The same seeded model is parallelized the same way twice, sharded once by torch and once by
fullshard, and trained on the same data: the registered parameters' placements and meshes, the
losses, ``clip_grad_norm_``'s total norm and the parameters after every step must agree. Then a
DCP checkpoint saved by either loads into the other and reshards into a 1-D dp=4 fullshard model
and a tp-only model. HSDP + TP (torchtitan's ("dp_replicate", "dp_shard", "tp") mesh, fully_shard on
mesh["dp_replicate", "dp_shard"]) is compared the same way at (2, 1, 2) and (1, 2, 2).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from torch import nn

D, HEADS, VOCAB = 8, 2, 12


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them.
        q, k, v = (w(x).view(b, t, -1, D // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = Attention()
        self.w1 = nn.Linear(D, hidden)
        self.w2 = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.w2(F.gelu(self.w1(x)))


class Net(nn.Module):
    def __init__(self, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.out = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
    plan.update({"attn.wo": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return plan


def dp_of(mesh):
    """(the mesh to shard over, this rank's data-parallel index): mesh["dp"] of a (dp, tp) mesh,
    mesh["dp_replicate", "dp_shard"] of a 3-D HSDP + TP one, ``mesh`` itself when 1-D."""
    if mesh.ndim == 1:
        return mesh, mesh.get_local_rank()
    if mesh.ndim == 2:
        return mesh["dp"], mesh.get_local_rank("dp")
    return mesh["dp_replicate", "dp_shard"], mesh.get_local_rank("dp_replicate") * mesh.size(1) + mesh.get_local_rank(
        "dp_shard"
    )


def build(impl: str, mesh, hidden: int, tp: bool = True, shard: bool = True, variant: str = "") -> Net:
    """The seeded Net, its blocks tensor-parallel over mesh["tp"], sharded over :func:`dp_of`'s
    mesh by torch's or fullshard's ``fully_shard``. ``variant``: "meta"
    (built on the meta device, then ``to_empty`` and initialized on the DTensors), "bf16"
    (MixedPrecisionPolicy gathering and computing in bfloat16, reducing in float32)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    with torch.device("meta" if variant == "meta" else "cpu"):
        model = Net(hidden)
    if tp:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], _tp_plan())
        # All parameters on the (dp, tp) mesh: torch's clip_grad_norm_ cannot mix meshes.
        parallelize_module(model.out, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    if shard:
        if impl == "torch":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from fullshard import MixedPrecisionPolicy, fully_shard
        kw = {"mesh": dp_of(mesh)[0]}
        if variant == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    if variant == "meta":
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()  # on DTensors: DTensor's own random-number offsets
    return model


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


def batch(step: int, dp_rank: int) -> torch.Tensor:
    """This dp rank's inputs (both tp ranks of a dp rank see the same ones)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 6, D, generator=g)[dp_rank]  # 4 dp ranks at most, 3 sequences of 6 each


def loss_of(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x).logsumexp(-1).mean()


def assert_same(ours: nn.Module, ref: nn.Module, what: str, exact: bool = True) -> None:
    """Registered parameters: same names, type, placements, mesh and local values."""
    from torch.distributed.tensor import DTensor

    for (name, p), (name2, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert name == name2, (name, name2)
        assert isinstance(q, DTensor), f"{what}: {name} is a {type(q).__name__}"
        assert (q.placements, q.device_mesh, q.shape) == (p.placements, p.device_mesh, p.shape), (
            what,
            name,
            (q.placements, q.device_mesh, q.shape),
            (p.placements, p.device_mesh, p.shape),
        )
        close(q.to_local(), p.to_local(), f"{what}: {name}", exact)


def close(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = True) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: differs by {(got - want).abs().max():.3e}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


Trained = tuple[Net, torch.optim.Optimizer, Net, torch.optim.Optimizer]


def train(mesh, hidden: int, opt_name: str, variant: str = "") -> Trained:
    """Train torch's and fullshard's 2-D models side by side, checking every step."""
    from torch.distributed.tensor import DTensor

    ref, ours = build("torch", mesh, hidden, variant=variant), build("fullshard", mesh, hidden, variant=variant)
    assert_same(ours, ref, f"{opt_name} h{hidden} {variant} after fully_shard")
    for p, q in zip(ref.parameters(), ours.parameters()):
        close(q.full_tensor(), p.full_tensor(), "full_tensor")
    ref_opt, opt = OPTIMIZERS[opt_name](ref.parameters()), OPTIMIZERS[opt_name](ours.parameters())
    dp_rank = dp_of(mesh)[1]
    for step in range(3):
        what = f"{opt_name} h{hidden} {variant} step {step}"
        x = batch(step, dp_rank)
        loss_ref, loss = loss_of(ref, x), loss_of(ours, x)
        close(loss, loss_ref, f"{what} loss")
        loss_ref.backward()
        loss.backward()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            assert isinstance(q.grad, DTensor) and q.grad.placements == p.grad.placements, (what, name)
            close(q.grad.to_local(), p.grad.to_local(), f"{what} grad {name}")
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)
        close(_full(norm), _full(norm_ref), f"{what} total norm")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        assert_same(ours, ref, what)
    check_unshard(ref, ours)
    return ref, ref_opt, ours, opt


def check_unshard(ref: Net, ours: Net) -> None:
    """After ``unshard()`` a block's registered parameters are its TP DTensors, as torch's."""
    for model in (ref, ours):
        model.blocks[0].unshard()
    for (name, p), q in zip(ref.blocks[0].named_parameters(), ours.blocks[0].parameters()):
        assert (q.placements, q.device_mesh, q.shape) == (p.placements, p.device_mesh, p.shape), name
        close(q.to_local(), p.to_local(), f"unsharded {name}")
    for model in (ref, ours):
        model.blocks[0].reshard()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full_values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor as a full tensor, by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    out = {k: v.clone() for k, v in msd.items()}
    for name, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"{name}.{key}"] = value.clone()
    return out


def dcp_round_trips(rank: int, mesh, tmp: str, hidden: int, trained: dict) -> list[str]:
    """Save each 2-D model, load it into the other and into differently laid-out models."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    ref, ref_opt, ours, opt = trained["torch"], trained["torch_opt"], trained["fullshard"], trained["fullshard_opt"]
    want = _full_values(ours, opt)
    got_ref = _full_values(ref, ref_opt)
    assert want.keys() == got_ref.keys()
    for k in want:
        close(want[k], got_ref[k], f"full state dict {k}")
    for impl, (model, o) in {"torch": (ref, ref_opt), "fullshard": (ours, opt)}.items():
        msd, osd = get_state_dict(model, o)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, f"h{hidden}-{impl}"))
    flat = init_device_mesh("cpu", (4,))
    targets = {  # saved by -> loaded into (name, model)
        "torch": [("fullshard 2-D", build("fullshard", mesh, hidden))],
        "fullshard": [
            ("torch 2-D", build("torch", mesh, hidden)),
            ("fullshard 2-D", build("fullshard", mesh, hidden)),
            ("fullshard dp=4", build("fullshard", flat, hidden, tp=False)),
            ("tp only", build("fullshard", mesh, hidden, shard=False)),
        ],
    }
    done = []
    for saved_by, loads in targets.items():
        for name, model in loads:
            o = torch.optim.AdamW(model.parameters(), lr=1e-2)
            msd, osd = get_state_dict(model, o)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, f"h{hidden}-{saved_by}"))
            set_state_dict(model, o, model_state_dict=msd, optim_state_dict=osd)
            got = _full_values(model, o)
            for k in want:
                if k.endswith(".step"):
                    continue
                close(got[k], want[k], f"h{hidden} {saved_by} -> {name}: {k}")
            done.append(f"{saved_by}->{name}")
    return done


def load_full(mesh, model: Net, hidden: int) -> list[str]:
    """``model``'s full (unsharded) state dict loads into a fresh 2-D fullshard model through
    ``load_state_dict`` itself and, when every dim divides evenly, through DCP's
    ``set_model_state_dict`` (torch's ``distribute_tensor`` asserts on uneven ``_StridedShard``
    placements, for torch's own ``fully_shard`` too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    done = []
    for how in ("load_state_dict", "set_model_state_dict") if hidden % 4 == 0 else ("load_state_dict",):
        model = build("fullshard", mesh, hidden)
        if how == "load_state_dict":
            model.load_state_dict(full)
        else:
            set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
        for name, p in model.named_parameters():
            close(p.full_tensor(), full[name], f"{how}: {name}")
        done.append(how)
    return done


def misuse(mesh) -> str:
    """TP parameters with fully_shard's default mesh (the whole world, overlapping tp) fail
    clearly, before anything is changed."""
    from fullshard import fully_shard

    model = build("fullshard", mesh, 12, shard=False)
    before = [(p, p.placements) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"mesh=mesh\['dp'\]"):
        fully_shard(model.blocks[0])
    assert [(p, p.placements) for p in model.parameters()] == before
    return "misuse"


def tp_body(rank: int, world: int, tmp: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    done = [misuse(mesh)]
    for hidden in (12, 10):  # 10: each tp rank holds 5 rows of w1, split 3 + 2 over dp
        for variant in ("meta", "bf16") if hidden == 10 else ():
            train(mesh, hidden, "adamw", variant)
            done.append(f"{variant} h{hidden}")
        for opt_name in OPTIMIZERS:
            ref, ref_opt, ours, opt = train(mesh, hidden, opt_name)
            done.append(f"{opt_name} h{hidden}")
        done += load_full(mesh, ours, hidden)
    # The last models (uneven, AdamW) go through checkpoints.
    trained = {"torch": ref, "torch_opt": ref_opt, "fullshard": ours, "fullshard_opt": opt}
    return done + dcp_round_trips(rank, mesh, tmp, 10, trained)


@pytest.mark.timeout(300)
def test_tp_then_fully_shard_matches_torch_2d(tmp_path) -> None:
    done = run_ranks(tp_body, 4, str(tmp_path), timeout=280)
    assert all(d == done[0] for d in done)
    assert len(done[0]) == 1 + 6 + 3 + 5, done[0]


def sharded_round_trip(mesh, hidden: int, trained: Trained) -> list[str]:
    """Sharded (DTensor) state dicts of model and optimizer, from ``get_state_dict``: each side's
    loads into a fresh model of the other through ``set_state_dict`` and gives the same full values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ref, ref_opt, ours, opt = trained
    want = _full_values(ours, opt)
    done = []
    for saved_by, (model, o), into in (("torch", (ref, ref_opt), "fullshard"), ("fullshard", (ours, opt), "torch")):
        msd, osd = get_state_dict(model, o)
        fresh = build(into, mesh, hidden)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh(batch(0, 0)).sum().backward()  # optimizer state to load into
        fresh_opt.step()
        fresh_opt.zero_grad()
        set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
        got = _full_values(fresh, fresh_opt)
        assert got.keys() == want.keys()
        for k in want:
            close(got[k], want[k], f"sharded {saved_by} -> {into}: {k}")
        done.append(f"sharded {saved_by}->{into}")
    return done


def hsdp_tp_body(rank: int, world: int) -> list[str]:
    """HSDP + TP on torchtitan's 3-D mesh, at (replicate, shard, tp) = (2, 1, 2) and (1, 2, 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import fullshard
    from fullshard import compat

    done = []
    for shape in ((2, 1, 2), (1, 2, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        for opt_name in OPTIMIZERS:
            even = train(mesh, 12, opt_name)
            done.append(f"{shape} {opt_name}")
        ref, ref_opt, ours, opt = trained = train(mesh, 10, "adamw")  # 5 rows per tp rank: 3 + 2 over dp_shard
        w1 = ours.blocks[0].w1.weight
        assert w1.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp"), w1.device_mesh
        assert w1.placements == (Replicate(), compat.strided_shard(0, 2), Shard(0)), w1.placements
        w2 = ours.blocks[0].w2.weight
        assert w2.placements == (Replicate(), Shard(0), Shard(1)), w2.placements
        with pytest.raises(NotImplementedError, match=r"torch.nn.utils.clip_grad_norm_"):
            fullshard.clip_grad_norm_(ours.parameters(), 1.0)  # it would sum over dp only
        want, got = _full_values(ref, ref_opt), _full_values(ours, opt)
        assert want.keys() == got.keys()
        for k in want:
            close(got[k], want[k], f"{shape} full state dict {k}")
        done += load_full(mesh, even[2], 12)  # also through set_model_state_dict: 12 rows split evenly
        done += sharded_round_trip(mesh, 10, trained)
    return done


@pytest.mark.timeout(300)
def test_hsdp_and_tp_on_a_3d_mesh_match_torch() -> None:
    """fully_shard(..., mesh=mesh["dp_replicate", "dp_shard"]) over tensor-parallel blocks: the
    parameters are DTensors on the 3-D mesh placed (Replicate(), _StridedShard(0, sf=2), Shard(0))
    for colwise weights, as torch's (fullshard refused a 2-D dp mesh with TP parameters)."""
    done = run_ranks(hsdp_tp_body, 4, timeout=280)
    assert all(d == done[0] for d in done)
    assert len(done[0]) == 2 * (2 + 2 + 2), done[0]
