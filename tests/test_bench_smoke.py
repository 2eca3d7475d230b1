"""The benchmark CLI runs end to end (figures are not checked: timing never fails a test)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest


def shm_entries():
    return {e for e in os.listdir("/dev/shm") if e.startswith("shmdist")}


@pytest.mark.timeout(300)
def test_bench_quick_prints_a_table_and_writes_json(tmp_path):
    before = shm_entries()
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "-m", "shmdist.bench", "--quick", "--ranks", "2",
                          "--backends", "shmdist,gloo,memcpy", "--json", str(out)],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    table = run.stdout.splitlines()
    assert any(line.startswith("| figure | shmdist |") and "shmdist ÷ best peer" in line for line in table)
    for row in ("p2p one-way latency 8 B", "p2p bandwidth 256 MiB", "p2p blocking-send loop 1 MiB",
                "p2p both ways at once 4 KiB", "all_reduce 4 KiB, 2 ranks",
                "barrier, 2 ranks", "CPU of a rank blocked 1 s in wait()"):
        assert any(line.startswith(f"| {row} |") for line in table), row
    assert "[  1/" in run.stderr        # progress is shown while it runs
    doc = json.loads(out.read_text())
    mine = [r for r in doc["results"] if r["backend"] == "shmdist"]
    half = {"all_reduce_bf16", "all_reduce_fp16"} if importlib.util.find_spec("torch") else set()
    assert {r["kind"] for r in mine} == {"latency", "bandwidth", "blocking", "bidir", "all_reduce", "broadcast",
                                         "barrier", "idle"} | half
    for r in mine:
        assert "failed" not in r, r
        assert r["value"] >= 0 and r["iters"] >= 1 and r["unit"] in ("s", "B/s", "cpu")
    assert shm_entries() <= before


@pytest.mark.timeout(300)
def test_bench_rounds_interleave_and_report_the_ratio_range(tmp_path):
    """--rounds 2: every backend measured twice, the ratio column gives its median and range."""
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "-m", "shmdist.bench", "--quick", "--rounds", "2", "--only", "latency",
                          "--backends", "shmdist,gloo", "--json", str(out)],
                         capture_output=True, text=True, timeout=280)
    if "gloo skipped" in run.stderr:
        pytest.skip("needs torch (gloo) as the peer")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "round 2/2: " in run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| p2p one-way latency")]
    assert rows and all(" gloo |" in row and "–" in row for row in rows)   # "0.01 (0.01–0.02) gloo"
    doc = json.loads(out.read_text())
    assert doc["meta"]["rounds"] == 2
    assert all(len(r["rounds"]) == 2 for r in doc["ratios"])
    assert all(len(r["rounds"]) == 2 for r in doc["results"] if "value" in r)


def test_bench_rejects_unknown_filters():
    run = subprocess.run([sys.executable, "-m", "shmdist.bench", "--only", "latency,nonsense"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--only: unknown nonsense" in run.stderr


@pytest.mark.timeout(200)
def test_bench_skips_deepspeed_with_a_note_when_it_cannot_run(tmp_path):
    """DeepSpeed is a peer only when its interpreter loads it and its op builds; else a note, and the run goes on."""
    run = subprocess.run([sys.executable, "-m", "shmdist.bench", "--quick", "--ranks", "2", "--only", "all_reduce",
                          "--backends", "shmdist,deepspeed", "--ds-python", str(tmp_path / "no-such-python")],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "note: DeepSpeed skipped (under " in run.stdout and "--ds-python" in run.stdout
    assert any(line.startswith("| all_reduce 4 KiB, 2 ranks |") for line in run.stdout.splitlines())
    assert "| DeepSpeed |" not in run.stdout
    run = subprocess.run([sys.executable, "-m", "shmdist.bench", "--quick", "--ranks", "2", "--only", "barrier",
                          "--backends", "shmdist,deepspeed"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "note: DeepSpeed skipped: give its interpreter with --ds-python" in run.stdout


def test_mpi_files_left_in_dev_shm_by_the_runs_own_jobs_are_removed(tmp_path):
    """Open MPI leaves a 16 MiB sm_segment file per launch in /dev/shm; the benchmark removes the
    ones that appeared during its launches and that no live process maps (another job's stay), and
    never one that was there before."""
    import mmap
    import multiprocessing
    from shmdist import bench

    tag = f"sm_segment.shmdist-test.{os.getpid()}"
    old, left, live = (f"/dev/shm/{tag}.{n}" for n in ("old", "left", "live"))
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def holder():
        with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            ready.set()
            done.wait(30)

    try:
        with open(old, "wb") as f:
            f.write(b"\0" * 4096)
        before = bench.mpi_shm_entries()
        for path in (left, live):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        p = ctx.Process(target=holder)
        p.start()
        assert ready.wait(30)
        bench.remove_mpi_leftovers(before)
        assert os.path.exists(old), "a file from before the run was removed"
        assert os.path.exists(live), "a file a live process maps was removed"
        assert not os.path.exists(left), "the run's own leftover stayed"
        done.set()
        p.join(30)
    finally:
        for path in (old, left, live):
            if os.path.exists(path):
                os.unlink(path)


def test_sizes_replace_the_tables_sizes_and_bad_ones_are_refused():
    from shmdist import bench
    rows = bench.plan(["bidir", "all_reduce", "barrier"], [2, 8], [16 << 10, 1 << 20])
    assert [(p.kind, p.nbytes, p.ranks) for p in rows] == [
        ("bidir", 16 << 10, 2), ("bidir", 1 << 20, 2),
        ("all_reduce", 16 << 10, 2), ("all_reduce", 1 << 20, 2), ("barrier", 0, 2),
        ("all_reduce", 16 << 10, 8), ("all_reduce", 1 << 20, 8), ("barrier", 0, 8)]
    assert bench.parse(["--sizes", "64K,1MiB,8"]).sizes == [8, 64 << 10, 1 << 20]
    for bad in ("3x", "4", ""):
        with pytest.raises(SystemExit):
            bench.parse(["--sizes", bad])


@pytest.mark.timeout(200)
def test_bench_measures_shmdist_16_bit_rows_with_torch_and_says_why_not_without():
    """shmdist's bfloat16/float16 rows run on torch tensors: measured where torch is, else a note names why."""
    run = subprocess.run([sys.executable, "-m", "shmdist.bench", "--quick", "--ranks", "2", "--only",
                          "all_reduce_bf16,all_reduce_fp16", "--sizes", "4K", "--backends", "shmdist"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| all_reduce ")]
    assert [r.split(" | ")[0] for r in rows] == ["| all_reduce bfloat16 4 KiB, 2 ranks",
                                                 "| all_reduce float16 4 KiB, 2 ranks"]
    if importlib.util.find_spec("torch"):
        assert all(r.split(" | ")[1] != "n/a" for r in rows), rows
        assert "all_reduce rows skipped" not in run.stdout
    else:
        assert "note: shmdist's bfloat16 and float16 all_reduce rows skipped" in run.stdout
        assert "torch is not installed" in run.stdout
