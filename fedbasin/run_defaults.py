"""The defaults of every run-config key of the Flower apps (re-exported as
:data:`fedbasin.config.DEFAULT_RUN_CONFIG`, which resolves and checks run configs).

A table of plain values, apart from the code that reads it, so that the model builders that compare
a run's values with the defaults (:mod:`fedbasin.causal_lm`) need not import ``fedbasin.config``,
which imports them.
"""

from __future__ import annotations

from fedbasin.options import run_config_defaults

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
    # strategy (matching, refinement, distillation and robust aggregation: fedbasin.options, added below)
    "alignment": True,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-nodes": 2,
    # server outputs
    "out-dir": "runs/flower",
    "resume": False,
    "overwrite": False,  # a fresh run may replace the outputs of an earlier run in out-dir
    "rebuild-results": False,  # resume: rebuild a missing/damaged results.json from checkpoints
}
# the schema's options (fedbasin.options): matching, learned refinement, distillation, robust aggregation
DEFAULT_RUN_CONFIG.update(run_config_defaults())
