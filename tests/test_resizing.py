"""Tail resizing in the search loop (`scamp_jax.hpo.resizing`): a restart keeps the trial's
global batch."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from scamp_jax.scheduling.elastic import Resize
from scamp_jax.scheduling.placement import DeviceOption


def test_a_restart_planned_at_another_global_batch_is_withdrawn():
    from concurrent.futures import Future

    from scamp_jax.hpo.resizing import TailResizer

    withdrawn = []
    core = SimpleNamespace(withdraw=lambda key, n: withdrawn.append((key, n)),
                           still_worth=lambda *a: True, restart_fits=lambda *a: True,
                           plan_of=lambda key: None, running={0: (0,)},
                           restarted=lambda *a: True)
    resizer = TailResizer(core, None, 4, submit=None, trial_plan=lambda p: None,
                          now=lambda: 1.0)
    logs = []
    planned = SimpleNamespace(plan=SimpleNamespace(batch_size=16), devices=1)
    record = SimpleNamespace(run=SimpleNamespace(members=[planned], stop=threading.Event()),
                             resizing=None, log=lambda *a: logs.append(a),
                             status=SimpleNamespace(state="running"), show_plan=lambda p: None)
    future = Future()
    future.set_result(SimpleNamespace(data_parallel=4, model_parallel=1, batch_size=12))
    resizer._book(Resize(0, (0, 1, 2, 3), DeviceOption(4, 1, 1.0)), future, record)
    assert withdrawn == [(0, 4)] and logs[0][0] == "withdrawn"
    assert record.resizing is None and not record.run.stop.is_set()
