"""Bad input gets a clear error naming the argument and the fix, on every rank, never a hang."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from dist import run_ranks
from torch import nn

FULLSHARD = [sys.executable, "-m", "fullshard.cli"]


def test_no_process_group() -> None:
    from fullshard import FSDP

    with pytest.raises(RuntimeError, match=r"init_process_group.*process_group="):
        FSDP(nn.Linear(2, 2))


def _raises(fn, exc, text: str) -> str:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{text!r} not in {e}"
        return type(e).__name__
    raise AssertionError(f"no {exc.__name__} for {text!r}")


def errors_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP, MixedPrecision
    from fullshard.frontend.wrap import size_based_auto_wrap_policy

    seen = []
    wrapped = FSDP(nn.Linear(4, 4))
    seen.append(_raises(lambda: FSDP(wrapped), ValueError, "already a FullyShardedDataParallel"))

    class Scaled(nn.Module):  # a meta parameter with no reset_parameters() to fill it
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3, device="meta"))

    seen.append(
        _raises(
            lambda: FSDP(nn.Sequential(nn.Linear(2, 2), Scaled())),
            ValueError,
            "1 (Scaled) is on the meta device and has no reset_parameters()",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(nn.Linear(2, 2), sharding_strategy="full_sharded"),
            ValueError,
            "full_shard, shard_grad_op, no_shard",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(param_dtype=torch.int8)),
            ValueError,
            "param_dtype=torch.int8 is not a floating-point",
        )
    )
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), mixed_precision="bf16"), TypeError, "mixed_precision must be"))
    inner = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2)))
    inner(torch.ones(1, 2)).sum().backward()
    seen.append(_raises(lambda: inner.module[0].clip_grad_norm_(1.0), RuntimeError, "must be called on the root"))
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), cpu_offload="yes"), TypeError, "cpu_offload must be"))
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), not_an_arg=1), TypeError, "not_an_arg"))
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), backward_prefetch="pre"), TypeError, "backward_prefetch"))
    # The settings reach one frozen config, which checks every field's type and names the argument.
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), forward_prefetch="y"), TypeError, "forward_prefetch: got 'y'"))
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), sync_module_states=1), TypeError, "sync_module_states: got 1"))
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), param_init_fn=3), TypeError, "param_init_fn must be callable"))
    seen.append(_raises(lambda: FSDP(nn.Linear(2, 2), device_id=True), TypeError, "device_id: got True"))
    # Arguments fullshard has no use for warn, naming the argument, once per tree (not per nested unit).
    for kwargs, text in [
        (dict(limit_all_gathers=False), "limit_all_gathers=False is not used"),
        (dict(use_orig_params=False), "use_orig_params=False is not used"),
        (dict(param_init_fn=lambda m: None), "param_init_fn is not used"),
    ]:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), auto_wrap_policy={nn.Linear}, **kwargs)
        unused = [str(x.message) for x in w if "is not used" in str(x.message)]
        assert len(unused) == 1 and unused[0].startswith(f"FullyShardedDataParallel: {text}"), unused
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        FSDP(nn.Linear(2, 2), limit_all_gathers=True, use_orig_params=True)
    assert not w, [str(x.message) for x in w]
    # The tutorial's old keyword still works, with a deprecation warning.
    import functools

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = FSDP(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
            fsdp_auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=50),
        )
    assert any("fsdp_auto_wrap_policy" in str(x.message) for x in w)
    assert len(m.fsdp_modules(m)) == 2
    return seen


@pytest.mark.timeout(120)
def test_constructor_errors_on_every_rank() -> None:
    results = run_ranks(errors_body, 2, timeout=100)
    assert results[0] == results[1] and len(results[0]) == 13


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(FULLSHARD + list(args), capture_output=True, text=True, timeout=timeout)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``fullshard ARGS`` in this process (options are checked before any worker starts): the
    exit code and what it wrote to stderr."""
    from fullshard.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args,text",
    [
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--sharding-strategy", "fully"], "use one of: full_shard"),
        (["--epochs", "0"], "--epochs must be at least 1"),
    ],
)
def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str], args: list[str], text: str) -> None:
    code, err = _main(capsys, "train", "mnist", *args)
    assert code == 2 and text in err, err


