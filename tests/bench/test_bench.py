"""``tensorwire bench``: its statistics, its JSON schema, and smoke runs with tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.bench.runner import SCENARIOS, _compare, format_table, make_row
from tensorwire.bench.schema import SCHEMA_VERSION, Row, document, validate
from tensorwire.bench.sharded import DEFAULT, EACH, FIRST, NO_ASIDE, ONE_PASS
from tensorwire.bench.stats import bus_bandwidth, fit_latency_bandwidth, gbps, parse_size, percentile, sizes, summarize

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    samples = list(np.random.default_rng(q).exponential(size=37))
    assert percentile(samples, q) == pytest.approx(np.percentile(samples, q))


def test_percentile_refuses_nonsense():
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)


def test_summary_and_bandwidths():
    summary = summarize([4.0, 1.0, 3.0, 2.0])
    assert (summary.p50, summary.mean, summary.count) == (2.5, 2.5, 4)
    assert summary.p99 == pytest.approx(3.97)
    assert gbps(2_000_000_000, 2.0) == 1.0
    assert math.isinf(gbps(1, 0.0))
    # nccl-tests' bus bandwidth factors
    assert bus_bandwidth("all_reduce", 10.0, 4) == pytest.approx(15.0)
    assert bus_bandwidth("all_gather", 10.0, 4) == pytest.approx(7.5)
    assert bus_bandwidth("reduce_scatter", 10.0, 8) == pytest.approx(8.75)
    assert bus_bandwidth("broadcast", 10.0, 8) == 10.0
    assert bus_bandwidth("p2p", 3.0, 2) == 3.0
    assert bus_bandwidth("one_to_n", 2.0, 4) == 6.0  # 3 receivers each got the value
    with pytest.raises(ValueError, match="unknown operation"):
        bus_bandwidth("scatter", 1.0, 2)


def test_fit_separates_fixed_cost_from_bandwidth():
    sizes_ = [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    seconds = [50e-6 + n / 4e9 for n in sizes_]  # 50 us + 4 GB/s
    latency, bandwidth = fit_latency_bandwidth(sizes_, seconds)
    assert latency == pytest.approx(50e-6)
    assert bandwidth == pytest.approx(4.0)
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_latency_bandwidth([4, 4], [1.0, 2.0])


def test_sizes_and_their_spelling():
    assert parse_size("4K") == 4096 and parse_size("64M") == 64 << 20 and parse_size("1g") == 1 << 30
    assert parse_size("1000") == 1000 and parse_size("2KB") == 2048
    for bad in ("", "x", "0", "1.5")[1:]:
        with pytest.raises(ValueError):
            parse_size(bad)
    assert sizes(4096, 1 << 20, 16) == [4096, 65536, 1 << 20]
    assert sizes(1000, 5000, 2) == [1000, 2000, 4000, 5000]
    assert sizes(64, 64, 2) == [64]
    with pytest.raises(ValueError, match="factor"):
        sizes(1, 8, 1)


def _rows() -> list[Row]:
    def row(method: str, baseline: bool, seconds: float) -> Row:
        return make_row(
            "p2p-processes", method, {"times": [seconds] * 3, "wrong": 0}, baseline=baseline, nbytes=1 << 20
        )

    return [
        row("memcpy (one thread)", True, 1e-4),
        row("tensorwire shm", False, 2e-4),
        row("bare gloo", True, 4e-4),
        row("bare ucxx", True, 8e-4),
    ]


def test_rows_are_compared_with_the_best_alternative_and_with_memcpy():
    rows = _rows()
    _compare(rows)
    ours = rows[1]
    assert ours.vs_best_baseline == pytest.approx(2.0)  # bare gloo (memcpy is the bound, not an alternative)
    assert ours.vs_memcpy == pytest.approx(0.5)
    assert ours.gbps == pytest.approx((1 << 20) / 2e-4 / 1e9)
    assert all(r.vs_best_baseline is None for r in rows if r.baseline)
    table = format_table(rows, []).splitlines()
    assert "GB/s" in table[1] and "us" in table[1]  # the units row
    assert "2.00" in table[3]


def test_table_cuts_reasons_at_a_word_and_prints_no_infinite_rate():
    from tensorwire.bench.schema import Fit

    reason = "same node, host memory, 67108864 B: shm (fastest estimate, est 13.5 ms); next: host 68.6 ms"
    rows = [
        make_row(
            "p2p-processes",
            "tensorwire auto",
            {"times": [0.0, 0.0], "wrong": 0},
            baseline=False,
            nbytes=1 << 20,
            transport="shm",
            reason=reason,
        )
    ]
    fits = [Fit("p2p-processes", "tensorwire auto", 12.0, math.inf, [4096, 65536])]
    text = format_table(rows, fits)
    assert "inf" not in text.lower()
    cell = next(c for c in text.splitlines()[2].split("  ") if c.startswith("shm: "))
    assert cell.endswith(" …") and f"shm: {reason}".startswith(cell[:-2])
    assert f"shm: {reason}"[len(cell) - 2] == " "  # the cut falls between words
    assert "bandwidth not measurable" in text


def test_document_follows_its_schema_and_the_check_finds_breakage():
    doc = json.loads(json.dumps(document(["tensorwire", "bench"], _rows(), [])))
    assert validate(doc) == []
    assert doc["schema_version"] == SCHEMA_VERSION and doc["versions"]["torch"] and doc["machine"]["cores"]
    broken = json.loads(json.dumps(doc))
    broken["schema_version"] = 99
    del broken["rows"][0]["p50_us"]
    broken["rows"][1]["wrong"] = "none"
    broken["rows"][2]["p99_us"] = 0.0
    problems = validate(broken)
    assert any("schema_version" in p for p in problems)
    assert any("row 0 lacks" in p for p in problems)
    assert any("row 1: wrong" in p for p in problems)
    assert any("row 2: p99 below p50" in p for p in problems)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TENSORWIRE_HOST": "127.0.0.1"}
    for key in ("TENSORWIRE_NODE_ID", "TENSORWIRE_CLUSTER_TOKEN", "RAY_ADDRESS"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
        check=False,
    )


def test_bench_smoke_every_scenario_tiny_sizes_checked_plotted_with_progress(tmp_path):
    """One run of every scenario (each start of Ray and of the peers costs seconds on 2 cores):
    its JSON, its table, its plots and its progress bar."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ("-b", "4K", "-e", "64K", "-n", "2", "-w", "0", "--check", "--peers", "2", "--json", str(out))
    done = run_cli(*args, "--plot", str(png), "--progress")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    _check_plots_and_progress(done, png)
    assert validate(doc) == []
    rows = doc["rows"]
    nixl = bool(importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl_cu13"))
    assert {r["scenario"] for r in rows} == set(SCENARIOS) - (set() if nixl else {"nixl-compare"})
    sharded = {r["method"] for r in rows if r["scenario"] == "sharded-sync"}
    ours = {DEFAULT, EACH, NO_ASIDE}
    baselines = {"gather on trainer 0, push whole", "Ray object store", ONE_PASS}
    assert sharded == ours | {mode + FIRST for mode in ours} | baselines
    assert all(r["wrong"] == 0 for r in rows)  # every byte checked, none wrong
    methods = {r["method"] for r in rows}
    for baseline in (
        "memcpy (one thread)",
        "bare torch.distributed gloo",
        "bare ucxx",
        "Ray object store",
        "Ray object store, zero-copy torch",
        "Ray RDT (gloo)",
        "torch.distributed gloo broadcast",
    ):
        assert baseline in methods
    ray_transport = [r for r in rows if r["method"] == "tensorwire (ray.method tensor_transport)"]
    assert [r["nbytes"] for r in ray_transport] == [4096, 65536] and not any(r["baseline"] for r in ray_transport)
    if nixl:
        assert "Ray RDT (nixl)" in methods
        bare = [r for r in rows if r["method"] == "bare NIXL"]
        assert [r["nbytes"] for r in bare] == [4096, 65536] and all(r["baseline"] for r in bare)
        _check_nixl_compare_rows([r for r in rows if r["scenario"] == "nixl-compare"])
    assert {r["tensors"] for r in rows if r["scenario"] == "many-tensors"} == {1, 16, 256, 1024}
    ours = [r for r in rows if r["method"] == "tensorwire auto (same node)" and r["scenario"] == "p2p-processes"]
    assert [r["nbytes"] for r in ours] == [4096, 65536]
    for r in ours:  # the ratio is the best alternative's median over ours, from the rows' own numbers
        alternatives = [
            b["p50_us"]
            for b in rows
            if b["scenario"] == "p2p-processes"
            and b["nbytes"] == r["nbytes"]
            and b["baseline"]
            and not b["method"].startswith("memcpy")
        ]
        assert len(alternatives) >= 2 and r["vs_best_baseline"] == pytest.approx(min(alternatives) / r["p50_us"])
    assert "p50" in done.stdout.splitlines()[0] and "GB/s" in done.stdout.splitlines()[1]  # header, units


def _check_nixl_compare_rows(rows: list[dict]) -> None:
    """Every case (sizes, and 1,024 tensors of the largest), both modes and placements: tensorwire nixl beside
    bare NIXL, compared with the case's best bare row; ucx and host for the same object."""
    cases = {(r["nbytes"], r["tensors"]) for r in rows}
    assert cases == {(4096, 1), (65536, 1), (65536, 1024)}
    for where in ("same node", "other node, UCX tcp"):
        for mode in ("same object", "new object"):
            for case in cases:
                here = {
                    r["method"]: r
                    for r in rows
                    if (r["nbytes"], r["tensors"]) == case and r["method"].endswith(f", {mode} ({where})")
                }
                names = {m.split(",")[0] for m in here}
                assert {"bare NIXL", "tensorwire nixl"} <= names, (case, names)
                assert mode == "new object" or {"tensorwire ucx", "tensorwire host"} <= names, (case, names)
                bare, ours = here[f"bare NIXL, {mode} ({where})"], here[f"tensorwire nixl, {mode} ({where})"]
                assert bare["baseline"] and not ours["baseline"] and ours["iterations"] >= 2
                best = min(r["p50_us"] for r in here.values() if r["baseline"])  # this case's bare rows
                assert ours["vs_best_baseline"] == pytest.approx(best / ours["p50_us"])


@pytest.mark.parametrize(
    "args, says",
    [
        (["--scenarios", "p2p-processes,warp-drive"], "unknown scenario"),
        (["-b", "1M", "-e", "4K"], "min <= max"),
        (["--transports", "shmm"], "did you mean 'shm'"),
    ],
)
def test_bench_usage_errors_exit_2(args, says, capsys):
    from tensorwire.cli import main

    assert main(["bench", *args]) == 2
    assert says in capsys.readouterr().err


def test_a_transport_that_needs_two_gpus_is_received_on_the_second_or_skipped_with_why():
    import torch

    from tensorwire.peers import consumer_device
    from tensorwire.transport import registry

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = registry.get_transport_class("nccl").capabilities
    if gpus >= 2:
        assert consumer_device(nccl) == ("cuda:1", "")
    else:
        assert consumer_device(nccl) == (None, f"needs two GPUs (one per process); this machine has {gpus}")
    assert consumer_device(registry.get_transport_class("shm").capabilities) == (None, "")


def _check_plots_and_progress(done: subprocess.CompletedProcess, png: pathlib.Path) -> None:
    """The size plot, the sharded sync's per-pair timeline beside it, and a progress bar on stderr
    that steps through every measurement once and never past its total (scenarios add their
    steps as they learn them)."""
    timeline = png.with_name("bench-sharded-timeline.png")
    for picture in (png, timeline):
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    drawn = [(int(a), int(b)) for a, b in re.findall(r"bench: +\d+%\|[^|]*\| (\d+)/(\d+) \[", done.stderr)]
    assert drawn, done.stderr[-800:]
    counts = [c for i, (c, _) in enumerate(drawn) if i == 0 or c != drawn[i - 1][0]]  # redraws: out
    assert counts == list(range(drawn[-1][1] + 1)), done.stderr[-800:]  # 0, 1, 2, ... every step once
    assert drawn[-1][0] == drawn[-1][1] > 20  # finished: every scenario's steps counted in the total
    assert not re.search(r"bench: +\d+step \[", done.stderr), done.stderr[-800:]  # what tqdm draws past it
    assert "bench:" not in done.stdout  # the bar stays on stderr


def test_the_timeline_is_drawn_next_to_the_plot():
    from tensorwire.cli import timeline_path

    assert timeline_path("out/bench.png") == "out/bench-sharded-timeline.png"
    assert timeline_path("bench") == "bench-sharded-timeline.png"


def test_calibrate_writes_the_table_where_output_says(tmp_path, monkeypatch, capsys):
    """``--output`` wins over this machine's table (a real calibration, written where the
    environment says and used by agents, is in tests/transport/hw/test_calibration.py)."""
    from tensorwire import calibrate as calibrating
    from tensorwire.cli import main
    from tensorwire.transport.hw.calibration import load_costs
    from tensorwire.transport.selector import CostEstimate

    machines, given = tmp_path / "machine.json", tmp_path / "costs.json"
    monkeypatch.setenv("TENSORWIRE_COSTS_FILE", str(machines))
    measured = {"shm": CostEstimate(12.0, 5.0), "host": CostEstimate(80.0, 1.5)}
    monkeypatch.setattr(calibrating, "calibrate", lambda max_bytes, iters: (measured, ["cuda_ipc: not usable here"]))
    assert main(["bench", "--calibrate", "-e", "1M", "-n", "1", "--output", str(given)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {given}" in out and "skipped cuda_ipc: not usable here" in out
    assert load_costs(str(given)) == measured and not machines.exists()
    assert main(["bench", "--calibrate", "-e", "4K", "--output", str(given)]) == 2
    assert "at least 1 MiB" in capsys.readouterr().err


def test_nixl_compare_is_skipped_with_a_note_where_no_one_sided_transport_reads_across_nodes(monkeypatch):
    from types import SimpleNamespace

    from tensorwire.bench import nixl_compare
    from tensorwire.bench.runner import Options
    from tensorwire.progress import ProgressBar
    from tensorwire.transport import get_transport_class

    caps = {n: get_transport_class(n).capabilities for n in ("shm", "host", "nixl")}
    here = SimpleNamespace(
        capabilities=lambda: caps,
        transports=lambda: {"shm": 1, "host": 1},
        unusable_transports=lambda: {"nixl": "not here"},
    )
    monkeypatch.setattr(nixl_compare, "runtime_agent", lambda: here)
    monkeypatch.setattr(nixl_compare, "nixl_api", lambda: None)  # the bare baseline is there
    notes, bar = [], ProgressBar(2, desc="bench", enabled=False)
    assert nixl_compare.bench_rows(Options(sizes=[4096]), bar, notes) == []
    assert notes == [
        "nixl-compare: skipped (no one-sided transport that exports per object reads across nodes here "
        "(nixl: not here))"
    ]
    assert bar.total == 0
    assert nixl_compare.compared(here) == (("host",), ())  # host memory across nodes, no export per object


def test_actor_cases_add_the_largest_size_of_a_mib_or_more_as_a_state_dict():
    from tensorwire.bench.actors import STATE_DICT_TENSORS, _p2p_cases

    assert _p2p_cases([4096, 65536]) == [(4096, 1), (65536, 1)]
    assert _p2p_cases([4096, 64 << 20, 256 << 20]) == [
        (4096, 1),
        (64 << 20, 1),
        (256 << 20, 1),
        (256 << 20, STATE_DICT_TENSORS),
    ]


def test_nixl_compare_counts_rounds_with_wrong_bytes_and_goes_on(monkeypatch):
    """A transport that delivers stale data (later fetches write nothing) is counted in
    ``#wrong``, round by round, instead of ending the bench."""
    from tensorwire.bench import nixl_compare

    ref = tw.put(nixl_compare._value(4096, 1, 7))  # the value the bench's producer puts
    try:
        times, wrong = nixl_compare.get_rounds(ref, 1, "", 3, 7)
        assert len(times) == 3 and wrong == 0
        end, bad = nixl_compare.get_new(ref, 1, "", 7)
        assert end > 0 and not bad
        real_get, calls = tw.get, []

        def writes_once(r, **options):  # the first fetch delivers; later ones write nothing
            calls.append(r)
            return real_get(r, **options) if len(calls) == 1 else options["out"]

        monkeypatch.setattr(nixl_compare.tw, "get", writes_once)
        times, wrong = nixl_compare.get_rounds(ref, 1, "", 3, 7)
        assert len(times) == 3 and wrong == 3
        assert nixl_compare.get_new(ref, 1, "", 7)[1]
    finally:
        tw.free(ref)


def test_ray_rdt_over_nixl_runs_on_its_own_actors_which_go_after_its_rounds(monkeypatch):
    """Ray's NIXL agent spins a core in each actor once connected: its rounds run on a pair of
    their own, after the other methods, and the pair is killed even when a round fails."""
    from types import SimpleNamespace

    from tensorwire.bench import actors
    from tensorwire.bench.options import Options

    made, killed, measured = [], [], []

    class Node:
        def remote(self):
            actor = SimpleNamespace(set=SimpleNamespace(remote=lambda *args: args))
            made.append(actor)
            return actor

    def measure(scenario, plans, nbytes, options, **kwargs):
        measured.append((scenario, list(plans), nbytes, kwargs["tensors"]))
        if len(measured) == 2:
            raise RuntimeError("a round failed")
        return [f"row {nbytes}"]

    monkeypatch.setattr(actors, "_gather", list)
    monkeypatch.setattr(actors, "_measure", measure)
    monkeypatch.setattr(actors.ray_baselines, "kill", killed.append)
    options = Options(sizes=[4096, 64 << 20])
    with pytest.raises(RuntimeError, match="a round failed"):
        actors._ray_nixl(Node(), options, progress=None)
    assert len(made) == 2 and killed == made  # its own pair, gone after the failure
    assert measured == [("p2p-actors", ["Ray RDT (nixl)"], 4096, 1), ("p2p-actors", ["Ray RDT (nixl)"], 64 << 20, 1)]
    killed.clear()
    monkeypatch.setattr(actors, "_measure", lambda *args, **kwargs: ["row"])
    assert actors._ray_nixl(Node(), Options(sizes=[4096]), progress=None) == ["row"] and len(killed) == 2
