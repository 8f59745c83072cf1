"""The parameter server: versioned weights, the staleness gate, the training buffer."""

from async_rl.param_server.buffer import AdmissionBuffer
from async_rl.param_server.gate import StalenessGate
from async_rl.param_server.server import ParameterServer

__all__ = ["AdmissionBuffer", "ParameterServer", "StalenessGate"]
