"""A discrete-event simulator of synchronous and asynchronous RL systems (pure Python).

It models generators with slots, prefill and decode costs, reward latency, the
trainer, weight updates (retract / keep / drain) and the staleness gate, to predict
throughput at cluster sizes that cannot be run here.
"""

from async_rl.sim.config import DecodeCost, SimConfig, sample_lengths
from async_rl.sim.engine import SimResult, simulate
