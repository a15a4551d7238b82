"""Process groups for a (tp, cp, pp, dp) layout, laid out Megatron-style, with ep folded over TP×CP×DP.

TP is innermost (neighbouring ranks, the fastest links), then CP, then DP, then PP
(Megatron's order tp, cp, dp, pp)::

    rank = tp_rank + tp * (cp_rank + cp * (data_rank + d * pp_rank))

Context parallelism shards no parameter: the c·d ranks of a stage with one TP rank hold the
same weights and average their gradients, so they form one data-parallel mesh axis of c·d
ranks (Megatron's data-parallel group "with context parallel"; torchtitan's ``dp_shard_cp``)
whose index is ``dp_rank = cp_rank + c·data_rank``: every data-parallel collective (the
gradient all-reduce or reduce-scatter, ZeRO's shards, FSDP2's mesh) runs over it as it
does without CP. The c ranks of one ``data_rank`` split each of its sequences
(``cp_group``).

Expert parallelism of degree ep (ep | t·d) folds over the t·d ranks of one pipeline stage
(:func:`autopar.techniques.expert_parallel.expert_ranks`, Megatron-Core's expert mesh with
expert-TP 1): stage rank j = tp_rank + t·dp_rank (consecutive global ranks) is EP rank
``j % ep`` of EP group ``j // ep``, and its expert-data-parallel (EDP) group is the t·d/ep
ranks of the stage with its EP rank (they hold the same experts).

The (tp, pp, c·d) part is the row-major order of a ``DeviceMesh`` of shape (pp, dp, tp) named
("pp", "dp", "tp"), built on the rank's device type (:mod:`autopar.runtime.device`). The
degrees are validated before any collective runs, so a wrong launch is a clear error on
every rank instead of a hang, and every group gets one timeout (by default the world
group's: torch would give the groups a mesh creates its own 30-minute default), so that a
dead or stuck peer ends a collective within it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.contract import support
from autopar.runtime.compat import group_options, group_timeout
from autopar.runtime.device import rank_device
from autopar.techniques.expert_parallel import expert_ranks

# the checkpoint group's backend by the world's: gloo (checkpoints move CPU tensors), but on
# a dry run's "fake" world (autopar.verify.dry_run) the fake backend, which serves any device
_CHECKPOINT_BACKEND = {"fake": None}

def validate_degrees(tp: int, pp: int, dp: int, world_size: int) -> None:
    """Check that tp, pp, dp are positive ints whose product is ``world_size``.

    Raises:
        ValueError: a degree is not a positive int, or tp*pp*dp != world_size (the
            message says how to launch or which plan to pass instead).
    """
    support.validate_degrees(tp, pp, dp, world_size)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates and process groups. Build with :meth:`build`.

    Attributes:
        mesh_shape: (p, c·d, t): the pipeline, data- (with context-) and tensor-parallel
            sizes, in the DeviceMesh's row-major order (``tp``, ``pp``, ``dp`` and
            ``world_size`` = t*p*c*d read it: the groups describe a mesh, the layout's
            degrees live in the plan).
        rank: global rank of this process.
        tp_rank: index in the TP group (innermost).
        pp_rank: pipeline stage index of this rank.
        dp_rank: index on the data-parallel axis, cp_rank + c·data_rank (module docstring).
        tp_group: ranks sharing (pp_rank, dp_rank).
        pp_group: ranks sharing (tp_rank, dp_rank): one per stage, ordered by pp_rank.
        dp_group: ranks sharing (tp_rank, pp_rank): the c·d ranks gradients average over.
        embedding_group: {first-stage rank, last-stage rank} with this rank's (tp_rank,
            dp_rank), for the tied-embedding gradient; None when pp == 1, when the first
            pipeline rank also holds the head (a V placement), or on a middle stage.
        device_mesh: the (pp, dp, tp) DeviceMesh the groups came from (for DTensor users).
        device: where this rank computes (CPU under gloo, ``cuda:LOCAL_RANK`` under NCCL).
        timeout: every group's timeout (None: torch's default for the backend).
        world_group: every rank, with ``timeout`` (the step's loss and gradient norm).
        checkpoint_group: every rank, gloo, with ``timeout``: the collectives of checkpoint
            saves and loads (DCP's and autopar's), apart from the training groups so that an
            asynchronous save's background collectives never interleave with a step's, and
            on the CPU whatever the training backend (DCP exchanges pickled plans).
        head_pp_rank: the pipeline rank holding the last model chunk (head and loss): p - 1,
            or 0 under a V placement (the schedule record's ``head_rank``).
        ep: the expert-parallel degree (ep | t·d; 1: no expert parallelism).
        ep_rank: this rank's index in its EP group ((tp_rank + t·dp_rank) mod ep).
        ep_group: the ep ranks of the stage exchanging tokens for their experts (with
            ``timeout``); None when ep == 1.
        edp_group: the t·d/ep ranks of the stage holding this rank's experts, over which
            expert gradients are summed; ``dp_group`` when ep == 1 (it is then the same set).
        cp: the context-parallel degree c (1: none).
        cp_group: the c ranks splitting this rank's sequences (with ``timeout``): those
            sharing (tp_rank, pp_rank, data_rank), in cp_rank order; None when cp == 1.
    """

    mesh_shape: tuple[int, int, int]
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None
    device_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    device: torch.device = torch.device("cpu")
    timeout: timedelta | None = None
    world_group: dist.ProcessGroup | None = None
    checkpoint_group: dist.ProcessGroup | None = None
    head_pp_rank: int = -1  # -1: p - 1
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, tp: int, pp: int, dp: int, *, device: torch.device | None = None,
              timeout: timedelta | float | None = None,
              head_pp_rank: int | None = None, ep: int = 1, cp: int = 1) -> ParallelGroups:
        """Create the groups; call on every rank, in the same order, after init_process_group.

        device: this rank's device (default :func:`~autopar.runtime.device.rank_device`).
        timeout: seconds or a timedelta for every group (default: the world group's).
        head_pp_rank: the pipeline rank of the last model chunk (default p - 1; 0 for a V
            placement, where no embedding group is made).
        ep: the expert-parallel degree, folded over TP×CP×DP (module docstring).
        cp: the context-parallel degree c; ``dp`` is d, the data-parallel replicas.

        Raises:
            RuntimeError: torch.distributed is not initialised.
            ValueError: see :func:`validate_degrees` (with tp·cp for tp), a timeout that is
                not positive, cp not a positive int, or ep not a positive divisor of
                tp·cp·dp (raised before any collective).
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call init_process_group (or launch with "
                "torchrun) before ParallelGroups.build"
            )
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ValueError(f"cp={cp!r} must be a positive int (the context-parallel degree)")
        validate_degrees(tp * cp, pp, dp, world_size)
        dp *= cp  # the data-parallel axis: c·d ranks (module docstring)
        _validate_ep(ep, tp * dp)
        head = pp - 1 if head_pp_rank is None else head_pp_rank
        if not 0 <= head < pp:
            raise ValueError(f"head_pp_rank {head_pp_rank} is outside [0, pp={pp})")
        device = torch.device(device) if device is not None else rank_device()
        timeout = as_timeout(timeout) if timeout is not None else \
            group_timeout(dist.group.WORLD, device)
        options = group_options(dist.get_backend(), timeout) if timeout is not None else None
        names = ("pp", "dp", "tp")
        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=names,
                                backend_override={n: (None, options) for n in names}
                                if options is not None else None)
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        ep_group, edp_group = _expert_groups(tp, pp, dp, ep, rank, timeout)
        return cls(
            mesh_shape=(pp, dp, tp), rank=rank,
            tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
            tp_group=mesh.get_group("tp"), pp_group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp"),
            embedding_group=_embedding_group(tp, pp, dp, rank, timeout, head),
            head_pp_rank=head,
            device_mesh=mesh, device=device, timeout=timeout,
            world_group=dist.new_group(list(range(world_size)), timeout=timeout),
            checkpoint_group=dist.new_group(list(range(world_size)), timeout=timeout,
                                            backend=_CHECKPOINT_BACKEND.get(dist.get_backend(), "gloo")),
            ep=ep, ep_rank=(tp_rank + tp * dp_rank) % ep, ep_group=ep_group,
            edp_group=edp_group if edp_group is not None else mesh.get_group("dp"),
            cp=cp, cp_group=_cp_group(tp, pp, dp, cp, rank, timeout),
        )

    def destroy(self, *, mesh_groups: bool = True) -> None:
        """Destroy the process groups :meth:`build` made that hold this rank (never the
        default group); call on every rank once the program is done, which cannot run
        afterwards. Each gloo group keeps an I/O thread that wakes every 10 ms and two
        workers until destroyed: a process that builds many programs (a test training
        dozens of plans) otherwise slows down with every one.

        mesh_groups: also the DeviceMesh's tp, pp and dp groups. False when DTensors lived
            on the mesh (FSDP2): torch's DTensor caches keep meshes equal to this one (equal
            by ranks and names, not groups), whose groups a later equal mesh would reuse.
        """
        groups = (self.embedding_group, self.world_group, self.checkpoint_group)
        if self.ep > 1:  # expert parallelism's own groups (at ep = 1 the EDP group is dp's)
            groups += (self.ep_group, self.edp_group)
        groups += (self.cp_group,)
        if mesh_groups:
            groups += (self.tp_group, self.pp_group, self.dp_group)
        done: set[int] = set()
        for group in groups:
            if group is None or group is dist.GroupMember.WORLD or id(group) in done:
                continue
            done.add(id(group))
            dist.destroy_process_group(group)

    @property
    def tp(self) -> int:
        """Tensor-parallel size t (ranks per TP group)."""
        return self.mesh_shape[2]

    @property
    def pp(self) -> int:
        """Pipeline-parallel size p (pipeline ranks)."""
        return self.mesh_shape[0]

    @property
    def dp(self) -> int:
        """The data-parallel axis: c·d ranks (d replicas, each split over c CP ranks)."""
        return self.mesh_shape[1]

    @property
    def cp_rank(self) -> int:
        """Index in the CP group: which two chunks of each sequence this rank holds."""
        return self.dp_rank % self.cp

    @property
    def data_rank(self) -> int:
        """The data-parallel replica whose rows of the global batch this rank reads."""
        return self.dp_rank // self.cp

    @property
    def world_size(self) -> int:
        """N = t*p*c*d, every rank of the mesh."""
        return self.mesh_shape[0] * self.mesh_shape[1] * self.mesh_shape[2]

    def pp_rank_to_global(self, pp_rank: int) -> int:
        """Global rank of stage ``pp_rank`` with this rank's tp/dp coordinates.

        Raises ValueError if pp_rank is outside [0, pp).
        """
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank {pp_rank} is outside [0, {self.pp})")
        return self.tp_rank + self.tp * (self.dp_rank + self.dp * pp_rank)

    def axis_names(self) -> dict[str, str]:
        """Process-group name -> axis ("tp", "pp", "dp", "ep", "cp", "embedding"), for
        :class:`CommMeter`: the EDP group counts as "dp" (expert gradients are the DP
        reduction of the experts)."""
        names = {self.tp_group.group_name: "tp", self.pp_group.group_name: "pp",
                 self.dp_group.group_name: "dp"}
        if self.ep_group is not None:
            names[self.ep_group.group_name] = "ep"
        if self.cp_group is not None:
            names[self.cp_group.group_name] = "cp"
        if self.edp_group is not None and self.edp_group.group_name not in names:
            names[self.edp_group.group_name] = "dp"
        if self.embedding_group is not None:
            names[self.embedding_group.group_name] = "embedding"
        return names

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (it owns the input embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the pipeline rank that owns the head and computes the loss: p - 1, or
        ``head_pp_rank``."""
        return self.pp_rank == (self.pp - 1 if self.head_pp_rank < 0 else self.head_pp_rank)


