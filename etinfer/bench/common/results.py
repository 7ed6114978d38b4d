"""One JSON result per benchmark run, in one schema: what was measured, the figures with their
spread, and where (command line, commit, date, CPU model and flags, L3 size, torch, device).

Shaped after llama.cpp's ``llama-bench`` rows (model, backend, test, t/s ± sd, the same rows as
JSON) and vLLM's ``--save-result``: a figure is one number with the labels that say what it is
(engine, mode, batch, model...), its unit, its spread and how many repeats are behind it. The
benchmark's own report rides along under ``details``. ``benchmarks/render.py`` builds
BENCHMARKS.md from the results kept under ``benchmarks/results/``; a run writes under
``results/`` (ignored by git) unless ``--result`` names the file.

Every command of ``etinfer bench`` and ``python -m studies`` writes through ``recorded``: its run
function returns its figures and its report, and ``recorded`` stamps and writes them.

Figures follow one convention, so that a page can select them across benchmarks: ``subject`` a
short lowercase name of the quantity without its unit (``decode``, ``decode step``, ``top-1
agreement``, ``latency``...), the same for the same quantity everywhere; a ratio its own figure
with unit ``x`` and a ``vs`` label naming its reference, measured beside it in the same run;
``labels`` only those that vary or that a reader needs (``engine``, ``model``, ``mode``,
``batch``, ``context``, ``arm``, ``workload``...).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from etinfer.bench.common.machine import ISA_ENV, cpu_flags, cpuinfo

SCHEMA = 1
Label = str | int | float | bool | None


@dataclass
class Figure:
    """One measured number: ``subject`` says what it is (``"decode tok/s"``, ``"top-1
    agreement"``), ``labels`` which arm, model and setting it belongs to."""

    subject: str
    value: float
    unit: str = ""  # "tok/s", "x" (a ratio), "ms", "s", "%", "MiB", "nats"...
    labels: dict[str, Label] = field(default_factory=dict)
    # The spread over the repeats: {"sd": ...}, {"min": ..., "max": ...} or {"ci95": [lo, hi]}.
    spread: dict[str, float | list[float]] | None = None
    n: int | None = None  # repeats behind the value


@dataclass
class Host:
    cpu: str
    flags: str  # the flags that choose kernels (avx2 avx512f avx512_vnni ...)
    l3_mib: float | None
    cores: int | None
    isa_held: str | None  # "avx2" where an AVX-512 host was held to AVX2 (ISA_ENV), else None
    torch: str
    device: str  # "cpu", or the GPU's name
    python: str

    @classmethod
    def here(cls, device: str = "cpu", held: str | None = None) -> Host:
        """This host; ``held``: the ISA the run held its engines to (by default this
        process's own hold)."""
        held = held or os.environ.get("ATEN_CPU_CAPABILITY")
        return cls(
            cpu=cpuinfo("model name") or platform.processor() or platform.machine(),
            flags=cpu_flags(),
            l3_mib=_l3_mib(),
            cores=os.cpu_count(),
            isa_held=held if held in ISA_ENV else None,
            torch=torch.__version__,
            device=_device_name(device),
            python=platform.python_version(),
        )

    @property
    def kind(self) -> str:
        """What a reader compares across: the GPU, or the CPU's vector width as it computed."""
        if self.device != "cpu":
            return self.device
        if self.isa_held:
            return f"{self.isa_held.upper()} (held)"
        return "AVX-512" if "avx512f" in self.flags.split() else "AVX2"


@dataclass
class Result:
    benchmark: str  # the command's name: "quantization", "ablation"...
    command: str  # the command line that produced it
    date: str  # UTC, ISO 8601
    commit: str | None  # the checkout's commit, "+dirty" where it had changes
    host: Host
    figures: list[Figure]
    details: dict = field(default_factory=dict)  # the benchmark's own report
    # None where the run wrote it; otherwise where its figures were taken from (a result kept
    # from before results were data, transcribed with its own date, commit, host and command).
    provenance: str | None = None
    schema: int = SCHEMA

    def to_json(self) -> str:
        return compact_json(dataclasses.asdict(self)) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> Result:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"a result's 'schema' must be {SCHEMA}, got {data.get('schema')!r}")
        data = dict(data)
        data["host"] = Host(**data["host"])
        data["figures"] = [Figure(**f) for f in data["figures"]]
        return cls(**data)

    @classmethod
    def read(cls, path: Path) -> Result:
        return cls.from_dict(json.loads(Path(path).read_text()))


