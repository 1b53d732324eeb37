import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.inference import NativeRolloutServer, Server, ServingTask, TextGeneration
from dew.sampling import Sampling

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def task(sharp_decoder):
    model, variables = sharp_decoder
    return ServingTask(model, variables, Sampling(temperature=1.0, top_k=8))


def run(server, requests):
    """Submit (prompt, budget, seed) requests, step until all finish, return results by request number."""
    numbers = [server.submit(*request) for request in requests]
    results = {}
    while server.busy:
        for finished in server.step():
            results[finished.request] = finished
    return [results[n] for n in numbers]


def test_greedy_server_equals_text_generation(task):
    greedy = ServingTask(task.model, task.variables, Sampling(temperature=0))
    served = run(Server.from_task(greedy, slots=2, capacity=32), [(p, 6, 0) for p in PROMPTS])
    generated = TextGeneration(task.model, task.variables)(PROMPTS, 6, jax.random.key(0), Sampling(temperature=0))
    for row, result in enumerate(served):
        assert result.ids == generated.response(row) and result.finish_reason == "length"
        # Two float32 paths (block-windowed decode against one padded prefill): on an AVX-512 host they differ by
        # up to 1.7e-5 at log-probabilities near -2.3, 7.4e-6 relative, so the bound is relative as well as absolute.
        np.testing.assert_allclose(result.old_log_probs, generated.old_log_probs[row], rtol=1e-5, atol=1e-5)


def test_continuous_batching_gives_each_request_its_tokens_alone(task):
    requests = [(p, 4 + i, 10 + i) for i, p in enumerate(PROMPTS)]  # different budgets: slots free at different steps
    together = run(Server.from_task(task, slots=2, capacity=32), requests)
    for request, result in zip(requests, together):
        alone = run(Server.from_task(task, slots=1, capacity=32), [request])[0]
        assert result.ids == alone.ids
        np.testing.assert_allclose(result.behavior_log_probs, alone.behavior_log_probs, atol=1e-5)
        assert len(result.ids) == request[1]


def test_contexts_joining_together_are_prefilled_packed(task, monkeypatch):
    import dew.inference.server as server_module

    requests = [(p, 5, 20 + i) for i, p in enumerate(PROMPTS)]  # lengths 3, 7, 1, 5, 2
    alone = [run(Server.from_task(task, slots=1, capacity=32), [request])[0] for request in requests]
    calls = []
    prefill = server_module._prefill
    monkeypatch.setattr(server_module, "_prefill", lambda *args: calls.append(args[-1].tokens.shape) or prefill(*args))
    monkeypatch.setattr(server_module, "PACKED_IDS", 8)
    together = run(Server.from_task(task, slots=5, capacity=32), requests)
    assert calls == [(1, 8), (1, 8), (1, 8)]  # packs [3], [7, 1], [5, 2]: at most 8 ids each
    for result, expected in zip(together, alone, strict=True):
        assert result.ids == expected.ids
        np.testing.assert_allclose(result.old_log_probs, expected.old_log_probs, atol=1e-5)
    calls.clear()
    monkeypatch.setattr(server_module, "PACKED_IDS", 4)
    longer = run(Server.from_task(task, slots=2, capacity=32), requests[1:3])  # 7 ids: more than a pack, alone
    assert calls == [(1, 8), (1, 8)]
    assert [r.ids for r in longer] == [r.ids for r in alone[1:3]]


def test_decode_steps_read_only_the_cache_blocks_their_requests_reach(task, monkeypatch):
    import dew.inference.server as server_module

    requests = [(p, 12 + 4 * i, 30 + i) for i, p in enumerate(PROMPTS)]  # up to 15, 23, 21, 29 and 30 ids
    whole = run(Server.from_task(task, slots=2, capacity=32), requests)
    windows = []
    decode = server_module._decode
    monkeypatch.setattr(server_module, "_decode", lambda *args: windows.append(len(args[2][0][0])) or decode(*args))
    server = Server.from_task(task, slots=2, capacity=30, block_size=8)
    assert [block.shape[2] for block in server._kv[0][1][0]] == [8, 8, 14]  # each as large as all before it
    blocked = run(server, requests)
    assert sorted(set(windows)) == [1, 2, 3] and windows[0] == 1  # prompts of 3 and 7 ids start in block 1
    for result, expected in zip(blocked, whole, strict=True):
        assert result.ids == expected.ids
        np.testing.assert_allclose(result.old_log_probs, expected.old_log_probs, atol=1e-5)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        Server.from_task(task, slots=2, capacity=32, block_size=0)


