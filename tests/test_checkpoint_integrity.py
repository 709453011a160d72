"""Checkpoint integrity (issue 31): checksums in a manifest, all-or-nothing loads, pruning that
keeps the new checkpoint, and one line per failure.

One saved checkpoint serves every corruption case (truncated shard, flipped data bytes, flipped
header bytes, deleted .metadata, deleted rank file, truncated extra file): each is detected by
``verify`` and by ``load`` naming the file and the rank that wrote it, leaves the model and the
optimizer bitwise as they were, and ``resume`` falls back to the older checkpoint beside it with
a warning naming the skipped one and why.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import io
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from models import make_stack, step_both
from test_checkpoint import _model

CASES = (
    "truncated shard",
    "flipped data bytes",
    "flipped header bytes",
    "deleted .metadata",
    "deleted rank file",
    "truncated extra file",
)


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(model, opt) -> tuple[dict, list]:
    """This rank's parameter shards and optimizer state, copied."""
    params = {n: _local(p) for n, p in model.named_parameters()}
    state = [{k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in opt.state.values()]
    return params, state


def _same(a: tuple[dict, list], b: tuple[dict, list]) -> bool:
    (pa, sa), (pb, sb) = a, b
    if pa.keys() != pb.keys() or len(sa) != len(sb):
        return False
    if not all(torch.equal(pa[k], pb[k]) for k in pa):
        return False
    for x, y in zip(sa, sb):
        if x.keys() != y.keys():
            return False
        for k in x:
            same = torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
            if not same:
                return False
    return True


def _trained(rank: int, world: int, api: str = "fsdp1", step: int = 0):
    model = _model(api)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world, api, step)
    return model, opt


def _train(model, opt, rank: int, world: int, api: str, step: int) -> None:
    ref = make_stack(scale_shape=(1,) if api == "fsdp2" else ())
    step_both(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.0), step, rank, world)


def _flip(path: Path, at: int, n: int = 64) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + n] = bytes(b ^ 0xFF for b in raw[at : at + n])
    path.write_bytes(bytes(raw))


