"""Plans that fit: calibration leaves nothing behind, the margin is the estimator's measured
error, and the plan sweep draws its model/budget pairs from the estimator sweep's generator."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import run_ranks
from torch import nn

from fullshard.jobs.planning.families import Shape

ROOT = Path(__file__).resolve().parents[1]
SMALL_GPT = Shape(layers=2, heads=2, kv_heads=2, head_dim=12, ffn=60, vocab=101)


def test_a_transient_block_drops_only_the_buffers_it_added() -> None:
    from fullshard.comm.buffers import BufferPool

    pool = BufferPool()
    kept = torch.empty(8)
    pool.release(kept)
    with pool.transient():
        again = pool.acquire(8, torch.float32, torch.device("cpu"))
        assert again is kept
        pool.release(again)  # held before the block: stays
        pool.release(torch.empty(16))  # new: dropped at the end
        pool.release(torch.empty(8))
        assert pool.nbytes == 4 * (8 + 16 + 8)
    assert pool.buffers() == [kept]
    with pytest.raises(RuntimeError, match="inside"), pool.transient():
        pool.release(torch.empty(4))
        raise RuntimeError("inside")
    assert pool.buffers() == [kept]


def calibration_leftovers_body(rank: int, world: int) -> dict[str, Any]:
    """Live tensor bytes and pooled bytes before and after :func:`calibrate` on this rank, and
    what timing the collectives alone (no release) leaves in the pool: the control."""
    from fullshard.comm import buffers
    from fullshard.frontend.meshes import default_mesh
    from fullshard.jobs.planning import families
    from fullshard.plan.calibrate import calibrate_comm
    from fullshard.plan.steptime import calibrate
    from fullshard.plan.tracker import LiveTensorBytes

    make, example, loss, is_unit = families.parts("gpt", SMALL_GPT, 2, 32)
    buffers.POOL.clear()
    # fully_shard's default mesh is made once per process and kept (a training job after the
    # calibration makes it anyway); calibration's stand-ins would make it first
    default_mesh("cpu")
    with LiveTensorBytes() as live:
        out = {"live_before": live.measure(), "pool_before": buffers.POOL.nbytes}
        cal = calibrate(make, example, loss, is_unit, torch.device("cpu"), optimizer="adamw")
        out |= {"live_at_return": live.measure(), "pool_after": buffers.POOL.nbytes, "leftover": cal.leftover_bytes}
        out["overhead"] = [cal.overhead.no_shard, cal.overhead.full_shard, cal.overhead.shard_grad_op]
        # gloo's worker thread lets go of the last collective's tensor (the calibration's times,
        # a few hundred bytes) just after the caller's wait returns: give it a moment
        deadline = time.monotonic() + 5.0
        while live.measure() > out["live_before"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out["live_after"] = live.measure()
        calibrate_comm(sizes=(1 << 14, 1 << 18), repeats=1)
        out |= {"live_control": live.measure(), "pool_control": buffers.POOL.nbytes}
    buffers.POOL.clear()
    return out


@pytest.mark.timeout(200)
def test_calibration_leaves_no_tensor_and_no_pooled_buffer_behind() -> None:
    """The start-up calibration's reduce-scatter buffers once stayed in the pool for the whole
    run (4 + 1 MiB at 2 ranks) and pushed a 26 MiB plan over its budget."""
    for r in run_ranks(calibration_leftovers_body, 2, timeout=180):
        assert r["live_after"] == r["live_before"] and r["pool_after"] == r["pool_before"] == 0, r
        assert r["leftover"] == 0
        assert all(0 < s < 1 for s in r["overhead"]), r  # the stand-ins were built and timed: the engine costs time
        # the control: timing the collectives alone keeps no receive buffer either, since a
        # 2-rank reduce-scatter on gloo now receives straight into its output (before that
        # change this measured 4 x (2^12 + 2^16) / 2 bytes pooled)
        assert r["pool_control"] == 0, r


def test_on_cuda_calibration_counts_what_the_allocator_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the leftover every prediction carries is all the caching allocator hands the
    process after calibration (cuBLAS's 64 MiB of workspaces on the H100, which the CUDA sweep
    leaves out of its peaks); on CPU only what calibration left in the buffer pool. (The
    calibration itself is stood in for: this machine has no GPU.)"""
    from fullshard.plan import steptime

    kept = 67_125_248  # the H100's cuBLAS workspaces (docs/estimate_cuda_sweep.md)
    stand_in = steptime.Calibration(comm=None, blocks={}, optimizer_seconds_per_param=0.0, optimizer="adamw")  # type: ignore[arg-type]
    monkeypatch.setattr(steptime, "_calibrate", lambda *a: stand_in)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: kept)
    none = lambda *a: None  # noqa: E731
    assert steptime.calibrate(none, none, none, none, torch.device("cuda", 0)).leftover_bytes == kept
    assert steptime.calibrate(none, none, none, none, torch.device("cpu")).leftover_bytes == 0


