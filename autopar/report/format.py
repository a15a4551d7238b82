"""Numbers and names as the report and the command line print them.

Time in seconds (``12.3 s``, ``45.6 ms``, ``7.8 µs``), memory in binary units (1 GiB =
2**30 bytes, as device memory is quoted), throughput in TFLOP/s (10**12 FLOP per second),
layouts as Megatron-LM style flags (``tp=8 pp=16 dp=8 mbs=1``). Also the display order
of the kinds a :class:`~autopar.contract.plan.Prediction` splits step time and memory into, shared
by the Markdown sections, the charts and ``autopar compare``. Reads only the Plan.
"""

from __future__ import annotations

from typing import Iterable

from autopar.contract.plan import Layout, Plan, recompute_counts  # recompute_counts: re-exported

__all__ = ["GIB", "recompute_counts", "TIME_KINDS", "MEMORY_KINDS", "TIME_KIND_NOTES", "format_seconds",
           "format_bytes", "format_gib", "format_tflops", "format_layout", "plan_flags",
           "cluster_line", "device_memory_bytes", "ordered"]

GIB = 2**30  # bytes per GiB
# Display order of Prediction.time_s_by_kind; kinds a cost model adds later come after.
TIME_KINDS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_p2p", "dp_comm",
              "bubble", "optimizer", "step_end")
# Display order of Prediction.memory_bytes_by_stage's kinds (bytes per GPU).
MEMORY_KINDS = ("parameters", "gradients", "optimizer_states", "activations")
TIME_KIND_NOTES = {
    "compute": "forward + backward matmuls and element-wise work",
    "recompute": "forward work repeated in backward (activation recomputation)",
    "tp_comm": "tensor-parallel all-reduces / all-gathers on the critical path",
    "pp_p2p": "activations and gradients sent between pipeline stages",
    "dp_comm": "data-parallel gradient reduction not hidden behind backward",
    "bubble": "pipeline fill and drain: idle time",
    "optimizer": "optimizer step",
    "ep_comm": "expert parallelism's all-to-alls: tokens to their experts and back",
    "cp_comm": "context parallelism's all-gathers of keys and values (and reduce-scatters "
               "of their gradients)",
    "step_end": "all-reduces closing the step: tied embedding gradient, loss and gradient norm",
}


def format_seconds(seconds: float) -> str:
    """``12.3 s``, ``45.6 ms`` or ``7.8 µs`` (three significant digits; whole seconds
    from 100 s)."""
    if seconds >= 1.0 or seconds == 0.0:
        return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def format_tflops(tflops: float) -> str:
    """TFLOP/s to one decimal, or three significant digits below 10 (tiny CPU runs)."""
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def format_bytes(num_bytes: float) -> str:
    """Binary units: ``512 B``, ``3.0 MiB``, ``71.2 GiB``, ``1.50 TiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_gib(num_bytes: float) -> str:
    """Bytes as GiB without the unit: one decimal, or three significant digits below 1 GiB."""
    gib = num_bytes / GIB
    return f"{gib:.1f}" if gib >= 1 else f"{gib:.3g}"


def format_layout(layout: Layout | dict) -> str:
    """``tp=8 pp=16 dp=8 mbs=1 recompute=full`` (fields left to the solver are omitted)."""
    data = layout if isinstance(layout, dict) else vars(layout)
    short = {"micro_batch_size": "mbs", "zero_stage": "zero", "virtual_stages": "v",
             "sequence_parallel": "sp", "num_micro_batches": "m"}
    defaults = {"virtual_stages": 1, "sequence_parallel": False, "ep": 1, "cp": 1}  # noise
    order = ("tp", "cp", "pp", "dp", "ep", "micro_batch_size", "num_micro_batches", "zero_stage",
             "recompute", "schedule", "virtual_stages", "sequence_parallel")
    keys = [k for k in order if k in data] + sorted(k for k in data if k not in order)
    items = [(k, data[k]) for k in keys if data[k] is not None and defaults.get(k) != data[k]]
    return " ".join(f"{short.get(k, k)}={v}" for k, v in items) or "(free)"


def plan_flags(plan: Plan) -> str:
    """The plan's layout as flags; per-layer recompute shows as ``recompute=none×90+full×6``."""
    text = format_layout(plan.layout())
    modes = plan.recompute
    if len(set(modes)) > 1:
        text += f" recompute={recompute_counts(modes)}"
    return text


def cluster_line(plan: Plan) -> str:
    """``dgx-a100: 128 nodes × 8 × NVIDIA A100-SXM4-80GB``."""
    c = plan.cluster
    device = c.get("device", {}).get("name", "?")
    nodes, per_node = c.get("nodes", "?"), c.get("gpus_per_node", "?")
    plural = "" if nodes == 1 else "s"
    return f"{c.get('name', 'cluster')}: {nodes} node{plural} × {per_node} × {device}"


def device_memory_bytes(plan: Plan) -> float | None:
    """Memory of one device of the plan's cluster in bytes, or None if the cluster dict
    lacks it."""
    try:
        return float(plan.cluster["device"]["memory_gib"]) * GIB
    except (KeyError, TypeError, ValueError):
        return None


def ordered(keys: Iterable[str], known: tuple[str, ...]) -> list[str]:
    """Known kinds in their display order (``TIME_KINDS``, ``MEMORY_KINDS``), then any
    others sorted."""
    keys = list(keys)
    return [k for k in known if k in keys] + sorted(k for k in keys if k not in known)
