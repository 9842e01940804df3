"""Training a draft: the loop and what feeds it, for every method (`specgen.methods`).

    setup.py        the training seam: `build_training(settings)` -> (trainer, data), from the typed settings
    trainer.py      the loop: steps, metrics.jsonl, TensorBoard, checkpoints, resume
    strategy.py     how the draft is replicated: DDP or DeepSpeed ZeRO-2 under `accelerate launch`
    optim.py        AdamW or Muon (+ AdamW for the rest)
    plan.py         deterministic length-bucketed (or packed) batch plans, split over processes
    offline.py      batches from shards;  online.py: batches captured by the target in the loop
    probe.py        acceptance length of the live draft during training; held-out scoring
"""
