"""Placement: how devices split between the trainer and generator replicas, the
replicated pool, and (on 8 fake devices) tensor-parallel generation and a run on split
devices."""

import json
import os
import subprocess
import sys
import types
from concurrent.futures import Future
from pathlib import Path

import pytest

from async_rl.config import PlacementConfig
from async_rl.generation import replicas
from async_rl.generation.replicas import ReplicatedPool
from async_rl.generation.request import Request, SlotHandle
from async_rl.rl import build
from async_rl.rl.errors import ConfigError
from async_rl.timeline import Timeline
from async_rl.trajectory import Trajectory
from rl_test_utils import fake_devices


def _ids(devices):
  return ([d for d in devices.trainer], [list(r) for r in devices.replicas])


@pytest.mark.parametrize("placement, local, everywhere, trainer, replicas", [
    # One device: the generator shares it (the default everywhere).
    (PlacementConfig(), 1, 1, [0], [[0]]),
    (PlacementConfig(), 8, 8, list(range(8)), [[0]]),
    # The trainer on 4, two 2-device replicas on the rest.
    (PlacementConfig(trainer_devices=4, devices_per_replica=2), 8, 8, [0, 1, 2, 3],
     [[4, 5], [6, 7]]),
    (PlacementConfig(trainer_devices=6), 8, 8, list(range(6)), [[6], [7]]),
    (PlacementConfig(trainer_devices=4, generator_replicas=1, devices_per_replica=2), 8, 8,
     [0, 1, 2, 3], [[4, 5]]),
    # Sharing: replicas on the trainer's first devices.
    (PlacementConfig(generator_replicas=2, devices_per_replica=2), 8, 8, list(range(8)),
     [[0, 1], [2, 3]]),
    # Across processes the trainer takes every device; generators process 0's first.
    (PlacementConfig(), 2, 4, [0, 1, 2, 3], [[0]]),
])
def test_devices_split_between_trainer_and_replicas(placement, local, everywhere, trainer,
                                                    replicas):
  got = build.split_devices(placement, list(range(local)), list(range(everywhere)))
  assert _ids(got) == (trainer, replicas)


def test_a_rollout_worker_without_a_trainer_gives_every_device_to_generators():
  got = build.split_devices(PlacementConfig(devices_per_replica=2), list(range(4)),
                            with_trainer=False)
  assert _ids(got) == ([], [[0, 1], [2, 3]])


