"""FSDP for a policy that does not fit one device: `torchrun --nproc-per-node N -m learner ... --fsdp`.

Each decoder layer and the whole model are sharded with FSDP2 (`fully_shard`): a rank keeps 1/N of every
weight, gradient and Adam moment, and gathers a layer's weights only while it computes that layer. The
trainer shards the policy at its first update (so the initial checkpoint and a restore load full weights,
as without FSDP) and moves the optimizer's moments into the shards. Checkpoints stay whole: every rank takes
part in gathering the full weights and moments, rank 0 writes them, so a run resumes with any number of
ranks, with or without FSDP. The KL/DPO reference is not sharded (every rank holds it whole).

    shard(model)                                   # in place; parameters become DTensor shards
    full = full_state(model, optimizer, names)     # collective: (weights, standard optimizer state) on rank 0
    load_full_optimizer_state(model, optimizer, state, names)   # a full state (every rank) into the shards
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model: Any) -> None:
    """Every decoder layer its own FSDP unit (gathered one at a time), then the rest (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers or ():
        fully_shard(layer)
    fully_shard(model)


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               names: Sequence[str]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The whole weights and optimizer state, gathered from every rank (all must call it); rank 0 gets them,
    the others empty ones. The optimizer state comes in torch's own layout (parameters by index in `names`'
    order), as an unsharded optimizer's `state_dict()` would give it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights: dict[str, Any] = dict(get_model_state_dict(model, options=_options()))
    by_name: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=_options()))
    if not weights:
        return {}, {}
    # As an unsharded model's checkpoint: a tied alias (lm_head = embeddings) is written once
    kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {k: v.contiguous() for k, v in weights.items() if k in kept}, _by_index(by_name, names)


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              names: Sequence[str]) -> None:
    """A whole optimizer state in torch's own layout (every rank holds it) into this rank's shards: each moment
    is cut as its parameter is (`distribute_tensor` with the parameter's mesh and placements, no traffic).

    Not `set_optimizer_state_dict`: measured here, it gave rank 1 its shards of exp_avg and exp_avg_sq
    mixed up when the state's keys came in another order than the optimizer makes them (negative second
    moments, then NaN)."""
    from torch.distributed.tensor import distribute_tensor

    params = dict(model.named_parameters())
    # In parameter order, each parameter's keys sorted: gathering them again for a checkpoint walks this order,
    # one collective per value, and every rank must walk the same one.
    for index in sorted(state["state"], key=int):
        param: Any = params[names[int(index)]]  # a DTensor: its mesh and placements say how it is cut
        per_param = state["state"][index]
        optimizer.state[param] = {
            key: distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                                   src_data_rank=None)
            if isinstance(value, Tensor) and value.dim() else value.clone() if isinstance(value, Tensor) else value
            for key, value in sorted(per_param.items())}
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        group.update({key: value for key, value in saved.items() if key != "params"})


def _by_index(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def dummy_pass(model: Any, device: torch.device) -> None:
    """A forward and backward that adds nothing to any gradient: a rank with no share of the batch still joins
    the collectives every sharded layer makes, or the other ranks would wait on it forever."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    (model(input_ids=ids).logits.sum() * 0.0).backward()


def as_float(norm: Tensor) -> float:
    """A gradient norm as a float, whether the parameters are sharded (a DTensor norm) or not."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
