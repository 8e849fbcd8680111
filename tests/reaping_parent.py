"""A node whose work is done by a child it has reaped (as torchrun's agent reaps a rank): runs the advise compute
probe (an MLP trained on one torch thread) as a child to its end, then sleeps SLEEP_S seconds.

    python tests/reaping_parent.py STEPS SLEEP_S
"""
import subprocess
import sys
import time

from deltaps.tools.children import module_command  # not torch_probes itself: this parent stays light (no torch)

if __name__ == "__main__":
    steps, sleep_s = int(sys.argv[1]), float(sys.argv[2])
    subprocess.run(module_command("deltaps.tools.torch_probes", "compute", 256, 2, 64, steps, time.time()), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(sleep_s)
