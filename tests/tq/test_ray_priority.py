"""A Ray instance rollbus starts runs its workers at the starting process's priority, not Ray's
default niceness of 15, under which TransferQueue starved beside two busy processes on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

HOSTED = textwrap.dedent("""
    import json, os
    import psutil, ray
    from materializer.transfer_queue import TransferQueueConnection

    connection = TransferQueueConnection(storage_units=1)
    connection.open()
    try:
        task = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote(), timeout=60)
        actors = {p.info["name"]: p.nice() for p in psutil.process_iter(["name"])
                  if (p.info["name"] or "").startswith("ray::") and "Transfer" in p.info["name"]
                  or (p.info["name"] or "").startswith("ray::SimpleStorage")}
        print(json.dumps({"driver": os.nice(0), "task": task, "actors": actors}))
    finally:
        connection.close()
""")


def test_the_workers_of_the_ray_rollbus_hosts_are_not_deprioritised() -> None:
    # A fresh process: the session's own Ray (the tq_cluster fixture) would be joined, not hosted.
    done = subprocess.run([sys.executable, "-c", HOSTED], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["task"] == seen["driver"], seen
    assert seen["actors"] and set(seen["actors"].values()) == {seen["driver"]}, seen
