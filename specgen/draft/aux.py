"""The aux layers a draft reads, in specgen's convention (0-based decoder-layer outputs) and in the serving engines'
(vLLM / speculators number the residual stream entering a layer: id = layer + 1); every method's config records them."""

import transformers


def serving_layer_ids(aux_layers: list[int]) -> list[int]:
    """specgen aux layers (0-based decoder-layer outputs) -> vLLM's `eagle_aux_hidden_state_layer_ids`.

    vLLM (0.32, `llama.py` `_maybe_add_hidden_state`) and speculators number the residual stream entering layer k,
    i.e. Hugging Face `hidden_states[k]` (0 = the embedding output), so the output of decoder layer i is id i + 1.
    """
    return [int(layer) + 1 for layer in aux_layers]


def aux_layers_of(config: transformers.PretrainedConfig) -> list[int]:
    """specgen's aux layers (0-based decoder-layer outputs) of a draft config (see `serving_layer_ids`); a DFlash
    config records them as `dflash_config.target_layer_ids`, the same numbers (`specgen.methods.dflash.model`)."""
    dflash = getattr(config, "dflash_config", None)
    if dflash:
        return [int(layer_id) for layer_id in dflash["target_layer_ids"]]
    return [int(layer_id) - 1 for layer_id in config.eagle_config["eagle_aux_hidden_state_layer_ids"]]


def num_aux_layers(config: transformers.PretrainedConfig) -> int:
    return len(config.eagle_config["eagle_aux_hidden_state_layer_ids"])
