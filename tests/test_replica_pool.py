"""ReplicaPool: the one pool of replicas under EnginePool, ServerPool, RemoteEnvironmentSource and RemoteFleet.

Replicas here are scripted: each says, when probed, whether it answers (and what it serves),
stays silent or is gone, so every path of the pool runs in milliseconds. The real replicas
are tested where they live: Ray actors in tests/test_ray_actors.py, a stalled vLLM engine in
tests/test_rollout_servers.py.
"""

import threading
import time

import pytest

from dew.inference import ReplicaPool, ServerDied


class Scripted:
    """What each replica answers a probe: "silent", "gone", or what it serves; every probe and rejoin recorded."""

    def __init__(self, count: int, rejoin=True):
        self.answers = ["serving 0"] * count
        self.probed: list[int] = []
        self.rejoined: list[tuple[int, object]] = []
        self.aside: list[int] = []
        self.rejoin_says = rejoin

    def probe(self, index, timeout):
        self.probed.append(index)
        answer = self.answers[index]
        if answer == "gone":
            raise ServerDied(f"replica {index} is gone")
        if answer == "silent":
            time.sleep(timeout)
            return None
        return answer

    def rejoin(self, index, served):
        self.rejoined.append((index, served))
        return self.rejoin_says(index, served) if callable(self.rejoin_says) else self.rejoin_says

    def pool(self, timeout=None, died=None, away=None, wait=None):
        return ReplicaPool([f"replica {i}" for i in range(len(self.answers))], what="replica", work="pieces",
                           timeout=timeout, probe=self.probe, rejoin=self.rejoin, on_aside=self.aside.append,
                           died=died, away=away, wait=wait)


def until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_the_least_busy_live_replica_takes_the_next_piece():
    replicas = Scripted(3)
    pool = replicas.pool()
    tickets = [pool.take() for _ in range(5)]
    assert [t.replica for t in tickets] == [0, 1, 2, 0, 1]  # ties go to the first; then the least busy
    assert [pool.in_flight(i) for i in range(3)] == [2, 2, 1]
    assert pool.release(tickets[0]) and pool.release(tickets[3])
    assert not pool.release(tickets[3])  # a second release is no release
    assert pool.take().replica == 0 and pool.in_flight(0) == 1
    pool.close()


def test_dead_replicas_are_left_out_and_none_left_is_named():
    replicas = Scripted(3)
    said_dead = {1}
    pool = replicas.pool(died=lambda index: index in said_dead)  # replica 1's own word: it died
    ticket = pool.take()
    assert ticket.replica == 0 and pool.live() == [0, 2] and pool.dead() == [1]
    pool.release(ticket, died=True)  # a piece that ended with its replica's death
    assert pool.live() == [2]
    pool.mark_dead(2)
    with pytest.raises(RuntimeError, match="no replica of the pool takes pieces: of 3 started, 3 died and 0 stopped"):
        pool.take()
    pool.close()


def test_a_failed_piece_has_its_replica_checked_off_the_callers_thread():
    replicas = Scripted(2)
    replicas.answers[0] = "gone"
    pool = replicas.pool()
    ticket = pool.take()
    began = time.monotonic()
    pool.release(ticket, failed=True)
    assert time.monotonic() - began < 0.5  # the check runs on the pool's own thread
    assert until(lambda: pool.dead() == [0]) and pool.live() == [1]
    replicas.answers[1] = "serving 0"
    failed = pool.take()
    pool.release(failed, failed=True)  # a replica that answers its check stays
    assert until(lambda: 1 in replicas.probed) and pool.live() == [1]
    pool.close()


def test_a_silent_replica_is_set_aside_its_pieces_abandoned_and_it_rejoins_once_caught_up():
    replicas = Scripted(2, rejoin=lambda index, served: served == "serving 2")
    pool = replicas.pool(timeout=0.2)
    replicas.answers[0] = "silent"
    abandoned = []
    ticket = pool.take()
    pool.attach(ticket, abandoned.append)
    assert ticket.replica == 0
    # silent 0.2 s with a piece waiting, then a probe unanswered for 0.2 s more: set aside
    assert until(lambda: pool.aside() == [0], seconds=5)
    assert len(abandoned) == 1 and isinstance(abandoned[0], ServerDied)
    assert "replica 0 was set aside: it answered nothing for 0.4 s with pieces waiting" in str(abandoned[0])
    assert replicas.aside == [0] and pool.live() == [1]
    assert not pool.release(ticket)  # its outcome came late: abandoned already
    assert [pool.take().replica for _ in range(3)] == [1, 1, 1]
    replicas.answers[0] = "serving 1"  # answers, but serves old weights: the rejoin says no, it stays aside
    assert until(lambda: (0, "serving 1") in replicas.rejoined, seconds=5) and pool.aside() == [0]
    replicas.answers[0] = "serving 2"  # caught up
    assert until(lambda: pool.live() == [0, 1], seconds=5) and replicas.rejoined[-1] == (0, "serving 2")
    late = pool.take()
    assert late.replica == 0  # the least busy again
    pool.attach(late, abandoned.append)
    pool.close()


def test_a_ticket_attached_after_its_replica_was_set_aside_is_abandoned_at_once():
    replicas = Scripted(2)
    pool = replicas.pool(timeout=30)
    ticket = pool.take()
    pool.set_aside(ticket.replica, "it did not load version 3 within 30 s")
    stopped = []
    pool.attach(ticket, stopped.append)
    assert len(stopped) == 1 and "did not load version 3" in str(stopped[0])
    pool.close()


