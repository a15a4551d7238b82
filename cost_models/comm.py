"""Collective and point-to-point communication time: the ring alpha-beta model.

For a group of n ranks and a message whose *full* size is M bytes, the ring
algorithms (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", section 4; Patarasuk & Yuan 2009 for the
bandwidth-optimal ring all-reduce) take

    all-gather      (n-1) steps, each rank sends M/n per step:   (n-1)/n * M / B + (n-1) * alpha
    reduce-scatter  same as all-gather (M is the full input):      (n-1)/n * M / B + (n-1) * alpha
    all-reduce      reduce-scatter followed by all-gather:       2(n-1)/n * M / B + 2(n-1) * alpha
    point-to-point  one message:                                           M / B + alpha

with B the per-GPU, per-direction bandwidth in bytes/s and alpha the per-step
latency.  B is what NCCL calls *bus bandwidth*: the NCCL tests define
busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for all-gather and
reduce-scatter (nccl-tests doc/PERFORMANCE.md), precisely so that busbw is the
link rate these formulas need, independent of n.  That is why ``LinkSpec``
stores bus bandwidth.

A group crosses the slowest link any of its members must use: the two-level
cluster is priced by :func:`group_link`, which picks ``intra_node`` (NVLink) or
``inter_node`` (InfiniBand) for a whole group.

An all-to-all (every rank sends a distinct 1/n of its buffer to every other rank) is
priced as the pairwise exchange of Thakur et al. 2005 (their long-message MPI_Alltoall):
n-1 rounds, each one message of M/n per rank, ``(n-1)/n * M / B + (n-1) * alpha``; NCCL
runs it as n-1 grouped point-to-point sends, and nccl-tests define its busbw = algbw *
(n-1)/n (``src/alltoall.cu``), so B is again the bus bandwidth.  :func:`all_to_all_time_s`
splits the peers of a group that spans nodes between NVLink and InfiniBand.

Conventions: ``nbytes`` is the full tensor size in bytes (for all-gather, the
gathered output; for reduce-scatter, the input before scattering; for all-to-all, one
rank's whole buffer, the 1/n it keeps included).  A group of
one rank, or zero bytes, costs 0.0 s: nothing is sent.
"""

from __future__ import annotations

from ._checks import check_choice, check_non_negative, check_positive_int
from .hardware import Cluster, LinkSpec

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
"""Kinds accepted by :func:`collective_time_s`."""


def _ring_time_s(nbytes: float, group_size: int, link: LinkSpec, kind: str) -> float:
    """A ring collective of ``kind`` over a message of ``nbytes`` in total: its passes of
    (n-1) ring steps (:func:`_rounds`), each step at its latency (:func:`_step_latency_s`)."""
    nbytes = check_non_negative("nbytes", nbytes)
    n = check_positive_int("group_size", group_size)
    if not isinstance(link, LinkSpec):
        raise ValueError(f"link must be a LinkSpec, got {type(link).__name__}")
    if n == 1 or nbytes == 0:
        return 0.0
    rounds = _rounds(kind, link)
    bandwidth_term = rounds * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s
    latency_term = rounds * (n - 1) * _step_latency_s(kind, link)
    return bandwidth_term + latency_term


def _step_latency_s(kind: str, link: LinkSpec) -> float:
    """alpha of one ring step of ``kind`` on ``link``: ``latency_s``, or for an all-gather
    ``LinkSpec.all_gather_latency_s`` where the backend's differs (gloo, measured)."""
    if kind == "all_gather" and link.all_gather_latency_s is not None:
        return link.all_gather_latency_s
    return link.latency_s