def test_lanes_decode_side_by_side_with_each_request_its_own_tokens(task):
    requests = [(p, 4 + i, 10 + i) for i, p in enumerate(PROMPTS)] * 2
    plain = run(Server.from_task(task, slots=4, capacity=32), requests)
    server = Server.from_task(task, slots=4, capacity=32, lanes=2)
    numbers = [server.submit(*request) for request in requests]
    server.cancel(numbers[1])
    results = {}
    while server.busy:
        results.update({f.request: f for f in server.step()})
    assert results[numbers[1]].finish_reason == "cancelled"
    for number, expected in zip(numbers, plain, strict=True):
        if number != numbers[1]:
            assert results[number].ids == expected.ids
            np.testing.assert_allclose(results[number].old_log_probs, expected.old_log_probs, atol=1e-5)
    balanced = Server.from_task(task, slots=4, capacity=32, lanes=2)
    balanced.submit(PROMPTS[0], 4), balanced.submit(PROMPTS[1], 4)
    balanced.step()
    assert [a is not None for a in balanced._active] == [True, False, True, False]  # one request per lane
    with pytest.raises(ValueError, match="lanes must be a positive integer that divides slots=4"):
        Server.from_task(task, slots=4, capacity=32, lanes=3)


def test_eos_cancel_and_bad_requests_leave_other_slots_alone(task):
    first = run(Server.from_task(task, slots=1, capacity=32), [(PROMPTS[0], 8, 1)])[0]
    long_alone = run(Server.from_task(task, slots=1, capacity=32), [(PROMPTS[1], 20, 2)])[0]
    # an EOS id the first request samples early and the long one does not sample before it is cancelled
    eos = next(i for i in first.ids[1:] if i not in long_alone.ids[:6])
    server = Server(task.model, task.variables, Sampling(temperature=1.0, top_k=8, eos_id=eos), slots=2, capacity=32)
    stopped, long = server.submit(PROMPTS[0], 8, 1), server.submit(PROMPTS[1], 20, 2)
    for bad, message in (([], "the prompt is empty"), ([1, 99], "outside the vocabulary \\[0, 32\\)"),
                         ([1] * 30, "exceeds the cache capacity 32")):
        with pytest.raises(ValueError, match=message):
            server.submit(bad, 4 if len(bad) != 30 else 8)
    results = {}
    for _ in range(5):
        results.update({f.request: f for f in server.step()})
    server.cancel(long)
    results.update({f.request: f for f in server.step()})
    assert results[stopped].ids == first.ids[: first.ids.index(eos) + 1] and results[stopped].eos
    assert results[long].finish_reason == "cancelled" and len(results[long].ids) == 5
    assert not server.busy


def test_reload_changes_later_tokens_and_casts_to_the_served_dtype(task):
    greedy = ServingTask(task.model, task.variables, Sampling(temperature=0), dtype=jnp.bfloat16)
    server = Server.from_task(greedy, slots=1, capacity=32)
    assert {leaf.dtype for leaf in jax.tree.leaves(server.variables)} == {jnp.dtype(jnp.bfloat16)}
    plain = run(Server.from_task(greedy, slots=1, capacity=32), [(PROMPTS[1], 10, 0)])[0]
    number = server.submit(PROMPTS[1], 10, 0)
    ids = []
    for _ in range(4):
        server.step()
    other = jax.tree.map(lambda x: -x, task.variables)
    server.reload(other)
    while server.busy:
        ids += [f for f in server.step() if f.request == number]
    changed = ids[0]
    # Token 4 is drawn from logits the old weights computed before the reload; the step that
    # feeds it already ran ahead on the old weights, so the server must run it again: token 5
    # on is drawn from the new weights' logits.
    assert changed.ids[:5] == plain.ids[:5] and changed.ids[5:] != plain.ids[5:]
    np.testing.assert_allclose(changed.old_log_probs[:5], plain.old_log_probs[:5], atol=1e-6)
    assert abs(changed.old_log_probs[5] - plain.old_log_probs[5]) > 1e-3


