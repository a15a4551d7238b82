"""Hardware descriptions: one accelerator, one link, one two-level cluster.

Units (every number carries its unit in its name):

* ``*_tflops``  -- 1e12 floating-point operations per second (dense 16-bit tensor math)
* ``*_gib``     -- 2**30 bytes
* ``*_gbps``    -- 1e9 bytes per second (GB/s, *bytes*, not bits)
* ``*_s``       -- seconds

Link bandwidths are NCCL "bus bandwidth": the achievable per-GPU, per-direction rate
that makes the ring-algorithm time of every collective ``bytes_on_wire / bandwidth``
(NCCL tests docs, "Performance": busbw = algbw * 2(n-1)/n for all-reduce). See comm.py.

The cluster is two-level (Megatron/DGX style): ``gpus_per_node`` GPUs joined by the
intra-node link (NVLink/NVSwitch), ``nodes`` nodes joined by the inter-node link
(InfiniBand).  Presets live as data in ``cost_models/presets/<name>.json``, where every
number sits next to its own ``source`` string; :meth:`Cluster.from_dict` folds those
per-number sources into the ``source`` field of the spec they belong to. Each preset also
has a ``memory_reserve`` block (:mod:`cost_models.reserve`): what a process holds besides
the cost model's peak.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ._checks import check_non_negative, check_positive, check_positive_int, is_number
from ._spec_json import check_text, read_fields, spec_from_dict, unwrap
from .reserve import MemoryReserve

PRESET_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = ("dgx-a100", "dgx-h100", "dgx-h200", "dgx-h800", "dgx2h-v100", "local-cpu")
"""Names accepted by :meth:`Cluster.from_name`; each is ``presets/<name>.json``."""

def _set(obj: object, field: str, value: object) -> None:
    """Normalise a field of a frozen dataclass inside ``__post_init__``."""
    object.__setattr__(obj, field, value)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (GPU or a CPU process standing in for one)."""

    name: str
    """Human-readable model name, e.g. "NVIDIA A100-SXM4-80GB"."""
    peak_tflops: float
    """Dense 16-bit (bf16/fp16) tensor-core peak, TFLOP/s (1e12 FLOP/s). A calibrated CPU
    process: the fp32 rate of a linear layer's three training GEMMs (forward, input and
    weight gradients) measured by ``autopar calibrate``."""
    memory_gib: float
    """Device memory, GiB (2**30 bytes)."""
    memory_bandwidth_gbps: float
    """Device-memory (HBM) bandwidth, GB/s (1e9 bytes/s)."""
    matmul_efficiency: float
    """Fraction of peak sustained by training GEMMs, in (0, 1]; one number per hardware
    profile, the same for every model (a calibration knob). With a tile model
    (``sm_count``) it is the rate inside a full GEMM tile, and tile and wave quantisation
    come on top (:func:`cost_models.compute.gemm_time_s`)."""
    source: str
    """Where the numbers come from (spec sheet, paper + table, calibration run)."""
    op_overhead_s: float = 0.0
    """Host seconds per executed graph node and micro-batch (framework dispatch: Python,
    the aten dispatcher, autograd recording), charged once in forward and twice in
    backward; views included. ``autopar calibrate`` measures it on CPU processes (blocks
    of negligible size over 3 x their graph nodes). The GPU presets hold what an H200's
    host measured the same way (22 µs), with ``async_dispatch``: there the dispatch
    overlaps the kernels and binds only where they are shorter."""
    async_dispatch: bool = False
    """The host dispatches work the device runs later (a GPU's asynchronous kernel
    launches): a node then takes the longer of its device time and its host dispatch
    (``op_overhead_s`` once in forward, twice in backward), not their sum
    (:func:`cost_models.compute.dispatched_time_s`). False: one process does both in turn
    (CPU ranks)."""
    recompute_overhead_s: float = 0.0
    """Host seconds per graph node of a recomputed layer and micro-batch that activation
    checkpointing adds besides re-running the node's forward (non-reentrant
    ``torch.utils.checkpoint``'s pack and unpack hooks and bookkeeping). ``autopar
    calibrate`` measures it; 0 on GPUs (see ``op_overhead_s``)."""
    comm_overlap: float = 1.0
    """Fraction of a collective's time that can run while the device computes, in [0, 1];
    that much of the DP gradient reduction hides behind the last backward
    (:func:`autopar.planner.costs.step.exposed_dp_s`). 1 on GPUs (NCCL beside the compute
    kernels, as DDP and Megatron use it). CPU processes over gloo move the bytes with the
    cores they compute on; ``autopar calibrate`` measures the fraction."""
    attention_tflops: float | None = None
    """Rate of the fused attention kernel (``scaled_dot_product_attention``), TFLOP/s
    counted as 4·b·a·s·s_kv·hd per forward and twice that in backward. None: its GEMMs
    are priced like any other (GPU presets). A CPU process runs it as small GEMMs with an
    exp per score, far below the linear layers' rate (``autopar calibrate``)."""
    gemm_half_dim: float = 0.0
    """Half-performance length of GEMMs without a tile model (a CPU core), in elements
    of a GEMM's smallest dimension d = min(m, n, k): it runs at
    ``peak·d/(d + gemm_half_dim)``, Hockney's (r∞, n½) model (Hockney & Jesshope,
    "Parallel Computers 2", 1988, §1.3.3) with r∞ the peak. ``autopar calibrate`` fits
    it to linear layers of several widths; 0: no shape effect (GPUs: the tile model)."""
    attention_half_dim: float = 0.0
    """The same for the fused attention kernel at ``attention_tflops``, d = min(s, hd)."""
    transcendental_gelems_per_s: float | None = None
    """1e9 elements/s of an element-wise op with a transcendental per element (erf-GELU,
    log-softmax's exp), forward + backward counted as 3 forwards. None: memory-bound
    (GPUs); a CPU core computes erf slower than it streams (``autopar calibrate``)."""
    optimizer_bytes_per_param: float = 32.0
    """Device-memory bytes the Adam step moves per parameter, read + write, as the
    optimizer that runs there implements it; the step is memory-bound. 32 (the default,
    GPUs): one fused kernel over the fp32 master, m, v and the 16-bit parameter and
    gradient (Megatron-LM's fused Adam; torch's ``fused=True``). A CPU process runs
    torch's unfused AdamW (``torch/optim/adam.py`` ``_single_tensor_adam``: weight decay,
    ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, a division, ``add_`` and ``addcdiv_``, each
    a pass over fp32 tensors): 80 bytes."""
    sm_count: int | None = None
    """Streaming multiprocessors that run GEMM tiles concurrently (A100 108, V100 80, H100
    SXM5 132: the NVIDIA architecture whitepapers); with ``gemm_tile`` it turns on tile and
    wave quantisation (:func:`cost_models.compute.gemm_time_s`). None: no tile model (a CPU)."""
    gemm_tile: tuple[int, int, int] | None = None
    """(tile_m, tile_n, tile_k): the output tile and K step of the library's most efficient
    tensor-core GEMM kernel (cuBLAS 256x128, e.g. ``ampere_bf16_s16816gemm_bf16_256x128_
    ldg8_f2f_stages_32x3``; NVIDIA "Matrix Multiplication Background" guide, section 2.3),
    usable in either orientation. None together with ``sm_count``."""

    def __post_init__(self) -> None:
        check_text("DeviceSpec.name", self.name, "the device model")
        for field in ("op_overhead_s", "recompute_overhead_s", "gemm_half_dim",
                      "attention_half_dim"):
            _set(self, field, check_non_negative(f"DeviceSpec.{field}", getattr(self, field)))
        if not isinstance(self.async_dispatch, bool):
            raise ValueError("DeviceSpec.async_dispatch must be true or false, got "
                             f"{self.async_dispatch!r}")
        if not is_number(self.comm_overlap) or not 0 <= self.comm_overlap <= 1:
            raise ValueError(f"DeviceSpec.comm_overlap must be a number in [0, 1], got "
                             f"{self.comm_overlap!r}")
        for field in ("attention_tflops", "transcendental_gelems_per_s"):
            if getattr(self, field) is not None:
                _set(self, field, check_positive(f"DeviceSpec.{field}", getattr(self, field)))
        _set(self, "optimizer_bytes_per_param", check_positive(
            "DeviceSpec.optimizer_bytes_per_param", self.optimizer_bytes_per_param))
        for field in ("peak_tflops", "memory_gib", "memory_bandwidth_gbps"):
            _set(self, field, check_positive(f"DeviceSpec.{field}", getattr(self, field)))
        eff = self.matmul_efficiency
        if not is_number(eff) or not 0 < eff <= 1:
            raise ValueError(
                f"DeviceSpec.matmul_efficiency must be a number in (0, 1], got {eff!r}"
            )
        _set(self, "matmul_efficiency", float(eff))
        self._check_tile_model()
        check_text("DeviceSpec.source", self.source, "where the numbers come from")

    def _check_tile_model(self) -> None:
        """``sm_count`` and ``gemm_tile`` come together (positive ints) or not at all."""
        if (self.sm_count is None) != (self.gemm_tile is None):
            raise ValueError("DeviceSpec.sm_count and DeviceSpec.gemm_tile go together: give "
                             f"both or neither, got {self.sm_count!r} and {self.gemm_tile!r}")
        if self.sm_count is None:
            return
        check_positive_int("DeviceSpec.sm_count", self.sm_count)
        tile = self.gemm_tile
        if not isinstance(tile, (tuple, list)) or len(tile) != 3:
            raise ValueError(f"DeviceSpec.gemm_tile must be (tile_m, tile_n, tile_k), got {tile!r}")
        _set(self, "gemm_tile", tuple(check_positive_int(f"DeviceSpec.gemm_tile[{i}]", v)
                                      for i, v in enumerate(tile)))

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (``memory_gib * 2**30``)."""
        return int(round(self.memory_gib * 2**30))

    @property
    def peak_flops(self) -> float:
        """Dense 16-bit peak in FLOP/s (``peak_tflops * 1e12``)."""
        return self.peak_tflops * 1e12


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link between GPUs, as the alpha-beta model sees it."""

    name: str
    """Human-readable link name, e.g. "NVLink3/NVSwitch"."""
    bandwidth_gbps: float
    """Achievable per-GPU, per-direction bandwidth, GB/s (1e9 bytes/s): NCCL bus bandwidth."""
    latency_s: float
    """Per-message (per ring hop) latency, seconds (the alpha term)."""
    source: str
    """Where the numbers come from."""
    reduce_scatter_as_all_reduce: bool = False
    """The backend reduce-scatters by all-reducing the whole tensor: torch's gloo (a ZeRO-1
    step's profile shows ``gloo:all_reduce`` under each ``c10d::_reduce_scatter_base_``).
    False: NCCL's ring reduce-scatter, half an all-reduce."""
    all_gather_latency_s: float | None = None
    """Per ring step latency of an all-gather where the backend's differs from
    ``latency_s``, seconds (None: ``latency_s``). Measured by ``calibrate`` for gloo: in a
    step on a shared 2-core host, a 512 KiB all-gather over 2 ranks took 2.0-2.1 ms against
    2.5 ms for the all-reduce of the same bytes, not the half the ring model gives."""

    def __post_init__(self) -> None:
        check_text("LinkSpec.name", self.name, "the link kind")
        if not isinstance(self.reduce_scatter_as_all_reduce, bool):
            raise ValueError("LinkSpec.reduce_scatter_as_all_reduce must be true or false, got "
                             f"{self.reduce_scatter_as_all_reduce!r}")
        if self.all_gather_latency_s is not None:
            _set(self, "all_gather_latency_s", check_non_negative(
                "LinkSpec.all_gather_latency_s", self.all_gather_latency_s))
        _set(self, "bandwidth_gbps", check_positive("LinkSpec.bandwidth_gbps", self.bandwidth_gbps))
        _set(self, "latency_s", check_non_negative("LinkSpec.latency_s", self.latency_s))
        check_text("LinkSpec.source", self.source, "where the numbers come from")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bus bandwidth in bytes/s (``bandwidth_gbps * 1e9``)."""
        return self.bandwidth_gbps * 1e9


@dataclass(frozen=True)
class Cluster:
    """``nodes`` identical nodes of ``gpus_per_node`` devices each (two-level topology)."""

    device: DeviceSpec
    """The accelerator every rank runs on."""
    gpus_per_node: int
    """Devices per node, joined by ``intra_node``."""
    nodes: int
    """Number of nodes, joined by ``inter_node``."""
    intra_node: LinkSpec
    """Link between two devices of the same node (NVLink/NVSwitch)."""
    inter_node: LinkSpec
    """Link between devices of different nodes (InfiniBand), per GPU."""
    name: str = "custom"
    """Preset name or a label of the user's choosing."""
    dtype: str = "bf16"
    """Training precision used on this cluster unless a layout says otherwise: "bf16"
    (mixed precision: 16-bit activations/communication, fp32 master weights and Adam
    states) or "fp32" (everything in 32-bit, e.g. the CPU/gloo path)."""
    attention: str = "math"
    """Attention kernel: "math" keeps the softmax for backward (a·s² per sequence, the
    accounting of Korthikanti et al. 2022); "flash" keeps only output and log-sum-exp
    (Dao et al. 2022), as PyTorch's fused CPU/GPU kernels do (``F.scaled_dot_product_
    attention``, which autopar's programs call) and Megatron-LM by default. The dgx-h100,
    dgx-h200 and dgx-h800 presets say "flash" (a gpu_check on an H200 measured the saved bytes of
    the fused kernel); dgx-a100 and dgx2h-v100 keep "math", the kernels of the 2021
    Megatron-LM runs their efficiency is fitted to (``benchmarks/published_runs.py``). A
    plan for a framework that fixes its kernel is priced with that one instead
    (``RuntimeSupport.attention_for``: torchtitan runs flash in bf16)."""
    memory_reserve: MemoryReserve = MemoryReserve()
    """What each process holds besides the cost model's peak (CUDA context, NCCL buffers,
    fragmentation; :mod:`cost_models.reserve`); a cluster file without it gets the GPU
    defaults of :class:`MemoryReserve`."""
    memory_headroom_gib: float = 0.0
    """Device memory per GPU, GiB, the user keeps free on top of the reserve
    (``--memory-headroom``): plans must fit in what is left."""

    def __post_init__(self) -> None:
        if self.attention not in ("math", "flash"):
            raise ValueError(f"Cluster.attention must be 'math' or 'flash', got {self.attention!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"Cluster.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        for field, kind in (("device", DeviceSpec), ("intra_node", LinkSpec),
                            ("inter_node", LinkSpec)):
            value = getattr(self, field)
            if not isinstance(value, kind):
                raise ValueError(
                    f"Cluster.{field} must be a {kind.__name__}, got {type(value).__name__}"
                )
        if not isinstance(self.memory_reserve, MemoryReserve):
            raise ValueError("Cluster.memory_reserve must be a MemoryReserve, got "
                             f"{type(self.memory_reserve).__name__}")
        _set(self, "memory_headroom_gib",
             check_non_negative("Cluster.memory_headroom_gib", self.memory_headroom_gib))
        check_positive_int("Cluster.gpus_per_node", self.gpus_per_node)
        check_positive_int("Cluster.nodes", self.nodes)
        check_text("Cluster.name", self.name, "a label")

    @property
    def num_gpus(self) -> int:
        """Total devices N = gpus_per_node * nodes."""
        return self.gpus_per_node * self.nodes

    # ----------------------------------------------------------------- presets
    @classmethod
    def from_name(cls, name: str, nodes: int = 1) -> "Cluster":
        """Load preset ``name`` (one of :data:`PRESET_NAMES`) with ``nodes`` nodes.

        ``"local-cpu"`` keeps its preset ``gpus_per_node``; use :meth:`local_cpu`
        to choose the number of processes.
        """
        key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
        if key not in PRESET_NAMES:
            raise ValueError(
                f"unknown cluster preset {name!r}; valid names: {', '.join(PRESET_NAMES)}"
            )
        check_positive_int("nodes", nodes)
        return dataclasses.replace(cls.from_json_file(PRESET_DIR / f"{key}.json"), nodes=nodes)

    @classmethod
    def dgx_a100(cls, nodes: int = 1) -> "Cluster":
        """DGX A100 80GB nodes: 8x A100-SXM4-80GB, NVSwitch, 8x HDR 200 Gb/s."""
        return cls.from_name("dgx-a100", nodes)

    @classmethod
    def dgx_h100(cls, nodes: int = 1) -> "Cluster":
        """DGX H100 nodes: 8x H100-SXM5-80GB, NVLink4/NVSwitch, 8x NDR 400 Gb/s."""
        return cls.from_name("dgx-h100", nodes)

    @classmethod
    def dgx_h200(cls, nodes: int = 1) -> "Cluster":
        """DGX H200 nodes: 8x H200-SXM-141GB (HBM3e, 4.8 TB/s), NVLink4/NVSwitch, 8x NDR
        400 Gb/s: the DGX H100 with the H200's memory."""
        return cls.from_name("dgx-h200", nodes)

    @classmethod
    def dgx_h800(cls, nodes: int = 1) -> "Cluster":
        """H800 nodes as DeepSeek-V3 trained on: 8x H800-SXM5-80GB (an H100 with NVLink cut to
        400 GB/s bidirectional; 160 GB/s achievable), NVSwitch, 8x 400 Gb/s InfiniBand."""
        return cls.from_name("dgx-h800", nodes)

    @classmethod
    def dgx2h_v100(cls, nodes: int = 1) -> "Cluster":
        """DGX-2H nodes: 16x V100-SXM3-32GB, NVSwitch, 8x EDR 100 Gb/s."""
        return cls.from_name("dgx2h-v100", nodes)

    @classmethod
    def local_cpu(cls, processes: int = 4) -> "Cluster":
        """One host running ``processes`` CPU ranks over gloo (a nominal profile)."""
        check_positive_int("processes", processes)
        return dataclasses.replace(cls.from_name("local-cpu", 1), gpus_per_node=processes)

    # ----------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of JSON types (``gemm_tile`` a list, as JSON reads it back);
        ``Cluster.from_dict(c.to_dict()) == c`` exactly."""
        d = dataclasses.asdict(self)
        if d["device"]["gemm_tile"] is not None:
            d["device"]["gemm_tile"] = list(d["device"]["gemm_tile"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Cluster":
        """Build a Cluster from :meth:`to_dict` output or a preset-style dict.

        A number (and ``attention``) may be written plain or as ``{"value": x, "source":
        "..."}``; in a device, link or ``memory_reserve``, such per-number sources are
        appended to its ``source``. ``memory_reserve`` and ``memory_headroom_gib`` are
        optional (defaults:
        :class:`~cost_models.reserve.MemoryReserve`'s GPU values, 0).
        Missing or unknown keys raise ValueError naming them.
        """
        optional = ("name", "dtype", "attention", "memory_reserve", "memory_headroom_gib")
        fields = read_fields("Cluster", d, ("device", "gpus_per_node", "nodes",
                                             "intra_node", "inter_node") + optional,
                              optional=optional)
        kwargs: dict[str, Any] = {
            "device": spec_from_dict(DeviceSpec, "Cluster.device", fields["device"]),
            "intra_node": spec_from_dict(LinkSpec, "Cluster.intra_node", fields["intra_node"]),
            "inter_node": spec_from_dict(LinkSpec, "Cluster.inter_node", fields["inter_node"]),
        }
        if "memory_reserve" in fields:
            kwargs["memory_reserve"] = spec_from_dict(MemoryReserve, "Cluster.memory_reserve",
                                                       fields["memory_reserve"])
        for field in ("gpus_per_node", "nodes", "memory_headroom_gib", "attention"):
            if field in fields:
                kwargs[field], _ = unwrap(f"Cluster.{field}", fields[field])
        for field in ("name", "dtype"):
            if field in fields:
                kwargs[field] = fields[field]
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "Cluster":
        """Read a cluster (or preset) JSON file written by hand or by :meth:`to_json_file`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"cluster file {path} is not valid JSON: {err}") from err
        return cls.from_dict(data)

    def to_json_file(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as indented JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
