import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models

ALL_OPTIONS = dict(
    vocab_size=40, emb_features=32, num_layers=2, num_heads=4, mlp_features=48, max_seq_len=32,
    num_kv_heads=2, head_dim=12, rope_theta=500.0, norm_eps=1e-5, qk_norm=True, tie_embeddings=False,
    attention_bias=True, logit_softcap=30.0,
)


def build(**overrides):
    return models.build("causal_transformer", **{**ALL_OPTIONS, **overrides})


def init(model, width=8):
    return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, width), jnp.int32))


def test_options_create_the_family_parameters():
    model = build()
    params = init(model)["params"]
    attention = params["layers_0"]["self_attn"]
    assert attention["q_proj"]["kernel"].shape == (32, 4 * 12)
    assert attention["k_proj"]["kernel"].shape == (32, 2 * 12)  # grouped-query: 2 KV heads
    assert "bias" in attention["q_proj"] and "bias" not in attention["o_proj"]  # Qwen2 attention bias
    assert attention["q_norm"]["scale"].shape == (12,)  # Qwen3 QK-norm over head_dim
    assert "lm_head" in params  # untied embeddings
    assert set(params["layers_0"]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}  # SwiGLU
    gelu = init(build(mlp_activation="gelu"))["params"]["layers_0"]["mlp"]
    assert set(gelu) == {"up_proj", "down_proj"}
    tied = init(build(tie_embeddings=True))["params"]
    assert "lm_head" not in tied


def test_softcap_bounds_logits():
    model = build(logit_softcap=2.0)
    variables = init(model)
    apply = jax.jit(model.apply)
    variables = jax.tree.map(lambda x: x * 50, variables)  # blow up the raw logits
    logits = apply(variables, jnp.arange(8)[None] % 40)
    assert float(jnp.abs(logits).max()) <= 2.0
    assert float(jnp.abs(logits).max()) > 1.9


@pytest.mark.parametrize("options", [{}, {"qk_norm": False, "tie_embeddings": True, "logit_softcap": None}])
def test_two_packed_documents_equal_each_alone(options):
    model = build(**options)
    variables = init(model)
    apply = jax.jit(model.apply)
    rng = np.random.default_rng(1)
    first, second = rng.integers(0, 40, 5), rng.integers(0, 40, 7)
    row = np.concatenate([first, second, [0, 0]])[None]
    segments = np.array([[1] * 5 + [2] * 7 + [0, 0]])
    positions = np.array([list(range(5)) + list(range(7)) + [0, 0]])
    packed = apply(variables, row, segment_ids=segments, positions=positions)
    alone_first = apply(variables, first[None])
    alone_second = apply(variables, second[None])
    np.testing.assert_allclose(packed[0, :5], alone_first[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, 5:12], alone_second[0], atol=1e-5, rtol=0)


def test_kv_cache_decode_equals_full_forward():
    model = build()
    variables = init(model)
    apply = jax.jit(model.apply)
    tokens = np.random.default_rng(2).integers(0, 40, (3, 12))
    full = apply(variables, tokens)
    cache = models.init_cache(model, batch=3, capacity=16)
    logits, cache = apply(variables, tokens[:, :5], cache=cache)  # prefill
    pieces = [logits]
    for t in range(5, 12):  # then one token at a time
        logits, cache = apply(variables, tokens[:, t : t + 1], cache=cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.lengths, [12, 12, 12])


def test_a_blocked_cache_decodes_as_one_array_and_a_step_may_read_only_its_first_blocks():
    model = build()
    variables = init(model)
    apply = jax.jit(model.apply)
    tokens = np.random.default_rng(5).integers(0, 40, (2, 12))
    full = apply(variables, tokens)
    cache = models.init_cache(model, batch=2, capacity=16, blocks=[4, 4, 8])
    assert cache.capacity == 16 and [block.shape[3] for block in cache.keys[0]] == [4, 4, 8]
    logits, cache = apply(variables, tokens[:, :3], cache=cache)
    pieces = [logits]
    for t in range(3, 12):
        reached = 2 if t < 8 else 3  # the blocks holding positions up to t
        window = models.KVCache(tuple(k[:reached] for k in cache.keys), tuple(v[:reached] for v in cache.values),
                                cache.lengths)
        logits, window = apply(variables, tokens[:, t : t + 1], cache=window)
        cache = models.KVCache(tuple(new + old[reached:] for new, old in zip(window.keys, cache.keys)),
                               tuple(new + old[reached:] for new, old in zip(window.values, cache.values)),
                               window.lengths)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="blocks must be positive sizes that sum to capacity=16"):
        models.init_cache(model, batch=2, capacity=16, blocks=[8, 4])


