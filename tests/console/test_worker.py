from __future__ import annotations

import pytest

from console.tasks import ping


@pytest.mark.worker
def test_it_gets_an_answer_from_a_real_worker_process(worker_pool):
    worker_pool.start(concurrency=1)
    result = ping.apply_async(queue=worker_pool.queue)
    assert result.get(timeout=20) == "pong"
    assert all(proc.poll() is None for proc in worker_pool.procs)
