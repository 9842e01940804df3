"""Aux-layer defaults and validation (specgen.capture.layers)."""

import pytest
from omegaconf import OmegaConf

from specgen.capture.layers import default_aux_layers, validate_aux_layers
from specgen.errors import SpecgenError


@pytest.mark.parametrize("num_layers, expected", [
    (32, [1, 15, 28]),   # Llama-3.1-8B: HF hidden_states [2, 16, 29]
    (36, [1, 17, 32]),   # Qwen3-8B
    (8, [1, 3, 4]),      # the tiny test models
    (7, [1, 2, 3]),      # smallest target with distinct defaults
])
def test_default_aux_layers_are_low_mid_high(num_layers, expected):
    assert default_aux_layers(num_layers) == expected


@pytest.mark.parametrize("num_layers", [1, 2, 4, 5, 6])
def test_default_aux_layers_refuse_small_models(num_layers):
    with pytest.raises(SpecgenError, match=r"capture\.aux_layers=\[") as error:
        default_aux_layers(num_layers)
    assert f"{num_layers} decoder layers" in str(error.value)


@pytest.mark.parametrize("layers", [[5, 0, 2], (3,), [0, 7], OmegaConf.create([4, 1, 6])])
def test_validate_keeps_the_given_order(layers):
    """The order given is the concatenation order, so it must survive validation untouched."""
    assert validate_aux_layers(layers, 8) == list(layers)
    assert all(type(layer) is int for layer in validate_aux_layers(layers, 8))


@pytest.mark.parametrize("layers, offending", [
    ([1, 8], "8"),        # one past the last layer
    ([-1], "-1"),         # negative indices are not wrapped
    ([0, 100], "100"),
])
def test_validate_rejects_out_of_range(layers, offending):
    with pytest.raises(SpecgenError) as error:
        validate_aux_layers(layers, 8)
    message = str(error.value)
    assert "capture.aux_layers" in message and offending in message and "0..7" in message


def test_validate_rejects_duplicates():
    with pytest.raises(SpecgenError, match=r"capture\.aux_layers.*layer 3 twice"):
        validate_aux_layers([3, 1, 3], 8)


@pytest.mark.parametrize("layers", [[1.0, 2], ["1"], [True, 2], [], "123", 3, None])
def test_validate_rejects_non_integer_lists(layers):
    with pytest.raises(SpecgenError, match=r"capture\.aux_layers"):
        validate_aux_layers(layers, 8)
