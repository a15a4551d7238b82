"""Distributed runtime: process groups (mesh), TP collectives, pipeline schedule, train step.

mesh.ParallelGroups builds the (tp, pp, dp) groups; collectives holds Megatron's f/g
operators and their modules; schedule runs GPipe/1F1B; engine.ParallelModule trains
one stage. Import the submodules directly (kept light: collectives does not pull in
torch.distributed.pipelining).
"""
