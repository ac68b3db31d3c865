"""``shardwise.zero.init``: ``zero.Init``, a model built already sharded, so it may exceed one rank's memory.

- ``context``: the ``Init`` context (parameters on meta, materialized one stage-3 unit at a time).
- ``edits``: what a model's code does to a meta parameter inside the context, replayed at materialize.
- ``folder_source``: a ``from_pretrained`` folder read by element ranges, each rank its own.
- ``hub_names``: the stored tensors transformers converts into a parameter (e.g. per-expert MoE).

Why a room of its own: it builds the model before any group exists and hands the builder its
placeholders and sources; nothing below it in ``zero/`` imports it. The face imports nothing.
"""
