"""``shardwise.sharded_init``: ``zero.Init``, a model built already sharded, so it may exceed one rank's memory.

- ``context``: the ``Init`` context (parameters on meta, materialized one stage-3 unit at a time).
- ``edits``: what a model's code does to a meta parameter inside the context, replayed at materialize.
- ``folder_source``: a ``from_pretrained`` folder read by element ranges, each rank its own.
- ``hub_names``: the stored tensors transformers converts into a parameter (e.g. per-expert MoE).

Why a package of its own, below ``zero/``: it builds the model before any group exists and hands the
builder its placeholders and sources, so it needs nothing of ZeRO's (only ``files/`` and ``comm/``), while
``zero/`` (``zero.Init``, ``GatheredParameters``), ``fsdp/``, ``inference/`` and ``moe/`` use it. Inside
``zero/`` it made that package the largest of the house (13% of the lines); here each reads alone.
DeepSpeed's name for it stays ``shardwise.zero.Init``. The face imports nothing.
"""