def _error_column(source: str, seed: int, commit: str) -> tuple[list[float], list[str]]:
    """The error column of ``source``'s first verbatim table, which must be the complete
    multi-process sweep of ``seed`` (real gloo workers) at ``commit``, in the printed order, with
    each measured row's sharding strategy (NO, SGO, FULL)."""
    text = (ROOT / source).read_text()
    intro, table = text.split("\n---\n")[:2]  # the first verbatim output, before the second measurement
    header = re.match(
        rf"Seed {seed}, (\d+) configurations \(`fullshard bench estimate --sweep \1 --seed {seed}`", table.strip()
    )
    assert header is not None and "in one process" not in table and "Real runs took" in table
    drawn = int(header.group(1))
    assert commit in intro
    column, kinds, rows = [], [], 0
    for line in table.splitlines():
        if line.startswith(f"| {seed}#"):
            rows += 1
            cells = [c.strip() for c in line.split("|")]
            if re.fullmatch(r"[+-]\d+\.\d%", cells[5]):
                column.append(float(cells[5][:-1]) / 100)
                kinds.append(cells[2].split()[0])
    assert drawn >= 40 and rows == drawn and len(column) >= drawn - 2  # the whole sweep ran; a failed run or two
    return column, kinds


def test_the_margin_tables_are_the_sweep_documents() -> None:
    """:data:`SWEEP_ERRORS`, :data:`SECOND_SEED` and :data:`THIRD_SEED` hold the error columns of
    their documents' multi-process tables (not the one-process measurement below them), every
    measured row; the margin follows from the lowest of their lowest errors as the module says."""
    from fullshard.plan import margin as m

    worst = worst_kept = 0.0
    assert m.GLOO_SWEEPS == (m.SWEEP_ERRORS, m.SECOND_SEED, m.THIRD_SEED)
    for d in m.GLOO_SWEEPS:
        column, kinds = _error_column(d.source, d.seed, d.commit)
        assert list(d.errors) == pytest.approx(column, abs=1e-12) and d.how == "real gloo workers"
        assert list(d.kinds) == kinds and set(kinds) == {"NO", "SGO", "FULL"}
        assert f"was {100 * min(column):+.1f}%" in d.describe()
        worst = min(worst, min(column) - m.PRINTED_STEP / 2)
        kept = [e for e, k in zip(column, kinds) if k in ("NO", "SGO")]
        worst_kept = min(worst_kept, min(kept) - m.PRINTED_STEP / 2)
        assert len(d.only(m.KEPT_KINDS).errors) == len(kept) > 10
    assert (m.SWEEP_ERRORS.seed, m.SECOND_SEED.seed, m.THIRD_SEED.seed) == (4242, 777, 5151)
    assert len(m.THIRD_SEED.errors) == 79
    assert m.MARGIN == pytest.approx(1 / (1 + worst) - 1) and m.MARGIN > 0 and m.MARGIN == m.MARGIN_FROM.margin
    # NO_SHARD and SHARD_GRAD_OP keep their own rows' worst (only the rounding, today; since the
    # rerun at 8fb6917 every strategy's worst is the rounding, so the two margins are equal)
    assert m.MARGIN_KEPT == pytest.approx(1 / (1 + worst_kept) - 1) and 0 < m.MARGIN_KEPT <= m.MARGIN
    assert m.margin_for(True) == m.MARGIN and m.margin_for(False) == m.MARGIN_KEPT


def _cuda_runs(seed: int, commit: str) -> list[tuple[float, float]]:
    """The (predicted, allocator peak) MiB of every run of ``docs/estimate_cuda_sweep.md``'s table
    "Measured at ``commit``, seed ``seed``" that has both, in the printed order."""
    tables = (ROOT / "docs/estimate_cuda_sweep.md").read_text().split("\n---\n")
    (table,) = [t for t in tables if f"## Measured at {commit}, seed {seed}:" in t]
    runs = []
    for line in table.splitlines():
        if line.startswith(f"| {seed}#"):
            cells = [c.strip() for c in line.replace("\\|", "/").split("|")]
            if cells[3] != "-" and cells[6] != "-":
                runs.append((float(cells[3]), float(cells[6])))
    return runs


