"""The single-server hub's GPU sharing (deploy/jupyterhub/device_pool.py).

What is protected: no device is ever held by two servers; a request the free devices cannot
meet is refused with a message naming who holds what, and one the machine can never meet says
so; a stopped server's devices return; a restarting server keeps its devices; a hub that
restarts while servers run re-marks their devices.
"""

from __future__ import annotations

import pytest
from device_pool import DevicePool, DevicesBusy, detect_devices


def test_each_device_goes_to_one_server_and_returns_on_release():
    pool = DevicePool(["0", "1", "2"])
    a = pool.acquire("alice", 1)
    b = pool.acquire("bob", 2)
    assert a == ["0"] and b == ["1", "2"] and not set(a) & set(b)
    assert pool.free() == []
    assert pool.acquire("carol", 0) == []  # the CPU profile needs no device
    with pytest.raises(DevicesBusy) as e:
        pool.acquire("carol", 1)
    message = str(e.value)
    assert "needs 1, 0 are free" in message and "alice: 0" in message and "bob: 1,2" in message
    assert "CPU profile" in message
    assert pool.release("bob") == ["1", "2"]
    assert pool.acquire("carol", 2) == ["1", "2"]
    assert pool.release("nobody") == []


def test_a_restarting_server_keeps_its_devices_and_may_shrink_or_grow():
    pool = DevicePool(["0", "1", "2", "3"])
    pool.acquire("bob", 1)
    assert pool.acquire("alice", 2) == ["1", "2"]
    assert pool.acquire("alice", 2) == ["1", "2"]  # same share again, not two more
    assert pool.acquire("alice", 1) == ["1"] and pool.free() == ["2", "3"]
    assert pool.acquire("alice", 3) == ["1", "2", "3"]
    with pytest.raises(DevicesBusy):
        pool.acquire("alice", 4)  # bob holds 0
    assert pool.held("alice") == ["1", "2", "3"]  # a refused request changes nothing


def test_requests_the_machine_cannot_meet_and_bad_device_lists():
    pool = DevicePool(["0", "1"])
    with pytest.raises(ValueError, match="needs 8 GPUs but this server has 2"):
        pool.acquire("alice", 8)
    with pytest.raises(ValueError, match="ask for 0 or more"):
        pool.acquire("alice", -1)
    with pytest.raises(ValueError, match="only once"):
        DevicePool(["0", "0"])
    with pytest.raises(ValueError, match="one non-empty name per device"):
        DevicePool(["0,1"])


def test_claim_restores_a_restarted_hubs_assignments():
    pool = DevicePool(["GPU-a", "GPU-b"])
    pool.claim("alice", ["GPU-b", "GPU-gone"])  # a device no longer listed is ignored
    assert pool.held("alice") == ["GPU-b"] and pool.free() == ["GPU-a"]
    with pytest.raises(DevicesBusy, match="recorded for both alice and bob"):
        pool.claim("bob", ["GPU-b"])


def test_detect_devices_prefers_the_hubs_setting():
    assert detect_devices({"WORKBENCH_HUB_DEVICES": "0, 1,2", "CUDA_VISIBLE_DEVICES": "7"}) == [
        "0", "1", "2"]
    assert detect_devices({"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    assert detect_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []
