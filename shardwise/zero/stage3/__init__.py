"""``shardwise.zero.stage3``: the stage-3 gather machinery, what makes a parameter whole while it is used.

- ``fetcher``: ``ParamFetcher``, the units (``find_units``), gather before a unit's forward and
  backward (prefetching the next), release after.
- ``direct_calls``: a submodule called on its own (outside its unit's forward) gathers what it reads.
- ``external``: ``ds_external`` parameters, and the check that a released parameter is not read.
- ``leaf``: z3 leaf modules (a module gathered whole, as one unit, e.g. an MoE block).
- ``gathered``: ``GatheredParameters``, the user's context that gathers parameters for a while.

Why a room of its own: these schedule the group's ``gather``/``release`` (``flat_group.py``,
``gather_state.py``) around the model's modules; the group below knows nothing of modules. The face
imports nothing, so a part is reached without loading the others.
"""