def as_timeout(timeout: timedelta | float) -> timedelta:
    """``timeout`` as a positive timedelta (a number is seconds); ValueError otherwise."""
    value = timeout if isinstance(timeout, timedelta) else None
    if value is None and isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = timedelta(seconds=timeout)
    if value is None or not value.total_seconds() > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got "
                         f"{timeout!r}")
    return value


def _embedding_group(tp: int, pp: int, dp: int, rank: int, timeout: timedelta | None,
                     head: int) -> dist.ProcessGroup | None:
    """Create every {first, head}-stage pair group, in the same order on all ranks.

    new_group must be called by every rank for every group; this rank keeps the one it
    belongs to. Returns None when the first pipeline rank is the ``head`` one (pp == 1, a
    V placement) or this rank is on neither.
    """
    if head == 0:
        return None
    mine: dist.ProcessGroup | None = None
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            first = tp_rank + tp * dp_rank
            last = tp_rank + tp * (dp_rank + dp * head)
            group = dist.new_group([first, last], timeout=timeout)
            if rank in (first, last):
                mine = group
    return mine


def _validate_ep(ep: int, ranks: int) -> None:
    """ep must be a positive int dividing the t·d ``ranks`` of a stage (before any
    collective)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or ranks % ep:
        options = [e for e in range(1, ranks + 1) if ranks % e == 0]
        raise ValueError(f"ep={ep!r} must be a positive divisor of tp·dp={ranks}: expert "
                         "parallelism folds over the tensor- and data-parallel ranks of a "
                         f"stage; choose ep in {options}")


def _expert_groups(tp: int, pp: int, dp: int, ep: int, rank: int, timeout: timedelta | None
                   ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's EP group, its EDP group), creating every EP and EDP group of every
    pipeline stage in the same order on all ranks (new_group is collective); (None, None)
    when ep == 1. Stage rank j of pipeline rank q is global rank ``j + t·d·q``."""
    if ep == 1:
        return None, None
    ep_mine = edp_mine = None
    n = tp * dp
    for pp_rank in range(pp):
        # EP group g: stage ranks [g·ep, (g+1)·ep); EDP group of EP rank e: e + ep·i
        members = [expert_ranks(g * ep, n, ep)[1] for g in range(n // ep)]
        members += [expert_ranks(e, n, ep)[2] for e in range(ep)]
        for k, stage_ranks in enumerate(members):
            ranks = [j + n * pp_rank for j in stage_ranks]
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks and k < n // ep:
                ep_mine = group
            elif rank in ranks:
                edp_mine = group
    return ep_mine, edp_mine


def _cp_group(tp: int, pp: int, dp: int, cp: int, rank: int, timeout: timedelta | None
              ) -> dist.ProcessGroup | None:
    """This rank's CP group, creating every one in the same order on all ranks (new_group
    is collective): the cp consecutive data-parallel indices ``c·data_rank + i`` of one
    (tp_rank, pp_rank). ``dp`` is the data-parallel axis (c·d). None when cp == 1."""
    if cp == 1:
        return None
    mine = None
    for pp_rank in range(pp):
        for data_rank in range(dp // cp):
            for tp_rank in range(tp):
                ranks = [tp_rank + tp * (cp * data_rank + i + dp * pp_rank) for i in range(cp)]
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine = group
    return mine
