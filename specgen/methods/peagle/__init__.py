"""P-EAGLE (parallel drafting): the EAGLE-3 layer trained to propose all K draft tokens in one forward.

What vLLM 0.32 serves (`speculative_config.parallel_drafting=True`, v1/spec_decode/llm_base_proposer.py and
utils.py `copy_and_expand_eagle_inputs_kernel`), after the target verified everything up to position p:

    slot 0      position p       token x[p+1] (the target's bonus token)   hidden fc(h[p])            -> draft 0
    slot d>=1   position p + d   token mask_token_id (config.json)         fc(mask_hidden) (learned)  -> draft d

in one causal forward over the verified positions and the K-1 mask slots (`combine_hidden_states(mask_hidden)`,
so fc_norm / input_norm apply to mask_hidden too); draft d is the argmax at slot d. Slot d attends to the base
entries 0..p and the slots 1..d, so it is a chain step at index p whose input does not depend on the previous
draft: specgen's `DraftKV` chain computes exactly that (`PEagleProposer`), and training unrolls it like TTT.

Training (`peagle_forward`), on the same batches as EAGLE-3 (speculators 0.9 `models/peagle`, the reference):
depth 0 at index a is EAGLE-3's step 0 (token x[a+1], the target's h[a]); depth d >= 1 at index a reads the mask
token and fc(mask_hidden) at position a + d, attends to base 0..a and depths 1..d at a, and predicts x[a+d+2]
against the target's distribution at a+d+1, scored where the loss mask says (`train.loss_mask`, as TTT). The loss
is speculators': one mean over every scored (index, depth) element (cross-entropy to the target restricted to
the draft vocabulary, i.e. its KL plus a constant). `train.cod_ratio` (null: every index at every depth) keeps
a random subset per depth as speculators' COD sampling does (`cod_selection`: depth d keeps a share
max(ratio^d, ratio_min) of the indices kept at depth d-1, nested); specgen still computes every element, so COD
only subsamples the loss here, it saves no compute. The mask token's embedding is the target's, frozen (speculators
trains it; vLLM shares the target's embedding with the draft, so a trained row would not be served).
"""

from specgen.methods.peagle.method import METHODS

__all__ = ["METHODS"]
