"""DFlash: a block-diffusion draft that proposes K tokens in ONE forward, from the target's context features.

What vLLM 0.32 serves (`method="dflash"`, `model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`),
and therefore what is trained here, with the same module names:

    ctx      = hidden_norm(fc(concat(aux hidden states of the target)))     # [S, k*H_t] -> [S, H], one per
                                                                            # verified position 0..p-1
    block    = embed([x_p, M, M, ..., M])                                   # 1 + K query slots at positions
                                                                            # p..p+K: the bonus token x_p, then
                                                                            # K mask tokens (dflash_config.mask_token_id)
    layer l  : q from input_layernorm(block);  keys/values = [k_proj/v_proj(ctx) ; k_proj/v_proj(input_layernorm(block))]
               q_norm / k_norm per head, then rotary (context keys at their own positions); every slot sees all
               context entries and (non-causal, the default) every slot of its block; Qwen3 layer otherwise
    logits   = lm_head(norm(block))   slot j = 1..K predicts token x_{p+j} (the slot's OWN position, no shift)

The context projection does NOT go through the layer's input_layernorm (vLLM's `precompute_and_store_context_kv`
normalises with hidden_norm only). The token embedding is the target's (frozen, not stored: vLLM shares it); the
LM head covers the draft vocabulary (`d2t`, as EAGLE-3) and is stored.

Layer ids: specgen's `capture.aux_layers` are 0-based decoder-layer OUTPUT indices, which is exactly DFlash's
`dflash_config.target_layer_ids` (SpecForge `extract_context_feature` reads hidden_states[id + 1]); vLLM turns them
into its EAGLE-3 aux ids as id + 1 (`get_eagle3_aux_layers_from_config`), i.e. the residual stream entering layer
id + 1 = the output of layer id. So `target_layer_ids == aux_layers`, with no shift (tested against vLLM's code).

Training (`dflash_loss`): per row, anchors a are sampled among positions whose token x_a and next token x_{a+1}
are trained (loss_mask) inside one sample; each anchor makes one block [x_a, M, ..., M] at positions a..a+B-1
(B = block_size = K + 1) that attends to the context entries 0..a-1 of its own sample and to its own block.
Slot k >= 1 is scored where loss_mask[a+k] holds (same sample, inside the row) against the target's distribution
at position a+k-1 (lm_head(last_hidden_state[a+k-1]), the distribution of token a+k), restricted to the draft
vocabulary; loss = sum over scored slots of exp(-(k-1)/gamma) * KL(target || draft) / number of scored slots
(speculators 0.9's DFlash loss; SpecForge uses hard data labels instead).
"""

from specgen.methods.dflash.method import METHODS

__all__ = ["METHODS"]
