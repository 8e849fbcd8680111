"""A child that ignores SIGTERM and has a child of its own (what a zygote's stop_children must kill after its grace):
starts `sleep 60`, prints "ready", then sleeps 60 s.

    python tests/deaf_parent.py
"""
import signal
import subprocess
import time

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen(["sleep", "60"])
    print("ready", flush=True)
    time.sleep(60)
