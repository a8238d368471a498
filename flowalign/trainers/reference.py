"""The reference model of full fine-tuning: a frozen copy of the trained weights as training starts.

Under LoRA a reference pass (a KL term's ``μ_ref``) switches the adapter off, with no second copy. Full
fine-tuning has no adapter, so the policy keeps a frozen copy of its trained modules, which its
``adapter_disabled()`` then runs in their place. Under fsdp the copy is sharded like the policy (``1/N``
of it per rank, gathered block by block for a reference pass). ``offload`` keeps it in CPU memory: under
fsdp its shards (FSDP2's CPU offload), under ddp its blocks, each moved to the device only for its own
forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowalign.errors import UserError
from flowalign.parallel import Parallel


def keep_reference(policy: Any, parallel: Parallel, offload: bool) -> nn.Module:
    """Have ``policy`` keep its reference copy (called before the policy is sharded or trained)."""
    if not hasattr(policy, "keep_reference"):
        raise UserError(f"the {getattr(policy, 'family', type(policy).__name__)} policy keeps no reference copy for "
                        "full fine-tuning: use model.finetune=lora (the reference is the adapter switched off) or "
                        "drop the reference term (trainer.beta=0 for flow_grpo, trainer.anchor=0 for rg_opd)")
    device = torch.device(policy.device)
    copy = policy.keep_reference(torch.device("cpu") if offload else device)
    return parallel.place_frozen(copy, device, offload)

