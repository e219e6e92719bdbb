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