def test_native_rollout_server_versions_draws_and_loads_in_flight(task):
    with NativeRolloutServer(Server.from_task(task, slots=2, capacity=64), version=3) as rollout:
        before = [rollout.submit(p, 12, seed=i) for i, p in enumerate(PROMPTS)]
        rollout.load(jax.tree.map(lambda x: x * 1.01, task.variables), version=4)
        after = rollout.submit(PROMPTS[0], 4, seed=0)
        draws = [f.result(timeout=60) for f in before]
        assert rollout.version == 4 and after.result(timeout=60).version == 4
        assert [d.version for d in draws] == [3] * len(PROMPTS)
        assert all(len(d.ids) == 12 and len(d.old_log_probs) == 12 for d in draws)
        long = rollout.submit(PROMPTS[1], 50, seed=9)
        rollout.cancel(long)
        assert long.result(timeout=60).finish_reason == "cancelled"
        with pytest.raises(ValueError, match="the prompt is empty"):
            rollout.submit([], 4)


def test_serving_in_bfloat16_runs_bfloat16_products(task):
    from dew.inference.server import cast_floating

    served_task = ServingTask(task.model, task.variables, Sampling(temperature=0), dtype=jnp.bfloat16)
    server = Server.from_task(served_task, slots=1, capacity=32)
    assert server.model.matmul_dtype == jnp.bfloat16 and task.model.matmul_dtype is None
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(server.variables))
    served = run(server, [(p, 6, 0) for p in PROMPTS])
    bf16 = TextGeneration(server.model, cast_floating(task.variables, jnp.bfloat16))
    generated = bf16(PROMPTS, 6, jax.random.key(0), Sampling(temperature=0))
    full = TextGeneration(task.model, task.variables)(PROMPTS, 6, jax.random.key(0), Sampling(temperature=0))
    for row, result in enumerate(served):
        assert result.ids == generated.response(row)  # the served precision, decoded one row at a time or batched
        np.testing.assert_allclose(result.old_log_probs, generated.old_log_probs[row], atol=2e-2)
        # the first draw reads the same prompt in both precisions: bfloat16 rounding moves it a little
        np.testing.assert_allclose(result.old_log_probs[0], full.old_log_probs[row, 0], atol=0.1)


def test_a_group_prefills_its_prompt_once_and_each_sample_draws_its_own(task, monkeypatch):
    import dew.inference.server as server_module

    prompt, other = PROMPTS[1], PROMPTS[3]
    # a GRPO group of 4 (one admission), another prompt, then 2 more of the group joining while it decodes
    requests = [(prompt, 6 + 2 * seed, seed) for seed in range(4)] + [(other, 4, 9)] + [(prompt, 5, 7), (prompt, 3, 8)]
    alone = [run(Server.from_task(task, slots=1, capacity=32), [request])[0] for request in requests]
    prefilled, shared = [], []
    prefill, share = server_module._prefill, server_module._share
    monkeypatch.setattr(server_module, "_prefill",
                        lambda *args: prefilled.append(int(args[-1].joining.sum())) or prefill(*args))
    monkeypatch.setattr(server_module, "_share", lambda kv, slots, copies, blocks: shared.append(
        int((copies.targets < slots.lengths.shape[0]).sum())) or share(kv, slots, copies, blocks))
    together = run(Server.from_task(task, slots=5, capacity=32), requests)
    assert prefilled == [2]  # the group's prompt and the other one, in one pack
    assert shared == [3, 1, 1]  # the group's other 3 samples, then each later one as a slot frees
    for result, expected in zip(together, alone, strict=True):
        assert result.ids == expected.ids  # its own key: the copied samples diverge from the first token on
        np.testing.assert_allclose(result.old_log_probs, expected.old_log_probs, atol=1e-5)
    assert len({tuple(result.ids) for result in together[:4]}) > 1


def test_after_a_reload_a_held_prompt_is_prefilled_again(task, monkeypatch):
    import dew.inference.server as server_module

    prompt = PROMPTS[1]
    changed = jax.tree.map(lambda leaf: leaf * 1.5, task.variables)
    server = Server.from_task(task, slots=2, capacity=32)
    first = server.submit(prompt, 8, 0)
    server.step()
    server.reload(changed)
    prefilled = []
    prefill = server_module._prefill
    monkeypatch.setattr(server_module, "_prefill",
                        lambda *args: prefilled.append(int(args[-1].joining.sum())) or prefill(*args))
    second = server.submit(prompt, 4, 1)
    results = {}
    while server.busy:
        results.update((done.request, done) for done in server.step())
    assert prefilled == [1]  # held under the old weights: prefilled again, not copied
    fresh = ServingTask(task.model, changed, task.sampling)
    assert results[second].ids == run(Server.from_task(fresh, slots=1, capacity=32), [(prompt, 4, 1)])[0].ids
    assert len(results[first].ids) == 8
