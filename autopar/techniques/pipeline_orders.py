r"""The drawings of the pipeline schedules: the order in which pipeline rank i runs its blocks,
(kind, micro-batch j, the rank's chunk c), kinds "F" (forward), "B" (backward; of a split
backward, the input gradient), "W" (a split backward's weight gradient) and "BW" (a split
backward schedule's whole backward in one block). The records of
:mod:`autopar.techniques.pipeline_schedules` point at them; the report simulates them into
its timeline, and a schedule without a closed-form price is priced by simulating its order
(:func:`cost_models.pipeline.simulate_orders`). Orders (Narayanan et al. 2021, section 2.2):

* GPipe: all m forwards, then all m backwards.
* 1F1B (PipeDream-flush): :math:`p - 1 - i` warm-up forwards on rank i, then one forward
  and one backward, then the remaining backwards.
* Interleaved 1F1B: rank i runs chunks 0..v-1 (virtual stage :math:`c p + i`). Forwards
  go in groups of p micro-batches per chunk: the k-th forward is micro-batch
  :math:`\lfloor k/(pv) \rfloor p + k \bmod p` of chunk :math:`\lfloor k/p \rfloor \bmod v`
  (backwards the same, chunks from v - 1 down); the warm-up is
  :math:`(v - 1) p + 2 (p - 1 - i)` forwards (at most m v), then one forward and one
  backward, then the remaining backwards (Megatron-LM's and
  ``torch.distributed.pipelining.ScheduleInterleaved1F1B``'s order).
* ZB-H1 (Qi et al. 2024, section 3.1, Figure 3): each backward is an input-gradient "B"
  and a weight-gradient "W"; rank i runs 1F1B's :math:`p - 1 - i` warm-up forwards, then
  F, B and, from the (i+1)-th pair on, the W of the oldest micro-batch whose B is done;
  the cool-down runs B, W and then the W's left
  (``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` with one stage per rank,
  whose order ``tests/unit/test_technique_records.py`` compares).
* ZB-V (Qi et al. 2024, section 6): 2p chunks placed as a V (rank r holds chunks r and
  2p - 1 - r); rank r runs 2(p - r) - 1 forwards of its first chunk, r pairs of forwards,
  p - r (F, B, W) of its second, then (F, B, W) of each chunk in turn, then the backwards
  and W's left (``torch.distributed.pipelining.ScheduleZBVZeroBubble``'s order, compared
  there too). No closed form prices it (zero bubble only when F = B = W): its price is
  the makespan of this order.
* DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 technical report, section 3.2.1; the V of
  ZB-V): warm-up forwards of both chunks, zero-bubble steps (B, W, F) of the second, then
  steps that pair a forward of one chunk with a whole backward "BW" of the other
  (overlapped on a GPU with a custom overlap; torch without one runs them one after the
  other, as drawn), then the backwards, the last split, and the W's left
  (``torch.distributed.pipelining.ScheduleDualPipeV``'s order, compared there too).
"""

from __future__ import annotations

__all__ = ["Order", "gpipe_order", "one_f_one_b_order", "zb_h1_order", "zb_v_order",
           "dualpipe_v_order", "interleaved_order", "order_in_flight"]

Order = list[tuple[str, int, int]]
"""A rank's blocks in run order: (kind, micro-batch, the rank's chunk); module docstring."""


def gpipe_order(pp: int, m: int, rank: int, v: int = 1) -> Order:
    """GPipe's blocks on ``rank`` (module docstring)."""
    return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]


def one_f_one_b_order(pp: int, m: int, rank: int, v: int = 1) -> Order:
    """1F1B's blocks on ``rank`` (module docstring)."""
    warmup = min(pp - 1 - rank, m)
    order = [("F", j, 0) for j in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k, 0), ("B", k, 0)]
    return order + [("B", j, 0) for j in range(m - warmup, m)]


def zb_h1_order(pp: int, m: int, rank: int, v: int = 1) -> Order:
    """ZB-H1's blocks on ``rank`` (module docstring)."""
    warmup = min(pp - 1 - rank, m)
    order = [("F", j, 0) for j in range(warmup)]
    done = 0  # W's run so far
    for k in range(m - warmup):
        order += [("F", warmup + k, 0), ("B", k, 0)]
        if k >= rank:
            order.append(("W", done, 0))
            done += 1
    for j in range(m - warmup, m):
        order += [("B", j, 0), ("W", done, 0)]
        done += 1
    return order + [("W", j, 0) for j in range(done, m)]


