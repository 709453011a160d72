"""torchtitan 0.3.0's llama3 trainer (default debugmodel config) trains on fullshard as on torch's FSDP2.

Runs ``examples/torchtitan_compare.py``'s eager variant: the same 4 steps at 2 gloo ranks, once
with torch's ``fully_shard`` and once with fullshard's bound in torchtitan's place, and checks
that the two logged loss curves agree within the script's tolerance. The quick tests check the
script's driver (a failed run does not stop the other engine's) and its shim 10; one more
(about a minute) runs torch's trainer for one step on a torch 2.13 made to act as 2.11, without
and with shim 10.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan==0.3.0)")
pytest.importorskip("tokenizers")

_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "torchtitan_compare.py"


def _script():
    spec = importlib.util.spec_from_file_location("torchtitan_compare", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_torchtitan_debugmodel_losses_match_torch_fsdp2(tmp_path: Path) -> None:
    tc = _script()
    args = tc.parse(["--variants", "eager", "--nproc", "2", "--steps", "4"])  # 4 steps: loss 8.1 -> 7.1
    tok_dir, data_dir = tc.make_assets(tmp_path)
    args.tokenizer, args.corpus = str(tok_dir), str(data_dir)
    curves = {engine: tc.launch(engine, "eager", args, tmp_path) for engine in tc.ENGINES}
    torch_curve, fullshard_curve = curves["torch"], curves["fullshard"]
    assert [row[0] for row in torch_curve] == list(range(1, args.steps + 1))
    assert torch_curve[-1][1] < torch_curve[0][1] - 0.5, "torch's run did not train"
    diff = tc.max_abs_diff(torch_curve, fullshard_curve)
    assert diff <= tc.TOLERANCE, tc.report("eager", curves)


_FAILED_TAIL = """\
[default0]:[rank0]:   File "torch/autograd/graph.py", line 841, in _engine_run_backward
[default0]:[rank0]: RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet.
[default0]:[rank0]: If you're using torch.compile/export/fx, it is likely that we are erroneously tracing
E1126 12:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1) local_rank: 0
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_run_does_not_stop_the_other(tmp_path: Path, monkeypatch, capsys) -> None:
    tc = _script()
    curve = [[1, 8.1, 2.0], [2, 7.9, 1.5]]

    def launch(engine, variant, a, root):
        if engine == "torch":
            raise RuntimeError(f"torch {variant} run failed (exit 1):\n{_FAILED_TAIL}")
        return curve

    monkeypatch.setattr(tc, "launch", launch)
    assert tc.compare(tc.parse(["--variants", "eager"])) == 2
    out = capsys.readouterr().out
    error = "RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet."
    assert f"[eager] torch: FAILED: {error}" in out
    assert "fullshard loss" in out and "7.9000000000" in out


def test_shim_10_one_unit_per_module_unless_weights_are_tied() -> None:
    tc = _script()
    calls: list[tuple[object, dict]] = []
    shard = tc._one_unit_per_module(lambda module, **kw: calls.append((module, kw)) or module)
    norm, head = torch.nn.LayerNorm(4), torch.nn.Linear(4, 8)
    assert shard([norm, head], reshard_after_forward=False) == [norm, head]
    assert calls == [(norm, {"reshard_after_forward": False}), (head, {"reshard_after_forward": False})]
    calls.clear()
    embed = torch.nn.Embedding(8, 4)
    embed.weight = head.weight  # tied: cannot be split
    shard([embed, norm, head])
    assert calls == [([embed, norm, head], {})]
    calls.clear()
    shard(head)
    assert calls == [(head, {})]


def test_shim_10_is_off_on_a_torch_with_partial_group_forwards() -> None:
    tc = _script()
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13):
        assert tc._has_partial_group_forward()


# torch 2.13 made to act as 2.11 where a module group ran only in part: the root completes no
# group. With AS_TORCH_211=hidden, shim 10's probe sees no completion either (so it splits).
# The patch is made when a process imports torch's FSDP2 state module, not at start-up: every
# Python process of the run reads this file, and inductor's CPU-feature probes, several
# subprocesses per worker, took 30 s more each launch when it imported torch there.
_AS_TORCH_211 = """\
import os
import sys

_TARGET = "torch.distributed.fsdp._fully_shard._fsdp_state"
mode = os.environ.get("AS_TORCH_211")


def _patch(module):
    class _Identity:
        def __get__(self, obj, cls):
            if obj is None and mode == "hidden":
                raise AttributeError("_force_complete_incomplete_states")
            return lambda output: output

    module.FSDPState._force_complete_incomplete_states = _Identity()


class _PatchOnImport:
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    _patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


if mode:
    sys.meta_path.insert(0, _PatchOnImport())
"""


@pytest.mark.timeout(300)
def test_shim_10_lets_torch_train_where_a_half_run_group_stays_incomplete(tmp_path: Path, monkeypatch) -> None:
    """torch's run, 1 step at 1 rank (as on the H100), on a torch acting as 2.11: fails as there
    without shim 10, trains with it."""
    tc = _script()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_AS_TORCH_211)
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    args = tc.parse(["--variants", "eager", "--steps", "1", "--nproc", "1"])
    tok_dir, data_dir = tc.make_assets(tmp_path)
    args.tokenizer, args.corpus = str(tok_dir), str(data_dir)
    off, on = tmp_path / "off", tmp_path / "on"
    off.mkdir()
    on.mkdir()
    monkeypatch.setenv("AS_TORCH_211", "visible")  # shim 10 off
    with pytest.raises(RuntimeError) as failed:
        tc.launch("torch", "eager", args, off)
    assert "data is not allocated yet" in tc.error_line(str(failed.value))
    monkeypatch.setenv("AS_TORCH_211", "hidden")  # shim 10 on
    assert [row[0] for row in tc.launch("torch", "eager", args, on)] == [1]
