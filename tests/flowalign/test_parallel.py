"""flowalign.parallel: the strategy config, the blocks FSDP wraps, and what each rank holds once sharded
(two gloo processes on CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flowalign.config import ParallelSection, load_config
from flowalign.errors import UserError
from flowalign.parallel import DDP, FSDP, block_modules, is_collective_failure, process_group_released, strategy
from tests.warm_start import free_port, spawn


def test_an_unknown_strategy_is_a_one_line_error_naming_the_field():
    with pytest.raises(UserError) as err:
        load_config(None, ["parallel.strategy=zero3"])
    message = str(err.value)
    assert "parallel.strategy" in message and "zero3" in message and "fsdp" in message and "\n" not in message


def test_fsdp_on_one_process_is_a_one_line_error():
    with pytest.raises(UserError) as err:
        strategy(ParallelSection(strategy="fsdp"), world=1, rank=0, device=torch.device("cpu"))
    assert "parallel.strategy=fsdp" in str(err.value) and "torchrun" in str(err.value) and "\n" not in str(err.value)
    strategy(ParallelSection(strategy="ddp"), world=1, rank=0, device=torch.device("cpu"))  # the default is fine


def test_the_strategy_object_follows_parallel_strategy_and_ddp_needs_no_collectives():
    assert isinstance(strategy(ParallelSection(strategy="fsdp"), 2, 1, "cpu"), FSDP)  # no collective to build it
    ddp = strategy(ParallelSection(strategy="ddp"), world=2, rank=1, device="cpu")
    assert isinstance(ddp, DDP) and not ddp.sharded and not ddp.takes_part()  # only the main rank evaluates
    assert ddp.padded([1, 2], fill=lambda: pytest.fail("ddp pads nothing")) == [1, 2]
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 4.0)
    assert float(ddp.clip_grad_norm([w], max_norm=1.0)) == pytest.approx(48 ** 0.5) and w.grad.norm() == pytest.approx(1.0)
    assert ddp.checksum([w]).item() == 3.0


class _Blocks(torch.nn.Module):
    """A stem and two blocks (found through ``BLOCK_LISTS``)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(2, 2)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_ddp_keeps_a_frozen_copy_whole_and_offloaded_streams_its_blocks_one_at_a_time():
    """On CPU the device moves cannot be seen; what can: an offloaded copy's blocks (and only its blocks)
    get the load/unload hooks around their own forward, a kept one none, and both compute the same."""
    ddp = strategy(ParallelSection(strategy="ddp"), world=1, rank=0, device="cpu")
    torch.manual_seed(0)
    kept = _Blocks()
    offloaded = _Blocks()
    offloaded.load_state_dict(kept.state_dict())
    assert ddp.place_frozen(kept, torch.device("cpu"), offload=False) is kept
    assert ddp.place_frozen(offloaded, torch.device("cpu"), offload=True) is offloaded
    hooks = lambda m: (len(m._forward_pre_hooks), len(m._forward_hooks))  # noqa: E731
    assert all(hooks(m) == (0, 0) for m in kept.modules())
    assert [hooks(m) for m in offloaded.blocks] == [(1, 1), (1, 1)]
    assert hooks(offloaded) == hooks(offloaded.stem) == (0, 0)  # the stem stays on the device
    x = torch.randn(3, 2)
    assert torch.equal(offloaded(x), kept(x))


@pytest.mark.parametrize("family,lists", [("sd3", ["transformer_blocks"]),
                                          ("flux", ["transformer_blocks", "single_transformer_blocks"]),
                                          ("wan", ["blocks"])])
def test_every_transformer_block_of_each_family_is_one_unit(tiny_model_dir, family, lists):
    import pipelines

    policy = pipelines.load(tiny_model_dir(family))
    blocks = block_modules(policy.transformer)
    expected = [b for name in lists for b in getattr(policy.transformer, name)]
    assert len(blocks) == len(expected) > 0 and {id(b) for b in blocks} == {id(b) for b in expected}


def test_collective_failures_are_told_apart_from_other_errors():
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert is_collective_failure(dist.DistBackendError("anything"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))



def _released(rank: int, world: int, port: int, out: str) -> None:
    """One rank: a collective inside ``process_group_released``, rank 1 then failing inside it; record
    whether the group outlived the block."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        with process_group_released():
            dist.init_process_group("gloo", rank=rank, world_size=world)
            total = torch.tensor([rank + 1.0])
            dist.all_reduce(total)
            if rank == 1:
                raise ValueError("a failing step")
    except ValueError:
        pass
    Path(out, f"rank{rank}.json").write_text(json.dumps({"sum": total.item(), "alive": dist.is_initialized()}))


def test_the_process_group_is_destroyed_when_a_run_ends_or_fails(tmp_path):
    """Left alive, a gloo group can abort the interpreter's exit (SIGABRT) after a run that succeeded."""
    spawn(_released, (2, free_port(), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"sum": 3.0, "alive": False}] * 2


