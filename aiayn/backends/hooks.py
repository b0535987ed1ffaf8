"""Whether a forward hook watches a module: paths that skip module calls for speed give way where one does.

A fused encoder layer or the flat decoding step runs a module's arithmetic without calling its sub-modules,
so a hook set on one of them (recorded attention, `aiayn inspect`, a profiler) would never fire. Such a path
asks `hooked` first and runs the modules themselves where it says yes. PyTorch has no public way to ask, so
this reads where it keeps the hooks; it is the one place in aiayn that does.
"""

from __future__ import annotations

import torch
from torch import nn


def hooked(module: nn.Module) -> bool:
    """Whether a forward hook would see a module inside `module`: the module's own, or one that
    `torch.nn.modules.module.register_module_forward_hook` sets on every module (as profilers do)."""
    every_module = torch.nn.modules.module  # where PyTorch keeps the hooks it calls on every module
    if getattr(every_module, "_global_forward_hooks", None) or getattr(every_module, "_global_forward_pre_hooks", None):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
