"""Where a named pretrained model's converted folder lives, for services that take `--model NAME`."""
from __future__ import annotations

from pathlib import Path

from infra.settings import cache_dir
from schemas.errors import ConfigError
from schemas.models import PRETRAINED


def pretrained_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def resolve_model(name_or_dir: str) -> str:
    """A model name (`smollm2-135m`) to its converted folder, or a local directory as it is."""
    if name_or_dir not in PRETRAINED:
        if not (Path(name_or_dir) / "config.json").is_file():
            raise ConfigError(f"--model {name_or_dir!r}: neither a known model ({', '.join(PRETRAINED)}) nor a "
                              "checkpoint directory with a config.json")
        return name_or_dir
    folder = pretrained_dir(name_or_dir)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--model {name_or_dir}: not converted yet; run `python -m learner.pretrained {name_or_dir}` "
                          f"once (it writes {folder})")
    return str(folder)
