"""A published checkpoint as a plain Hugging Face folder: weights, config, tokenizer and a model card.

    python -m learner.export --ns NS --version N --out DIR        # or --version latest
    python -m learner.export --ns NS --version N --out DIR --eval runs/NS/eval.json

The weights are the checkpoint's, verified against its manifest's sha256; the optimizer and trainer state
stay behind. The tokenizer is the base model's (its own files) or ByT5's for the byte-level model, so

    AutoModelForCausalLM.from_pretrained(DIR); AutoTokenizer.from_pretrained(DIR)

is all a user needs. README.md is a model card: base model, algorithm, namespace, policy version, what it
was trained on, and the held-out figures of `learner.eval` when given (`--eval`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from learner import checkpoint_store
from learner.checkpoint_files import CONFIG_FILE, MODEL_FILE
from schemas.errors import ConfigError, PipelineError
from schemas.manifests import CheckpointManifest
from schemas.topics import Topics

CARD_FILE = "README.md"
LINEAGE_FILE = "trajpipe_checkpoint.json"


def export(settings: Settings, ns: str, version: Optional[int], out: Path,
           eval_results: Optional[list[dict[str, Any]]] = None) -> Path:
    """Write the checkpoint `version` of `ns` (None: the newest announced) to `out`; returns `out`."""
    store = ObjectStore(settings)
    if version is None:
        newest = checkpoint_store.newest(settings, Topics(ns), store, run=ns)
        if newest is None:
            raise ConfigError(f"{ns} has announced no checkpoint")
        loaded = newest
    else:
        loaded = checkpoint_store.load_version(store, ns, version)
    manifest = loaded.manifest
    out.mkdir(parents=True, exist_ok=True)
    for name in (MODEL_FILE, CONFIG_FILE):
        (out / name).write_bytes(loaded.files[name])
    tokenizer = base_tokenizer(manifest.base_model)
    tokenizer.save_pretrained(str(out))
    config = json.loads(loaded.files[CONFIG_FILE])
    generation = {"eos_token_id": config.get("eos_token_id", tokenizer.eos_token_id),
                  "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                  else config.get("eos_token_id"), "do_sample": True, "temperature": 1.0}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    (out / LINEAGE_FILE).write_text(manifest.to_json().decode())
    versions = [r for r in eval_results or [] if r.get("version") == manifest.version]
    (out / CARD_FILE).write_text(model_card(ns, manifest, versions, eval_results or []))
    return out


def base_tokenizer(base_model: str) -> Any:
    """The base model's tokenizer when it has one, else ByT5's (the byte-level model needs no files)."""
    from producers.policy.tokenizer import has_tokenizer_files, load_hf_tokenizer

    if base_model:
        from infra.models import resolve_model

        folder = resolve_model(base_model)
        if has_tokenizer_files(folder):
            return load_hf_tokenizer(folder)
    return load_hf_tokenizer(None)


def model_card(ns: str, manifest: CheckpointManifest, here: list[dict[str, Any]],
               everything: list[dict[str, Any]]) -> str:
    base = manifest.base_model or "the byte-level model built from its config (no pretrained weights)"
    lines = [
        f"# {ns} v{manifest.version}",
        "",
        f"Post-trained with trajpipe: {manifest.algorithm} (policy version {manifest.version}, step "
        f"{manifest.step}), from {base}.",
        "",
        "| | |", "| --- | --- |",
        f"| base model | {manifest.base_model or '-'} |",
        f"| algorithm | {manifest.algorithm} |",
        f"| data namespace | `{ns}` (topics `{ns}.*`, shards under `shards/{ns}/`) |",
        f"| policy version | {manifest.version} |",
        f"| batches in this version | {len(manifest.batch_ids)} (skipped: {len(manifest.skipped_batches)}) |",
        f"| created | {manifest.created_ts} ms since the epoch |",
        "",
    ]
    if here:
        lines += ["## Held-out evaluation (`learner.eval`, 95% Wilson intervals)", "",
                  "| mode | success | interval | episodes | mean reward |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['mode']} | {r['success']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['episodes']} "
                  f"| {r['reward_mean']:.3f} |" for r in here]
        baseline = [r for r in everything if r.get("version") == 0]
        if baseline and manifest.version != 0:
            lines += ["", "Version 0 (before training): " + ", ".join(
                f"{r['mode']} {r['success']:.3f}" for r in baseline)]
    else:
        lines += ["No evaluation was given (`--eval runs/<ns>/eval.json`, from `python -m learner.eval`)."]
    lines += ["", "Load it:", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH)", "tokenizer = AutoTokenizer.from_pretrained(PATH)",
              "```", "", f"Its lineage (batches, offsets, skipped batches) is in `{LINEAGE_FILE}`.", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.export", description=__doc__.splitlines()[0])
    add_ns_argument(p)
    p.add_argument("--version", default="latest", help="a version number, or latest (default)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write")
    p.add_argument("--eval", type=Path, help="eval.json of learner.eval / the demo, for the model card")
    args = p.parse_args(argv)
    try:
        version = None if args.version == "latest" else int(args.version)
    except ValueError:
        p.error(f"--version {args.version!r}: a number or latest")
    try:
        results = json.loads(args.eval.read_text()) if args.eval else None
        out = export(Settings.from_env(), args.ns, version, args.out, results)
    except (PipelineError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load it with AutoModelForCausalLM / AutoTokenizer .from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