def test_the_cuda_margin_follows_the_cuda_sweep_document() -> None:
    """:data:`CUDA_SWEEPS` hold the predicted and allocator-peak columns of the CUDA sweep's two
    measured tables; with :data:`CUDA_SLACK` bytes, :data:`CUDA_MARGIN` is the least share that
    holds each run (the MiB at their rounding's worst); a candidate on NCCL keeps both free, on
    gloo nothing changes, and a plan on NCCL says where its margin comes from."""
    from types import SimpleNamespace

    from fullshard.plan import margin as m
    from fullshard.plan import planner
    from fullshard.plan.candidate import Candidate

    worst = 0.0
    for d, count in zip(m.CUDA_SWEEPS, (65, 52)):
        runs = _cuda_runs(d.seed, d.commit)
        assert list(d.runs) == runs and len(runs) == count
        for p, a in runs:  # what each run needs, computed here from the MiB as recorded
            need = ((a + 0.005) * 2**20 - m.CUDA_SLACK) / ((p - 0.005) * 2**20) - 1
            assert d.ratio(m.CUDA_SLACK) >= need - 1e-12
            worst = max(worst, need)
    assert m.CUDA_MARGIN == pytest.approx(worst) and m.CUDA_MARGIN > m.MARGIN
    # the slack is what holds the small models: Phi 777#25 measured 33% above its prediction
    assert max(d.ratio(0) for d in m.CUDA_SWEEPS) > 0.3
    for regathers in (True, False):
        assert m.margin_for(regathers, "nccl") == max(m.margin_for(regathers), m.CUDA_MARGIN)
    assert m.margin_for(True, "gloo") == m.MARGIN and m.slack_for("gloo") == 0 and m.slack_for("nccl") == m.CUDA_SLACK
    full = Candidate(False, (), (), False, ("b0",))
    peak = 100 * 2**20
    cand = SimpleNamespace(candidate=full, peak=SimpleNamespace(total=peak), step=SimpleNamespace(seconds=1.0))
    on_cuda_needs = planner.needs(peak, m.CUDA_MARGIN) + m.CUDA_SLACK
    budget = on_cuda_needs - 1  # within the gloo margin, one byte short of CUDA's share and slack
    assert planner.choose([cand], budget).best is cand
    on_cuda = planner.choose([cand], budget, backend="nccl")
    assert on_cuda.best is None and on_cuda.margin_of(cand) == m.CUDA_MARGIN and on_cuda.needs(cand) == on_cuda_needs
    assert "caching allocator's peak" in on_cuda.describe()[-1] and "unsplit blocks" in on_cuda.describe()[0]
    assert planner.choose([cand], on_cuda_needs, backend="nccl").best is cand
    # a margin the caller gives replaces both
    given = planner.choose([cand], budget, margin=0.0, backend="nccl")
    assert given.best is cand and given.needs(cand) == peak


def _fake_scored(peaks_and_steps: list[tuple[int, float]]) -> list:
    """Scored FULL_SHARD candidates (blocks ``c0``, ``c1``...: one each, so the planner's margin
    is :data:`~fullshard.plan.margin.MARGIN`) with these peaks (bytes) and steps (seconds)."""
    from types import SimpleNamespace

    from fullshard.plan.candidate import Candidate

    return [
        SimpleNamespace(
            candidate=Candidate(False, (), (), False, (f"c{i}",)),
            peak=SimpleNamespace(total=p),
            step=SimpleNamespace(seconds=s),
        )
        for i, (p, s) in enumerate(peaks_and_steps)
    ]


def test_plan_sweep_pairs_come_from_the_estimator_sweeps_draw_with_tight_budgets() -> None:
    from fullshard.jobs.planning import plan_sweep
    from fullshard.jobs.planning.sweep import draw

    seven = plan_sweep.pairs(11, 7)
    assert seven == plan_sweep.pairs(11, 7) and seven[:5] == plan_sweep.pairs(11, 5)
    assert [c for c, _, _ in seven[::2]] == draw(11, 4) and [c for c, _, _ in seven[1::2]] == draw(11, 3)
    assert [k for _, k, _ in seven] == ["tight", "drawn"] * 3 + ["tight"]
    assert all(0 <= f < plan_sweep.TIGHT_ABOVE for _, k, f in seven if k == "tight")
    assert all(0 <= f < 1 for _, _, f in seven) and seven != plan_sweep.pairs(12, 7)
    with pytest.raises(ValueError, match="n=0"):
        plan_sweep.pairs(11, 0)