def test_prefill_of_different_valid_lengths_shares_one_shape():
    model = build()
    variables = init(model)
    apply = jax.jit(model.apply)
    rng = np.random.default_rng(3)
    short, long = rng.integers(0, 40, 3), rng.integers(0, 40, 6)
    chunk = np.zeros((2, 6), np.int64)
    chunk[0, :3], chunk[1] = short, long
    cache = models.init_cache(model, batch=2, capacity=10)
    logits, cache = apply(variables, chunk, cache=cache, lengths=jnp.array([3, 6]))
    np.testing.assert_array_equal(cache.lengths, [3, 6])
    np.testing.assert_allclose(logits[0, :3], apply(variables, short[None])[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1], apply(variables, long[None])[0], atol=1e-5, rtol=0)
    # Row 0 continues from its own length; row 1 is finished (length 0 this step) and its cache stays as it was.
    following = rng.integers(0, 40, 1)
    before = jax.tree.map(np.asarray, cache)
    step, cache = apply(variables, np.array([[following[0]], [7]]), cache=cache, lengths=jnp.array([1, 0]))
    expected = apply(variables, np.concatenate([short, following])[None])[0, -1]
    np.testing.assert_allclose(step[0, 0], expected, atol=1e-5, rtol=0)
    for layer in range(len(cache.keys)):
        np.testing.assert_array_equal(cache.keys[layer][1], before.keys[layer][1])
        np.testing.assert_array_equal(cache.values[layer][1], before.values[layer][1])
    np.testing.assert_array_equal(cache.lengths, [4, 6])


def test_packed_prefill_writes_each_prompt_into_its_own_row():
    model = build()
    variables = init(model)
    apply = jax.jit(model.apply)
    rng = np.random.default_rng(4)
    first, second = rng.integers(0, 40, 3), rng.integers(0, 40, 5)
    # Rows 2 and 0 of a 3-row cache take the two prompts packed in one row of 10 ids (2 of padding);
    # row 1 holds an earlier request's keys, which the prefill leaves alone.
    tokens = np.concatenate([first, second, [0, 0]])[None]
    segment_ids = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 4, 0, 0]])
    rows = np.array([[2, 2, 2, 0, 0, 0, 0, 0, 1, 1]])  # padding names row 1: it is not written
    cache = models.init_cache(model, batch=3, capacity=8)
    _, cache = apply(variables, rng.integers(0, 40, (3, 2)), cache=cache, lengths=jnp.array([0, 2, 0]))
    before = jax.tree.map(np.asarray, cache)
    logits, cache = apply(variables, tokens, segment_ids=segment_ids, positions=positions, cache=cache, rows=rows,
                          logits_at=np.array([[2, 7]]))
    assert logits.shape == (1, 2, 40)
    np.testing.assert_array_equal(cache.lengths, [5, 2, 3])
    np.testing.assert_allclose(logits[0, 0], apply(variables, first[None])[0, -1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[0, 1], apply(variables, second[None])[0, -1], atol=1e-5, rtol=0)
    for layer in range(len(cache.keys)):
        np.testing.assert_array_equal(cache.keys[layer][1], before.keys[layer][1])
        np.testing.assert_array_equal(cache.values[layer][1], before.values[layer][1])
    # Decoding continues each row from its prompt as if the prompt had been prefilled alone.
    following = rng.integers(0, 40, 3)
    step, cache = apply(variables, following[:, None], cache=cache, lengths=jnp.array([1, 0, 1]))
    np.testing.assert_allclose(step[0, 0], apply(variables, np.append(second, following[0])[None])[0, -1],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(step[2, 0], apply(variables, np.append(first, following[2])[None])[0, -1],
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs segment_ids and positions"):
        apply(variables, tokens, cache=cache, rows=rows)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_kv_heads": 3}, "num_kv_heads must divide num_heads=4"),
        ({"head_dim": None, "emb_features": 30}, "not divisible by num_heads"),
        ({"mlp_activation": "relu"}, "mlp_activation must be one of"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"logit_softcap": -1.0}, "logit_softcap must be positive"),
    ],
)
def test_bad_configs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(**overrides)


