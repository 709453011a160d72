"""Sharded checkpoints: resharding across world sizes, atomic saves, errors on every rank."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from models import Block, make_stack, step_both


def _model(api: str = "fsdp1"):
    from fullshard import FSDP, fully_shard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    if api == "fsdp2":  # fully_shard refuses 0-dim parameters, as torch's does
        model = copy.deepcopy(make_stack(scale_shape=(1,)))
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    return FSDP(copy.deepcopy(make_stack()), auto_wrap_policy=ModuleWrapPolicy({Block}))


def _full_optim(model, opt) -> dict:
    from fullshard import FSDPModule
    from fullshard.state.optim_state import full_optim_state_dict

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    else:
        osd = full_optim_state_dict(model, opt)
    return {
        f"{n}.{k}": v.clone() if isinstance(v, torch.Tensor) else v
        for n, e in osd["state"].items()
        for k, v in e.items()
    }


def _full_model(model) -> dict:
    # full_tensor() on a one-rank mesh is the parameter itself: clone, training goes on after
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}


def save_body(rank: int, world: int, root: str, api: str = "fsdp1") -> tuple[dict, dict]:
    from fullshard.state import checkpoint

    ref = make_stack(scale_shape=(1,) if api == "fsdp2" else ())
    model = _model(api)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        step_both(model, opt, ref, ref_opt, step, rank, world)
        checkpoint.save(root, step, model, opt, extra={"rank": rank, "step": step}, keep=2)
    return _full_model(model), _full_optim(model, opt)


def load_body(rank: int, world: int, root: str, saved_world: int, api: str = "fsdp1") -> tuple[dict, dict, dict]:
    from fullshard.state import checkpoint

    model = _model(api)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = checkpoint.load(root, model, opt)
    full, optim = _full_model(model), _full_optim(model, opt)
    # Training continues from the loaded state.
    ref = make_stack(scale_shape=(1,) if api == "fsdp2" else ())
    step_both(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.0), 3, rank, world)
    return full, optim, extra


@pytest.mark.timeout(400)
# fewer, larger shards (3: uneven, DTensor chunks) and more, smaller ones; each API in one of them
@pytest.mark.parametrize("saved,loaded,api", [(2, [1, 3], "fsdp2"), (4, [2], "fsdp1")])
def test_checkpoint_reshards(tmp_path: Path, saved: int, loaded: list[int], api: str) -> None:
    root = str(tmp_path / "ckpt")
    want_model, want_optim = run_ranks(save_body, saved, root, api, timeout=180)[0]
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_00000001", "step_00000002"], names  # keep=2
    for world in loaded:
        results = run_ranks(load_body, world, root, saved, api, timeout=180)
        full, optim, extra = results[0]
        for k, v in want_model.items():
            assert torch.equal(full[k], v), (world, k)
        assert set(optim) == set(want_optim)
        for k, v in want_optim.items():
            assert torch.equal(torch.as_tensor(optim[k]), torch.as_tensor(v)), (world, k)
        # extra state is per rank: ranks that also existed at save time get theirs back
        assert [r[2].get("rank") for r in results] == [r if r < saved else None for r in range(world)]


def per_rank_save_body(rank: int, world: int, base: str) -> tuple[dict, dict]:
    """Each rank saves into its own directory (Ray Train's idiom), one holding a stale half-save."""
    from fullshard.state import checkpoint

    root = Path(base) / f"rank{rank}"
    if rank == 1:  # an interrupted earlier save of the same step left a file behind
        (root / "step_00000001.tmp").mkdir(parents=True)
        (root / "step_00000001.tmp" / "__7_0.distcp").write_bytes(b"stale")
    ref = make_stack()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        step_both(model, opt, ref, ref_opt, step, rank, world)
        checkpoint.save(root, step, model, opt, extra={"rank": rank}, keep=1)
    return _full_model(model), _full_optim(model, opt)


@pytest.mark.timeout(300)
def test_per_rank_directories_merge_into_one_checkpoint(tmp_path: Path) -> None:
    import shutil

    want_model, want_optim = run_ranks(per_rank_save_body, 2, str(tmp_path), timeout=180)[0]
    merged = tmp_path / "merged"
    merged.mkdir()
    for rank in range(2):
        assert [p.name for p in (tmp_path / f"rank{rank}").iterdir()] == ["step_00000001"]  # keep=1, no .tmp
        for f in (tmp_path / f"rank{rank}" / "step_00000001").iterdir():
            shutil.copy(f, merged / f.name)
    names = sorted(p.name for p in merged.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt", "manifest.json"]
    results = run_ranks(load_body, 3, str(merged), 2, timeout=180)
    full, optim, _ = results[0]
    for k, v in want_model.items():
        assert torch.equal(full[k], v), k
    for k, v in want_optim.items():
        assert torch.equal(torch.as_tensor(optim[k]), torch.as_tensor(v)), k
    assert [r[2].get("rank") for r in results] == [0, 1, None]


def errors_body(rank: int, world: int, root: str) -> list[str]:
    from fullshard import FSDP, checkpoint
    from fullshard.comm import collectives
    from fullshard.state.checkpoint import CheckpointError

    done = []
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = make_stack()
    step_both(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.0), 0, rank, world)
    good = checkpoint.save(root, 1, model, opt)

    # A crash during the next save (rank 1's storage fails mid-write) leaves step 1 the newest.
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real_write = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if rank == 1:
            (Path(self.path) / "partial.distcp").write_bytes(b"half a shard")
            raise OSError("disk full")
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = failing_write
    with pytest.raises(CheckpointError, match="disk full"):
        checkpoint.save(root, 2, model, opt)
    FileSystemWriter.write_data = real_write
    assert checkpoint.latest(root) == good
    done.append("crash in save")

    before = model.state_dict()
    # Not a checkpoint at all.
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        checkpoint.load(Path(root) / "nothing-here", model, opt)
    # A checkpoint of another model: the mismatches are named, the model is unchanged.
    other = FSDP(torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Linear(13, 4)))
    with pytest.raises(
        CheckpointError, match=r"missing key\(s\) 0.bias, 0.weight.*unexpected key\(s\).*blocks.0.lin.weight"
    ):
        checkpoint.load(good, other)
    wrong = copy.deepcopy(make_stack())
    wrong.head = torch.nn.Linear(13, 4)
    from fullshard.frontend.wrap import ModuleWrapPolicy

    wrong = FSDP(wrong, auto_wrap_policy=ModuleWrapPolicy({Block}))
    with pytest.raises(CheckpointError, match=r"shape mismatch for head.weight: checkpoint \(3, 13\), model \(4, 13\)"):
        checkpoint.load(good, wrong)
    # A model that heads no unit (unwrapped, or a plain module around wrappers) is refused by type.
    plain = torch.nn.Sequential(FSDP(torch.nn.Linear(2, 2)))
    with pytest.raises(CheckpointError, match="TypeError: model must be the root FullyShardedDataParallel or a module"):
        checkpoint.save(root, 3, plain)
    done.append("wrong model")
    # A truncated shard file: an error on every rank, and the model is not changed.
    if rank == 0:
        shard = sorted(good.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    collectives.barrier(collectives.default_group())
    with pytest.raises(CheckpointError, match=r"failed verification: __0_0.distcp \(written by rank 0\): 100 bytes"):
        checkpoint.load(good, model, opt)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    done.append("truncated")
    return done


@pytest.mark.timeout(200)
def test_checkpoint_errors_reach_every_rank(tmp_path: Path) -> None:
    results = run_ranks(errors_body, 2, str(tmp_path / "ckpt"), timeout=180)
    assert results[0] == results[1] == ["crash in save", "wrong model", "truncated"]


def convert_save_body(rank: int, world: int, root: str, api: str) -> dict:
    from fullshard.state import checkpoint

    ref = make_stack(scale_shape=(1,) if api == "fsdp2" else ())
    model = _model(api)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step_both(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.0), 0, rank, world)
    checkpoint.save(root, 1, model, opt)
    return _full_model(model)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("suffix,api", [(".pt", "fsdp1"), (".safetensors", "fsdp2")])