def test_plan_sweep_budgets_and_plans_fit_under_the_margin() -> None:
    from fullshard.jobs.planning import plan_sweep
    from fullshard.plan.planner import needs

    # the fastest candidate is the largest; the smallest the slowest
    scored = _fake_scored([(100 * 2**20, 1.0), (60 * 2**20, 2.0), (30 * 2**20, 3.0)])
    tight = plan_sweep.budget_of(scored, "tight", 0.05, leftover=1000)
    assert tight == pytest.approx((needs(30 * 2**20) + 1000) * 1.05, abs=1)
    assert plan_sweep.budget_of(scored, "drawn", 0.5) == 65 * 2**20
    rows = plan_sweep._plans(scored, [("tight", 0.0), ("drawn", 1.0), ("drawn", 0.0)], 0)
    assert rows[0]["plan"].all_units == ("c2",) and rows[0]["budget"] == needs(30 * 2**20)
    assert rows[1]["plan"].all_units == ("c1",)  # 100 MiB: the largest needs its margin more
    assert rows[2]["plan"] is None and rows[2]["smallest_needs"] == needs(30 * 2**20)
    for r in rows[:2]:
        assert needs(r["predicted"][0]) <= r["budget"]
    with pytest.raises(ValueError, match="kind='loose'"):
        plan_sweep.budget_of(scored, "loose", 0.5)


def test_the_margin_follows_the_candidates_strategy_and_near_ties_go_to_less_machinery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from fullshard.plan import margin, planner
    from fullshard.plan.candidate import Candidate
    from fullshard.plan.margin import MARGIN_KEPT

    # Since the sweeps' rerun at 8fb6917 both margins are the rounding; the rule by strategy is
    # checked with FULL_SHARD's margin as the sweeps at 962e9e9 gave it (1.57%).
    full_margin = 0.0157
    monkeypatch.setattr(margin, "MARGIN", full_margin)

    blocks = ("b0", "b1")

    def scored(c: Candidate, peak: int, step: float) -> SimpleNamespace:
        return SimpleNamespace(candidate=c, peak=SimpleNamespace(total=peak), step=SimpleNamespace(seconds=step))

    no_shard = Candidate(True, (), (), False, blocks)
    sgo = Candidate(False, blocks, (), False, blocks)  # every unit kept gathered: SHARD_GRAD_OP
    full = Candidate(False, (), (), False, blocks)
    full_ac = Candidate(False, (), blocks, False, blocks)
    mib = 2**20
    # NO_SHARD fastest, FULL_SHARD smaller; a budget 1% over NO_SHARD's peak: within its margin
    # (0.05%), not within FULL_SHARD's (1.57%), so NO_SHARD is planned
    cands = [scored(no_shard, 100 * mib, 1.0), scored(full, 99 * mib, 1.2)]
    p = planner.choose(cands, int(101 * mib))
    assert p.best is cands[0] and p.margin_of(cands[0]) == MARGIN_KEPT and p.margin_of(cands[1]) == full_margin
    assert planner.choose(cands, int(101 * mib), margin=full_margin).best is cands[1]  # one margin for all
    assert "(NO_SHARD, SHARD_GRAD_OP)" in p.margin_line() and "NO/SGO configurations" in p.margin_line()
    # predicted within 5%: a tie, to the least machinery (no unit gathered again in backward,
    # then no recomputation), not to the fastest prediction
    ties = [scored(full_ac, 10 * mib, 1.00), scored(full, 10 * mib, 1.02), scored(sgo, 10 * mib, 1.04)]
    assert planner.choose(ties, 100 * mib).best is ties[2]
    assert planner.choose(ties[:2], 100 * mib).best is ties[1]
    # beyond 5% the prediction decides
    assert planner.choose([scored(full_ac, mib, 1.0), scored(sgo, mib, 1.06)], 100 * mib).best.candidate is full_ac


def plan_sweep_model_body(rank: int, world: int) -> dict:
    """One drawn-like model through the plan sweep's measurement, one round."""
    from fullshard.jobs.planning import plan_sweep
    from fullshard.jobs.planning.sweep import Config

    c = Config(0, 0, "gpt", SMALL_GPT, 2, 32, "full_shard", "none", "fp32", 2, "fsdp2")
    return plan_sweep.measure_model(c, [("tight", 0.0), ("drawn", 0.9)], 1, torch.device("cpu"))


