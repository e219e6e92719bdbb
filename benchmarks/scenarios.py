"""Every benchmark scenario, declared once: its name, the script and arguments that run it, the
page sections that render its JSON, its line in the README, the peers whose versions its
results record, and the code it exercises (what makes its figures stale).

`python -m benchmarks` runs these; benchmarks/report.py renders their sections in this order;
benchmarks/README.md's scenario list is generated from them (`python -m benchmarks --readme`,
tests/test_bench_registry.py fails when it drifts); `python -m benchmarks --stale` compares
each result's commit with the last commit that changed what the scenario exercises.

A new scenario is one `Scenario(...)` below: a script that ends in
`_measure.run_scenario(args, run)` (or `write_results`), and a renderer `def f(r, plots) ->
list[str]` in report.py or a report_*.py, named here as "module:function".

Only the standard library at import: `--stale` and the README check run without matplotlib.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# What every scenario runs through: the server, the client and the wire between them.
CORE = ("server", "client", "protos")


@dataclass(frozen=True)
class Scenario:
    """One scenario: `script` run with `args` (or `quick`) writes docs/benchmarks/results/
    `name`.json, which `sections` (title, "module:function") render on the page."""

    name: str
    script: str
    readme: str  # one line: what it measures, against what
    sections: tuple[tuple[str, str], ...]
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)
    # W = workers_from..cores appended as `--workers ...` (the machine decides the sweep)
    workers_from: int | None = None
    peers: tuple[str, ...] = ()  # distributions whose versions the JSON records
    exercises: tuple[str, ...] = ()  # paths beyond CORE, the script and the modules it uses
    needs_cuda: bool = False  # its main figures need a CUDA device
    core: tuple[str, ...] = field(default=CORE)

    def arguments(self, quick: bool, cores: int) -> list[str]:
        """The script's arguments in full or quick mode on a machine of `cores` CPUs."""
        out = list(self.quick if quick else self.args)
        if self.workers_from is not None:
            out += ["--workers", *map(str, range(self.workers_from, cores + 1))]
        return out

    def command(self, quick: bool) -> str:
        """The command that reproduces this scenario's JSON and its sections."""
        return f"python -m benchmarks --only {self.name}" + (" --quick" if quick else "")

    def paths(self) -> list[str]:
        """Repository paths whose change can change this scenario's figures: CORE, its script,
        the benchmark modules that script uses (imported, or run by file name), and
        `exercises`. Renderers (report*.py, _page.py) are left out: they draw, not measure."""
        found: list[str] = []
        todo = [self.script]
        while todo:
            name = todo.pop()
            if name in found or not (HERE / name).exists():
                continue
            found.append(name)
            todo += sorted(_siblings(HERE / name) - set(found))
        return [*self.core, *(f"benchmarks/{n}" for n in sorted(found)), *self.exercises]