@pytest.mark.parametrize("placement, local, everywhere, field", [
    (PlacementConfig(trainer_devices=9), 8, 8, "placement.trainer_devices"),
    (PlacementConfig(trainer_devices=4, generator_replicas=3, devices_per_replica=2), 8, 8,
     "placement.generator_replicas"),
    (PlacementConfig(generator_replicas=5, devices_per_replica=2), 8, 8,
     "placement.generator_replicas"),
    (PlacementConfig(trainer_devices=2), 2, 4, "placement.trainer_devices"),
])
def test_a_placement_that_does_not_fit_names_the_field(placement, local, everywhere, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    build.split_devices(placement, list(range(local)), list(range(everywhere)))


@pytest.mark.parametrize("values, field", [
    ({"trainer_devices": 0}, "placement.trainer_devices"),
    ({"devices_per_replica": 0}, "placement.devices_per_replica"),
    ({"kind": "slurm"}, "placement.kind"),
    ({"gpu_memory_fraction": 1.5}, "placement.gpu_memory_fraction"),
    ({"rollout_workers": 2}, "placement.rollout_workers"),  # in process
])
def test_bad_placement_values_name_the_field(values, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    PlacementConfig(**values)


class _FakePool:
  """Resolves requests at once; a `hold_slot` request's samples hold a slot each."""

  def __init__(self, version=0):
    self.version = self.requested_version = version
    self.timeline, self.engine = Timeline(), types.SimpleNamespace()
    self.submitted, self.extended, self.released, self.updates = [], [], [], []
    self.futures = []

  def _samples(self, request):
    out = []
    for i in range(request.n):
      meta = {"request_id": request.request_id, "index": i}
      if request.hold_slot:
        meta["slot"] = SlotHandle(i, id(request) + i, len(request.prompt) + 1)
      out.append(Trajectory.from_completion(request.prompt, [5], [-1.0], [self.version],
                                            "stop", metadata=meta))
    return out

  def submit(self, request, hold=False):
    self.submitted.append(request)
    future = Future()
    self.futures.append((future, request))
    if not hold:
      future.set_result(self._samples(request))
    return future

  def extend(self, handle, request):
    self.extended.append(handle)
    future = Future()
    future.set_result(self._samples(request))
    return future

  def release(self, handle):
    self.released.append(handle)

  def update_weights(self, params, version, mode="retract"):
    self.updates.append((version, mode))
    self.version = self.requested_version = version
    future = Future()
    future.set_result({"transfer_s": 1.0, "pause_s": 0.5 * version})
    return future

  def metrics(self):
    return {k: 1 for k in (*replicas._SUMMED, "slot_occupancy", "decode_tokens_per_s",
                           "time_paused_s")} | {"version": self.version}


def test_requests_go_to_the_replica_with_the_fewest_samples_in_flight():
  pools = [_FakePool(), _FakePool()]
  replicated = ReplicatedPool(pools)
  pools[0].submit = lambda r, _submit=pools[0].submit: _submit(r, hold=True)  # replica 0 busy
  replicated.submit(Request("a", [1, 2], n=4))
  replicated.submit(Request("b", [1, 2], n=1))
  replicated.submit(Request("c", [1, 2], n=1))
  assert [r.request_id for r in pools[0].submitted] == ["a"]
  assert [r.request_id for r in pools[1].submitted] == ["b", "c"]


def test_a_held_slot_is_continued_and_released_on_its_own_replica():
  pools = [_FakePool(), _FakePool()]
  for pool in pools:
    pool.submit = lambda r, _submit=pool.submit: _submit(r, hold=True)
  replicated = ReplicatedPool(pools)
  first = replicated.submit(Request("a", [1, 2], n=1, hold_slot=True))
  second = replicated.submit(Request("b", [1, 2], n=1, hold_slot=True))
  for pool in pools:  # both in flight at once: one on each replica
    for future, request in pool.futures:
      future.set_result(pool._samples(request))
  a, b = first.result()[0].metadata["slot"], second.result()[0].metadata["slot"]
  replicated.extend(b, Request(("b", 1), [1, 2, 5, 6], n=1)).result()
  replicated.release(a)
  assert pools[1].extended == [b] and pools[0].released == [a]
  assert pools[0].extended == [] and pools[1].released == []
  # A handle no replica holds resolves to None: the caller submits instead.
  assert replicated.extend(a, Request(("a", 1), [1, 2, 5, 6], n=1)).result() is None


def test_updates_reach_every_replica_and_the_version_is_the_oldest():
  pools = [_FakePool(), _FakePool(version=0)]
  replicated = ReplicatedPool(pools)
  result = replicated.update_weights({"w": 1}, 3, "keep").result()
  assert [p.updates for p in pools] == [[(3, "keep")], [(3, "keep")]]
  assert result == {"transfer_s": 2.0, "pause_s": 1.5}
  pools[1].version = 2
  assert replicated.version == 2 and replicated.metrics()["version"] == 2
  assert len(replicated.metrics()["replicas"]) == 2
  assert replicated.metrics()["generated_tokens"] == 2


def test_tensor_parallel_generation_and_a_run_on_split_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS=fake_devices(8),
             PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                         str(Path(__file__).parent)]))
  out = subprocess.run([sys.executable, str(Path(__file__).with_name("placement_check.py")),
                        str(tmp_path / "run")], env=env, capture_output=True, text=True,
                       timeout=900, cwd=Path(__file__).parents[1])
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  # The tensor-parallel engine draws the one-device engine's tokens; float32 rounding
  # of the split matmuls stays far below what would flip a draw.
  assert r["tp_tokens_equal"] and r["tp_logp_max_abs_diff"] < 1e-4, r
  assert r["tp_sharded_leaves"] > 0, "the 2-device engine splits its params"
  assert r["trainer_devices"] == [0, 1, 2, 3]
  assert r["replica_devices"] == [[4, 5], [6, 7]]
  assert r["end_version"] == 3 and all(t > 0 for t in r["replica_tokens"]), r
  assert all(t > 0 for t in r["trained_tokens"]) and r["params_moved"] > 0, r