def test_take_waits_for_a_replica_set_aside_to_answer_again():
    replicas = Scripted(1)
    pool = replicas.pool(timeout=1.0)
    replicas.answers[0] = "silent"
    pool.set_aside(0, "it stalled")
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(pool.take()))
    waiter.start()
    time.sleep(0.3)
    assert not taken  # nothing live: it waits (up to the timeout) for the replica to come back
    replicas.answers[0] = "serving 0"
    waiter.join(10)
    assert taken and taken[0].replica == 0
    pool.set_aside(0, "it stalled again")
    replicas.answers[0] = "silent"
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="of 1 started, 0 died and 1 stopped answering"):
        pool.take()
    assert 0.9 < time.monotonic() - began < 5
    pool.close()


def test_a_sweep_sets_the_silent_aside_and_leaves_the_gone_out_before_a_load():
    replicas = Scripted(3)
    pool = replicas.pool(timeout=0.2)
    replicas.answers[1], replicas.answers[2] = "silent", "gone"
    began = time.monotonic()
    pool.sweep()
    assert time.monotonic() - began < 2  # every replica probed at once
    assert pool.live() == [0] and pool.aside() == [1] and pool.dead() == [2] and replicas.aside == [1]
    pool.close()


def test_a_replica_that_says_it_is_away_is_set_aside_not_given_up_and_comes_back_under_a_new_name():
    """away(index) (a vLLM engine whose process is gone while its host starts it again): read at every choice, it
    sets the replica aside at once (its pieces abandoned, the publisher told), never dead; ``ready`` waits for it as
    ``take`` does; once its probe answers and it rejoins it takes pieces again, under the name it came back with."""
    replicas = Scripted(2)
    gone = {1}
    pool = replicas.pool(away=lambda index: index in gone, wait=5.0)
    replicas.answers[1] = "silent"  # not answering while its host starts it again
    assert spread(pool, 4) == {0} and pool.aside() == [1] and not pool.dead() and replicas.aside == [1]
    replicas.answers[0] = "silent"
    pool.set_aside(0, "it stalled")
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(pool.ready()))
    waiter.start()
    time.sleep(0.3)
    assert not waited  # nothing live: a load waits like a draw
    pool.rename(1, "replica 1 again")
    gone.clear()
    replicas.answers[1] = "serving 3"
    waiter.join(10)
    assert waited == [True] and pool.live() == [1] and (1, "serving 3") in replicas.rejoined
    assert pool.names == ["replica 0", "replica 1 again"] and spread(pool, 3) == {1}
    with pytest.raises(ValueError, match="the pool already has a replica named 'replica 0'"):
        pool.rename(1, "replica 0")
    pool.close()
    with pytest.raises(ValueError, match="come back \\(away\\) are set aside, which needs a probe"):
        ReplicaPool(["a"], away=lambda index: False)


def test_bad_pools_are_refused_by_name():
    with pytest.raises(ValueError, match="a pool of engines needs at least one"):
        ReplicaPool([], what="engine")
    with pytest.raises(ValueError, match=r"names of the pool's replicas must differ \(messages.*\['a', 'a'\]"):
        ReplicaPool(["a", "a"])
    with pytest.raises(ValueError, match="needs a probe"):
        ReplicaPool(["a"], timeout=5)
    with pytest.raises(ValueError, match="timeout must be"):
        ReplicaPool(["a"], timeout=0, probe=lambda index, wait: 0)


def spread(pool, pieces: int) -> set[int]:
    """The replicas ``pieces`` pieces in flight at once go to (all end afterwards)."""
    tickets = [pool.take() for _ in range(pieces)]
    for ticket in tickets:
        pool.release(ticket)
    return {ticket.replica for ticket in tickets}


def test_an_added_replica_takes_pieces_once_it_has_caught_up_and_a_retired_one_never_again():
    replicas = Scripted(2)
    caught_up = threading.Event()
    replicas.rejoin_says = lambda index, served: caught_up.is_set()
    pool = replicas.pool(timeout=0.2)
    replicas.answers.append("serving 0")
    added = pool.add("replica 2")
    assert added == 2 and pool.aside() == [2] and pool.live() == [0, 1]  # probed, not caught up yet
    assert until(lambda: (2, "serving 0") in replicas.rejoined)
    assert spread(pool, 6) == {0, 1}  # nothing goes to it meanwhile
    caught_up.set()
    assert until(lambda: pool.live() == [0, 1, 2], seconds=5)
    with pytest.raises(ValueError, match="already has a replica named 'replica 2'"):
        pool.add("replica 2")

    held = [pool.take(), pool.take()]
    busy = pool.take()
    assert sorted(t.replica for t in held) == [0, 1] and busy.replica == 2  # the newcomer takes its share
    for ticket in held:
        pool.release(ticket)
    abandoned = []
    pool.attach(busy, abandoned.append)
    finished = threading.Thread(target=lambda: (time.sleep(0.2), pool.release(busy)))
    finished.start()
    assert pool.retire(2, timeout=5) == 0 and not abandoned  # its piece finished within the timeout
    finished.join()
    assert pool.live() == [0, 1] and pool.retired() == [2] and 2 not in pool.aside()
    assert spread(pool, 6) == {0, 1}

    slow = pool.take()
    pool.attach(slow, abandoned.append)
    assert pool.retire(slow.replica, timeout=0.1) == 1 and "was removed from the pool" in str(abandoned[0])
    assert pool.live() == [1 - slow.replica]
    # a piece whose outcome came just before the retirement (its release not yet run) keeps it: not counted
    late = pool.take()
    pool.attach(late, lambda error: False)
    assert pool.retire(late.replica, timeout=0) == 0 and pool.live() == []
    pool.close()
