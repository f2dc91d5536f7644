"""A catalogue of bad inputs: each gets a TypeError/ValueError that names the
function, the key path (where there is one), the bad value and a fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import spmdtree as st

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EMPTY = jax.sharding.Mesh(np.empty((0,), dtype=object), ("x",))


EXPLICIT = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def w(names, shape=(2, 4), cls=st.Partitioned):
    return {"layer": {"w": cls(jnp.zeros(shape), names)}}


def _on_its_own_other_mesh():
    """A box that carries a mesh of its own, other than MESH (same axes, other shape)."""
    return {
        "w": st.Partitioned(
            jnp.zeros((2, 4)), ("data", "model"), mesh=jax.make_mesh((4, 2), ("data", "model"))
        )
    }


def _in_jit_on(mesh, fn, x):
    with jax.set_mesh(mesh):
        return jax.jit(fn)(x)


def _under_flax_rules(rules, fn):
    import flax.linen as nn

    with nn.logical_axis_rules(rules):
        return fn()


CASES = {
    "names-of-wrong-rank": (
        lambda: st.box({"layer": {"w": jnp.zeros((2, 4))}}, {"layer": {"w": ("data",)}}),
        ValueError,
        ["box:", "tree['layer']['w']", "('data',)", "(2, 4)", "Give one name per dimension"],
    ),
    "names-not-str-none-tuple": (
        lambda: st.box({"layer": {"w": jnp.zeros((2, 4))}}, {"layer": {"w": ("data", 3.5)}}),
        TypeError,
        ["box:", "tree['layer']['w']", "entry 1 is 3.5", "a str, None"],
    ),
    "mesh-axis-not-in-mesh": (
        lambda: st.to_sharding(w(("data", "tensor")), MESH),
        ValueError,
        ["to_sharding:", "tree['layer']['w']", "'tensor'", "'data' (size 2)", "Use one of them"],
    ),
    "mesh-axis-twice": (
        lambda: st.to_sharding(w(("data", ("model", "data"))), MESH),
        ValueError,
        ["to_sharding:", "tree['layer']['w']", "'data' twice", "Replace one use with None"],
    ),
    "duplicate-logical-names": (
        lambda: st.to_spec(w(("embed", "embed"), cls=st.LogicallyPartitioned), [("embed", "data")]),
        ValueError,
        ["to_spec:", "tree['layer']['w']", "'embed' given twice", "distinct names"],
    ),
    "rules-not-pairs": (
        lambda: st.to_sharding({}, MESH, [("embed", "data", "model")]),
        TypeError,
        ["to_sharding:", "rule 0 is ('embed', 'data', 'model')", "each rule is a pair"],
    ),
    "rules-non-str-name": (
        lambda: st.to_sharding({}, MESH, [(("embed",), "data")]),
        TypeError,
        ["to_sharding:", "logical name ('embed',) is not a str", "e.g. ('embed', 'fsdp')"],
    ),
    "rules-dict-value": (
        lambda: st.to_sharding({}, MESH, [("embed", {"data": 2})]),
        TypeError,
        ["to_sharding:", "maps 'embed' to {'data': 2}", "Write it as ('embed', 'data')"],
    ),
    "remove-axis-wrong-name": (
        lambda: st.remove_axis(w(("embed", "mlp")), 0, "layers"),
        ValueError,
        ["remove_axis:", "tree['layer']['w']", "'embed', not 'layers'", "same index and name"],
    ),
    "add-axis-index-out-of-range": (
        lambda: st.add_axis(w(("embed", "mlp")), 7, "layers"),
        ValueError,
        ["add_axis:", "tree['layer']['w']", "not 7", "Pass an index in range"],
    ),
    "remove-axis-index-out-of-range": (
        lambda: st.remove_axis(w(("embed", "mlp")), 2, "layers"),
        ValueError,
        ["remove_axis:", "tree['layer']['w']", "no axis 2", "same index that add_axis"],
    ),
    "strict-indivisible-dimension": (
        lambda: st.to_sharding(w(("data", "model"), shape=(3, 8)), MESH, strict=True),
        ValueError,
        ["to_sharding:", "tree['layer']['w']", "dimension 0", "size 3", "strict=False"],
    ),
    "raise-error-fallback": (
        lambda: st.with_logical_constraint(
            {"h": jnp.zeros((4, 8))},
            {"h": ("batch", "heads")},
            [("batch", "data")],
            MESH,
            st.RulesFallback.RAISE_ERROR,
        ),
        ValueError,
        ["with_logical_constraint:", "x['h']", "no rule maps 'heads'", "Add a rule for 'heads'"],
    ),
    "empty-mesh": (
        lambda: st.to_sharding(w(("data", "model")), EMPTY),
        ValueError,
        ["to_sharding:", "has no axes", "jax.make_mesh"],
    ),
    "box-names-tree-of-wrong-structure": (
        lambda: st.box({"a": jnp.zeros(2), "b": jnp.zeros(2)}, {"a": ("data",)}),
        ValueError,
        ["box:", "structure of `tree`", "present keys: ['a']", "{'a': '*', 'b': '*'}"],
    ),
    "match-invalid-regex": (
        lambda: st.match([("kernel[", ("a",))]),
        ValueError,
        ["match:", "'kernel['", "not a valid regular expression", "re.escape"],
    ),
    "match-strict-unmatched-path": (
        lambda: st.box(
            {"dense": {"kernel": jnp.zeros(2), "bias": jnp.zeros(2)}},
            st.match([("kernel$", ("data",))], strict=True),
        ),
        ValueError,
        ["box:", "tree['dense']['bias']", "'dense/bias'", "strict=False"],
    ),
    "more-dims-than-names": (
        lambda: st.to_spec(jax.vmap(lambda _: w(("data", "model")))(jnp.arange(2)), mesh=MESH),
        ValueError,
        ["to_spec:", "tree['layer']['w']", "(2, 2, 4)", "st.add_axis", "st.vmap"],
    ),
    "fewer-dims-than-names-strict": (
        lambda: st.to_sharding(
            jax.tree.map(lambda x: x[0], w(("data", "model"))), MESH, strict=True
        ),
        ValueError,
        ["to_sharding:", "tree['layer']['w']", "(4,)", "st.optimizer_sharding"],
    ),
    "mesh-of-the-wrong-kind": (
        lambda: st.to_sharding(w(("data", "model")), "mesh"),
        TypeError,
        ["to_sharding:", "'mesh'", "jax.make_mesh"],
    ),
    "box-with-its-own-other-mesh": (
        lambda: st.to_sharding(_on_its_own_other_mesh(), MESH),
        ValueError,
        ["to_sharding:", "tree['w']", "own mesh", "box.replace(mesh=None)"],
    ),
    "vmap-name-mismatch": (
        lambda: st.vmap(lambda t: t, partition_name="layers")(w(("blocks", "mlp"))),
        ValueError,
        ["vmap:", "args", "'blocks', not 'layers'"],
    ),
    "explicit-axes-in-jit-without-set-mesh": (
        lambda: jax.jit(
            lambda x: st.with_logical_constraint(
                x, ("batch",), [("batch", "data")], jax.make_mesh((2, 4), ("data", "model"))
            )
        )(jnp.zeros(4)),
        ValueError,
        ["with_logical_constraint:", "x", "jax.set_mesh"],
    ),
    "logical-spec-longer-than-array": (
        lambda: st.with_logical_constraint(
            jnp.zeros(4), ("batch", "embed"), [("batch", "data")], MESH
        ),
        ValueError,
        ["with_logical_constraint:", "('batch', 'embed')", "(4,)"],
    ),
    "rule-mesh-axis-typo": (
        lambda: st.to_sharding(
            w(("embed", "mlp"), cls=st.LogicallyPartitioned), MESH, [("mlp", "modle")]
        ),
        ValueError,
        [
            "to_sharding:",
            "tree['layer']['w']",
            "rule 0 ('mlp', 'modle')",
            "'model' (size 4)",
            "Did you mean 'model'?",
        ],
    ),
    "rule-mesh-axis-typo-in-a-constraint": (
        lambda: st.with_logical_constraint(jnp.zeros((2, 4)), ("b", "m"), [("m", "mdl")], MESH),
        ValueError,
        ["with_logical_constraint:", "x", "rule 0 ('m', 'mdl')", "Did you mean 'model'?"],
    ),
    "partitioned-axis-typo": (
        lambda: st.to_spec(w(("dta", "model")), mesh=MESH),
        ValueError,
        ["to_spec:", "tree['layer']['w']", "'dta'", "Did you mean 'data'?"],
    ),
    "stale-names-inside-a-plain-scan": (
        lambda: jax.jit(
            lambda t: jax.lax.scan(lambda c, layer: (c, st.constrain(layer, MESH)), 0.0, t)[1]
        )({"w": st.Partitioned(jnp.zeros((3, 4)), ("layers", "model"))}),
        ValueError,
        ["constrain:", "tree['w']", "('layers', 'model')", "(4,)", "st.scan", "params="],
    ),
    "stale-names-after-a-plain-vmap-into-st-vmap": (
        lambda: st.vmap(lambda t: t)(jax.vmap(lambda _: w(("data", "model")))(jnp.arange(3))),
        ValueError,
        [
            "vmap:",
            "args[0]['layer']['w']",
            "(3, 2, 4)",
            "do not include the mapped axis",
            "st.add_axis",
        ],
    ),
    "reduced-state-without-params": (
        lambda: st.to_sharding(
            jax.eval_shape(
                optax.adafactor(1e-3, min_dim_size_to_factor=1).init, w(("data", "model"))
            ),
            MESH,
        ),
        ValueError,
        ["to_sharding:", "tree[0].v_row['layer']['w']", "(2,)", "params=", "st.optimizer_sharding"],
    ),
    "raise-error-fallback-without-a-mesh": (
        lambda: st.with_logical_constraint(
            jnp.zeros((4, 8)),
            ("batch", "heads"),
            [("batch", "data")],
            fallback=st.RulesFallback.RAISE_ERROR,
        ),
        ValueError,
        ["with_logical_constraint:", "x", "no rule maps 'heads'", "Add a rule for 'heads'"],
    ),
    "rules-a-dict-with-a-bad-value": (
        lambda: st.to_spec({}, {"embed": 3}),
        TypeError,
        ["to_spec:", "rule 0 maps 'embed' to 3", "Write it as ('embed', 'data')"],
    ),
    "rules-a-flat-list": (
        lambda: st.to_spec({}, ["embed", "data"]),
        TypeError,
        ["to_spec:", "rule 0 is 'embed'", "each rule is a pair"],
    ),
    "rules-nested-one-level-too-deep": (
        lambda: st.to_spec({}, [[("embed", "data"), ("mlp", "model")]]),
        TypeError,
        [
            "to_spec:",
            "rule 0 is (('embed', 'data'), ('mlp', 'model'))",
            "whose logical name ('embed', 'data') is not a str",
        ],
    ),
    "a-mesh-passed-where-rules-go": (
        lambda: st.to_spec(w(("data", "model")), MESH),
        TypeError,
        ["to_spec:", "rules are a mesh", "Pass the mesh as mesh="],
    ),
    "a-mesh-passed-where-rules-go-in-a-constraint": (
        lambda: st.with_logical_constraint(jnp.zeros(4), ("batch",), MESH),
        TypeError,
        ["with_logical_constraint:", "rules are a mesh", "Pass the mesh as mesh="],
    ),
    "a-jnp-function-on-a-box": (
        lambda: jnp.sum(st.Partitioned(jnp.zeros(4), ("data",))),
        TypeError,
        ["Partitioned is a metadata box", "jax functions act on arrays", "st.unbox"],
    ),
    "optimizer-sharding-of-unboxed-params": (
        lambda: st.optimizer_sharding(optax.adam(1e-3), {"w": jnp.zeros((2, 4))}, MESH),
        ValueError,
        ["optimizer_sharding:", "params", "no boxes", "st.unbox"],
    ),
    "params-from-another-model": (
        lambda: st.to_sharding(
            jax.eval_shape(
                optax.adafactor(1e-3, min_dim_size_to_factor=1).init, w(("data", "model"))
            ),
            MESH,
            params={"other": st.Partitioned(jnp.zeros((2, 4)), ("model", "data"))},
        ),
        ValueError,
        [
            "to_sharding:",
            "tree[0].v_row['layer']['w']",
            "(2,)",
            "no box in params= has",
            "the tree given to tx.init",
        ],
    ),
    "constrain-a-box-with-its-own-other-mesh": (
        lambda: st.constrain(_on_its_own_other_mesh(), MESH),
        ValueError,
        ["constrain:", "tree['w']", "own mesh", "box.replace(mesh=None)"],
    ),
    "constrain-on-explicit-axes-in-jit-without-set-mesh": (
        lambda: jax.jit(lambda t: st.constrain(t, jax.make_mesh((2, 4), ("data", "model"))))(
            w(("data", "model"))
        ),
        ValueError,
        ["constrain:", "tree['layer']['w']", "Explicit", "jax.set_mesh"],
    ),
    "shard-an-abstract-tree": (
        lambda: st.shard(jax.eval_shape(lambda: w(("data", "model"))), MESH),
        TypeError,
        ["shard:", "tree['layer']['w']", "ShapeDtypeStruct", "st.to_abstract"],
    ),
    "logical-to-mesh-axes-shape-without-mesh": (
        lambda: st.logical_to_mesh_axes(("batch",), [("batch", "data")], shape=(4,)),
        TypeError,
        ["logical_to_mesh_axes:", "shape= and mesh= together", "only shape="],
    ),
    "scan-partition-name-mismatch": (
        lambda: st.scan(lambda c, x: (c, x), 0.0, w(("blocks", "mlp")), partition_name="layers"),
        ValueError,
        ["scan:", "xs['layer']['w']", "'blocks', not 'layers'"],
    ),
    "fallback-given-as-a-string": (
        lambda: st.with_logical_constraint(
            jnp.zeros(4), ("batch",), [("batch", "data")], MESH, "raise_error"
        ),
        TypeError,
        ["with_logical_constraint:", "'raise_error'", "st.RulesFallback.RAISE_ERROR"],
    ),
    "to-sharding-without-a-mesh": (
        lambda: st.to_sharding(w(("data", "model")), None),
        TypeError,
        ["to_sharding:", "mesh is None", "jax.make_mesh"],
    ),
    "sharded-init-with-a-rule-typo": (
        lambda: st.sharded_init(
            lambda k: w(("embed", "mlp"), cls=st.LogicallyPartitioned),
            MESH,
            [("embed", "dat")],
        )(jax.random.key(0)),
        ValueError,
        ["sharded_init:", "tree['layer']['w']", "rule 0 ('embed', 'dat')", "Did you mean 'data'?"],
    ),
    "describe-an-axis-not-in-the-mesh": (
        lambda: st.describe(w(("data", "tensor")), MESH),
        ValueError,
        ["describe:", "tree['layer']['w']", "'tensor'", "'data' (size 2)"],
    ),
    "add-axis-index-not-an-int": (
        lambda: st.add_axis(w(("data", "model")), "0", "layers"),
        TypeError,
        ["add_axis:", "index is '0'", "expected an int"],
    ),
    "box-names-a-bare-string": (
        lambda: st.box({"w": jnp.zeros(4)}, {"w": "data"}),
        TypeError,
        ["box:", "tree['w']", "'data'", "expected a tuple with one entry per dimension"],
    ),
    "constraint-spec-not-a-prefix": (
        lambda: st.with_logical_constraint({"a": jnp.ones(2)}, {"b": ("batch",)}, [], MESH),
        ValueError,
        ["with_logical_constraint:", "prefix of x", "'b'"],
    ),
    # Names that no rule mentions (new in 0.2): a likely mistake is never "replicated".
    "logical-boxes-and-no-rules-at-all": (
        lambda: st.to_sharding(w(("embed", "mlp"), cls=st.LogicallyPartitioned), MESH),
        ValueError,
        [
            "to_sharding:",
            "tree['layer']['w']",
            "('embed', 'mlp')",
            "no rules are in effect",
            "st.logical_axis_rules(rules)",
        ],
    ),
    "no-rules-in-shard": (
        lambda: st.shard(w(("embed", "mlp"), cls=st.LogicallyPartitioned), EXPLICIT),
        ValueError,
        ["shard:", "tree['layer']['w']", "no rules are in effect", "rules=[(name, mesh_axes)"],
    ),
    "no-rules-in-sharded-init": (
        lambda: st.sharded_init(lambda k: w(("embed", "mlp"), cls=st.LogicallyPartitioned), MESH)(
            jax.random.key(0)
        ),
        ValueError,
        ["sharded_init:", "tree['layer']['w']", "no rules are in effect"],
    ),
    "no-rules-in-plan": (
        lambda: st.plan(w(("embed", "mlp"), cls=st.LogicallyPartitioned), MESH),
        ValueError,
        ["plan:", "tree['layer']['w']", "no rules are in effect (no rules=, none on the box,"],
    ),
    "no-rules-in-a-constraint-with-a-mesh": (
        lambda: st.with_logical_constraint(jnp.ones((2, 4)), ("batch", None), mesh=MESH),
        ValueError,
        [
            "with_logical_constraint:",
            "the array at x",
            "('batch', None)",
            "no rules are in effect (no rules=, none set with st.logical_axis_rules)",
        ],
    ),
    "no-rules-in-a-constraint-inside-jit": (
        lambda: _in_jit_on(
            EXPLICIT, lambda x: st.with_logical_constraint(x, ("batch", None)), jnp.ones((2, 4))
        ),
        ValueError,
        ["with_logical_constraint:", "the array at x", "no rules are in effect"],
    ),
    "no-rules-in-optimizer-sharding": (
        lambda: st.optimizer_sharding(
            optax.adam(1e-3), w(("embed", "mlp"), cls=st.LogicallyPartitioned), MESH
        ),
        ValueError,
        ["optimizer_sharding:", "['layer']['w']", "no rules are in effect"],
    ),
    "mesh-axis-names-in-a-logical-box": (
        lambda: st.to_sharding(
            w(("data", "model"), cls=st.LogicallyPartitioned), MESH, [("embed", "data")]
        ),
        ValueError,
        [
            "to_sharding:",
            "tree['layer']['w']",
            "'data', which no rule mentions, is a mesh axis",
            "use st.Partitioned",
            "('data', 'data')",
        ],
    ),
    "mesh-axis-names-in-a-logical-box-in-describe": (
        lambda: st.describe(
            w(("data", "model"), cls=st.LogicallyPartitioned), EXPLICIT, [("embed", "data")]
        ),
        ValueError,
        ["describe:", "tree['layer']['w']", "is a mesh axis of this mesh"],
    ),
    "mesh-axis-names-in-a-constraint-inside-jit": (
        lambda: _in_jit_on(
            MESH,
            lambda x: st.with_logical_constraint(x, ("data", None), [("batch", "data")]),
            jnp.ones((2, 4)),
        ),
        ValueError,
        ["with_logical_constraint:", "the array at x", "'data', which no rule mentions"],
    ),
    "a-typo-in-a-rules-logical-name": (
        lambda: st.to_sharding(
            w(("embed", "mlp"), cls=st.LogicallyPartitioned),
            MESH,
            [("emebd", "data"), ("mlp", "model")],
        ),
        ValueError,
        [
            "to_sharding:",
            "tree['layer']['w']",
            "'embed', which no rule mentions",
            "rule 0",
            "'emebd', which nothing uses",
            "Did you mean 'emebd', or is the rule's name the typo?",
        ],
    ),
    "a-typo-in-a-box-name-in-a-constraint": (
        lambda: st.with_logical_constraint(
            jnp.ones((2, 4)), ("batch", "emebd"), [("batch", "data"), ("embed", "model")], MESH
        ),
        ValueError,
        ["with_logical_constraint:", "the array at x", "'emebd'", "Did you mean 'embed'"],
    ),
    "an-unmentioned-name-under-strict": (
        lambda: st.to_sharding(
            w(("embed", "heads"), cls=st.LogicallyPartitioned),
            MESH,
            [("embed", "data")],
            strict=True,
        ),
        ValueError,
        [
            "to_sharding:",
            "tree['layer']['w']",
            "no rule mentions 'heads'",
            "('heads', None)",
            "strict=False",
        ],
    ),
    "flax-rules-context-is-not-read": (
        lambda: _under_flax_rules(
            [("embed", "data")],
            lambda: st.to_sharding(w(("embed", "mlp"), cls=st.LogicallyPartitioned), MESH),
        ),
        ValueError,
        [
            "to_sharding:",
            "tree['layer']['w']",
            "no rules are in effect",
            "flax's rules context (nn.logical_axis_rules) holds (('embed', 'data'),)",
            "spmdtree does not read it",
            "rules=nn.get_logical_axis_rules()",
        ],
    ),
    "a-box-used-as-an-array": (
        lambda: jnp.asarray(st.Partitioned(jnp.zeros(4), ("data",))),
        TypeError,
        ["Partitioned is a metadata box", "st.unbox"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_clear_error(case):
    fn, kind, fragments = CASES[case]
    with pytest.raises(kind) as info:
        fn()
    assert type(info.value) is kind  # exactly TypeError/ValueError, not a subclass from JAX
    message = str(info.value)
    missing = [fragment for fragment in fragments if fragment not in message]
    assert missing == [], message


def test_several_wrong_leaves_make_one_error_listing_five_then_a_count():
    tree = {f"w{i}": st.Partitioned(jnp.zeros((2, 4)), ("data", "tensor")) for i in range(8)}
    with pytest.raises(ValueError) as info:
        st.to_sharding(tree, MESH)
    lines = str(info.value).splitlines()
    assert lines[0] == "to_sharding: 8 leaves are wrong:"
    assert [line.split()[3] for line in lines[1:6]] == [f"tree['w{i}']" for i in range(5)]
    assert lines[6] == "  ... and 3 more."


def test_errors_of_different_kinds_in_one_call_are_collected():
    tree = {
        "a": st.Partitioned(jnp.zeros((2, 4)), ("data", "tensor")),
        "b": st.LogicallyPartitioned(jnp.zeros(4), ("x",), rules=[("x", "data")]),
        "c": st.Partitioned(jnp.zeros((2, 4)), ("data", "data")),
    }
    with pytest.raises(ValueError) as info:
        st.to_sharding(tree, MESH)
    message = str(info.value)
    assert "2 leaves are wrong" in message and "tree['a']" in message and "tree['c']" in message
