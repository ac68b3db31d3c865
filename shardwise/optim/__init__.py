"""``shardwise.optim``: what steps the master weights, the same for every ZeRO stage and front end.

- ``optimizers``: the optimizer a DeepSpeed ``optimizer`` section names, or the client's, rebuilt
  over the master shards.
- ``schedules``: DeepSpeed's LR schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``).
- ``ds_optimizers``: DeepSpeed's own config optimizers (Lamb, Muon), stepped whole-tensor.
- ``loss_scale``: fp16 dynamic loss scaling with DeepSpeed's semantics.
- ``grad_norm``: the global gradient 2-norm over ZeRO shards and TP slices (one definition).

Why a package: these five are what the engine's ``step()`` runs between the reduced gradients and
the publish, and none of them knows a process group layout; the package imports nothing at its
face, so reaching one part does not load the others.
"""
