"""The benchmark harness runs and writes sane output. It asserts no speed: speed is a
benchmark's business (benchmarks/), not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_quick_benchmark_writes_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loader_vs_dataloader.py"), "--quick",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    for name in ("dataloader", "stoker"):
        system = res["systems"][name]
        assert len(system["repeats"]) == 1
        assert system["batches_per_s"]["min"] <= system["batches_per_s"]["median"]
        assert system["batches_per_s"]["median"] > 0
    assert res["ratio_stoker_over_dataloader"]["batches_per_s_median"] > 0
    assert "ratio stoker / DataLoader" in result.stdout


@pytest.mark.timeout(120)
def test_quick_wire_benchmark_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "wire.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "wire.py"), "--quick", "--sizes", "64K,4M",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    assert [s["size"] for s in res["sizes"]] == [64 << 10, 4 << 20]
    for size in res["sizes"]:
        for name in ("tcp", "tls", "stoker", "stoker_sock", "stoker_torch", "stoker_tls",
                     "stoker_shm", "memcpy"):
            system = size["systems"][name]
            assert len(system["repeats"]) == 1
            assert system["gb_per_s"]["median"] > 0
            assert system["repeats"][0]["timed_bytes"] == (
                size["timed_batches"] * size["payload_bytes"])
        stoker = size["systems"]["stoker"]
        assert stoker["client_cpu_s_per_gb"]["median"] > 0
        assert stoker["peer_cpu_s_per_gb"]["median"] > 0
        assert size["ratio_stoker_over_tcp"] > 0 and size["ratio_stoker_shm_over_tcp"] > 0
        # Through gRPC every payload byte crosses the socket; through shared memory none do
        # (the stats count payload bytes either way, plus the small frames).
        assert stoker["wire_bytes_per_payload_byte"] >= 1.0
    assert "## Wire: bytes/s into client memory" in result.stdout and "raw TCP" in result.stdout
    # Each stoker system took the path its name says (shared memory: no data connection).
    for size in res["sizes"]:
        assert size["transport_ran"] == {"stoker": "frames", "stoker_sock": "data_socket",
                                         "stoker_torch": "data_socket",
                                         "stoker_tls": "data_socket", "stoker_shm": "shm"}
        # The trainer's CPU per GB in steady state, numpy and torch, over the raw receiver's
        # (one reused 4 MiB buffer): the figures the page's goal is read from.
        for name in ("tcp", "stoker_sock", "stoker_torch"):
            assert size["systems"][name]["client_cpu_steady_s_per_gb"]["median"] > 0
        assert size["ratio_client_cpu_steady_sock_over_tcp"] > 0
        assert size["ratio_client_cpu_steady_torch_over_tcp"] > 0
    # Every ratio is also taken against the fastest raw receiver the search found.
    limit = res["tcp_limit"]
    assert limit["best"]["gb_per_s"] == max(w["gb_per_s"] for w in limit["ways"]) > 0
    assert len(limit["ways"]) == 4 * 3 * 2  # chunk sizes x receive calls x SO_RCVBUF
    for size in res["sizes"]:
        assert set(size["ratio_over_fastest_tcp"]) == {"tcp", "stoker", "stoker_sock",
                                                       "stoker_torch", "stoker_tls",
                                                       "stoker_shm"}
    assert "Against the fastest raw TCP receiver" in result.stdout
    assert "one reused 4 MiB buffer" in result.stdout and "stoker torch s/GB" in result.stdout


@pytest.mark.timeout(180)
def test_quick_storage_benchmark_reads_local_and_s3(tmp_path: Path) -> None:
    out = tmp_path / "storage.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "storage.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    assert set(res["formats"]) == {"image-folder", "tokens"}
    for fmt in res["formats"].values():
        for run in ("local", "s3_cold", "s3_warm"):
            rep = fmt["runs"][run]["repeats"][0]
            assert rep["samples"] > 0 and rep["samples_per_s"] > 0 and rep["server_exit_code"] == 0
        assert fmt["ratio_over_local"]["local"] == 1.0
        assert fmt["endpoint_get_limit"]["objects"] > 0
    assert "s3_warm" in result.stdout


@pytest.mark.timeout(180)
def test_quick_packing_benchmark_delivers_every_token(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    out = tmp_path / "packing.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "packing.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    corpus, packing = res["corpus"], res["packing"]
    assert corpus["tokens"] > 0 and corpus["docs_longer_than_seq_len"] > 0
    assert 0.9 < packing["packing_efficiency"] <= 1 and 0 < packing["cut_fraction"] < 1
    assert packing["rows"] * res["params"]["seq_len"] - packing["padding_tokens"] == (
        corpus["tokens"])
    assert res["tokenize"]["cold_open_s"] > 0 and res["tokenize"]["tokens_per_s"] > 0
    for name in ("text", "tokens"):
        system = res["systems"][name]
        assert len(system["repeats"]) == 1
        assert system["real_tokens_per_s"]["median"] > 0
    assert res["ratio_text_over_tokens"]["rows_per_s"] > 0
    assert "## Sequence packing" in result.stdout


@pytest.mark.timeout(240)
def test_quick_pipeline_benchmark_runs_every_system_and_checks_batches(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--quick", "--workers", "1",
         "--images", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == []  # batch shapes and dtypes, server exit codes
    (sweep,) = res["sweep"]
    assert sweep["workers"] == 1
    for name in ("dataloader", "stateful", "stoker", "stoker_uint8"):
        images = sweep[name]["images_per_s"]
        assert len(sweep[name]["repeats"]) == 1 and images["median"] > 0
    assert set(sweep["ratio_images_per_s"]) == {"stateful", "stoker", "stoker_uint8"}
    assert "vs DataLoader" in result.stdout


@pytest.mark.timeout(300)
def test_the_suite_runs_scenarios_and_generates_the_page(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results, page = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "stall", "startup",
         "--results", str(results), "--docs", str(page)],
        capture_output=True, text=True, timeout=290, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in results.glob("*.json")) == ["stall.json", "startup.json"]
    stall = json.loads((results / "stall.json").read_text())
    for row in stall["costs"]:  # each system's steps took at least the compute time
        for name in ("sync", "dataloader", "stoker"):
            assert row[name]["step_over_compute"] >= 0.99
    # Provenance, stamped by the one writer (benchmarks/_measure.py) and printed per section.
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    prov = stall["provenance"]
    assert prov["commit"] == head and prov["commit_date"]
    assert prov["command"] == "python -m benchmarks --only stall --quick"
    assert prov["machine"]["cores"] >= 1 and len(prov["machine"]["load_before"]) == 3
    assert prov["machine"]["cpu"] and prov["peers"]["torch"] != "not installed"
    text = page.read_text()
    assert "## Stall: simulated training" in text and "## Start-up" in text
    assert text.count(f"Commit `{head[:10]}`") == 2
    assert "Not measured in this run (no wire.json in results/)" in text
    assert (page.parent / "benchmarks" / "stall.png").stat().st_size > 1000


@pytest.mark.timeout(120)
def test_quick_sweep_benchmark_checks_every_jobs_bytes(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--quick", "--images", "64",
         "--json", str(out)], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    rep = res["repeats"][0]
    assert len(rep["sweep"]["jobs"]) == 4 and rep["lone"]["server_cpu_s"] > 0
    # Every batch of the 4 jobs' epoch was built once; the other requests shared it.
    counts = rep["sweep"]["outcomes"]
    assert counts["built"] == res["batches_per_epoch"] == 4
    assert counts["joined"] + counts["cached"] == 3 * 4
    assert "identical to the lone job's: yes" in result.stdout


@pytest.mark.timeout(120)
def test_per_batch_breakdown_runs_on_the_data_connection(tmp_path: Path) -> None:
    out = tmp_path / "per_batch.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "per_batch.py"), "--batches", "200",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (repeat,) = json.loads(out.read_text())["repeats"]
    # Two workers' figures, and the path a client told it is on another machine takes.
    assert repeat["front_us"] > 0 and len(repeat["workers_us"]) == 2
    assert repeat["transport"] == "data_socket"
    assert "## Per batch: CPU by process on the data connection" in result.stdout


def _suite(tmp_path: Path, name: str, timeout: float) -> tuple[dict, str, str]:
    """`python -m benchmarks --quick --only NAME` into tmp_path: its JSON, the page, stdout."""
    results, page = tmp_path / "results", tmp_path / "docs" / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", name, "--results",
         str(results), "--docs", str(page)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads((results / f"{name}.json").read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    return res, page.read_text(), result.stdout


@pytest.mark.timeout(150)
def test_quick_fleet_benchmark_measures_every_server_set(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    res, page, _ = _suite(tmp_path, "fleet", 140)
    rows = {r["name"]: r for r in res["throughput"]}
    assert list(rows) == ["1 server x 2 workers", "2 servers x 2 workers",
                          "1 server x 4 workers"]
    for row in rows.values():
        assert row["samples_per_s"]["median"] > 0 and row["capacity_ratio"] > 0
        assert row["capacity_samples_per_s"] == row["workers"] * 500  # 2 ms a sample
        assert row["first_batch_s"]["median"] > 0
    assert rows["2 servers x 2 workers"]["servers"] == 2
    assert res["first_batch_goal_s"] == pytest.approx(0.25 * 256 * 0.002)
    for style in ("set_epoch", "again"):  # both loop styles, each epoch read whole
        assert 0 <= res["boundaries"][style]["stall"]["median"] < 1
    assert "## Fleet: one rank against many server workers" in page
    assert "Epoch boundaries" in page


@pytest.mark.timeout(150)
def test_quick_pipeline_batch_benchmark_compares_batch_sizes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    res, page, _ = _suite(tmp_path, "pipeline_batch", 140)
    big, small = res["systems"]["big"], res["systems"]["small"]
    assert (big["batch_size"], small["batch_size"]) == (64, 16)
    assert big["images_per_s"]["median"] > 0 and small["images_per_s"]["median"] > 0
    assert res["ratio_big_over_small"] == pytest.approx(
        big["images_per_s"]["median"] / small["images_per_s"]["median"])
    assert "## Image pipeline: batch 256 against batch 32" in page


@pytest.mark.timeout(150)
def test_gpu_benchmark_skips_without_cuda_and_runs_its_cpu_standin(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the scenario runs in full there, not as a smoke test")
    res, page, out = _suite(tmp_path, "gpu", 140)
    assert res["skipped"].startswith("no CUDA device") and "images" not in res
    assert f"GPU part skipped: {res['skipped']}" in out
    assert "GPU part not measured: no CUDA device" in page
    rows = res["cpu_standin"]["rows"]
    assert [r["burn_ms"] for r in rows] == [0.0, 20.0] and rows[0]["over_counting"] == 1.0
    for row in rows:
        assert row["batches_per_s"]["median"] > 0 and row["client_cpu_ms_per_batch"]["median"] > 0


@pytest.mark.timeout(120)
def test_quick_seek_benchmark_seeks_both_cuts(tmp_path: Path) -> None:
    out = tmp_path / "seek.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "seek.py"), "--quick", "--repeats", "1",
         "--json", str(out)], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    assert set(res["systems"]) == {"fixed", "tokens"}
    for system in res["systems"].values():
        assert system["near_s"] > 0 and system["far_s"] > 0 and system["epoch_of_far"] > 0


@pytest.mark.timeout(400)
def test_quick_lockstep_benchmark_measures_the_bound_stoker_and_dataloader(
        tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    res, page, _ = _suite(tmp_path, "lockstep", 390)
    systems = res["systems"]
    assert list(systems) == ["bound", "stoker", "dataloader"]
    assert systems["bound"]["of_bound"] == 1.0
    for s in systems.values():
        assert s["steps_per_s"] > 0 and 0 <= s["stall"] < 1
        assert len(s["ranks"]) == res["parameters"]["ranks"]
        assert s["wait_p99_ms"] >= s["wait_p50_ms"]
        assert [r["steps_per_s"] for r in s["repeats"]] == [s["steps_per_s"]]  # --quick: 1
    # CPU per step by process kind: the servers' workers build stoker's batches, DataLoader's
    # workers are the ranks' children.
    assert systems["stoker"]["cpu_ms_per_step"]["server_workers"] > 0
    assert systems["dataloader"]["cpu_ms_per_step"]["rank_children"] > 0
    assert systems["bound"]["cpu_ms_per_step"]["total"] < systems["stoker"]["cpu_ms_per_step"][
        "total"]
    assert "## Lockstep: ranks that step together" in page
    assert "CPU ms per step" in page


@pytest.mark.timeout(30)
def test_lockstep_reports_the_repeat_with_the_median_ratio_to_its_own_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from lockstep import _median_run
    bound = [{"steps_per_s": b, "wait_p99_ms": 1.0} for b in (20.0, 25.0, 24.0)]
    # steps/s 19, 21, 22 against bounds 20, 25, 24: ratios 0.95, 0.84, 0.917
    runs = [{"steps_per_s": s, "wait_p99_ms": w} for s, w in ((19.0, 3.0), (21.0, 9.0),
                                                             (22.0, 5.0))]
    got = _median_run(runs, bound)
    assert got["steps_per_s"] == 22.0 and got["wait_p99_ms"] == 5.0
    assert abs(got["of_bound"] - 22 / 24) < 1e-12
    assert [round(r["of_bound"], 3) for r in got["repeats"]] == [0.95, 0.84, 0.917]
    assert _median_run(bound, bound)["of_bound"] == 1.0


@pytest.mark.timeout(200)
def test_video_benchmark_measures_stoker_and_the_peer_per_core_on_each_codec(
        tmp_path: Path) -> None:
    pytest.importorskip("av")
    out = tmp_path / "video.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "video.py"), "--videos", "4", "--repeats",
         "1", "--epochs", "1", "--workers", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads(out.read_text())
    assert [row["codec"] for row in res["rows"]] == ["h264", "vp9"]
    for row in res["rows"]:
        for system in ("peer", "stoker"):
            assert row[system]["clips_per_s"] > 0 and row[system]["cpu_per_clip"] > 0
        assert 0 < row["stoker"]["server_cpu_per_clip"] < row["stoker"]["cpu_per_clip"]
        assert row["per_core"] == pytest.approx(
            row["peer"]["cpu_per_clip"] / row["stoker"]["cpu_per_clip"])
    assert res["reference_share"]["vp9"] == 1.0 and 0 < res["reference_share"]["h264"] < 1