def _count_shards(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One rank: shard the tiny SD3 transformer (LoRA, then full weights), take one optimiser step and
    record this rank's share of the trained parameters and of the optimiser state."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import pipelines

    result = {}
    for mode in ("lora", "full"):
        torch.manual_seed(0)
        policy = pipelines.load(model_dir, lora={"rank": 4} if mode == "lora" else None, full_finetune=mode == "full")
        full = sum(p.numel() for p in policy.trainable.parameters() if p.requires_grad)
        strategy(ParallelSection(strategy="fsdp"), world, rank, torch.device("cpu")).shard(policy.trainable)
        params = [p for p in policy.trainable.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        cond = policy.encode(["a red circle"])
        x = policy.initial_noise(1, torch.Generator().manual_seed(0))
        policy.velocity(x, 0.5, cond, 1.0).square().mean().backward()
        optimizer.step()
        local = sum(p.to_local().numel() for p in params)
        state = sum(v.to_local().numel() for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
        result[mode] = {"full": full, "local": local, "state": state,
                        "all_transformer": sum(p.to_local().numel() for p in policy.trainable.parameters())}
        result[mode]["transformer_total"] = sum(p.numel() for p in policy.trainable.parameters())
    # full fine-tuning's frozen reference copy is laid out as the policy is: 1/N of it per rank
    policy = pipelines.load(model_dir, full_finetune=True)
    copy = policy.keep_reference(torch.device("cpu"))
    parallel = strategy(ParallelSection(strategy="fsdp"), world, rank, torch.device("cpu"))
    assert parallel.place_frozen(copy, torch.device("cpu"), offload=False) is copy
    result["reference"] = {"local": sum(p.to_local().numel() for p in copy.parameters()),
                           "total": sum(p.numel() for p in copy.parameters())}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_each_of_two_ranks_holds_about_half_of_the_weights_and_optimiser_state(tiny_sd3_dir, tmp_path):
    spawn(_count_shards, (2, free_port(), str(tiny_sd3_dir), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("lora", "full"):
        full = ranks[0][mode]["full"]
        locals_ = [r[mode]["local"] for r in ranks]
        assert sum(locals_) == full  # the shards tile the trained weights exactly once
        assert all(0.4 * full <= n <= 0.6 * full for n in locals_), (mode, locals_, full)
        states = [r[mode]["state"] for r in ranks]
        assert states == [2 * n for n in locals_]  # AdamW's two moments, each the size of the rank's shard
        frozen_too = [r[mode]["all_transformer"] for r in ranks]  # under LoRA the frozen base is sharded as well
        assert sum(frozen_too) == ranks[0][mode]["transformer_total"]
        assert all(n <= 0.6 * ranks[0][mode]["transformer_total"] for n in frozen_too)
    reference = [r["reference"]["local"] for r in ranks]
    assert sum(reference) == ranks[0]["reference"]["total"] == ranks[0]["full"]["full"]
    assert all(0.4 * ranks[0]["reference"]["total"] <= n <= 0.6 * ranks[0]["reference"]["total"] for n in reference)


def _options_step(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One rank: a LoRA step (forward, backward, clipped norm, AdamW, a reference pass) under each option."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import pipelines

    norms = {}
    for name, opts in {"default": {}, "cpu_offload": {"cpu_offload": True}, "bf16": {"mixed_precision": "bf16"},
                       "keep_gathered": {"reshard_after_forward": False}}.items():
        torch.manual_seed(0)
        policy = pipelines.load(model_dir, lora={"rank": 4})
        parallel = strategy(ParallelSection(strategy="fsdp", **opts), world, rank, torch.device("cpu"))
        parallel.shard(policy.trainable)
        params = [p for p in policy.trainable.parameters() if p.requires_grad]
        cond = policy.encode(["a red circle"])
        x = policy.initial_noise(1, torch.Generator().manual_seed(0))
        policy.velocity(x, 0.5, cond, 1.0).square().mean().backward()
        norms[name] = float(parallel.clip_grad_norm(params, 1.0))
        torch.optim.AdamW(params, lr=1e-3).step()
        with torch.no_grad(), policy.adapter_disabled():
            policy.velocity(x, 0.5, cond, 1.0)
    Path(out, f"rank{rank}.json").write_text(json.dumps(norms))
    dist.destroy_process_group()


@pytest.mark.slow
def test_cpu_offload_bf16_and_kept_gathered_weights_train_like_the_default(tiny_sd3_dir, tmp_path):
    spawn(_options_step, (2, free_port(), str(tiny_sd3_dir), str(tmp_path)), 2)
    norms = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert norms[0] == norms[1]  # the clipped norm is the whole model's, the same on both ranks
    n = norms[0]
    assert n["default"] > 0 and n["cpu_offload"] == n["default"] and n["keep_gathered"] == n["default"]
    assert n["bf16"] != n["default"] and n["bf16"] == pytest.approx(n["default"], rel=0.05)  # bf16 compute