def test_cli_data_dir_without_mnist(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    code, err = _main(capsys, "train", "mnist", "--data-dir", str(tmp_path))
    assert code == 2, err
    assert "t10k-images-idx3-ubyte" in err and "leave out --data-dir" in err, err


def test_cli_unknown_command_and_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(capsys, "frobnicate")[0] == 2
    code, err = _main(capsys, "train", "imagenet")
    assert code == 2 and "unknown job 'imagenet'" in err
    assert _cli("frobnicate").returncode == 2  # the installed command's exit status


def test_the_cause_is_named_before_a_peer_whose_connection_it_closed(tmp_path) -> None:  # noqa: ANN001
    """Rank 1 raises while rank 0 is still setting up the process group: rank 0's gloo error
    ("Connection closed by peer"), stamped the same second or earlier, is the consequence."""
    from types import SimpleNamespace

    from fullshard.jobs.launch import _failed

    def record(message: str, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(message={"message": message}, exitcode=1, timestamp=timestamp)

    gloo = (
        "RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:49831. This is typically caused by a remote worker crashing."
    )
    for t0, t1 in ((10, 10), (9, 10)):
        err = SimpleNamespace(failures={0: record(gloo, t0), 1: record("ValueError: boom on rank 1", t1)})
        failed = _failed(err, tmp_path / "log")
        assert failed.rank == 1 and "boom on rank 1" in str(failed), failed
    # without a cause among them, the earliest still leads
    err = SimpleNamespace(failures={0: record(gloo, 11), 1: record(gloo.replace("49831", "1"), 10)})
    assert _failed(err, tmp_path / "log").rank == 1


@pytest.mark.timeout(180)
def test_failure_on_one_rank_stops_the_others() -> None:
    import jobs

    from fullshard.jobs.launch import WorkerFailed, launch

    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 1.*boom on rank 1"):
        launch(jobs.fail_on_rank1, ("boom on rank 1",), nproc=2)
    assert time.monotonic() - start < 150  # far below the 600 s process-group timeout


@pytest.mark.timeout(120)
def test_launched_workers_take_each_launchs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked from one forkserver still see the launcher's environment of their own
    launch: a variable set, changed, then removed between launches, and OMP_NUM_THREADS
    (torch's thread count) following the number of ranks."""
    import jobs

    from fullshard.jobs.launch import launch, worker_environment

    name = "FULLSHARD_TEST_LAUNCH_ENV"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(name, "first")
    threads = int(worker_environment(2)["OMP_NUM_THREADS"])
    assert launch(jobs.environment_probe, (name,), nproc=2) == {0: ("first", "0", threads), 1: ("first", "1", threads)}
    monkeypatch.setenv(name, "second")
    threads = int(worker_environment(1)["OMP_NUM_THREADS"])
    assert launch(jobs.environment_probe, (name,), nproc=1) == {0: ("second", "0", threads)}
    monkeypatch.delenv(name)
    assert launch(jobs.environment_probe, (name,), nproc=1)[0][0] is None


@pytest.mark.timeout(120)
def test_launches_with_an_environment_fork_only_where_the_server_started_with_it() -> None:
    """Benchmark launches (``env=BENCH_ENV``, a variable torch reads when it starts) fork from
    the forkserver when it started with the same value (the suite sets it first, as ``fullshard
    bench`` does); a launch asking for a value the server lacks gets a fresh interpreter."""
    import jobs

    from fullshard.jobs.launch import BENCH_ENV, launch

    assert "forkserver" in launch(jobs.parent_command, (), nproc=1, env=BENCH_ENV)[0]
    spawned = launch(jobs.parent_command, (), nproc=1, env={"FULLSHARD_TEST_READ_AT_START": "1"})[0]
    assert "forkserver" not in spawned and "spawn_main" not in spawned, spawned  # the launcher itself


@pytest.mark.timeout(120)
def test_launch_runs_every_rank() -> None:
    import jobs

    from fullshard.jobs.launch import launch

    assert launch(jobs.world_sum, (), nproc=3) == {0: 3.0, 1: 3.0, 2: 3.0}
    with pytest.raises(ValueError, match="--nproc must be at least 1"):
        launch(jobs.world_sum, (), nproc=0)


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def test_idx_files_in_torchvision_layout(tmp_path: Path) -> None:
    from fullshard.jobs.data import mnist as mnist_data

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    imgs, labels = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 10, 20)
    _write_idx(raw / "train-images-idx3-ubyte", imgs, gz=True)
    _write_idx(raw / "train-labels-idx1-ubyte", labels, gz=True)
    _write_idx(raw / "t10k-images-idx3-ubyte", imgs[:5], gz=False)
    _write_idx(raw / "t10k-labels-idx1-ubyte", labels[:5], gz=False)
    train, test = mnist_data.load(tmp_path)
    assert len(train) == 20 and len(test) == 5
    x, y = train[3]
    assert x.shape == (1, 28, 28) and int(y) == int(labels[3])
    want = (imgs[3] / 255.0 - mnist_data.MEAN) / mnist_data.STD
    assert np.allclose(x[0].numpy(), want, atol=1e-5)
    (raw / "t10k-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 9) + b"\x01")
    with pytest.raises(ValueError, match="truncated"):
        mnist_data.load(tmp_path)


def test_cli_bench_rejects_unknown_workload(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main(capsys, "bench", "nope")
    assert code == 2 and "invalid choice" in err


@pytest.mark.timeout(300)
def test_bench_compare_runs_every_implementation_and_writes_its_section(tmp_path: Path) -> None:
    md, png = tmp_path / "BENCH.md", tmp_path / "chart.png"
    md.write_text("# mine\n\nhand-written text\n")
    args = (
        "bench",
        "compare",
        "--compare",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--write",
        str(md),
        "--chart",
        str(png),
    )
    r = _cli(*args, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "implementation" not in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "fullshard",
        "fullshard fully_shard",
        "torch FSDP2",
        "DDP",
        "no communication",
    ], r.stdout
    assert all(float(row.split("|")[3]) > 0 for row in rows), r.stdout  # CPU seconds per step, measured
    text = md.read_text()
    assert (
        text.startswith("# mine\n\nhand-written text\n")
        and "| fullshard |" in text
        and "bench compare --compare tiny" in text
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_markdown_section_is_replaced_not_appended(tmp_path: Path) -> None:
    from fullshard.jobs.bench.report import write_markdown

    md = tmp_path / "B.md"
    md.write_text("# head\n")
    write_markdown(str(md), "first table")
    md.write_text(md.read_text() + "\n## after\n")
    write_markdown(str(md), "second table")
    text = md.read_text()
    assert "first table" not in text and text.count("second table") == 1
    assert text.startswith("# head\n") and text.rstrip().endswith("\n\n## after")  # the blank line kept


@pytest.mark.timeout(300)
def test_bench_gpu_code_path_runs_the_same_model_everywhere(tmp_path: Path) -> None:
    """``bench gpu`` on the CPU (--allow-cpu): every implementation trains the same model on the
    same batch (equal first-step losses, up to bf16 rounding), and its section goes beside the
    compare section, not over it."""
    import torch

    md = tmp_path / "B.md"
    from fullshard.jobs.bench.report import write_markdown

    write_markdown(str(md), "compare table")
    if not torch.cuda.is_available():  # refused before any worker starts: in this process
        from fullshard.cli import main

        with pytest.raises(SystemExit, match="--allow-cpu"):
            main(["bench", "gpu"])
    r = _cli(
        "bench",
        "gpu",
        "--allow-cpu",
        "--preset",
        "tiny",
        "--offload-presets",
        "tiny",
        "--batch",
        "2",
        "--seq",
        "32",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--offload-steps",
        "1",
        "--offload-batch",
        "2",
        "--write",
        str(md),
        timeout=280,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")
        for line in r.stdout.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    impls = ["fullshard", "torch FSDP2", "unwrapped, autocast bf16", "unwrapped, bf16 parameters"]
    losses = [float(rows[i][-2]) for i in impls]
    assert max(losses) - min(losses) < 0.02 and 4.0 < losses[0] < 7.0, losses  # about ln(256) = 5.55 at init
    assert "tiny" in rows and "did not train" not in rows["tiny"][3], r.stdout
    text = md.read_text()
    assert "compare table" in text and "| fullshard |" in text and "bench gpu --allow-cpu" in text


def _first_forward_error(rank: int, change: object) -> str:
    """The error of the first forward of an FSDP model of three Linear units that ``change``
    (rank, model) -> kwargs alters on some ranks before wrapping."""
    from fullshard import FSDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    kwargs = change(rank, net)  # type: ignore[operator]
    try:
        FSDP(net, auto_wrap_policy={nn.Linear}, **kwargs)(torch.ones(2, 4)).sum().backward()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _freeze_layer(rank: int, net: nn.Module) -> dict:
    if rank == 1:
        net[0].requires_grad_(False)
    return {}


def _freeze_bias(rank: int, net: nn.Module) -> dict:
    if rank == 0:
        net[2].bias.requires_grad_(False)
    return {}


def _reshape_weight(rank: int, net: nn.Module) -> dict:
    if rank == 1:  # the same bytes, another shape
        net[0].weight = nn.Parameter(torch.zeros(2, 8))
    return {}


def rank_dependent_body(rank: int, world: int) -> list[str]:
    return [_first_forward_error(rank, change) for change in (_freeze_layer, _freeze_bias, _reshape_weight)]


@pytest.mark.timeout(120)
def test_rank_dependent_setups_are_named_at_the_first_forward_on_every_rank() -> None:
    results = run_ranks(rank_dependent_body, 2, timeout=100)
    assert results[0] == results[1]  # the same sentence on every rank
    frozen, bias, shape = results[0]
    assert frozen == (
        "RuntimeError: FSDP unit '0' has different trainable parameters across ranks: parameter '0.bias' has "
        "requires_grad=False on rank(s) [1] and True on rank(s) [0] (rank 0: all trainable; rank 1: frozen: "
        "0.weight, 0.bias): every rank must freeze the same parameters (requires_grad_(False)) before wrapping "
        "(rank-dependent code?)"
    ), frozen
    assert "parameter '2.bias' has requires_grad=False on rank(s) [0] and True on rank(s) [1]" in bias, bias
    assert shape == (
        "RuntimeError: FSDP unit '0' holds parameters of different shapes or dtypes across ranks, at parameter #0 "
        "(rank 0: 0.weight: (4, 4) torch.float32; rank 1: 0.weight: (2, 8) torch.float32): every rank must build "
        "the same model, with the same shapes and dtypes, before wrapping (rank-dependent model code?)"
    ), shape


def _fsdp1(**kwargs: object) -> object:
    from fullshard import FSDP

    return FSDP(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), **kwargs)


def _child_after_parent() -> None:
    from fullshard import fully_shard

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(net)
    fully_shard(net[0])


def arguments_body(rank: int, world: int) -> list[str]:
    """Constructor arguments of the wrong kind: each a ValueError / TypeError naming the argument
    and the fix, on every rank, before any collective."""
    from fullshard import CPUOffload, fully_shard

    cases = [
        (lambda: _fsdp1(process_group="world"), TypeError, "process_group must be a torch.distributed ProcessGroup"),
        (lambda: _fsdp1(ignored_modules=nn.Linear(2, 2)), TypeError, "pass ignored_modules=[module]"),
        (lambda: fully_shard(3), TypeError, "fully_shard: module must be an nn.Module"),
        (lambda: _fsdp1(device_id=torch.device("meta")), ValueError, "device_id=meta cannot hold the shards"),
        (lambda: CPUOffload(offload_params="yes"), TypeError, "CPUOffload(offload_params=...) must be True or False"),
        (lambda: CPUOffload(offload_params=2), TypeError, "CPUOffload(offload_params=...) must be True or False"),
        (_child_after_parent, ValueError, "apply fully_shard bottom-up, to submodules first"),
    ]
    if not torch.cuda.is_available():
        cases += [
            (lambda: _fsdp1(device_id=0), ValueError, "device_id=0 is a CUDA device, but this torch has no CUDA"),
            (lambda: _fsdp1(device_id=torch.device("cuda", 0)), ValueError, "on CPU pass device_id=None"),
        ]
    return [_raises(fn, exc, text) for fn, exc, text in cases]


def different_models_body(rank: int, world: int) -> str:
    """sync_module_states over ranks whose models differ: named on every rank before any broadcast."""
    from fullshard import FSDP

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4 + rank))
    return _raises(lambda: FSDP(model, sync_module_states=True), ValueError, "the ranks' modules differ at module #")


@pytest.mark.timeout(120)
def test_sync_module_states_over_different_models_is_named_on_every_rank() -> None:
    assert run_ranks(different_models_body, 2, timeout=100) == ["ValueError"] * 2


def outside_body(rank: int, world: int) -> list[str]:
    """A process group or mesh of rank 0 only: rank 1 (outside it) is told so; rank 0 wraps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from fullshard import fully_shard

    group, mesh = dist.new_group([0]), DeviceMesh("cpu", [0])
    if rank == 0:
        _fsdp1(process_group=group)
        fully_shard(nn.Linear(2, 2), mesh=mesh)
        return []
    return [
        _raises(lambda: _fsdp1(process_group=group), ValueError, "this rank (1) is not in process_group"),
        _raises(
            lambda: fully_shard(nn.Linear(2, 2), mesh=mesh), ValueError, "this rank (1) is not in the mesh (ranks [0])"
        ),
    ]


@pytest.mark.timeout(120)
def test_constructor_arguments_of_the_wrong_kind_are_named() -> None:
    results = run_ranks(arguments_body, 2, timeout=100)
    assert results[0] == results[1] and len(results[0]) == (7 if torch.cuda.is_available() else 9), results
    assert run_ranks(outside_body, 2, timeout=100) == [[], ["ValueError", "ValueError"]]


def _failed_collective_names_rank(rank: int, world: int) -> str:
    """A collective that fails in a process started without a launcher (RANK unset, as under
    the tutorial's mp.spawn): the message names this rank, not -1."""
    import os

    from fullshard.comm import handle
    from fullshard.comm.flight_recorder import RECORDER
    from fullshard.comm.peers import CollectiveFailed

    assert "RANK" not in os.environ
    from fullshard.comm import flight_recorder

    with flight_recorder.at("layers.0", "forward"):
        RECORDER.issue("all_gather", torch.float32, 16, 64, "[0,1]")
    with pytest.raises(CollectiveFailed) as failed:
        handle._explain(RuntimeError("Connection reset by peer"))
    return str(failed.value)


@pytest.mark.timeout(60)
def test_a_failed_collective_names_the_rank_without_a_launcher() -> None:
    for rank, text in enumerate(run_ranks(_failed_collective_names_rank, 2, timeout=40)):
        assert text.startswith(f"rank {rank}: all_gather"), text


def _deepcopy_body(rank: int, world: int) -> list[str]:
    """copy.deepcopy of a sharded model, each front end: the error names what to do instead."""
    import copy

    from fullshard import FullyShardedDataParallel, fully_shard

    texts = []
    for wrap in (lambda m: FullyShardedDataParallel(m), lambda m: fully_shard(m)):
        model = wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
        try:
            copy.deepcopy(model)
        except RuntimeError as err:
            texts.append(str(err))
    return texts


@pytest.mark.timeout(100)
def test_deepcopy_of_a_sharded_model_is_refused_by_name_on_both_front_ends() -> None:
    # torch's FSDP1 raises "cannot pickle 'module' object" here, the wrapper raised pickle's
    # TypeError about a ProcessGroup; an EMA model is a deep copy taken before wrapping.
    for texts in run_ranks(_deepcopy_body, 2, timeout=80):
        assert len(texts) == 2, texts
        assert "FullyShardedDataParallel" in texts[0] and "before wrapping" in texts[0], texts
        assert "fully_shard" in texts[1] and "before sharding" in texts[1], texts


def _clip_without_gradients_body(rank: int, world: int) -> list[str]:
    """The wrapper's clip_grad_norm_ before any backward: no rank has gradients."""
    import warnings

    from fullshard import FullyShardedDataParallel

    model = FullyShardedDataParallel(torch.nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = model.clip_grad_norm_(1.0)
    assert norm.dtype == torch.float32 and norm.item() == 0.0
    return [str(w.message) for w in caught if "clip_grad_norm_" in str(w.message)]


@pytest.mark.timeout(60)
def test_clip_grad_norm_on_a_rank_without_gradients_warns_as_torch() -> None:
    for rank, texts in enumerate(run_ranks(_clip_without_gradients_body, 2, timeout=50)):
        assert len(texts) == 1 and f"rank {rank} with no gradients" in texts[0], texts