def test_unknown_model_and_option_raise():
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        models.build("gpt")
    with pytest.raises(TypeError, match="causal_transformer"):
        build(hidden_size=3)


@pytest.mark.parametrize("weight_axis", [0, 1])
def test_a_float32_weight_product_differentiates_like_the_plain_product(weight_axis):
    from dew.models.weight_product import weight_product

    x = jax.random.normal(jax.random.key(0), (2, 5, 6))
    weight = jax.random.normal(jax.random.key(1), (6, 4) if weight_axis == 0 else (4, 6))
    dims = (((2,), (weight_axis,)), ((), ()))
    cotangent = jax.random.normal(jax.random.key(2), (2, 5, 4))

    def loss(product):
        return lambda x, w: (product(x, w, dims) * cotangent).sum()

    ours = jax.grad(loss(weight_product(jnp.float32)), argnums=(0, 1))(x, weight)
    plain = jax.grad(loss(jax.lax.dot_general), argnums=(0, 1))(x, weight)
    for got, want in zip(ours, plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_axis", [0, 1])
def test_a_bfloat16_weight_product_differentiates_like_the_plain_product_of_bfloat16_operands(weight_axis):
    # The weight gradient transposes one operand in memory before its product (see _transposed);
    # the sums are the same bfloat16 products accumulated in float32, so the gradients match closely.
    from dew.models.weight_product import weight_product

    x = jax.random.normal(jax.random.key(0), (3, 7, 24))
    weight = jax.random.normal(jax.random.key(1), (24, 10) if weight_axis == 0 else (10, 24))
    dims = (((2,), (weight_axis,)), ((), ()))
    cotangent = jax.random.normal(jax.random.key(2), (3, 7, 10))

    def plain(x, w, dims):
        return jax.lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), dims,
                                   preferred_element_type=jnp.float32)

    def loss(product):
        return lambda x, w: (product(x, w, dims) * cotangent).sum()

    ours = jax.grad(loss(weight_product(jnp.bfloat16)), argnums=(0, 1))(x, weight)
    want = jax.grad(loss(plain), argnums=(0, 1))(x, weight)
    for got, expected in zip(ours, want):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
    # The weight gradient's products are exact sums of bfloat16 products: the same numbers as
    # float64 arithmetic on the rounded operands, up to float32 accumulation.
    rows_x = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64).reshape(-1, 24)
    rows_grad = np.asarray(cotangent.astype(jnp.bfloat16).astype(jnp.float32), np.float64).reshape(-1, 10)
    exact = rows_x.T @ rows_grad if weight_axis == 0 else rows_grad.T @ rows_x
    np.testing.assert_allclose(ours[1], exact, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_takes_bfloat16_operands_in_the_backward_pass_too():
    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32, max_seq_len=8, matmul_dtype=jnp.bfloat16)
    # 40 rows: more than dew's CPU kernel takes (native_product), so every forward product is XLA's dot here
    tokens = jnp.zeros((5, 8), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)
    grads = jax.grad(lambda v: model.apply(v, tokens).sum())

    def all_products(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from all_products(inner)

    products = list(all_products(jax.make_jaxpr(grads)(variables).jaxpr))
    weight_products = [e for e in products if any(v.aval.ndim == 2 for v in e.invars)]
    # 7 weight products and the tied output layer, each once forward and twice backward.
    assert len(weight_products) == 3 * 8
    assert all(v.aval.dtype == jnp.bfloat16 for e in weight_products for v in e.invars)
    assert all(e.outvars[0].aval.dtype == jnp.float32 for e in weight_products)
    gradient = jax.tree.leaves(grads(variables))
    assert all(leaf.dtype == jnp.float32 for leaf in gradient)


def test_a_weight_product_refuses_a_contraction_it_was_not_written_for():
    from dew.models.weight_product import weight_product

    with pytest.raises(ValueError, match="contracts an activation's last axis with one axis of a 2-D weight"):
        weight_product(jnp.float32)(jnp.ones((2, 3)), jnp.ones((2, 4)), (((0,), (0,)), ((), ())))
