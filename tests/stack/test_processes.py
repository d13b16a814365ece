"""Killing a whole process session at once, as a lost machine loses everything it ran."""

import subprocess
import sys
import time

from stack import processes


def test_kill_session_and_wait_takes_every_process_of_the_session_and_nothing_else():
    # A session leader with a child that leaves the process group (as Ray's workers do) but not the session.
    code = "import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)']); time.sleep(60)"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        deadline = time.time() + 10
        while len(processes.session_members(leader.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        members = processes.session_members(leader.pid)
        assert len(members) == 2, members
        assert processes.kill_session_and_wait(leader.pid) == 2
        leader.wait(timeout=5)
        assert not any(processes.pid_alive(p) for p in members)
        assert processes.session_members(leader.pid) == []
        assert processes.pid_alive(bystander.pid)
    finally:
        bystander.kill()
        leader.kill()
