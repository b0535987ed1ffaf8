"""Reading weight files safely: every problem becomes one line that names the file and the tensor.

Before a model runs, its weights are checked key by key: a file that is empty, cut short or not
safetensors at all; a tensor the model lacks or one it needs; a shape that differs; NaN or Inf
values. PyTorch pickles (`pytorch_model.bin`, trainer state) are read with `weights_only=True`,
and a pickle that holds anything but tensors is refused with aiayn's message, not PyTorch's.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from aiayn.paths import check_input_file

MAX_LISTED = 4  # problems named in one message; the rest are counted


class WeightsError(ValueError):
    """A weights file that cannot be used (damaged, unreadable, non-finite); the message names it."""


class WeightsMismatch(WeightsError):
    """An intact weights file made for a different model (keys or shapes differ)."""


def _listed(problems: list[str]) -> str:
    more = len(problems) - MAX_LISTED
    return "; ".join(problems[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, after checking that the file is whole and its values finite."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; a safetensors weights file belongs there")
    check_input_file(path, "weights file")  # a device (a link to /dev/zero), a link loop: said so
    if path.stat().st_size == 0:
        raise WeightsError(f"{path} is empty (0 bytes): it was not written completely; use an intact copy "
                           "(or an earlier checkpoint)")
    try:
        state = load_file(str(path))
    except SafetensorError as err:
        raise WeightsError(f"{path} is not a complete safetensors file ({err}); it is probably truncated: use an "
                           "intact copy (or an earlier checkpoint)") from None
    check_finite(state, path)
    return state


def check_layer_counts(path: str | Path, n_encoder_layers: int, n_decoder_layers: int) -> None:
    """Raise `WeightsMismatch` when a safetensors file holds another number of encoder or decoder layers than a
    config asks for, read from the file's header before the model is built (building 10,000 layers takes a minute
    before the keys could be compared). A file that cannot be read is left to `read_safetensors` to name."""
    try:
        with safe_open(str(path), "pt") as handle:
            keys = list(handle.keys())
    except (SafetensorError, OSError):
        return
    held = {}
    for stack in ("encoder", "decoder"):
        indices = {int(m.group(1)) for key in keys if (m := re.match(rf"{stack}\.layers\.(\d+)\.", key))}
        held[stack] = max(indices) + 1 if indices else 0
    if (held["encoder"], held["decoder"]) != (n_encoder_layers, n_decoder_layers):
        raise WeightsMismatch(f"{path} holds {held['encoder']:,} encoder and {held['decoder']:,} decoder layers, but "
                              f"its config asks for {n_encoder_layers:,} and {n_decoder_layers:,}: the config and the "
                              "weights are not one model's files; use the config saved with these weights")


def check_finite(state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Raise `WeightsError` naming the tensors that hold NaN or Inf."""
    bad = []
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            n_nan = int(torch.isnan(tensor).sum())
            n_inf = int(torch.isinf(tensor).sum())
            bad.append(f"{name} has {n_nan} NaN and {n_inf} Inf values")
    if bad:
        raise WeightsError(f"{source}: non-finite weights ({_listed(bad)}); the model diverged or the file is "
                           "damaged: use an earlier checkpoint")


def read_torch_file(path: str | Path) -> Any:
    """A PyTorch file read with `weights_only=True`: tensors and plain values only, never other pickled objects."""
    path = check_input_file(path, "PyTorch file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise WeightsError(f"{path}: refused: this pickle holds Python objects besides tensors, and loading them "
                           "could run code; convert the checkpoint to safetensors where it was made") from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        reason = str(err).split(". ")[0] if str(err) else type(err).__name__
        raise WeightsError(f"{path} is not a readable PyTorch file ({reason}); it may be truncated: use an intact "
                           "copy (or an earlier checkpoint)") from None


def _aliases(model: nn.Module) -> dict[str, set[str]]:
    """For each state-dict key, the keys that share its storage (tied weights are saved once)."""
    own = model.state_dict()

    def storage(name: str) -> tuple:
        tensor = own[name]  # empty tensors share no data, whatever their pointer says
        return (tensor.data_ptr(), tuple(tensor.shape)) if tensor.numel() else (name,)

    groups: dict[tuple, set[str]] = {}
    for name in own:
        groups.setdefault(storage(name), set()).add(name)
    return {name: groups[storage(name)] for name in own}


def check_fits(model: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Raise `WeightsMismatch` listing, key by key, what the model lacks, what it needs and which shapes or dtypes
    differ."""
    own = model.state_dict()
    aliases = _aliases(model)
    unexpected = sorted(set(state) - set(own))
    missing = sorted(name for name in own if not aliases[name] & set(state))
    shapes = [f"{name} is {tuple(state[name].shape)} in the file but {tuple(own[name].shape)} in the model"
              for name in sorted(set(state) & set(own)) if tuple(state[name].shape) != tuple(own[name].shape)]
    # a tensor of another dtype would be cast silently (int64 weights become other numbers): the file is not this
    # model's, whatever its shapes
    dtypes = [f"{name} is {str(state[name].dtype).removeprefix('torch.')} in the file but "
              f"{str(own[name].dtype).removeprefix('torch.')} in the model"
              for name in sorted(set(state) & set(own)) if state[name].dtype != own[name].dtype]
    problems = (shapes + dtypes + [f"missing {name}" for name in missing]
                + [f"unexpected {name}" for name in unexpected])
    if problems:
        raise WeightsMismatch(f"{source} does not fit the model of its config: {_listed(problems)}")


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Read a safetensors file, check it against `model` key by key and copy it in.

    Keys saved under older names are renamed first where the model says how (`upgrade_keys`).
    """
    state = read_safetensors(path)
    from aiayn.nn.model import upgrade_keys

    upgrade_keys(state)
    check_fits(model, state, path)
    model.load_state_dict(state, strict=False)  # tied aliases absent from the file share a loaded tensor
    return model
