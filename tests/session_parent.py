"""A parent as torchrun's agent is one: starts a child (`sleep 60`) in a session of its own, then sleeps 60 s.

    python tests/session_parent.py
"""
import subprocess
import time

if __name__ == "__main__":
    subprocess.Popen(["sleep", "60"], start_new_session=True)
    time.sleep(60)
