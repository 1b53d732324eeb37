"""A SubprocessEnvironment worker for tests/test_fuzz_protocols.py: its first reply is the bytes of a file.

``reply_worker.py PATH`` reads one request line, writes PATH's bytes to stdout as they are
(anything: a valid reply, broken JSON, binary, a partial or oversized line), and exits at
once if they hold no newline (so a partial line ends in EOF, not a hang). Later requests
get the valid reply {"context": [1, 2], "status": "running"}.
"""

import sys

first = open(sys.argv[1], "rb").read()
sys.stdin.buffer.readline()
sys.stdout.buffer.write(first)
sys.stdout.buffer.flush()
if b"\n" not in first:
    sys.exit(0)
for _ in sys.stdin.buffer:
    sys.stdout.buffer.write(b'{"context": [1, 2], "status": "running"}\n')
    sys.stdout.buffer.flush()