def _siblings(path: Path) -> set[str]:
    """The benchmark modules `path` imports or names as a file (a peer it runs), renderers
    left out."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {f"{a.name.split('.')[0]}.py" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(f"{node.module.split('.')[0]}.py")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= set(re.findall(r"\b(\w+\.py)\b", node.value)) if len(node.value) < 60 \
                else set()
    return {n for n in names if (HERE / n).is_file() and not n.startswith(("report", "_page"))
            and n not in ("__main__.py", "scenarios.py")}


IMAGES = ("numpy", "Pillow", "simplejpeg", "opencv-python-headless")  # the server's decode, resize
TORCH = ("torch",)
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("pipeline", "pipeline.py",
             "the image pipeline (JPEG -> crop -> flip -> normalize) against torch DataLoader, "
             "torchdata's StatefulDataLoader and SPDL, W = 0..cores",
             (("Image pipeline: stoker vs DataLoader", "report:pipeline"),
              ("Training-node CPU", "report:trainer_cpu")),
             workers_from=0, peers=(*IMAGES, *TORCH, "torchdata", "spdl")),
    Scenario("pipeline_socket", "pipeline.py",
             "the same pipeline with stoker's batches on the data connection, as between "
             "machines (W >= 1)",
             (("Image pipeline through the data socket", "report:pipeline"),
              ("Training-node CPU through the data socket", "report:trainer_cpu")),
             args=("--transport", "socket"), quick=("--quick", "--transport", "socket"),
             workers_from=1, peers=(*IMAGES, *TORCH, "torchdata", "spdl")),
    Scenario("wire", "wire.py",
             "ready batches into client memory by each transport, against the fastest raw "
             "TCP receiver (tcp_limit.py), raw TLS and memcpy",
             (("Wire: bytes/s into client memory", "report:wire"),),
             quick=("--quick", "--sizes", "64K,1M,16M"), peers=("numpy",)),
    Scenario("per_batch", "per_batch.py",
             "where a small batch's fixed cost goes: CPU per batch of the front end, each "
             "worker and the trainer, on the data connection (no peer: a breakdown)",
             (("Per batch: CPU by process on the data connection", "report:per_batch"),),
             peers=("numpy",)),
    Scenario("stall", "stall.py",
             "simulated training steps: step time and wait for data, sync and DataLoader "
             "against stoker, over a data cost per batch",
             (("Stall: simulated training", "report:stall"),), peers=TORCH),
    Scenario("startup", "startup.py",
             "seconds to the first batch: DataLoader with fork, spawn and forkserver workers "
             "against RemoteLoader",
             (("Start-up", "report:startup"),), peers=TORCH),
    Scenario("memory", "memory.py",
             "resident memory of server and client over a long run, peak and growth",
             (("Memory over a long run", "report:memory"),), peers=("numpy",)),
    Scenario("memory_prefix_cache", "memory.py",
             "the same, with the prefix cache filled by an image dataset",
             (("Memory over a long run, prefix cache filled", "report:memory"),),
             args=("--prefix-cache",), quick=("--quick", "--prefix-cache"), peers=IMAGES),
    Scenario("prefix_cache", "prefix_cache.py",
             "the held-out image pipeline's cold epoch 0 against epoch 1 with the prefix "
             "cache warm",
             (("Prefix cache: epoch 0 against epoch 1", "report:prefix_cache"),), peers=IMAGES),
    Scenario("scale", "scale.py",
             "images/s against worker processes and servers, and the sizing model",
             (("Scale", "report:scale"),), peers=IMAGES),
    Scenario("s3", "storage.py",
             "the same dataset from local disk and a loopback S3 endpoint, cold and warm",
             (("S3: local disk vs object store", "report:s3"),), peers=("numpy", "boto3", "moto")),
    Scenario("packing", "packing.py",
             "packed text rows (`format: text`) against pre-tokenized windows",
             (("Sequence packing", "report:packing"),), peers=("numpy", "tokenizers")),
    Scenario("chat", "chat.py",
             "conversations rendered, masked and packed by the server against transformers' "
             "apply_chat_template in a DataLoader",
             (("Conversations: rendered, masked and packed", "report:chat"),),
             peers=(*TORCH, "transformers", "jinja2")),
    Scenario("mixture", "mixture.py",
             "a mixture of 3 token datasets against the plain `tokens` format",
             (("Mixtures", "report:mixture"),), peers=("numpy",)),
    Scenario("token_budgets", "token_budgets.py",
             "token-budget batches (`batch_tokens`) against fixed-size batches",
             (("Token budgets", "report:token_budgets"),), peers=("numpy",)),
    Scenario("seek", "seek.py",
             "`RemoteLoader.seek` far into a run against near, fixed-size and token-budget "
             "batches: one request, not a replay",
             (("Seek: far against near", "report:seek"),), peers=("numpy",)),
    Scenario("elastic", "elastic.py",
             "servers join and leave a running trainer; the autoscale loop sizes them on the "
             "stall",
             (("Elastic: servers join and leave a running trainer", "report:elastic"),),
             peers=("numpy",)),
    Scenario("sweep", "sweep.py",
             "four identical jobs at once against one server, against one job alone",
             (("Sweep: jobs sharing batches", "report:sweep"),), peers=IMAGES),
    Scenario("fleet", "fleet.py",
             "one rank against 4..16 server workers and two servers; first batch; epoch "
             "boundaries",
             (("Fleet: one rank against many server workers", "report_fleet:fleet"),),
             peers=("numpy",)),
    Scenario("pipeline_batch", "pipeline_batch.py",
             "the image pipeline at batch 256 against batch 32 from the same server",
             (("Image pipeline: batch 256 against batch 32", "report_fleet:pipeline_batch"),),
             peers=IMAGES),
    Scenario("gpu", "gpu.py",
             "ResNet-50 and a GPT-2 small where CUDA is (skips without), and a CPU stand-in: "
             "the client's cost to a busy trainer",
             (("GPU: ResNet-50 and GPT-2 small, and the client's cost to a busy trainer",
               "report_fleet:gpu"),),
             peers=(*IMAGES, *TORCH, "torchvision"), needs_cuda=True),
    Scenario("orders", "orders.py",
             "the first batch of a new shuffled epoch and the server's memory, 1e5 to 1e9 "
             "samples",
             (("Orders: the first batch of an epoch against the dataset's size",
               "report_orders:orders"),), peers=("numpy",)),
    Scenario("tfdata", "tfdata_service.py",
             "tf.data service and plain tf.data against stoker, the image pipeline from "
             "TFRecord files (TensorFlow from .venv-tf)",
             (("tf.data service and tf.data: the same pipeline from TFRecord",
               "report_tfdata:tfdata"),), peers=(*IMAGES, "tensorflow")),
    Scenario("lockstep", "lockstep.py",
             "R rank processes stepping together against S servers, the bound and DataLoader",
             (("Lockstep: ranks that step together", "report:lockstep"),), peers=TORCH),
    Scenario("video", "video.py",
             "video clips (`format: video`) against a PyAV clip Dataset in DataLoader",
             (("Video clips: format: video against a PyAV Dataset", "report:video"),),
             peers=(*TORCH, "av")),
    Scenario("decode", "decode.py",
             "the image decode and resample alone on one core, and libjpeg-turbo's full and "
             "cropped decode (the limit rows)",
             (("Image decode alone: stoker's crop decode and libjpeg-turbo's limit",
               "decode:section"),),
             peers=IMAGES),
    Scenario("tables", "tables.py",
             "the same rows as loose parquet, Iceberg, Delta and Lance: global shuffle against "
             "`shuffle: block`, local disk and S3 (moto)",
             (("Tables in lakes: parquet, Iceberg, Delta and Lance", "tables:section"),),
             peers=("pyarrow", "pyiceberg", "deltalake", "pylance")),
)
BY_NAME = {s.name: s for s in SCENARIOS}


def of_script(script: str, name: str | None = None) -> Scenario | None:
    """The scenario `name` if given and known, else the first that runs `script`."""
    if name in BY_NAME:
        return BY_NAME[name]
    return next((s for s in SCENARIOS if s.script == script), None)


README_BEGIN = "<!-- scenarios: begin (made by `python -m benchmarks --readme`) -->"
README_END = "<!-- scenarios: end -->"
# The pages whose scenario list is made from SCENARIOS: the table, and the top README's line.
READMES = (HERE / "README.md", ROOT / "README.md")


def scenario_list(readme: Path) -> str:
    """`readme`'s scenario list, its markers included: benchmarks/README.md has a table, the
    top README.md a line of names."""
    if readme == READMES[0]:
        rows = ["| scenario | script | what it measures |", "| --- | --- | --- |"]
        rows += [f"| `{s.name}` | {s.script} | {s.readme} |" for s in SCENARIOS]
    else:
        rows = [f"The {len(SCENARIOS)} scenarios: "
                + ", ".join(f"`{s.name}`" for s in SCENARIOS) + "."]
    return "\n".join([README_BEGIN, *rows, README_END])


def readme_with_list(readme: Path) -> str:
    """`readme`'s text with its scenario list made from SCENARIOS."""
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:start] + scenario_list(readme) + text[end:]