def compact_json(value: object, indent: str = "") -> str:
    """JSON with each record on one line (a figure, the host: a mapping of plain values or of
    lists and mappings of plain values) and anything else under 100 characters; the rest nested,
    one space a level. A kept result reads as a table of figures, and a changed figure is one
    changed line of a diff."""
    flat = json.dumps(value)
    if not isinstance(value, dict | list) or not value or _is_record(value):
        return flat
    if len(indent) + len(flat) <= 100:
        return flat
    inner = indent + " "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {compact_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    items = [inner + compact_json(v, inner) for v in value]
    return "[\n" + ",\n".join(items) + f"\n{indent}]"


def _is_record(value: object) -> bool:
    def plain(v: object) -> bool:
        return not isinstance(v, dict | list)

    def shallow(v: object) -> bool:
        members = v.values() if isinstance(v, dict) else v if isinstance(v, list) else [v]
        return all(plain(m) for m in members)

    return isinstance(value, dict) and all(shallow(v) for v in value.values())


def new_result(
    benchmark: str,
    figures: list[Figure],
    details: dict | None = None,
    *,
    device: str = "cpu",
    program: str = "etinfer",
    argv: list[str] | None = None,
    commit: str | None = None,
    isa_held: str | None = None,
) -> Result:
    """A result of this run, stamped with this command line (``program`` and ``argv``, by
    default this process's arguments), checkout (``commit``: as it was when the run started,
    by default now), date and host."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return Result(
        benchmark=benchmark,
        command=" ".join([program, shlex.join(sys.argv[1:] if argv is None else argv)]),
        date=now.isoformat().replace("+00:00", "Z"),
        commit=commit or checkout_commit(),
        host=Host.here(device, isa_held),
        figures=figures,
        details=details or {},
    )


def write_result(result: Result, path: str | Path | None = None) -> Path:
    """``path``, or ``results/<benchmark>/<date>-<commit>.json`` under the working directory."""
    if path is None:
        stamp = result.date.replace(":", "").replace("-", "")
        path = Path("results") / result.benchmark / f"{stamp}-{result.commit or 'nocommit'}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.to_json())
    return path


def add_result_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--result",
        metavar="PATH",
        help="where the run's JSON result goes (default: results/<benchmark>/<date>-<commit>.json)",
    )


def recorded(
    benchmark: str,
    run: Callable[[argparse.Namespace], tuple[list[Figure], dict]],
    program: str = "etinfer",
) -> Callable[[argparse.Namespace], int]:
    """A command's function that runs ``run`` and writes its figures as one result (``details``
    may name the ``device`` it ran on; the CPU otherwise). ``program``: how the command line
    starts (``python -m studies`` for a study)."""

    def command(args: argparse.Namespace) -> int:
        # The code that runs is the checkout's at the start: edits made meanwhile are not in it.
        commit = checkout_commit()
        figures, details = run(args)
        device = details.get("device", "cpu")
        # A run that holds only its child engines to an ISA (``--isa``) ran on a held host.
        held = getattr(args, "isa", None)
        result = new_result(
            benchmark,
            figures,
            details,
            device=device,
            program=program,
            commit=commit,
            isa_held=held,
        )
        path = write_result(result, args.result)
        print(f"result: {path}")
        return 0

    return command


def engine_device(engine_kwargs: dict) -> str:
    """The device engines built with these settings run on (``cpu``, ``cuda``...), for a run
    whose engines are gone by the time it is recorded."""
    from etinfer.config import EngineConfig

    return str(EngineConfig(device=engine_kwargs.get("device", "auto")).torch_device())


def model_labels(path: Path) -> dict[str, Label]:
    """The labels that name a model's file: a short name (``SmolLM2-135M-Instruct Q4_1``) and
    its size in MiB; a folder's name alone."""
    path = Path(path)
    if path.is_dir():
        return {"model": path.name}
    name = path.stem.rsplit(".", 1)  # "SmolLM2-135M-Instruct.Q4_1": the model, its format
    return {"model": " ".join(name), "model_mib": round(path.stat().st_size / 2**20, 1)}


def checkout_commit() -> str | None:
    """The commit of the checkout etinfer runs from, "+dirty" where it has uncommitted changes;
    None outside a git checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _l3_mib() -> float | None:
    """The last-level cache the kernel reports for CPU 0 (index3 is L3 on x86 Linux)."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    units = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
    return float(size[:-1]) * units[size[-1]] if size[-1] in units else float(size) / 2**20


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"
