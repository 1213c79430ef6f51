"""dlo.reaper at a command's end: the orphans it was handed are waited for, so their CPU time is counted."""

import resource
import subprocess
import sys
import textwrap


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime  # process_time() in a loop is mostly system time


def test_an_orphans_cpu_time_reaches_whoever_waits_for_the_command(tmp_path):
    """A process whose parent ended (here: a shell that started it in the background and left) is handed
    to the command (a subreaper while `stopping()`), which waits for it at its end: its CPU seconds reach
    the command's RUSAGE_CHILDREN and so `time dlo ...` (and `time make run`), not init's, where they
    were lost."""
    script, done = tmp_path / "command.py", tmp_path / "burnt"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        from dlo import reaper

        burn = ("import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\n"
                "open({str(done)!r}, 'w').close()")
        with reaper.stopping():
            subprocess.run(["sh", "-c", 'exec 1>&- 2>&-; {sys.executable} -c "$0" &', burn], check=True)
            # its burning done before the command ends, however loaded the machine (collect_orphans waits 2 s)
            end = time.monotonic() + 50
            while not os.path.exists({str(done)!r}) and time.monotonic() < end:
                time.sleep(0.02)
    """))
    before = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    after = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
    assert out.returncode == 0, out.stderr[-800:]
    assert after - before >= 0.6, f"{after - before:.2f} CPU s counted; the orphan alone burned 0.6"