@pytest.mark.timeout(300)
def test_plan_sweep_measures_each_plan_and_every_hand_configuration() -> None:
    a, b = run_ranks(plan_sweep_model_body, 2, timeout=280)
    assert [r["plan"] for r in a["rows"]] == [r["plan"] for r in b["rows"]]  # every rank runs rank 0's plans
    assert len(a["hands"]) == 6 and all(s > 0 and peak > 0 and cpu > 0 for s, peak, cpu in a["hands"].values())
    assert set(a["hands_predicted"]) == set(a["hands"]) and all(s > 0 for s in a["hands_predicted"].values())
    for r in a["rows"]:
        assert r["plan"] is not None, r  # a tight budget is what the smallest needs, or more
        seconds, peak, _ = r["measured"]
        assert seconds > 0 and peak <= r["budget"], r  # the plan fits its budget, measured


def test_plan_sweep_report_counts_fits_ratios_refusals_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's arithmetic on made-up measurements (no process started)."""
    from fullshard.jobs import launch
    from fullshard.jobs.planning import plan_sweep
    from fullshard.plan.candidate import Candidate

    names = ("blocks.0",)
    full, sgo = Candidate(False, (), (), False, names), Candidate(False, names, (), False, names)
    mib = 2**20
    # (wall seconds, peak, CPU seconds)
    hands = {
        "FULL_SHARD": (0.10, 10 * mib, 0.05),
        "SHARD_GRAD_OP": (0.08, 14 * mib, 0.06),
        "NO_SHARD": (0.05, 30 * mib, 0.01),
    }
    calls = []

    def fake(worker: object, args: tuple, world: int, env: object = None) -> list:
        calls.append(args[0])
        if len(calls) == 2:
            raise launch.WorkerFailed("worker rank 0 failed: boom")
        rows = [
            {
                "kind": "tight",
                "budget": 12 * mib,
                "plan": full,
                "predicted": (9 * mib, 0.1),
                "measured": (0.104, 11 * mib, 0.051),
            },
            {
                "kind": "drawn",
                "budget": 15 * mib,
                "plan": sgo,
                "predicted": (12 * mib, 0.08),
                "measured": (0.09, 16 * mib, 0.06),
            },
            {"kind": "drawn", "budget": 5 * mib, "plan": None, "smallest_needs": 11 * mib, "measured": None},
        ]
        predicted = {"FULL_SHARD": 0.099, "SHARD_GRAD_OP": 0.07, "NO_SHARD": 0.06}
        return [
            {"rows": rows[:2] if len(calls) == 1 else [rows[0], rows[2]], "hands": hands, "hands_predicted": predicted},
            None,
        ]

    monkeypatch.setattr(launch, "launch", fake)
    lines = list(plan_sweep.report(5, 6, rounds=1))
    text = "\n".join(lines)
    assert len(calls) == 3 and "failed: worker rank 0 failed: boom" in text
    assert "Plans that fit their budget measured: 2 of 3." in text  # the SGO plan peaked at 16 > 15 MiB
    # 0.104 / FULL_SHARD's 0.10 (the only hand within 12 MiB) twice; 0.09 / SHARD_GRAD_OP's 0.08 (within 15 MiB)
    assert "step / fastest fitting hand step: max 1.12, median 1.04, min 1.04; within 5% (or faster) in 2 of 3." in text
    # CPU time: 0.051 / FULL_SHARD's 0.05 twice; 0.06 / the least of FULL_SHARD's and SHARD_GRAD_OP's (0.05)
    assert (
        "CPU time / fastest fitting hand CPU time: max 1.20, median 1.02, min 1.02; within 5% (or faster) in 2 of 3."
        in text
    )
    assert "Refused (nothing fits under the margin): 1" in text and "Failed models: 1" in text
    assert "| **NO** |" in text and plan_sweep.MARGIN_FROM.describe() in text
    # steps predicted / measured: the plan's and the fastest fitting hand's
    assert "| yes | 100.0 / 104.0 | FULL_SHARD 99.0 / 100.0 | 1.04 | 1.02 |" in text