def test_convert_to_one_full_state_dict(
    tmp_path: Path, suffix: str, api: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    want = run_ranks(convert_save_body, 2, str(root), api, timeout=180)[0]
    out = tmp_path / f"model{suffix}"
    r = subprocess.run(
        [sys.executable, "-m", "fullshard.cli", "convert", str(root), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out)
    plain = make_stack(seed=3, scale_shape=(1,) if api == "fsdp2" else ())
    plain.load_state_dict(state, strict=True)  # a plain model loads it for inference
    for k, v in want.items():
        assert torch.equal(plain.state_dict()[k], v), k
    from fullshard.cli import main  # what `python -m fullshard.cli` exits with

    assert main(["convert", str(tmp_path), str(out)]) == 1
    assert "is not a checkpoint" in capsys.readouterr().err
    # An output that cannot be written is one line, exit status 1 (it was a raw traceback).
    for bad, why in (
        (out / f"x{suffix}", f"its folder {out} cannot be made: {out} is a file, not a directory"),
        (root, f"output {root} must end in .safetensors or .pt"),
    ):
        assert main(["convert", str(root), str(bad)]) == 1
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    (tmp_path / f"folder{suffix}").mkdir()
    assert main(["convert", str(root), str(tmp_path / f"folder{suffix}")]) == 1
    assert "is a directory: give the path of a file in it" in capsys.readouterr().err
