"""Megatron-LM's TP pattern (``autopar.planner.strategies.megatron``) on models Megatron does not ship,
with sequence parallelism, where every reshard must be one autopar offers (else ``evaluate``
refuses the placements):

* a prediction head (ModernBERT-decoder's dense -> GELU -> LayerNorm before the vocabulary
  projection): only the Linear that produces the logits is the column-split LM head;
* hyper-connection streams (Hunyuan-V4's residual of (b, s, streams, h)): a stream dim
  split where the stream is made must not meet the residual stream's sequence shards;
  an op that would is kept whole.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.graph.capture import trace_model
from autopar.planner.strategies.megatron import megatron_placements

SEQ, H, V = 16, 32, 64
CLUSTER = autopar.Cluster.local_cpu(processes=2)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class PredictionHeadLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.norm, self.dense, self.head_norm = nn.LayerNorm(H), nn.Linear(H, H), nn.LayerNorm(H)
        self.decoder = nn.Linear(H, V)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.head_norm(F.gelu(self.dense(self.norm(x)))))


class _StreamsBlock(_Block):
    """Reads the mean of the streams, adds its update to each stream by a learned weight
    (Hunyuan-V4's hyper-connections): (b, s, 4, h)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.ones(4, 1))

    def forward(self, x):
        return x + super().forward(x.mean(2)).unsqueeze(2) * self.mix


class StreamsLM(nn.Module):
    """A residual of 4 streams made by expanding the embedding (captured by export, which
    sees ``expand``'s stream count)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, H), nn.Linear(H, V)
        self.layers = nn.ModuleList(_StreamsBlock() for _ in range(2))

    def forward(self, idx):
        x = self.emb(idx) * (1.0 if idx.size(1) > 1 else 2.0)  # export, not symbolic_trace
        x = x.unsqueeze(2).expand(-1, -1, 4, -1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(2))


def _evaluate(model):
    layout = autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=2, sequence_parallel=True,
                            dtype="fp32")
    return autopar.evaluate(model, CLUSTER, layout, global_batch_size=2, seq_len=SEQ)


def test_only_the_logits_linear_is_the_lm_head():
    traced = trace_model(PredictionHeadLM(), SEQ)
    placements = megatron_placements(traced, 2, sequence_parallel=True)
    assert placements["decoder"].startswith("column")
    assert placements["dense"].startswith("replicate")
    assert _evaluate(PredictionHeadLM()).placements == placements


def test_a_stream_dim_split_never_meets_sequence_shards():
    plan = _evaluate(StreamsLM())  # raised "plan reshards ... in a way autopar does not offer"
    assert plan.sequence_parallel and plan.predicted.step_time_s > 0
