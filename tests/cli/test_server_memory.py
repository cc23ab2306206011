"""Servers allocate from one heap and hand its free part back beyond a bound; trainers keep
freed memory (blocktrain/runtime.py): a flood of request bodies must not leave a server at its
peak for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from blocktrain.cli.main import build_parser

SERVERS = {"aggregator", "serve", "serve-block"}


def test_the_servers_and_only_they_run_from_one_trimmed_heap():
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert set(choices) >= SERVERS
    for name, sub in choices.items():
        server = sub.get_default("server") or False
        assert server == (name in SERVERS), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_server_gives_back_what_a_burst_freed_beyond_the_bound():
    # a process of its own: the settings are the whole process's, and its trim thread stays
    code = textwrap.dedent(
        """
        import time, torch
        from blocktrain import runtime
        def rss_mb():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        assert runtime.serve_from_heap(trim_every_s=0.05, retain=32 << 20)
        before = rss_mb()
        burst = [torch.ones(1 << 20) for _ in range(100)]  # 400 MB of 4 MB requests
        peak = rss_mb()
        del burst
        time.sleep(0.5)
        print(before, peak, rss_mb())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, peak, after = map(float, out.stdout.split())
    assert peak - before > 300
    assert after - before < 64, (before, peak, after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_trainers_memory_mode_takes_effect_on_glibc():
    from blocktrain import runtime

    assert runtime.keep_freed_memory()  # what this process runs under anyway (cli/main.py)
