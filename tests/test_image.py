"""docker/Dockerfile.server, built from this checkout and run: a client outside the container
streams an epoch from the server inside it, and SIGTERM stops it cleanly.

Machines without a Docker engine or a registry (development, CI) build and run images with
podman/buildah in chroot isolation, on a local stand-in for the `python:3.11-slim` base that
`../shared/tools/container-base.sh` builds once per machine (`.ci/run` runs it; its header has
the commands used here). Only the FROM image is a stand-in: every step after it runs for real.
The container shares the host's network, so its ports are host ports, and the host's /dev/shm,
where a segment of another user's dead server waits for the unprivileged server to trip on.

What skips, and what fails: this test skips only where images cannot be built or run here at
all (podman or buildah missing, no base image, podman unable to use its storage). Once those
work, anything else (the build, the start as the unprivileged user, the stream, the exit) is
the image's fault and fails the test.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

REPO = Path(__file__).resolve().parents[1]
BASE = "docker.io/library/python:3.11-slim"  # FROM in Dockerfile.server, kept as users see it
TAG = "localhost/stoker-server:test"  # kept between runs: podman's layer cache
USER = "10001:10001"  # USER in Dockerfile.server
CLASSES = ("circle", "square")
N = 40  # samples; 8x8 RGB PNGs of random pixels: no two alike, lossless
BUILD_TIMEOUT = 480  # s: ~25 s warm, minutes when pip fetches every dependency afresh

# The build (~25-40 s) and the run share one budget; a busy 2-core CI machine needs room.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 120)


def podman_or_skip() -> None:
    """Skip, naming what is missing, where podman/buildah cannot build or run images here."""
    setup = ("run tools/container-base.sh (as root; or the machine's "
             "../shared/tools/container-base.sh) first")
    missing = [tool for tool in ("podman", "buildah") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: {setup}")
    info = subprocess.run(["podman", "info", "--format", "{{.Store.GraphRoot}}"],
                          capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"podman cannot use its storage here: {info.stderr.strip()}")
    if subprocess.run(["podman", "image", "exists", BASE], timeout=60).returncode != 0:
        pytest.skip(f"no {BASE} image (the registry is out of reach): {setup}")


@dataclass(frozen=True)
class Built:
    id: str  # by ID, not TAG: another checkout may retag TAG meanwhile
    user: str  # USER
    command: list[str]  # ENTRYPOINT + CMD: what `docker run IMAGE` runs


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The server image built from this checkout (a failed build fails the test)."""
    podman_or_skip()
    iid = tmp_path_factory.mktemp("image") / "iid"
    # --format docker: keeps HEALTHCHECK, as `docker build` does (OCI images drop it).
    build = ["podman", "build", "--isolation=chroot", "--pull=never", "--network=host",
             "--format=docker", "-f", "docker/Dockerfile.server", "-t", TAG,
             "--iidfile", str(iid), "."]
    started = time.monotonic()
    done = subprocess.run(build, cwd=REPO, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, f"{' '.join(build)} failed:\n{done.stdout}\n{done.stderr}"
    print(f"built {TAG} in {time.monotonic() - started:.1f} s")
    inspect = subprocess.run(["podman", "image", "inspect", iid.read_text().strip()],
                             capture_output=True, text=True, check=True, timeout=60)
    (meta,) = json.loads(inspect.stdout)
    config = meta["Config"]
    return Built(meta["Id"], config.get("User", ""),
                 config.get("Entrypoint", []) + config.get("Cmd", []))


def write_dataset(root: Path) -> dict[bytes, tuple[str, int]]:
    """An image-folder dataset under `root`: each image's pixels (CHW, as the server sends
    them) -> (its file, its label)."""
    rng = np.random.default_rng(18)
    expected = {}
    for i in range(N):
        label = i % len(CLASSES)
        folder = root / CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        path = folder / f"{i:03d}.png"
        Image.fromarray(pixels).save(path)
        expected[pixels.transpose(2, 0, 1).tobytes()] = (path.name, label)
    assert len(expected) == N
    return expected


def readable_by_all(root: Path) -> None:
    """The container runs as another user: it must read the dataset whatever the umask."""
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


class ContainerServer(ServerProcess):
    """ServerProcess (ready event, stderr, reap) around `buildah run` of the image's server.

    SIGTERM to `buildah run` itself does not reach the server (buildah kills it): stop() sends
    it to the server process, as `docker stop` sends it to the container's PID 1."""

    def __init__(self, container: str, image: Built, config: Path, data: Path) -> None:
        super().__init__(config)
        # `buildah run` runs no ENTRYPOINT: the image's own command, with options appended
        # (the last --host wins): the host's loopback, as the container shares its network;
        # port 0, so that the server takes free ports and announces them in its ready event.
        self.args = ["buildah", "run", "--isolation", "chroot", "--user", image.user,
                     "-v", f"{config}:/etc/stoker/config.yaml:ro", "-v", f"{data}:/data:ro",
                     container, "--", *image.command,
                     "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                     "--log-level", "INFO"]

    def server_pid(self) -> int:
        """The first process below `buildah run` that runs the image's `stoker serve`."""
        assert self.proc is not None
        queue = collections.deque([self.proc.pid])
        while queue:
            pid = queue.popleft()
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                # Children are listed per thread, and buildah (Go) forks from any thread.
                for task in Path(f"/proc/{pid}/task").iterdir():
                    queue.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue  # gone meanwhile
            # python3 running the entry point; not buildah-chroot-exec, which has its argv
            if argv[0].startswith(b"/usr/bin/python") and argv[1:3] == [
                    b"/usr/local/bin/stoker", b"serve"]:
                return pid
        raise AssertionError(f"no `stoker serve` process below buildah run:\n{self.stderr}")

    def terminate(self, timeout: float) -> int:
        """SIGTERM to the server; the exit code `buildah run` passes on. If that fails,
        buildah run is stopped (it kills the server) before the error goes on."""
        assert self.proc is not None
        try:
            if self.proc.poll() is None:
                os.kill(self.server_pid(), signal.SIGTERM)
            self.proc.wait(timeout)
        finally:
            code = self.stop(timeout=30)  # only reaps, unless the server did not stop
        return code


def uids(pid: int) -> list[str]:
    """Real, effective, saved and filesystem user IDs of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return line.split()[1:]
    raise AssertionError(f"/proc/{pid}/status has no Uid line")


@pytest.fixture
def foreign_leftover() -> Iterator[Path]:
    """A shared-memory segment of another user's server that died. The container shares the
    host's /dev/shm (chroot isolation, as `docker run --ipc=host` does), and its server, as
    another user, cannot remove it: it must start all the same (it once died of the
    PermissionError). A server of this user on the host may remove it first (it is gone)."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid: a server that is gone
    path = Path("/dev/shm") / f"stoker_{gone.pid}_0_1"
    path.write_bytes(b"\0" * 4096)
    path.chmod(0o600)
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def container(image: Built) -> Iterator[str]:
    name = subprocess.run(["buildah", "from", "--pull-never", image.id], capture_output=True,
                          text=True, check=True, timeout=120).stdout.strip()
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120)


def test_the_server_image_serves_an_exact_epoch_and_stops_cleanly(
        image: Built, container: str, foreign_leftover: Path, tmp_path: Path,
        ledger) -> None:
    # What the Dockerfile promises: an unprivileged user, and the config where CMD reads it.
    assert image.user == USER
    assert image.command[:2] == ["stoker", "serve"]
    assert image.command[image.command.index("--config") + 1] == "/etc/stoker/config.yaml"
    data = tmp_path / "data"
    expected = write_dataset(data / "shapes")
    readable_by_all(data)
    config = write_config(tmp_path / "config.yaml", {
        "server": {"workers": 1, "grace_seconds": 5},
        "datasets": {"shapes": {"format": "image-folder", "source": "/data/shapes"}}})
    config.chmod(0o644)
    server = ContainerServer(container, image, config, data)
    server.start(timeout=120)  # returns on the server's ready event
    try:
        assert uids(server.server_pid()) == [USER.split(":")[0]] * 4  # not root
        # The HTTP readiness probe, from outside the container.
        with urllib.request.urlopen(f"{server.http_url}/readyz", timeout=10) as answer:
            assert answer.status == 200

        seen: collections.Counter[str] = collections.Counter()
        indices: list[int] = []
        loader = RemoteLoader(server.address, "shapes", batch_size=8, drop_last=False,
                              output="numpy", seed=3)
        for batch in loader:
            indices += batch["sample_index"].tolist()
            for image, label in zip(batch["image"], batch["label"], strict=True):
                assert image.tobytes() in expected, "an image that is not in the dataset"
                name, want = expected[image.tobytes()]
                assert label == want, name
                seen[name] += 1
        lost, duplicated = ledger.compare(seen.elements(), [name for name, _ in
                                                            expected.values()])
        ledger.record("servers", "the server image, unprivileged, beside another user's dead "
                      "server's shared memory: an epoch streamed from outside",
                      lost=lost, duplicated=duplicated)
        assert sorted(indices) == list(range(N))
        assert len(seen) == N and set(seen.values()) == {1}, seen  # every sample, once
    finally:
        code = server.terminate(timeout=60)
    assert code == 0, server.stderr
    assert "shutting down: draining streams" in server.stderr
    assert '{"event": "stopped"}' in "".join(server.stdout), server.stdout
