"""The launch helper of the multi-process tests: a hang fails the test with every process's stack, not a bare
timeout."""

import sys

import pytest

from conftest import run_launched

HANGS = """
import subprocess, sys, threading, time
def wait_forever():
    time.sleep(600)
threading.Thread(target=wait_forever, name="stuck-helper", daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef child_waits(): time.sleep(600)\\nchild_waits()"])
print("started", flush=True)
child.wait()
"""


def test_a_launch_that_hangs_fails_with_the_stacks_of_all_its_processes():
    with pytest.raises(pytest.fail.Exception) as failed:
        run_launched([sys.executable, "-c", HANGS], timeout=3)
    message = str(failed.value)
    assert "did not end within 3 s" in message
    assert "wait_forever" in message and "child_waits" in message  # the launcher's thread and its child's stack
    assert "started" in message  # and its output


def test_a_launch_that_ends_returns_its_output():
    done = run_launched([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                        timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
