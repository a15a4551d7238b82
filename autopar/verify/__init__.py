"""``autopar verify``: a few training steps of the parallel program against one device."""

from autopar.verify.check import verify
from autopar.verify.result import (ParamDiff, StepLoss, Tolerances, VerificationError,
                                   VerifyReport)

__all__ = ["verify", "Tolerances", "ParamDiff", "StepLoss", "VerifyReport", "VerificationError"]
