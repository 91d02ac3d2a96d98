"""A benchmark stopped with SIGTERM stops the systems it started, as Ctrl-C does (services/tools/bench/system.py)."""

import os
import signal
import subprocess
import sys
import textwrap

from shared.config import PROJECT_ROOT

BENCH = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from services.tools.bench.system import UpProcess
    # a stand-in for `morphling up`: it runs until Ctrl-C, which UpProcess.stop sends (its handler set, as up sets
    # its own, since a shell's background job starts with SIGINT ignored)
    STAND_IN = ("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "print('ready', flush=True); time.sleep(600)")
    up = UpProcess([sys.executable, "-c", STAND_IN], Path(sys.argv[1]))
    try:
        up.lines.get(timeout=30)  # its handler is set
        print(up.proc.pid, flush=True)
        time.sleep(600)
    finally:
        up.stop()
""")


def test_a_terminated_benchmark_stops_the_system_it_started(tmp_path):
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(tmp_path / "up.log")], cwd=PROJECT_ROOT,
                             stdout=subprocess.PIPE, text=True)
    system_pid = int(bench.stdout.readline())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    try:
        os.kill(system_pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "the benchmark's system outlived it"