def all_reduce_time_s(nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Ring all-reduce of ``nbytes`` over ``group_size`` ranks, in seconds.

    ``2(n-1)/n * nbytes / bw + 2(n-1) * latency`` (Thakur et al. 2005; NCCL busbw).
    """
    return _ring_time_s(nbytes, group_size, link, "all_reduce")


def all_gather_time_s(nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Ring all-gather producing a ``nbytes`` tensor (each rank holds nbytes/n), seconds.

    ``(n-1)/n * nbytes / bw + (n-1) * latency`` (Thakur et al. 2005; NCCL busbw), with
    ``LinkSpec.all_gather_latency_s`` as the latency where it is set.
    """
    return _ring_time_s(nbytes, group_size, link, "all_gather")


def reduce_scatter_time_s(nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of a ``nbytes`` input (each rank keeps nbytes/n), seconds.

    ``(n-1)/n * nbytes / bw + (n-1) * latency`` (Thakur et al. 2005; NCCL busbw); a whole
    all-reduce where the backend runs it as one (``LinkSpec.reduce_scatter_as_all_reduce``:
    gloo).
    """
    return _ring_time_s(nbytes, group_size, link, "reduce_scatter")


def _rounds(kind: str, link: LinkSpec) -> int:
    """Passes of (n-1) ring steps a ring collective of ``kind`` makes on ``link``."""
    if kind == "reduce_scatter":
        return 2 if link.reduce_scatter_as_all_reduce else 1
    return {"all_reduce": 2, "all_gather": 1}[kind]


def ring_latency_s(kind: str, group_size: int, link: LinkSpec) -> float:
    """The latency part of a ring collective of ``kind`` ("all_reduce", "all_gather" or
    "reduce_scatter") over ``group_size`` ranks, seconds: rounds · (n-1) · alpha (an
    all-gather's own alpha where the link sets one), what one more collective of any size
    costs beyond its bytes."""
    check_choice("ring collective kind", kind, COLLECTIVE_KINDS[:3])
    return (_rounds(kind, link) * (check_positive_int("group_size", group_size) - 1)
            * _step_latency_s(kind, link))


def p2p_time_s(nbytes: float, link: LinkSpec) -> float:
    """One point-to-point message of ``nbytes``: ``latency + nbytes / bw`` seconds.

    Zero bytes cost 0.0 s (no message is sent).
    """
    nbytes = check_non_negative("nbytes", nbytes)
    if not isinstance(link, LinkSpec):
        raise ValueError(f"link must be a LinkSpec, got {type(link).__name__}")
    if nbytes == 0:
        return 0.0
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


def pipeline_send_time_s(nbytes: float, tp: int, pp_link: LinkSpec, tp_link: LinkSpec,
                         scatter_gather: bool = True, sequence_sharded: bool = False) -> float:
    """One activation of ``nbytes`` (b*s*h elements, whole) sent from a pipeline stage to the
    next, whose t = ``tp`` ranks each hold it whole (or, ``sequence_sharded``, a 1/t slice), seconds.

    * ``tp == 1``, or neither option: one message of ``nbytes`` over ``pp_link``
      (:func:`p2p_time_s`);
    * ``scatter_gather`` (Megatron-LM's ``scatter_gather_tensors_in_pipeline``, Narayanan
      et al. 2021, section 4.1): the t ranks of a stage hold the same tensor, so each sends
      only its 1/t slice to its peer of the next stage over its own link, in parallel, and
      the receivers rebuild the tensor with an all-gather over the TP link (NVLink inside
      a node): ``p2p(nbytes/t, pp_link) + all_gather(nbytes, t, tp_link)``;
    * ``sequence_sharded`` (sequence parallelism, Korthikanti et al. 2022: the activation
      between layers is already split along s): each rank sends its 1/t slice and nothing
      is gathered, ``p2p(nbytes/t, pp_link)``.

    The scatter/gather pays off when ``pp_link`` is the slower inter-node link; over
    NVLink it moves the same bytes per rank as a whole send.
    """
    check_positive_int("tp", tp)
    if tp == 1 or not (scatter_gather or sequence_sharded):
        return p2p_time_s(nbytes, pp_link)
    send = p2p_time_s(check_non_negative("nbytes", nbytes) / tp, pp_link)
    return send if sequence_sharded else send + all_gather_time_s(nbytes, tp, tp_link)


def collective_time_s(kind: str, nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Dispatch on ``kind`` (one of :data:`COLLECTIVE_KINDS`), seconds.

    ``"p2p"`` validates ``group_size`` but prices one message whatever it is;
    ``"all_to_all"`` is the one-level case of :func:`all_to_all_time_s` (every peer on
    ``link``). An unknown kind raises ValueError: it is never priced as free.
    """
    check_choice("collective kind", kind, COLLECTIVE_KINDS)
    if kind == "p2p":
        check_positive_int("group_size", group_size)
        return p2p_time_s(nbytes, link)
    if kind == "all_to_all":
        return all_to_all_time_s(nbytes, group_size, group_size, link, link)
    ring = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s,
            "reduce_scatter": reduce_scatter_time_s}[kind]
    return ring(nbytes, group_size, link)


def _check_link(name: str, link: object) -> LinkSpec:
    if not isinstance(link, LinkSpec):
        raise ValueError(f"{name} must be a LinkSpec, got {type(link).__name__}")
    return link


def _pairwise_part_s(nbytes: float, peers: int, group_size: int, link: LinkSpec) -> float:
    """``peers`` rounds of the pairwise exchange on ``link``, one message of nbytes/n each:
    ``peers * (nbytes/n / bw + alpha)``; 0.0 without peers."""
    if peers == 0:
        return 0.0
    return peers * (nbytes / group_size / link.bandwidth_bytes_per_s + link.latency_s)


def all_to_all_time_s(nbytes_per_rank: float, group_size: int, ranks_per_node_in_group: int,
                      intra: LinkSpec, inter: LinkSpec) -> float:
    """All-to-all over ``group_size`` = g ranks, r = ``ranks_per_node_in_group`` of them on
    each node, each rank holding a buffer of ``nbytes_per_rank`` = M bytes, in seconds.

    Each rank keeps M/g and sends M/g to each of its g-1 peers, M*(g-1)/g in all (the
    pairwise exchange of Thakur et al. 2005, their long-message MPI_Alltoall; NCCL's
    all-to-all is such a set of grouped point-to-point sends, and nccl-tests' all-to-all
    busbw = algbw*(g-1)/g). The
    r-1 peers in the rank's node are reached over ``intra`` (NVLink/NVSwitch), the g-r
    others over ``inter`` (InfiniBand); the two parts run concurrently, so

        time = max((r-1) * (M/g / B_intra + alpha_intra),  (g-r) * (M/g / B_inter + alpha_inter))

    one latency per message round on each link. Assumptions: ``inter`` is the per-GPU
    InfiniBand rate as the presets hold it (one NIC per GPU, or the node's NICs shared
    evenly by its r ranks, every rank sending at once); NVSwitch gives every pair the full
    per-GPU NVLink rate; no token is forwarded or deduplicated between nodes (DeepSeek-V3's
    node-limited routing and DeepEP's IB-then-NVLink forwarding, DeepSeek-V3 report
    section 3.2.2, move fewer IB bytes than this). The IB part dominates as soon as g > r:
    on H800 NVLink carries 160 GB/s against InfiniBand's 50 GB/s per GPU (DeepSeek-V3
    report section 3.2.2), the reason Megatron-Core MoE overlaps the expert-parallel
    all-to-all with compute (its MoE README: ``--overlap-moe-expert-parallel-comm``).

    A group of one rank or zero bytes costs 0.0 s. ValueError unless 1 <= r <= g and g is
    a multiple of r (the group spans whole node shares).
    """
    nbytes = check_non_negative("nbytes_per_rank", nbytes_per_rank)
    g = check_positive_int("group_size", group_size)
    r = check_positive_int("ranks_per_node_in_group", ranks_per_node_in_group)
    intra, inter = _check_link("intra", intra), _check_link("inter", inter)
    if r > g or g % r:
        raise ValueError(f"ranks_per_node_in_group={r} must divide group_size={g} (each node "
                         f"holds the same share of the group)")
    if g == 1 or nbytes == 0:
        return 0.0
    return max(_pairwise_part_s(nbytes, r - 1, g, intra), _pairwise_part_s(nbytes, g - r, g, inter))


def group_link(cluster: Cluster, group_size: int, stride: int) -> LinkSpec:
    """The link that the process groups of size ``group_size`` and ``stride`` cross.

    Ranks follow the Megatron layout ``rank = tp_rank + t*(dp_rank + d*pp_rank)`` and
    GPUs are numbered node-major (``node = rank // gpus_per_node``).  A group is
    ``{r0 + k*stride : k < group_size}``; TP groups have stride 1, DP groups stride t,
    PP groups stride t*d.  In this layout the groups of one family tile the ranks in
    aligned blocks of ``S = stride * group_size`` consecutive ranks (block c covers
    ``[c*S, (c+1)*S)``, holding ``stride`` interleaved groups).

    Every group of the family stays inside a node iff ``gpus_per_node % S == 0``
    (then also ``stride*(group_size-1) < gpus_per_node``).  If ``S`` does not divide
    ``gpus_per_node`` some block straddles a node boundary and some group in it
    crosses (e.g. 8 GPUs/node, stride 3, size 2: the group {6, 9}); the family's
    collective finishes when its slowest group does, so it is priced at
    ``inter_node``.  A single-node cluster and ``group_size == 1`` give ``intra_node``.

    ValueError when the group does not fit in the cluster
    (``stride*(group_size-1) >= num_gpus``).
    """
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    check_positive_int("group_size", group_size)
    check_positive_int("stride", stride)
    span = stride * (group_size - 1)
    if span >= cluster.num_gpus:
        raise ValueError(
            f"a group of size {group_size} with stride {stride} spans {span + 1} ranks, "
            f"but the cluster has only {cluster.num_gpus} GPUs"
        )
    if group_size == 1 or cluster.nodes == 1:
        return cluster.intra_node
    if cluster.gpus_per_node % (stride * group_size) == 0:
        return cluster.intra_node
    return cluster.inter_node
