"""A tool-episode worker for tests/test_sandbox.py, speaking dew.sandbox.SubprocessEnvironment's JSON lines.

The episode: reset returns [BOS, 10 + task]. Each step must carry exactly the context
the worker last returned (otherwise it replies "error" and stays alive). The first
``--turns - 1`` steps call the square tool on the action's first token n and append
[TOOL, n * n] after the action; the last step is the answer and completes the episode.
get_state / set_state snapshot the whole state as base64 JSON.

``--modulus M`` squares modulo M; ``--audit PATH`` appends each completed square call as a
JSON line (the episode identity, the turn and n); ``--pause TASK,TURN:FILE`` creates FILE
at that square call and then waits forever (for a test to kill it mid-call).

``--fail KIND`` misbehaves at the first step instead (see ``fail``); ``--spawn`` starts a
grandchild that sleeps, with the ``--marker`` in its argv; ``--marker`` is otherwise ignored
and lets a test find this process in /proc.
"""

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time

BOS, TOOL = 1, 3


def send(message) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def fail(kind: str) -> None:
    if kind == "hang":
        time.sleep(3600)
    elif kind == "memory":
        hoard = bytearray(1 << 30)  # past RLIMIT_AS: MemoryError, exit status 1
        send({"context": [len(hoard)], "status": "running"})
    elif kind == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        sys.stderr.write("square worker: giving up\n")
        sys.stderr.flush()
        sys.exit(3)
    elif kind == "not_json":
        sys.stdout.write("this is not json\n")
        sys.stdout.flush()
    elif kind == "oversized":
        send({"context": [1], "status": "running", "detail": "x" * 100_000})
    elif kind == "endless":
        sys.stdout.write("x" * 10_000_000)  # never a newline
        sys.stdout.flush()
        time.sleep(3600)
    elif kind == "negative":
        send({"context": [1, -4], "status": "running"})
    elif kind == "boolean":
        send({"context": [1, True], "status": "running"})
    elif kind == "missing":
        send({"status": "running"})
    elif kind == "bad_status":
        send({"context": [1], "status": "finished"})
    elif kind == "array":
        send([1, 2])
    elif kind == "two_lines":
        send({"context": [1, 2], "status": "running"})
        send({"context": [1, 2], "status": "running"})
    else:
        raise SystemExit(f"unknown failure {kind!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--fail", default=None)
    parser.add_argument("--spawn", action="store_true")
    parser.add_argument("--marker", default="")
    parser.add_argument("--modulus", type=int, default=None, help="square modulo this (keeps ids in a vocabulary)")
    parser.add_argument("--audit", default=None, help="append each completed square call here, one JSON line")
    parser.add_argument("--pause", default=None, help="TASK,TURN:FILE: at that call, create FILE and wait forever")
    args = parser.parse_args()
    state = {"context": [], "turn": 0, "episode": None}
    for line in iter(sys.stdin.readline, ""):
        request = json.loads(line)
        op = request["op"]
        if op == "reset":
            episode = request["episode"]
            state = {"context": [BOS, 10 + episode["task"]], "turn": 0, "episode": episode}
            if args.spawn:
                sleeper = "import time; time.sleep(300)"
                subprocess.Popen([sys.executable, "-c", sleeper, args.marker, "grandchild"])
            detail = "task={task} step={step} sample={sample} seed={seed}".format(**episode)
            send({"context": state["context"], "status": "running", "detail": detail})
        elif op == "step" and args.fail:
            fail(args.fail)
        elif op == "step":
            if request["context"] != state["context"]:
                send({"context": [], "status": "error", "detail": "context mismatch"})
                continue
            tokens = request["tokens"]
            state["turn"] += 1
            after = request["context"] + tokens
            if state["turn"] < args.turns:
                n = tokens[0]
                episode = state["episode"]
                if args.pause:
                    where, marker = args.pause.split(":", 1)
                    if where == f"{episode['task']},{state['turn']}":
                        open(marker, "w").close()
                        time.sleep(3600)  # the test kills the trainer (and this worker with it) here
                square = n * n if args.modulus is None else n * n % args.modulus
                state["context"] = after + [TOOL, square]
                if args.audit:
                    with open(args.audit, "a") as audit:
                        audit.write(json.dumps({**episode, "turn": state["turn"], "n": n}) + "\n")
                detail = f"square({n}) = {square} at policy step {request['policy_step']}"
                send({"context": state["context"], "status": "running", "detail": detail})
            else:
                state["context"] = after
                send({"context": after, "status": "completed", "detail": f"answer {tokens[0]} eos={request['eos']}"})
        elif op == "get_state":
            if args.fail == "bad_state":
                send({"state": "not base64!"})
            else:
                send({"state": base64.b64encode(json.dumps(state).encode()).decode()})
        elif op == "set_state":
            state = json.loads(base64.b64decode(request["state"]))
            send({"restored": True})


if __name__ == "__main__":
    main()
