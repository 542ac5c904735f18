"""The defaults of every run-config key of the Flower apps (re-exported as
:data:`fedbasin.config.DEFAULT_RUN_CONFIG`, which resolves and checks run configs).

A table of plain values, apart from the code that reads it, so that the model builders that compare
a run's values with the defaults (:mod:`fedbasin.causal_lm`) need not import ``fedbasin.config``,
which imports them.
"""

from __future__ import annotations

DEFAULT_RUN_CONFIG: dict[str, bool | int | float | str] = {
    # rounds and reproducibility
    "num-server-rounds": 3,
    "seed": 0,
    # data (see fedbasin.data.load_task) and partitioning across nodes
    "data": "digits",
    "partitioner": "iid",  # iid | dirichlet
    "dirichlet-alpha": 0.5,
    "proxy-size": 0,  # examples held back by the server for later refinement
    "proxy-selection-fraction": 0.2,  # share of the proxy split that keep-best scores (refinement, distillation)
    "proxy-evaluation-fraction": 0.2,  # share only reported (0: none; those examples train)
    "max-train-examples": 0,  # 0: the whole training split
    "block-size": 64,  # text sources: tokens per example
    # model: fields of the family's config; 0 or "" keeps the data's/family's default
    "model.dim": 64,
    "model.depth": 2,
    "model.heads": 4,
    "model.mlp-dim": 128,
    "model.norm": "layernorm",
    "model.activation": "gelu",
    "model.bias": True,
    "model.patch-size": 0,  # vit only
    "model.position": "",  # gpt only: learned | rope
    "model.kv-heads": 0,  # hf-config model types with grouped-query attention; 0: as many as heads
    # Hugging Face causal LMs on text data (fedbasin.causal_lm); "" keeps fedbasin's own models
    "hf-config": "",  # a model type (gpt2 | gpt_neox | llama | mistral | qwen2) sized by model.*, or a config.json
    "hf-pretrained": "",  # a saved model directory (or hub id): its weights start the run
    "tokenizer": "",  # Hugging Face tokenizer directory (or hub id) for text data; "": hf-pretrained's
    # local training on each node
    "init": "server",  # server: start from the broadcast model | client: round 1 from a node seed
    "local-epochs": 5,
    "lr": 0.002,
    "batch-size": 16,
    "weight-decay": 0.01,
    "device": "auto",  # auto | cpu | cuda | cuda:N
    # strategy
    "alignment": True,
    "symmetry": "orthogonal",  # orthogonal | permutation
    "align-iterations": 20,
    "universe-iterations": 1,  # >1: re-align every client to the running average (universe matching)
    "refine-steps": 0,  # >0: learned refinement on the server's proxy split (needs proxy-size >= 10)
    "refine-lr": 0.01,
    "refine-head-lr": 0.0,  # >0: Adam's learning rate for the per-head QK/OV maps (0: refine-lr)
    "refine-permutations": "ste",  # ste (straight-through Hungarian) | sinkhorn | fixed (the matching's)
    "refine-group": "orthogonal",  # orthogonal | invertible (per-head QK/OV maps, ReLU neuron scalings)
    "refine-start": "symmetry",  # symmetry (`symmetry`'s mode) | permutation | orthogonal | best (both, the better)
    "refine-lambda": "0.4,0.6",  # LO,HI: two models train at λ ~ U(LO, HI) on their path
    "refine-schedule": "constant",  # constant | cosine (learning rate decays to 0 over refine-steps)
    "refine-soft-labels": 0.0,  # w in [0, 1]: the maps train on (1 - w) labels + w the clients' mean probabilities
    "refine-soft-label-top-k": 0,  # k > 0: soft labels kept as each target's k largest entries (sparse)
    "refine-workers": 0,  # threads sharing each refinement batch (0: one per torch CPU thread; fixed: same result anywhere)
    "distill-steps": 0,  # >0: distil the clients' logit ensemble into the merge on the proxy split
    "distill-lr": 0.002,
    "distill-temperature": 3.0,
    "distill-label-weight": 0.0,  # w in [0, 1]: (1 - w) KL to the ensemble + w CE on the proxy labels
    "distill-augment": "none",  # none | crop | crop-flip: random views of the transfer images (image data)
    "distill-teacher": "logits",  # logits | probabilities: the ensemble averages the clients' logits or probabilities
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-nodes": 2,
    # robust aggregation (server side; see fedbasin.strategies.AlignedFedAvg, docs/robustness.md)
    "max-abs-weight": 1e6,  # a reply holding any |value| above this is excluded
    "max-num-examples": 1000000,  # num-examples cap (0: none)
    "max-examples-ratio": 1.0,  # and at most this × the round's lower-median count (0: none)
    "outlier-threshold": 3.5,  # MAD rule in the aligned basis, and two equal camps fail the round (0: off)
    "proxy-screening": 0.0,  # t > 0: exclude replies whose proxy loss > (1 + t) × the lower median of the cohort's proxy losses
    "clip-ratio": 0.0,  # >0: clip updates to this × the median update norm
    "aggregator": "mean",  # mean | trimmed-mean | median (coordinate-wise, after alignment)
    "trim-fraction": 0.25,  # trimmed-mean: fraction dropped at each end
    # server outputs
    "out-dir": "runs/flower",
    "resume": False,
    "overwrite": False,  # a fresh run may replace the outputs of an earlier run in out-dir
    "rebuild-results": False,  # resume: rebuild a missing/damaged results.json from checkpoints
}
