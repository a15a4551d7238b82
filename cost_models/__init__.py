"""cost_models: analytic prices of compute, memory and communication for GPT training.

A standalone package (standard library only; it imports neither torch nor
autopar).  It prices quantities -- FLOPs, bytes, group sizes -- on a described
cluster; it does not read graphs.  Modules:

* :mod:`cost_models.hardware` -- DeviceSpec, LinkSpec, Cluster and the JSON presets
* :mod:`cost_models.compute`  -- roofline op time, GEMM tile/wave quantisation, GPT model FLOPs
* :mod:`cost_models.memory`   -- ZeRO model states, Korthikanti activations, in-flight micro-batches
* :mod:`cost_models.comm`     -- ring alpha-beta collectives, the two-level all-to-all, pipeline sends,
  the link a group crosses
* :mod:`cost_models.moe`      -- mixture-of-experts layers: dispatch bytes and time, expert FLOPs,
  tokens per expert, expert states under expert parallelism and ZeRO, dispatch buffers
* :mod:`cost_models.pipeline` -- bubble fraction and pipelined step time
* :mod:`cost_models.reserve`  -- the memory reserve: CUDA context, NCCL buffers, step temporaries,
  fragmentation
"""

from ._checks import RECOMPUTE_MODES
from .comm import (COLLECTIVE_KINDS, all_gather_time_s, all_reduce_time_s, all_to_all_time_s,
                   collective_time_s, group_link, p2p_time_s, pipeline_send_time_s,
                   reduce_scatter_time_s)
from .compute import (dispatched_time_s, gemm_efficiency, gemm_time_s, gpt_model_flops,
                      matmul_time_s, memory_bound_time_s, op_time_s)
from .hardware import PRESET_NAMES, Cluster, DeviceSpec, LinkSpec
from .memory import (ADAM_OPTIMIZER_BYTES_PER_PARAM, all_forwards_in_flight,
                     interleaved_in_flight, model_state_bytes,
                     one_forward_one_backward_in_flight, transformer_layer_activation_bytes)
from .moe import (BALANCED_ROUTING, MOE_FORWARD_ALL_TO_ALLS, SWITCH_CAPACITY_FACTOR,
                  expert_data_parallel_size, expert_model_state_bytes,
                  expert_param_count_per_rank, expert_params, moe_all_to_all_time_s,
                  moe_all_to_alls_per_layer, moe_dispatch_buffer_bytes, moe_dispatch_bytes,
                  moe_expert_flops, moe_router_flops, tokens_per_expert)
from .pipeline import bubble_fraction, pipeline_step_time_s
from .reserve import RESERVE_KINDS, MemoryReserve

__all__ = [
    "ADAM_OPTIMIZER_BYTES_PER_PARAM",
    "BALANCED_ROUTING",
    "COLLECTIVE_KINDS",
    "MOE_FORWARD_ALL_TO_ALLS",
    "PRESET_NAMES",
    "RECOMPUTE_MODES",
    "RESERVE_KINDS",
    "SWITCH_CAPACITY_FACTOR",
    "Cluster",
    "DeviceSpec",
    "LinkSpec",
    "MemoryReserve",
    "all_forwards_in_flight",
    "all_gather_time_s",
    "all_reduce_time_s",
    "all_to_all_time_s",
    "bubble_fraction",
    "collective_time_s",
    "dispatched_time_s",
    "expert_data_parallel_size",
    "expert_model_state_bytes",
    "expert_param_count_per_rank",
    "expert_params",
    "gemm_efficiency",
    "gemm_time_s",
    "gpt_model_flops",
    "group_link",
    "interleaved_in_flight",
    "matmul_time_s",
    "memory_bound_time_s",
    "model_state_bytes",
    "moe_all_to_all_time_s",
    "moe_all_to_alls_per_layer",
    "moe_dispatch_buffer_bytes",
    "moe_dispatch_bytes",
    "moe_expert_flops",
    "moe_router_flops",
    "one_forward_one_backward_in_flight",
    "op_time_s",
    "p2p_time_s",
    "pipeline_send_time_s",
    "pipeline_step_time_s",
    "reduce_scatter_time_s",
    "tokens_per_expert",
    "transformer_layer_activation_bytes",
]