def zb_v_order(pp: int, m: int, rank: int, v: int = 2) -> Order:
    """ZB-V's blocks on ``rank`` (chunk 0: virtual stage rank, chunk 1: 2p - 1 - rank),
    torch's ``ScheduleZBVZeroBubble`` order: it plans max(2p - 1, m) micro-batches and
    drops the blocks of those past m."""
    n = max(2 * pp - 1, m)
    f, b, w = [0, 0], [0, 0], [0, 0]  # forwards, input and weight gradients run per chunk
    order: Order = []

    def run(kind: str, c: int) -> None:
        count = {"F": f, "B": b, "W": w}[kind]
        order.append((kind, count[c], c))
        count[c] += 1

    for _ in range(2 * (pp - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1), run("F", 0)
    for _ in range(pp - rank):
        run("F", 1), run("B", 1), run("W", 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run("F", 0)
        run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)
    for _ in range(rank):
        run("B", 0), run("B", 1)
    for _ in range(pp - rank):
        run("B", 0), run("W", 0)
    while w[1] < b[1]:
        run("W", 1)
    while w[0] < b[0]:
        run("W", 0)
    return [block for block in order if block[1] < m]


def dualpipe_v_order(pp: int, m: int, rank: int, v: int = 2) -> Order:
    """DualPipeV's blocks on ``rank`` (its chunks as ZB-V's), torch's ``ScheduleDualPipeV``
    order (DeepSeek-AI 2024, section 3.2.1; deepseek-ai/DualPipe): a forward and a whole
    backward ("BW") of the other chunk are one overlapped step, run here one after the
    other (as torch runs them without a custom overlap); the last steps split the backward
    and run the W's left."""
    order: Order = []
    count: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []  # (micro-batch, chunk) of B's whose W waits

    def run(kind: str, c: int) -> None:
        key = (c, "F" if kind == "F" else "B")
        j = count.get(key, 0)
        order.append((kind, j, c))
        count[key] = j + 1
        if kind == "B":
            pending.append((j, c))

    def weight() -> None:
        if pending:
            j, c = pending.pop(0)
            order.append(("W", j, c))

    for _ in range(2 * (pp - rank - 1)):
        run("F", 0)
    for _ in range(rank + 1):
        run("F", 0), run("F", 1)
    for _ in range(pp - rank - 1):
        run("B", 1), weight(), run("F", 1)
    for _ in range(m - 2 * pp + rank + 1):  # the overlapped steps
        run("F", 0), run("BW", 1), run("F", 1), run("BW", 0)
    for _ in range(pp - rank - 1):
        run("BW", 1), run("F", 1), run("BW", 0)
    split, half = False, (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        run("B" if split else "BW", 1)
        split = split or (i == half and rank % 2 == 0)
        run("B" if split else "BW", 0)
    for _ in range(pp - rank - 1):
        weight(), run("B" if split else "BW", 0)
    for _ in range(rank + 1):
        weight()
    return order


def interleaved_order(pp: int, m: int, rank: int, v: int) -> Order:
    """Interleaved 1F1B's blocks on ``rank`` (module docstring). ValueError unless p
    divides m."""
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs num_micro_batches divisible by pp, got "
                         f"m={m}, pp={pp}")

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // pp) % v
        return kind, (k // (pp * v)) * pp + k % pp, chunk if kind == "F" else v - 1 - chunk

    total = m * v
    warmup = min((v - 1) * pp + 2 * (pp - 1 - rank), total)
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op("F", warmup + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def order_in_flight(order: Order, virtual_stages: int) -> float:
    """Whole-stage micro-batches of activations a rank holds at peak when it runs ``order``:
    the most chunk forwards whose backward has not finished, over v. A backward finishes at
    its "B" in an order without "W" blocks (a whole backward, run with
    ``retain_graph=False``, frees each node's saved tensors as it goes), else at its "W" or
    "BW": torch's split backward runs the input-gradient pass with ``retain_graph=True``
    (``torch.distributed.pipelining._backward.stage_backward_input``), so a micro-batch's
    whole graph stays until its weight-gradient pass frees it. Qi et al. 2024 (Table 1)
    count less, a W holding only the weight gradients' inputs; on two processes the
    saved bytes torch holds were measured equal to this count (benchmarks/
    split_backward_memory.py)."""
    split = any(kind == "W" for kind, _, _ in order)
    frees = {"BW", "W"} if split else {"B", "BW"}
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1 if kind in frees else 0
        peak = max(peak, held)
    return peak / virtual_stages
