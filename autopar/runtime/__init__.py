"""Distributed runtime: process groups, TP operators, pipeline schedule, ZeRO, train step.

mesh.ParallelGroups builds the (tp, pp, dp) groups; tp_ops holds Megatron's f/g operators
and their sequence-parallel relatives, tp_modules the modules the TP rewrite inserts,
vocab_parallel the vocabulary-split embedding and cross-entropy; schedule runs GPipe /
1F1B / interleaved 1F1B; engine.ParallelModule trains this rank's model chunks; zero and
fsdp shard over DP; rng keeps the per-rank dropout streams; checkpoint saves and loads the
training state across plans (checkpoint_state maps it to the checkpoint's keys, shard_state
reads one parameter whole out of ZeRO's flat slices or FSDP2's shards, checkpoint_files
makes a save whole or absent and checks a load, checkpoint_export moves whole weights in and
out); expert_parallel runs a transformers experts module's E/ep local experts with
tokens dispatched and combined by all-to-all; stats measures a step; launch starts local
gloo processes; compat
holds the private torch APIs autopar uses. Import the submodules directly (kept light:
tp_ops does not pull in torch.distributed.pipelining).
"""