def test_every_hand_configuration_the_sweeps_compare_against_is_a_candidate() -> None:
    """The planner can choose each of the six hand configurations (FULL_SHARD, SHARD_GRAD_OP,
    NO_SHARD, with and without AC on every block), so a budget one of them fits under the
    margin is never refused for want of it."""
    from fullshard.jobs.planning.plan_bench import hand_configurations
    from fullshard.plan.candidate import candidates

    for n in range(1, 6):
        names = tuple(f"layers.{i}" for i in range(n))
        hands = hand_configurations(names)
        assert len(set(hands.values())) == 6
        assert set(hands.values()) <= set(candidates(list(names))), n
        assert set(hands.values()) <= set(candidates(list(names), prefetch=False, grouping=False)), n


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class _PositionTable(nn.Module):
    """Token embedding plus a float32 position table registered as a buffer (a sinusoidal
    encoding's habit), two blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(97, 40)
        self.register_buffer("pe", torch.randn(512, 40))
        self.blocks = nn.ModuleList(_Block(40) for _ in range(2))
        self.head = nn.Linear(40, 97)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pe[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _position_table_parts() -> tuple:
    return (
        _PositionTable,
        lambda: torch.zeros(3, 24, dtype=torch.long),
        lambda m, ids: m(ids).float().sum(),
        lambda m: isinstance(m, _Block),
    )


def fp32_buffer_body(rank: int, world: int) -> dict[str, tuple[int, int, str, str]]:
    """Per fully_shard candidate (FULL_SHARD; the last block kept gathered and the first
    recomputed), bf16: predicted and measured peak (third step, this rank) and their moments."""
    from fullshard.plan.planner import Candidate, predict_peak
    from fullshard.plan.running_unit import RunningUnit
    from fullshard.plan.tracker import LiveTensorBytes

    make, example, loss_fn, is_unit = parts = _position_table_parts()
    blocks = ("blocks.0", "blocks.1")
    out = {}
    for cand in (Candidate(False, (), (), False, blocks), Candidate(False, blocks[1:], blocks[:1], False, blocks)):
        estimate = predict_peak(cand, *parts, world, param_dtype=torch.bfloat16)
        running: list[RunningUnit] = []
        with LiveTensorBytes(label=lambda: running[0].moment if running else "building") as live:
            model = make()
            running.append(RunningUnit(model, is_unit))
            model = cand.apply(model, torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            for _ in range(3):
                live.reset_peak()
                loss_fn(model, example()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[cand.describe()] = (estimate.total, live.peak, estimate.moment, str(live.peak_label))
    return out


@pytest.mark.timeout(200)
def test_a_float32_buffer_under_bf16_is_traced_as_each_front_end_keeps_it() -> None:
    """fully_shard leaves a float32 buffer in float32 (as torch's does), so bf16 activations
    added to it are float32 until the next unit casts them; the FSDP1 wrapper casts buffers to
    bf16. The trace cast every buffer: a plan of the audit's sinusoidal transformer exceeded
    its budget by 7%, and here both candidates measured 40,968 bytes above their estimates. The
    planner traces NO_SHARD (the wrapper) apart from the fully_shard candidates."""
    from fullshard.plan import planner
    from fullshard.plan.calibrate import BlockTime, CommModel, Link
    from fullshard.plan.peak import estimate_peak
    from fullshard.plan.steptime import Calibration

    first, second = run_ranks(fp32_buffer_body, 2, timeout=180)
    for name, (predicted, measured, moment, measured_moment) in first.items():  # rank 0's peak, predicted
        assert abs(predicted - measured) <= 64, (name, predicted, measured, measured_moment)
        assert moment == measured_moment, (name, moment, measured_moment)
        assert second[name][1] <= measured, (name, second[name])  # rank 1 holds the smaller shards
    parts, bf16 = _position_table_parts(), torch.bfloat16
    times = {n: BlockTime(0.01, 0.02) for n in ("<root>", "blocks.0", "blocks.1")}
    cal = Calibration(CommModel(2, "gloo", *(Link(1e-4, 1e-9) for _ in range(3))), times, 1e-9, "adamw")
    scored = planner._score_all(cal, *parts, bf16)
    for s in scored:  # the planner's shared traces give what the candidate's own trace gives
        assert s.peak.total == planner.predict_peak(s.candidate, *parts, 2, param_dtype=bf16).total, s.candidate
    # `fullshard estimate` traces each front end as the planner does
    no_shard = next(s for s in scored if s.candidate.no_shard and not s.candidate.checkpoint).peak.total
    assert estimate_peak(*parts, 2, param_dtype=bf16, sharding_strategy="no_shard").total == no_shard
    full = next(s for s in scored if s.candidate.describe() == "FULL_SHARD").peak.total
    assert estimate_peak(*parts, 2, param_dtype=bf16, front_end="fully_shard").total == full
