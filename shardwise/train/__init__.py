"""`shardwise train`'s job: model, data, loop, outputs, run folder; see docs/train.md.

Its flags and run config file are read in ``shardwise.cli.train`` (the command), which calls
``shardwise.train.run.main`` with them.
"""
