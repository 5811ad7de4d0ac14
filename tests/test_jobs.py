"""kpipe.infra.jobs.run_job in the job's own process: a Ctrl-C ends a Snakemake script's job, after it has unwound, and
even where Python would swallow it (and the handler it replaced comes back after the job); Rust's
thread pools held to the job's threads."""

import signal
import subprocess
import sys
import textwrap

# SIGINT arrives while a weakref callback runs: there KeyboardInterrupt is only printed ("Exception
# ignored in ..."), as it was in a module lock's callback during an import of a Ctrl-C'd run. The script
# first sets the handler Python starts with in a terminal: a shell's background job (`make test &`,
# `nohup ...`) starts its processes with SIGINT ignored, and Python then installs none, so the bare run
# would never see the Ctrl-C and the comparison would depend on how the suite was started.
SWALLOWED = textwrap.dedent("""
    import os, signal, time, weakref
    from types import SimpleNamespace
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import kpipe.infra.jobs
    from kpipe.infra.jobs import run_job

    kpipe.infra.jobs.INTERRUPT_GRACE_S = 0.5
    smk = SimpleNamespace(log=[], resources=SimpleNamespace(gpu_slots=0), config={"gpu": {"slots_per_gpu": 1}}, rule="t", threads=1)

    def work():
        class Held:
            pass

        def callback(ref):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)

        held = Held()
        ref = weakref.ref(held, callback)
        del held
        time.sleep(2.0)  # the job's work goes on
        print("ran on after Ctrl-C", flush=True)

    run_job(smk, work)
""")


def test_a_ctrl_c_that_python_would_swallow_still_ends_the_job():
    bare = subprocess.run([sys.executable, "-c", SWALLOWED.replace("run_job(smk, work)", "work()")],
                          capture_output=True, text=True, timeout=60)
    assert "ran on after Ctrl-C" in bare.stdout and "KeyboardInterrupt" in bare.stderr  # what Python does
    job = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=60)
    assert job.returncode == -signal.SIGINT, job.stdout + job.stderr
    assert "ran on after Ctrl-C" not in job.stdout


UNWINDS = textwrap.dedent("""
    import os, signal, sys, time
    from types import SimpleNamespace
    from kpipe.infra.jobs import run_job

    smk = SimpleNamespace(log=[], resources=SimpleNamespace(gpu_slots=0), config={"gpu": {"slots_per_gpu": 1}}, rule="t", threads=1)

    def work():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)
        finally:
            open(sys.argv[1], "w").write("stopped its server")

    run_job(smk, work)
""")


def test_a_ctrl_c_job_unwinds_first(tmp_path):
    """What a job started (the offline teacher's server) is stopped on the way out, as before."""
    marker = tmp_path / "unwound"
    job = subprocess.run([sys.executable, "-c", UNWINDS, str(marker)], capture_output=True, text=True, timeout=60)
    assert job.returncode in (-signal.SIGINT, 130), job.stdout + job.stderr
    assert marker.read_text() == "stopped its server"


def test_the_previous_sigint_handler_comes_back_after_the_job(monkeypatch):
    from types import SimpleNamespace

    from kpipe.infra import jobs

    monkeypatch.setenv(jobs.JOB_STARTED, "0")  # what run_job sets stays in this test
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    before = signal.getsignal(signal.SIGINT)
    smk = SimpleNamespace(log=[], resources=SimpleNamespace(gpu_slots=0), config={"gpu": {"slots_per_gpu": 1}}, rule="t", threads=1)
    during = []
    jobs.run_job(smk, lambda: during.append(signal.getsignal(signal.SIGINT)))
    assert during and during[0] is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_a_job_s_rayon_threads_are_its_snakemake_threads_unless_the_user_set_them():
    from kpipe.infra.jobs import threads_held_to

    environ: dict[str, str] = {}
    threads_held_to(4, environ)
    assert environ == {"RAYON_NUM_THREADS": "4"}
    environ = {"RAYON_NUM_THREADS": "2"}
    threads_held_to(4, environ)
    assert environ == {"RAYON_NUM_THREADS": "2"}
    environ = {}
    threads_held_to(0, environ)  # a job of no declared threads still gets one
    assert environ == {"RAYON_NUM_THREADS": "1"}
