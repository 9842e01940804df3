"""Which target layers an EAGLE-3 draft reads, and the indexing convention for them.

Convention (public: configs, shard metadata and the trainer all use it):

* `aux_layers` are 0-based decoder-layer OUTPUT indices. Aux layer `i` is the output of decoder
  layer `i`, before the final norm. In Hugging Face terms that is `hidden_states[i + 1]` of
  `model(..., output_hidden_states=True)` for `i < L - 1` (`hidden_states[0]` is the embedding
  output). HF's last entry `hidden_states[L]` is the *post-norm* state, whereas our aux layer
  `L - 1` is the raw output of the last decoder layer.
* The default EAGLE-3 choice is low / middle / high: `[1, L//2 - 1, L - 4]`, i.e. HF
  `hidden_states` indices `[2, L//2, L - 3]`.
* The order of `aux_layers` is the order in which the layers are concatenated along the hidden
  dimension, so it is kept exactly as given.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from specgen.errors import SpecgenError


def default_aux_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 low/mid/high layers `[1, L//2 - 1, L - 4]` for a target with `num_layers` layers."""
    layers = [1, num_layers // 2 - 1, num_layers - 4]
    if not all(0 <= a < b < num_layers for a, b in zip(layers, layers[1:])):
        raise SpecgenError(
            f"the target has {num_layers} decoder layers, too few for distinct default EAGLE-3 aux layers "
            f"[1, L//2-1, L-4] = {layers}; pass capture.aux_layers=[...] with distinct indices in [0, {num_layers - 1}]"
        )
    return layers


def resolve_aux_layers(requested: Sequence[int] | None, num_layers: int) -> list[int]:
    """`capture.aux_layers` (`requested`) checked against a `num_layers`-layer target; None: the EAGLE-3 default."""
    return default_aux_layers(num_layers) if requested is None else validate_aux_layers(list(requested), num_layers)


def validate_aux_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Check user-given aux layers against a target with `num_layers` decoder layers.

    Returns them as a plain list of ints in the given order (the concatenation order). Negative
    indices are refused rather than wrapped: `-1` would silently mean the pre-norm last layer,
    which is rarely what someone porting an `hidden_states[-1]` habit intends.
    """
    valid = f"0..{num_layers - 1} (0-based decoder-layer outputs of a {num_layers}-layer target)"
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise SpecgenError(f"capture.aux_layers must be a non-empty list of layer indices in {valid}, got {layers!r}")
    checked: list[int] = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise SpecgenError(f"capture.aux_layers entry {layer!r} is not an integer; use indices in {valid}")
        if not 0 <= layer < num_layers:
            raise SpecgenError(f"capture.aux_layers entry {layer} is out of range; use indices in {valid}")
        if layer in checked:
            raise SpecgenError(f"capture.aux_layers lists layer {layer} twice ({list(layers)}); list each layer once")
        checked.append(int(layer))
    return checked


@contextmanager
def layer_output_hooks(layers: torch.nn.ModuleList, indices: Sequence[int],
                       keep: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Inside the block, every forward of decoder layer `i` (for `i` in `indices`) calls `keep(i, hidden_states)`
    with that layer's output; the hooks are removed on leaving it, errors included, so a model shared with other
    code carries no hook of ours outside the block."""

    def hook_for(index: int):
        def hook(module, args, output):
            keep(index, output[0] if isinstance(output, tuple) else output)
        return hook

    hooks = [layers[index].register_forward_hook(hook_for(index)) for index in indices]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
