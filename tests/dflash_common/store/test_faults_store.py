"""Store faults beyond tests/dflash_common/test_store*.py: leftovers of writers killed without being
reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from test_store_support import manifest

from dflash_common.store import StoreWriter
from dflash_common.store.writer import _host


def test_the_staging_of_a_killed_but_unreaped_writer_is_cleaned(tmp_path):
    """A rank SIGKILLed after its torchrun agent stays a zombie until PID 1 reaps it; signal 0 still
    finds it, yet it writes nothing more: its staging dir goes."""
    StoreWriter.create_or_open(tmp_path / "s", manifest())
    writer = subprocess.Popen(["sleep", "60"])
    os.kill(writer.pid, signal.SIGKILL)
    time.sleep(0.2)  # killed, not yet waited for: a zombie
    os.kill(writer.pid, 0)  # which signal 0 still finds
    staging = tmp_path / "s/.staging" / f"u7~{_host()}~{writer.pid}~abcd1234"
    (staging / "layer_1").mkdir(parents=True)
    StoreWriter.create_or_open(tmp_path / "s", manifest())
    assert not staging.exists()
    writer.wait()
