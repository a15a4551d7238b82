"""Step 1 of the flow: capture a model as a torch.fx graph on meta tensors and annotate
every node (kind, shape, FLOPs, parameters, saved bytes, layer)."""

from autopar.graph.annotate import NodeInfo, TracedModel
from autopar.graph.capture import TraceError, trace_model

__all__ = ["NodeInfo", "TracedModel", "TraceError", "trace_model"]
