"""Each side runs without the other side's dependencies: the server without torch, the
client without boto3, image codecs or FastAPI (and, for output="numpy", without torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from stoker.server import ServerProcess, write_config

from conftest import TESTS, TOY_DATASETS, server_env

BLOCKER = TESTS / "blocker"


def blocked_env(*packages: str) -> dict[str, str]:
    return {**server_env(BLOCKER), "STOKER_TEST_BLOCK": ",".join(packages)}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=90, env={**os.environ, **env})


def test_the_blocker_blocks() -> None:
    result = run_python("import torch", blocked_env("torch"))
    assert result.returncode != 0 and "blocked by the test" in result.stderr


def test_server_serves_without_torch_and_client_reads_numpy_without_torch(tmp_path: Path,
                                                                        ) -> None:
    images = tmp_path / "images" / "cat"
    images.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 10, 10)).save(images / "a.png")
    config = write_config(tmp_path / "c.yaml", {"datasets": {
        "toy": TOY_DATASETS["toy"],
        "pics": {"format": "image-folder", "source": str(tmp_path / "images"), "size": 4}}})
    with ServerProcess(config, workers=1, env=blocked_env("torch")) as server:
        result = run_python(f"""
            import sys
            from stoker.client import RemoteLoader
            for name in ("toy", "pics"):
                with RemoteLoader({server.address!r}, name, batch_size=1, output="numpy",
                                  timeout=60) as loader:
                    batch = next(iter(loader))
                    print(name, sorted(batch), type(batch["sample_index"]).__name__)
            assert "torch" not in sys.modules
        """, blocked_env("torch", "boto3", "PIL", "fastapi", "uvicorn", "yaml", "pydantic"))
        assert result.returncode == 0, result.stderr
        assert "toy ['flag', 'label', 'sample_index', 'small', 'tokens', 'weight', 'x'] ndarray"\
            in result.stdout
        assert "pics ['image', 'label', 'sample_index'] ndarray" in result.stdout
    assert "blocked" not in server.stderr


def test_client_with_torch_output_needs_no_server_side_packages() -> None:
    result = run_python("""
        import stoker.client, sys
        heavy = {"PIL", "fastapi", "uvicorn", "boto3", "pydantic", "yaml"} & set(sys.modules)
        assert not heavy, heavy
    """, blocked_env("boto3", "PIL", "fastapi", "uvicorn"))
    assert result.returncode == 0, result.stderr


def test_the_server_serves_without_the_lake_libraries_and_a_lake_dataset_names_the_extra(
        tmp_path: Path) -> None:
    """The lake libraries are imported only where a lake table opens: a server without them
    serves its other datasets, and a config with a lake table names the `lake` extra."""
    lake = ("pyiceberg", "deltalake", "lance")
    config = write_config(tmp_path / "c.yaml", {"datasets": {"toy": TOY_DATASETS["toy"]}})
    with ServerProcess(config, workers=1, env=blocked_env(*lake)) as server:
        result = run_python(f"""
            from stoker.client import RemoteLoader
            with RemoteLoader({server.address!r}, "toy", batch_size=2, output="numpy",
                              timeout=60) as loader:
                print(sorted(next(iter(loader))))
        """, blocked_env(*lake))
        assert result.returncode == 0, result.stderr
    assert "blocked" not in server.stderr
    (tmp_path / "t").mkdir()
    for fmt, source in (("delta", {"source": str(tmp_path / "t")}),
                        ("lance", {"source": str(tmp_path / "t")}),
                        ("iceberg", {"catalog": {"uri": "sqlite:///c.db"}, "table": "ns.t"})):
        bad = write_config(tmp_path / f"{fmt}.yaml", {"datasets": {
            "t": {"format": fmt, **source, "columns": ["id"]}}})
        result = subprocess.run([sys.executable, "-m", "stoker.server", "check", str(bad)],
                                capture_output=True, text=True, timeout=90,
                                env={**os.environ, **blocked_env(*lake)})
        assert result.returncode != 0, (fmt, result.stdout)
        assert "stoker[lake]" in result.stderr and "datasets.t" in result.stderr, result.stderr
