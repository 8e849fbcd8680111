"""A child that ignores SIGTERM and has a child of its own (what a zygote's stop_children must kill after its grace):
ignores SIGTERM, then starts `sleep 60` and sleeps 60 s itself.

    python tests/deaf_parent.py
"""
import signal
import subprocess
import time

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen(["sleep", "60"])
    time.sleep(60)
