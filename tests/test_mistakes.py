"""A catalogue of bad inputs: each gets a TypeError/ValueError that names the
function, the key path (where there is one), the bad value and a fix."""

import warnings

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

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


TYPO_RULES = [("batch", "data"), ("embed", "model"), ("mlp", None)]


def _one_typo_among(name, abstract=True):
    """Three boxes that use 'embed' and one, 'bias', that uses `name`."""
    value = jax.ShapeDtypeStruct((8,), jnp.float32) if abstract else jnp.zeros((8,))
    tree = {f"w{i}": st.LogicallyPartitioned(value, ("embed",)) for i in range(3)}
    return {**tree, "bias": st.LogicallyPartitioned(value, (name,))}


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
    "match-strict-pattern-matching-nothing": (
        lambda: st.box(
            {"dense": {"kernel": jnp.zeros(2)}},
            st.match([("kernel$", ("data",)), ("heads$", ("model",))], strict=True),
        ),
        ValueError,
        ["box:", "pattern 1 ('heads$')", "matches none", "'dense/kernel'", "Fix the regex"],
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
            "one edit from 'emebd', the name of rule 0, which nothing else in this call uses",
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
    "a-typo-on-one-box-among-correct-ones": (
        lambda: st.to_sharding(_one_typo_among("emebd"), MESH, TYPO_RULES),
        ValueError,
        [
            "to_sharding:",
            "tree['bias']",
            "'emebd', which no rule mentions, one edit from 'embed' of rule 1",
            "which 3 other leaves use in this call",
            "Did you mean 'embed'?",
            "('emebd', None)",
        ],
    ),
    "a-typo-on-one-box-in-sharded-init": (
        lambda: st.sharded_init(
            lambda: _one_typo_among("embde", abstract=False), MESH, TYPO_RULES
        )(),
        ValueError,
        ["sharded_init:", "tree['bias']", "'embde'", "Did you mean 'embed'?"],
    ),
    **{
        f"a-one-edit-typo-by-{kind}": (
            lambda typo=typo: st.to_spec(_one_typo_among(typo), TYPO_RULES, mesh=MESH),
            ValueError,
            [
                "to_spec:",
                "tree['bias']",
                f"{typo!r}, which no rule mentions",
                "Did you mean 'embed'?",
            ],
        )
        for kind, typo in [
            ("insert", "embeds"),
            ("delete", "emed"),
            ("change", "embad"),
            ("swap", "mebed"),
            ("swap-at-the-end", "embde"),
        ]
    },
    "a-name-one-edit-from-a-rule-on-purpose": (
        lambda: st.to_spec(
            {"w": st.LogicallyPartitioned(jnp.zeros((4, 8)), ("head", "embed"))},
            [("heads", "model"), ("embed", "data")],
            mesh=MESH,
        ),
        ValueError,
        [
            "to_spec:",
            "tree['w']",
            "'head', which no rule mentions, one edit from 'heads'",
            "add a rule for it: ('head', None) to replicate it, or one that shards it",
        ],
    ),
    "a-rule-name-typo-under-many-boxes": (
        lambda: st.to_sharding(
            _one_typo_among("embed"), MESH, [("batch", "data"), ("emebd", "model")]
        ),
        ValueError,
        [
            "to_sharding:",
            "tree['w0']",
            "one edit from 'emebd', the name of rule 1, which nothing in this call uses",
            "while 4 leaves use 'embed': the rule's name looks like the typo",
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


@pytest.mark.parametrize(
    "name",
    [
        "emdeb",  # two swaps away from 'embed'
        "embxyd",  # an insert and a change
        "mbd",  # short: never guessed
        "mlpp",  # one edit from 'mlp', which is too short to guess at
        "embed_out",  # a name of its own
    ],
)
def test_names_not_one_edit_from_a_rule_name_are_not_refused(name):
    specs = st.to_spec(_one_typo_among(name), TYPO_RULES, mesh=MESH)
    assert specs["bias"] == jax.sharding.PartitionSpec(None)
    assert specs["w0"] == jax.sharding.PartitionSpec("model")
    rows = st.plan(_one_typo_among(name), MESH, TYPO_RULES).rows
    flags = {row.path: row.flags for row in rows}["bias"]
    assert f"no rule mentions {name!r}: left unsharded" in flags


def test_one_edit_is_the_damerau_criterion():
    from itertools import product

    word = "embed"
    ones = {word[:i] + word[i + 1 :] for i in range(5)}  # delete
    ones |= {word[:i] + c + word[i:] for i, c in product(range(6), "xe")}  # insert
    ones |= {word[:i] + c + word[i + 1 :] for i, c in product(range(5), "xq")}  # change
    ones |= {word[:i] + word[i + 1] + word[i] + word[i + 2 :] for i in range(4)}  # swap
    ones.discard(word)
    for typo in sorted(ones):
        if len(typo) < 4:
            continue
        with pytest.raises(ValueError, match="Did you mean 'embed'"):
            st.to_spec(_one_typo_among(typo), TYPO_RULES, mesh=MESH)


def test_a_typo_in_a_constraint_names_the_likely_spelling_too():
    rules = [("batch", "data"), ("embed", "model")]
    x = {"a": jnp.ones((2, 4)), "b": jnp.ones((2, 4))}
    specs = {"a": ("batch", "embed"), "b": ("batch", "emebd")}
    with pytest.raises(ValueError) as info:
        st.with_logical_constraint(x, specs, rules, MESH)
    message = str(info.value)
    assert "x['b']" in message and "x['a']" not in message
    assert "which 1 other leaf uses in this call. Did you mean 'embed'?" in message


@pytest.mark.parametrize(
    "others, said",
    [
        (0, "which no other leaf uses in this call"),
        (1, "which 1 other leaf uses in this call"),
        (2, "which 2 other leaves use in this call"),
    ],
)
def test_a_typo_message_counts_the_other_leaves_only(others, said):
    # the leaf with the typo uses 'embed' itself, on its other dimension: not counted
    value = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    tree = {"typo": st.LogicallyPartitioned(value, ("embed", "embde"))}
    tree |= {f"w{i}": st.LogicallyPartitioned(value, ("embed", None)) for i in range(others)}
    with pytest.raises(ValueError) as info:
        st.to_spec(tree, TYPO_RULES, mesh=MESH)
    message = str(info.value)
    assert "tree['typo']" in message and "one edit from 'embed' of rule 1" in message
    assert f"{said}. Did you mean 'embed'?" in message


class _Recorded(Exception):
    """Raised by the stand-in for st.to_sharding once it has recorded its inputs."""


def _to_sharding_inputs():
    """The (case, tree, mesh, rules) of every catalogue case that calls st.to_sharding."""
    seen = []
    real = st.to_sharding
    for case, (fn, _, _) in CASES.items():

        def record(tree, mesh, rules=None, case=case, **kwargs):
            seen.append((case, tree, mesh, rules))
            raise _Recorded

        st.to_sharding = record
        try:
            fn()
        except Exception:  # the case's own error, or _Recorded: the inputs are what counts
            pass
        finally:
            st.to_sharding = real
    return seen


def _outcome(fn):
    """What a call gives: its result, or its error with the function's name and the
    box's key path (the root, for a box on its own) taken out; and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ("ok", fn())
        except (TypeError, ValueError) as e:
            said = str(e).split(": ", 1)[1].replace("the box at tree ", "the box ")
            result = (type(e).__name__, said)
    return result, [str(w.message).replace("tree dimension", "the box dimension") for w in caught]


def _boxes_of(tree):
    return [x for x in jax.tree.leaves(tree, is_leaf=st.is_boxed) if st.is_boxed(x)]


@pytest.mark.parametrize(
    "case, tree, mesh, rules",
    [pytest.param(*row, id=row[0]) for row in _to_sharding_inputs()],
)
def test_get_sharding_is_to_sharding_on_the_catalogue_inputs(case, tree, mesh, rules):
    boxes = _boxes_of(tree)
    try:
        context = st.logical_axis_rules(rules or ())
        context.__enter__()
    except TypeError:  # malformed rules: both read the empty context instead
        context = None
    try:
        for box in boxes:
            if not hasattr(box, "get_sharding"):
                continue
            want = _outcome(lambda box=box: st.to_sharding(box, mesh))
            got = _outcome(lambda box=box: box.get_sharding(mesh))
            assert got == want, (case, box)
    finally:
        if context is not None:
            context.__exit__(None, None, None)


def test_the_catalogue_gives_get_sharding_many_boxes_to_compare():
    inputs = _to_sharding_inputs()
    assert len(inputs) >= 15 and sum(len(_boxes_of(tree)) for _, tree, _, _ in inputs) >= 20


def test_get_sharding_of_a_box_holding_a_subtree_is_the_box_over_shardings():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    box = st.Partitioned({"a": jnp.zeros((4, 8)), "b": jnp.zeros((2, 4))}, ("data", "model"))
    got = box.get_sharding(mesh)
    assert isinstance(got, st.Partitioned)
    assert {k: v.spec for k, v in got.value.items()} == {
        "a": P("data", "model"),
        "b": P("data", "model"),
    }
    assert got == st.to_sharding(box, mesh)


def _osa_distance(a, b):
    """Damerau's distance (optimal string alignment), the textbook dynamic program."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


@hypothesis.given(
    a=hypothesis.strategies.text("abc", min_size=2, max_size=6),
    b=hypothesis.strategies.text("abc", min_size=2, max_size=6),
)
def test_a_name_is_refused_exactly_when_it_is_one_edit_from_a_rule_name(a, b):
    hypothesis.assume(a != b)
    tree = {"w": st.LogicallyPartitioned(jax.ShapeDtypeStruct((4,), jnp.float32), (a,))}
    expected = len(a) >= 4 and len(b) >= 4 and _osa_distance(a, b) == 1
    try:
        st.to_spec(tree, [(b, None)], mesh=MESH)
        refused = False
    except ValueError as e:
        assert "Did you mean" in str(e)
        refused = True
    assert refused == expected