def _corrupt(directory: Path, case: str, data: bytes) -> str:
    """Damage the checkpoint in ``directory`` as ``case`` says; the problem verify must report."""
    shard, extra = directory / "__1_0.distcp", directory / "extra_rank0.pt"
    size = shard.stat().st_size
    if case == "truncated shard":
        shard.write_bytes(shard.read_bytes()[: size // 2])
        return f"__1_0.distcp (written by rank 1): {size // 2} bytes where {size} were written (truncated)"
    if case == "flipped data bytes":  # inside the tensor data of one of rank 1's parameter shards
        at = shard.read_bytes().find(data)
        assert at >= 0
        _flip(shard, at)
        return "__1_0.distcp (written by rank 1): checksum mismatch"
    if case == "flipped header bytes":  # the zip header of the first record
        _flip(shard, 0, 16)
        return "__1_0.distcp (written by rank 1): checksum mismatch"
    if case == "deleted .metadata":
        (directory / ".metadata").unlink()
        return ".metadata (written by rank 0): missing"
    if case == "deleted rank file":
        shard.unlink()
        return "__1_0.distcp (written by rank 1): missing"
    full = extra.stat().st_size
    extra.write_bytes(extra.read_bytes()[:20])
    return f"extra_rank0.pt (written by rank 0): 20 bytes where {full} were written (truncated)"


def _checkpoint_warnings(seen: list) -> list[str]:
    from fullshard.checkpoint import CheckpointWarning

    return [str(w.message) for w in seen if issubclass(w.category, CheckpointWarning)]


def corruption_body(rank: int, world: int, base: str) -> list[str]:
    import torch.distributed as dist

    from fullshard import checkpoint
    from fullshard.checkpoint import CheckpointError

    model, opt = _trained(rank, world)
    good = checkpoint.save(Path(base) / "good", 1, model, opt, extra={"rank": rank})
    good2 = checkpoint.save(Path(base) / "good", 2, model, opt, extra={"rank": rank})  # the same, named 2
    saved = _snapshot(model, opt)
    data = [None] * world  # rank 1's first 64 bytes of a parameter shard, as saved
    dist.all_gather_object(data, next(p for p in model.parameters() if p.numel() * 4 >= 64).detach().numpy().tobytes())
    done = []
    for step, case in enumerate(CASES, start=1):
        _train(model, opt, rank, world, "fsdp1", step)  # the model now differs from the checkpoint
        before = _snapshot(model, opt)
        root = Path(base) / case.replace(" ", "_")
        bad = root / "step_00000002"
        expected = [""]
        if rank == 0:
            shutil.copytree(good, root / "step_00000001")
            shutil.copytree(good2, bad)
            expected = [_corrupt(bad, case, data[1][:64])]
        dist.broadcast_object_list(expected, 0)
        assert checkpoint.verify(bad) == expected
        with pytest.raises(CheckpointError) as failed:
            checkpoint.load(bad, model, opt)
        assert str(failed.value) == f"checkpoint {bad} failed verification: {expected[0]}"
        assert _same(_snapshot(model, opt), before), case
        sized = case not in ("flipped data bytes", "flipped header bytes")  # latest() reads no byte
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert checkpoint.latest(root) == (root / "step_00000001" if sized else bad)
            found = checkpoint.resume(root, model, opt)
        assert found is not None and found[0] == root / "step_00000001" and found[1] == {"rank": rank}
        skipped = f"fullshard: skipping checkpoint {bad}: {expected[0]}"
        want = ([skipped] if sized else []) + ([skipped] if rank == 0 else [])
        assert _checkpoint_warnings(seen) == want, (case, _checkpoint_warnings(seen))
        assert _same(_snapshot(model, opt), saved), case
        done.append(case)
    # A job whose every checkpoint fails verification says so once and starts from step 0.
    from fullshard.jobs.train.session import Session

    root = Path(base) / "all_bad"
    if rank == 0:
        shutil.copytree(Path(base) / "deleted_rank_file" / "step_00000002", root / "step_00000002")
    dist.barrier()
    before = _snapshot(model, opt)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert Session(argparse.Namespace(checkpoint_dir=str(root))).resume(model, opt) is None
    lines = [
        f"fullshard: skipping checkpoint {root / 'step_00000002'}: __1_0.distcp (written by rank 1): missing",
        f"fullshard: none of the 1 checkpoint(s) in {root} verified (each is named above): training from step 0",
    ]
    assert err.getvalue().splitlines() == (lines if rank == 0 else []), err.getvalue()
    assert _same(_snapshot(model, opt), before)
    return done


@pytest.mark.timeout(300)
def test_every_corruption_is_named_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_ranks(corruption_body, 2, str(tmp_path), timeout=240) == [list(CASES)] * 2
    from fullshard.cli import main

    capsys.readouterr()
    root = tmp_path / "deleted_rank_file"
    assert main(["verify", str(root)]) == 1  # the command's exit status
    out, err = capsys.readouterr()
    assert out == f"verified {root / 'step_00000001'}: 5 files, " + out.split(", ", 1)[1]
    assert err.splitlines() == [
        f"fullshard verify: {root / 'step_00000002'}: __1_0.distcp (written by rank 1): missing",
        f"fullshard verify: 1 of 2 checkpoints in {root} failed",
    ]
    assert main(["verify", str(root / "step_00000001")]) == 0
    converted = tmp_path / "model.pt"
    assert main(["convert", str(root / "step_00000002"), str(converted)]) == 1
    assert "failed verification: __1_0.distcp (written by rank 1): missing" in capsys.readouterr().err
    assert main(["convert", str(root), str(converted)]) == 0  # a folder: its newest verified checkpoint
    out, err = capsys.readouterr()
    skipped = f"fullshard: skipping checkpoint {root / 'step_00000002'}: __1_0.distcp (written by rank 1): missing"
    assert err.splitlines()[0] == skipped, err
    make_stack().load_state_dict(torch.load(converted), strict=True)


def all_or_nothing_body(rank: int, world: int, base: str, api: str) -> list[str]:
    """Failures that checksums do not catch (a checkpoint without a manifest, an optimizer of
    another type) happen while reading, before the model or the optimizer changes."""
    import torch.distributed as dist

    from fullshard import checkpoint
    from fullshard.checkpoint import CheckpointError

    model, opt = _trained(rank, world, api)
    good = checkpoint.save(Path(base) / api, 1, model, opt, extra={"rank": rank})
    _train(model, opt, rank, world, api, 1)
    before = _snapshot(model, opt)
    done = []
    for case, damage, reason in (
        ("truncated extra file", "extra_rank0.pt", r"on rank 0: .* \(reading extra_rank0\.pt\)"),
        ("damaged shard", "__1_0.distcp", r"on ranks? .*: .* \(reading __1_0\.distcp\)"),
    ):
        legacy = Path(base) / f"{api}-{case.replace(' ', '_')}"
        if rank == 0:
            shutil.copytree(good, legacy)
            (legacy / "manifest.json").unlink()  # as saved before checksums: nothing verifies it
            (legacy / damage).write_bytes((legacy / damage).read_bytes()[:200])
        dist.barrier()
        with pytest.raises(CheckpointError, match=rf"^checkpoint load from {legacy} failed {reason}$"):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                checkpoint.load(legacy, model, opt)
        assert "CheckpointException" not in str(seen)
        if rank == 0:
            assert _checkpoint_warnings(seen) == [
                f"fullshard: loading checkpoint {legacy} unverified: no manifest (saved before fullshard wrote "
                "checksums, or not by fullshard)"
            ]
        assert _same(_snapshot(model, opt), before), case
        done.append(case)
    # An optimizer of another type: its first missing key and both types are named; the fresh
    # SGD's state, created to load into, is gone again.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError) as failed:
        checkpoint.load(good, model, sgd)
    assert str(failed.value).startswith(
        f"checkpoint load from {good} failed on ranks 0 and 1: optimizer mismatch: the checkpoint holds AdamW "
        "state, the optimizer is SGD; first missing key optim.state."
    ) and str(failed.value).endswith(".momentum_buffer"), str(failed.value)
    assert len(sgd.state) == 0 and _same(_snapshot(model, opt), before)
    done.append("optimizer mismatch")
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api", ["fsdp1", "fsdp2"])
def test_a_failed_load_changes_nothing(tmp_path: Path, api: str) -> None:
    want = ["truncated extra file", "damaged shard", "optimizer mismatch"]
    assert run_ranks(all_or_nothing_body, 2, str(tmp_path), api, timeout=240) == [want] * 2


def prune_body(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist

    from fullshard import checkpoint
    from fullshard.checkpoint import CheckpointError

    model, opt = _trained(rank, world)
    checkpoint.save(root, 1, model, opt)
    if rank == 0:  # a newer folder without .metadata or manifest (an interrupted copy)
        (Path(root) / "step_00000005").mkdir()
        (Path(root) / "step_00000005" / "__0_0.distcp").write_bytes(b"half a shard")
    dist.barrier()
    new = checkpoint.save(root, 2, model, opt, keep=1)
    names = sorted(p.name for p in Path(root).iterdir())
    assert names == ["step_00000002", "step_00000005"], names  # step 1 pruned; 5 neither counted nor removed
    legacy = Path(root) / "step_00000007"  # as saved before checksums: never picked from a folder
    dist.barrier()  # every rank has looked
    if rank == 0:
        shutil.copytree(new, legacy)
        (legacy / "manifest.json").unlink()
        shutil.copytree(legacy, Path(root).with_name("legacy") / legacy.name)
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert checkpoint.latest(root) == new
        assert checkpoint.resume(root, model, opt)[0] == new
    incomplete = Path(root) / "step_00000005"
    skipped = [
        f"fullshard: skipping checkpoint {legacy}: no manifest (saved before fullshard wrote checksums, or not by "
        f"fullshard); checkpoint.load('{legacy}') loads it unverified",
        f"fullshard: skipping checkpoint {incomplete}: .metadata: missing",
    ]
    assert _checkpoint_warnings(seen) == skipped * (2 if rank == 0 else 1)  # latest() here, resume() on rank 0
    with pytest.raises(CheckpointError, match=r"holds no verified checkpoint: each of its 1 step_\* folder"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint.load(Path(root).with_name("legacy"), model, opt)
    # A newer complete checkpoint does not push out the one just written either.
    checkpoint.save(root, 9, model, opt)
    checkpoint.save(root, 3, model, opt, keep=1)
    return sorted(p.name for p in Path(root).iterdir())


@pytest.mark.timeout(200)
def test_pruning_keeps_the_new_checkpoint_and_counts_only_complete_ones(tmp_path: Path) -> None:
    results = run_ranks(prune_body, 2, str(tmp_path / "ckpt"), timeout=180)
    assert results == [["step_00000003", "step_00000005", "step_00000007"]] * 2  # 2 and 9 pruned


def corrupt_newer_body(rank: int, world: int, root: str) -> tuple[list[str], list[str]]:
    """A job's checkpoints 3 and 6, step 6's shard damaged; the job resumes from 3 and saves 4
    and 5 with keep=2."""
    import torch.distributed as dist

    from fullshard import checkpoint

    model, opt = _trained(rank, world)
    checkpoint.save(root, 3, model, opt)
    checkpoint.save(root, 6, model, opt)
    dist.barrier()
    if rank == 0:
        shard = Path(root) / "step_00000006" / "__1_0.distcp"
        _flip(shard, shard.stat().st_size // 2)
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert checkpoint.resume(root, model, opt)[0] == Path(root) / "step_00000003"
        checkpoint.save(root, 4, model, opt, keep=2)
        checkpoint.save(root, 5, model, opt, keep=2)
    names = sorted(p.name for p in Path(root).iterdir())
    dist.barrier()
    # A copy of step 4 named step_00000009 would resume "at step 9" with step 4's state.
    if rank == 0:
        shutil.copytree(Path(root) / "step_00000004", Path(root) / "step_00000009")
    dist.barrier()
    with warnings.catch_warnings(record=True) as renamed:
        warnings.simplefilter("always")
        assert checkpoint.resume(root, model, opt)[0] == Path(root) / "step_00000005"
    return names, _checkpoint_warnings(seen) + _checkpoint_warnings(renamed)


@pytest.mark.timeout(200)
def test_pruning_counts_only_verified_checkpoints(tmp_path: Path) -> None:
    """A newer checkpoint that fails verification (resuming skipped it) was counted by keep=K
    and pushed out the good ones: checkpoints 3 and 6 (damaged), saves of 4 and 5 with keep=2
    ended with 5 and the damaged 6. It is neither counted nor removed, with one warning."""
    root = tmp_path / "ckpt"
    (names0, warned0), (names1, warned1) = run_ranks(corrupt_newer_body, 2, str(root), timeout=180)
    assert names0 == names1 == ["step_00000004", "step_00000005", "step_00000006"]
    bad = f"{root / 'step_00000006'}: __1_0.distcp (written by rank 1): checksum mismatch"
    assert warned0 == [
        f"fullshard: skipping checkpoint {bad}",  # resume, on rank 0
        f"fullshard: not counting checkpoint {root / 'step_00000006'} towards keep=2, nor removing it: "
        "__1_0.distcp (written by rank 1): checksum mismatch",  # the save of 4, by its leader; not again at 5
        f"fullshard: skipping checkpoint {root / 'step_00000009'}: manifest.json: saved at step 4, but the "
        "folder is named step_00000009 (renamed or copied?)",  # the second resume
        f"fullshard: skipping checkpoint {bad}",
    ], warned0
    assert warned1 == [], warned1


def full_disk_body(rank: int, world: int, root: str, fill: bool) -> str:
    """A save that runs out of space: on a small tmpfs filled up (``fill``), else on rank 1 by a
    write that raises ENOSPC. Every rank gets the same one line; the previous checkpoint stays."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystem

    from fullshard import checkpoint
    from fullshard.checkpoint import CheckpointError

    model, opt = _trained(rank, world)
    good = checkpoint.save(root, 1, model, opt)
    real = FileSystem.create_stream
    filler = Path(root) / "filler"
    if fill and rank == 0:
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        filler.write_bytes(b"\0" * max(0, free - 16 * 1024))  # room for the extra files, not the shards
    dist.barrier()

    @contextlib.contextmanager
    def no_space(self, path, mode):
        with real(self, path, mode) as stream:
            if rank == 1 and "w" in mode and str(path).endswith(".distcp"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield stream

    if not fill:
        FileSystem.create_stream = no_space
    try:
        with pytest.raises(CheckpointError) as failed:
            checkpoint.save(root, 2, model, opt)
    finally:
        FileSystem.create_stream = real
    dist.barrier()
    if rank == 0:
        filler.unlink(missing_ok=True)
    assert checkpoint.latest(root) == good and checkpoint.verify(good) == []
    return str(failed.value)


@pytest.mark.timeout(200)
def test_a_full_disk_is_one_line_on_every_rank(tmp_path: Path) -> None:
    lines = run_ranks(full_disk_body, 2, str(tmp_path), False, timeout=180)
    want = f"checkpoint save to {tmp_path / 'step_00000002'} failed on rank 1: "
    want += "No space left on device (writing __1_0.distcp)"
    assert lines == [want, want]


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    where = tmp_path / "small"
    where.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True
        )
    except OSError as e:
        pytest.skip(f"no mount command here ({e}); test_a_full_disk_is_one_line_on_every_rank covers the message")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the simulated ENOSPC test covers the message")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


@pytest.mark.timeout(200)
def test_a_full_tmpfs_is_one_line_on_every_rank(small_tmpfs: Path) -> None:
    lines = run_ranks(full_disk_body, 2, str(small_tmpfs), True, timeout=180)
    assert lines[0] == lines[1], lines
    head = f"checkpoint save to {small_tmpfs / 'step_00000002'} failed on rank"
    assert lines[0].startswith(head), lines[0]
    for clause in lines[0][len(head) :].split("; on "):  # the errno, not torch.save's "unexpected pos"
        assert "No space left on device (writing __" in clause, lines[0]
    assert "\n" not in lines[0] and "CheckpointException" not in lines[0]


@pytest.mark.timeout(200)
def test_a_failed_worker_prints_one_line_and_logs_its_traceback(tmp_path: Path, capfd) -> None:
    import jobs

    from fullshard.jobs.launch import run_job

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, result = run_job("fullshard train test", jobs.save_into, str(blocker), 2)
    err = capfd.readouterr().err
    assert (code, result) == (1, None)
    tmp = blocker / "step_00000001.tmp"
    want = f"fullshard: checkpoint save to {blocker / 'step_00000001'} failed on ranks 0 and 1: Not a directory ({tmp})"
    lines = err.strip().splitlines()
    assert lines and set(lines[:-1]) == {want} and "Traceback" not in err, err  # each rank's line, no traceback
    head, log = lines[-1].split("; tracebacks in ")
    assert head.startswith("fullshard train test: worker rank ") and head.endswith(" failed (exit code 1)"), head
    text = Path(log).read_text()
    assert "Traceback" in text and "CheckpointError: checkpoint save to" in text
    Path(log).unlink()


def test_jobs_check_their_arguments_before_starting_workers(tmp_path: Path, capsys) -> None:
    from fullshard.cli import main

    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "twelve.txt").write_bytes(b"hello world\n")
    (tmp_path / "short.txt").write_text("x" * 1000)
    cases = [
        (["--data", str(tmp_path / "empty.txt")], "0 bytes of text in 1 file(s) give 0 training and 0 validation"),
        (["--data", str(tmp_path / "twelve.txt")], "12 bytes of text in 1 file(s) give 10 training and 2 validation"),
        (["--data", str(tmp_path / "short.txt"), "--seq-len", "512"], "--seq-len 512 needs at least 514 in each"),
        (["--checkpoint-dir", str(tmp_path / "empty.txt")], "is a file, not a directory"),
    ]
    for args, text in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["train", "gpt", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and text in err and err.count("\n") == 1, err  # one line, no usage dump


def test_a_checkpoint_as_checkpoint_dir_is_refused(tmp_path: Path, capsys) -> None:
    """Given a checkpoint as its --checkpoint-dir, a job resumed from it on every start and saved
    its new checkpoints inside it, where no start looked: every restart lost the progress since.
    Both jobs refuse it at start-up, naming the argument and the parent to pass instead."""
    from fullshard.jobs.train import gpt, mnist

    saved = tmp_path / "ckpt" / "step_00000003"
    saved.mkdir(parents=True)
    (saved / "manifest.json").write_text("{}")
    dcp = tmp_path / "dcp"  # a checkpoint by its files, not its name
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    for parse_args in (gpt.parse_args, mnist.parse_args):  # what `fullshard train JOB` runs first
        for path, parent in (
            (saved, saved.parent),
            (tmp_path / "new" / "step_00000006", tmp_path / "new"),
            (dcp, tmp_path),
        ):
            with pytest.raises(SystemExit) as exit_:
                parse_args(["--checkpoint-dir", f"{path}/"])
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and err.count("\n") == 1, err
            assert f"--checkpoint-dir {path}/ is a checkpoint (or named like one)" in err, err
            assert f"pass its parent, --checkpoint-dir {parent} " in err, err
    assert not (tmp_path / "new").exists()


def test_a_mesh_of_the_wrong_type_is_a_type_error() -> None:
    from fullshard import FSDP, fully_shard

    with pytest.raises(
        TypeError, match=r"^fully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh .* str 'cpu'"
    ):
        fully_shard(torch.nn.Linear(2, 2), mesh="cpu")
    with pytest.raises(TypeError, match=r"^FullyShardedDataParallel: device_mesh must be a .*DeviceMesh .* int 5$"):
        FSDP(copy.deepcopy(torch.nn.Linear(2, 2)), device_mesh=5)


def optimizer_corners_body(rank: int, world: int, root: str) -> list[str]:
    """Optimizer-state corners a helper's audit found (2026-11-27)."""
    from fullshard import FSDP, checkpoint

    done = []
    # a failed load leaves an optimizer whose state is partly created bitwise as it was
    sgd_model = _model()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    _train(sgd_model, sgd, rank, world, "fsdp1", 0)
    checkpoint.save(os.path.join(root, "sgd"), 1, sgd_model, sgd)
    model = _model()
    named = dict(model.named_parameters())
    opt = torch.optim.Adam([p for n, p in named.items() if "blocks" in n], lr=1e-2)
    _train(model, opt, rank, world, "fsdp1", 0)
    opt.add_param_group({"params": [p for n, p in named.items() if "blocks" not in n], "lr": 1e-3})
    before = _snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match="optimizer mismatch"):
        checkpoint.load(os.path.join(root, "sgd"), model, opt)
    assert _same(_snapshot(model, opt), before)  # Adam's moments were decayed by the failed load
    done.append("failed load")
    # saved before the first step (no state yet): loads into a fresh model and optimizer
    fresh = _model()
    checkpoint.save(os.path.join(root, "fresh"), 0, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    again = _model()
    checkpoint.load(os.path.join(root, "fresh"), again, torch.optim.AdamW(again.parameters(), lr=1e-3))
    done.append("saved before a step")
    # the optimizer state dict functions refuse what they used to misread
    trained, adamw = _trained(rank, world)
    osd = FSDP.optim_state_dict(trained, adamw)
    two = torch.optim.AdamW(
        [{"params": [p for n, p in trained.named_parameters() if "blocks" in n]}, {"params": []}], lr=1e-2
    )
    two.param_groups[1]["params"] = [p for n, p in trained.named_parameters() if "blocks" not in n]
    with pytest.raises(ValueError, match="optim_state_dict has 1 parameter groups but optim has 2"):
        FSDP.optim_state_dict_to_load(trained, two, osd)
    stray = torch.nn.Parameter(torch.zeros(3))
    mixed = torch.optim.AdamW([*trained.parameters(), stray], lr=1e-2)
    with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) that are not the model's"):
        FSDP.optim_state_dict(trained, mixed)
    # a parameter listed in the dict's group without state (no gradient before the save) loads without
    without = copy.deepcopy(osd)
    dropped = next(iter(without["state"]))
    del without["state"][dropped]
    loaded = FSDP.optim_state_dict_to_load(trained, adamw, without)
    assert len(loaded["state"]) == len(osd["state"]) - 1
    done.append("optim state dicts")
    return done


@pytest.mark.timeout(180)
def test_optimizer_state_corners(tmp_path: Path) -> None:
    want = ["failed load", "saved before a step", "optim state dicts"]
    assert run_ranks(optimizer_corners_body, 2, str(tmp_path), timeout=160) == [want, want]
