"""autopar: automatic tensor/pipeline/data-parallel plans for GPT training.

Public face: :func:`plan`, :func:`evaluate`, :func:`parallelize`, :class:`Cluster`,
:class:`Layout`, :class:`Plan`, :mod:`report` (``report.write_report``) and :func:`load_model`.
"""

from cost_models.hardware import Cluster

from autopar import report  # autopar.report.write_report(plan, out_dir, hand_layouts=...)
from autopar.api import evaluate, evaluate_plan, plan
from autopar.models import load_model
from autopar.plan import Layout, Plan, Prediction
from autopar.planner.decision import InfeasibleError
from autopar.graph.capture import TraceError

__all__ = ["Cluster", "Layout", "Plan", "Prediction", "plan", "evaluate", "evaluate_plan", "parallelize",
           "report", "load_model", "InfeasibleError", "TraceError"]


def parallelize(*args, **kwargs):
    """See :func:`autopar.runtime.parallelize.parallelize` (imported lazily: it needs torch.distributed)."""
    from autopar.runtime.parallelize import parallelize as _parallelize

    return _parallelize(*args, **kwargs)
