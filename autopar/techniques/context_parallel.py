"""Context parallelism (CP), one record: everything autopar knows about splitting a
sequence's tokens over cp ranks for the whole transformer layer (Megatron-Core's context
parallelism; Llama 3, Grattafiori et al. 2024, arXiv:2407.21783, section 3.3.2; Liu et al.
2023, "Ring Attention", for the ring form).

* **the split** (:func:`sequence_chunks`): the s tokens of a sequence are cut into 2·cp
  chunks of s/(2cp); CP rank i holds chunks i and 2cp−1−i ("head-tail" load balancing:
  under a causal mask chunk j attends j + 1 chunks of keys, so every rank computes
  (i + 1) + (2cp − i) = 2cp + 1 chunk blocks: the same work on every rank);
* **the attention** (:func:`autopar.runtime.context_parallel.context_parallel_attention`):
  the keys and values of the cp ranks are all-gathered before attention (Llama 3's
  all-gather CP, arXiv:2407.21783 section 3.3.2: "we first all-gather the key (K) and value
  (V) tensors, and then compute attention output for the local query (Q) tensor chunk"),
  and their gradients reduce-scattered in backward; each local query chunk attends the
  gathered keys up to its own last position;
* **the price** (:func:`kv_all_gather_elems`): per attention layer and micro-batch, an
  all-gather of K and V (2·b·s·h_kv·d_head elements of the whole sequence, (cp−1)/cp of
  them received by each rank) in forward and a reduce-scatter of their gradients of the
  same size in backward; attention FLOPs and every activation divided by cp;
* **the groups** (:func:`cp_ranks`): Megatron's rank order tp, cp, dp, pp (TP innermost):
  stage rank j = tp_rank + t·(cp_rank + c·dp_rank); the gradients of every parameter are
  averaged over the c·d ranks of a stage that hold the same TP shard;
* **the framework mapping** (:data:`FRAMEWORK_FLAGS`): Megatron-LM's
  ``--context-parallel-size``, torchtitan's ``parallelism.context_parallel_degree``.

Pure Python: the planner, the runtime, the report and the frameworks import it.
"""

from __future__ import annotations

__all__ = ["sequence_chunks", "local_positions", "cp_problem", "cp_ranks", "cp_degrees",
           "kv_all_gather_elems", "CP_MIN_LOCAL_TOKENS", "FRAMEWORK_FLAGS", "SOURCE"]

CP_MIN_LOCAL_TOKENS = 8192
"""The search tries cp > 1 only while each rank keeps at least this many tokens of a
sequence: Llama 3 extended its context to 128K tokens with cp = 16, 8K tokens per rank
(arXiv:2407.21783, Table 4), and trained at 8K without CP. A search-space rule (each cp is
a search of its own), not a limit of the runtime: a pinned ``Layout.cp`` is priced and run
at any length."""

SOURCE = ("Grattafiori et al. 2024 (The Llama 3 Herd of Models, arXiv:2407.21783), section "
          "3.3.2: all-gather context parallelism with 2·cp load-balanced chunks")

FRAMEWORK_FLAGS = {
    "megatron": "--context-parallel-size",
    "torchtitan": "parallelism.context_parallel_degree",
}
"""Per target framework, its setting of the CP degree (Megatron-LM's arguments.py;
torchtitan's ``Parallelism`` job config)."""


def sequence_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2·``cp`` sequence chunks CP rank ``cp_rank`` holds, in its local
    order: (cp_rank, 2·cp − 1 − cp_rank) (head-tail load balancing). Raises ValueError for
    cp < 1 or a rank outside [0, cp)."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp) with cp={cp} >= 1")
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp: int, cp_rank: int) -> list[int]:
    """The global token positions (0-based) of the s/cp tokens CP rank ``cp_rank`` holds, in
    its local order (the positions its rotary or learned position embeddings must use).
    Raises ValueError unless 2·cp divides ``seq_len``."""
    problem = cp_problem(cp, seq_len)
    if problem:
        raise ValueError(problem)
    c = seq_len // (2 * cp)
    return [p for j in sequence_chunks(cp, cp_rank) for p in range(j * c, (j + 1) * c)]


def cp_problem(cp: int, seq_len: int | None = None, attention_dropout: float = 0.0) -> str | None:
    """Why context parallelism of degree ``cp`` does not run, or None. seq_len: s (2·cp
    chunks must divide it; None: not checked); attention_dropout: the attention's dropout
    probability (its mask would have to follow the chunks: refused)."""
    if cp < 1:
        return f"cp={cp} must be a positive integer"
    if cp == 1:
        return None
    if seq_len is not None and seq_len % (2 * cp):
        return (f"cp={cp} splits each sequence into 2·cp={2 * cp} equal chunks (head-tail "
                f"load balancing), which seq_len={seq_len} is not a multiple of; choose a "
                f"cp with 2·cp | {seq_len}")
    if attention_dropout:
        return (f"cp={cp} with attention dropout {attention_dropout}: context-parallel "
                "attention draws no dropout mask; set the attention dropout to 0 or use cp=1")
    return None


def cp_ranks(stage_rank: int, tp: int, cp: int, dp: int) -> tuple[int, list[int]]:
    """(CP rank, the stage ranks of this rank's CP group) for ``stage_rank`` =
    tp_rank + t·(cp_rank + c·dp_rank) of the t·c·d ranks of a pipeline stage (Megatron's
    order tp, cp, dp). Raises ValueError for a rank outside the stage."""
    if not 0 <= stage_rank < tp * cp * dp:
        raise ValueError(f"stage rank {stage_rank} outside the tp·cp·dp={tp * cp * dp} ranks")
    tp_rank, rest = stage_rank % tp, stage_rank // tp
    cp_rank, dp_rank = rest % cp, rest // cp
    return cp_rank, [tp_rank + tp * (i + cp * dp_rank) for i in range(cp)]


def kv_all_gather_elems(batch: int, seq_len: int, kv_heads: int, head_dim: int) -> int:
    """Elements of one attention layer's K and V over the whole sequence (2·b·s·h_kv·d_head):
    what the CP all-gather assembles on every rank per micro-batch in forward (each rank
    receives (cp−1)/cp of them) and what the reduce-scatter of their gradients sums in
    backward (arXiv:2407.21783 section 3.3.2)."""
    return 2 * batch * seq_len * kv_heads * head_dim


def cp_degrees(seq_len: int, num_gpus: int, pinned: int | None = None) -> list[int]:
    """The context-parallel degrees a search tries for sequences of ``seq_len`` tokens on
    ``num_gpus`` GPUs: ``pinned`` when given, else 1 and every divisor c of the GPUs with
    2·c | s and s/c >= :data:`CP_MIN_LOCAL_TOKENS`."""
    if pinned is not None:
        return [pinned]
    return [c for c in range(1, num_gpus + 1) if num_gpus % c == 0 and (
        c == 1 or seq_len % (2 * c) == 0 and seq_len // c >= CP_MIN_LOCAL_TOKENS)]
