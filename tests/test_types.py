"""The public type aliases: what the signatures say, and that every form they name works."""

import inspect
import pathlib
import runpy
import typing

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdtree as st

ALIASES = ["AnyMesh", "AxisName", "MeshAxes", "Names", "NamesFn", "Rules"]


def _public_functions():
    for name in st.__all__:
        obj = getattr(st, name)
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, fn in vars(obj).items():
                if inspect.isfunction(fn) and (attr == "__init__" or not attr.startswith("_")):
                    yield f"{name}.{attr}", fn


PUBLIC = dict(_public_functions())


def test_the_aliases_are_exported():
    assert set(ALIASES) <= set(st.__all__)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_signature_resolves_at_runtime(name):
    hints = typing.get_type_hints(PUBLIC[name])  # what sphinx, pydantic or typeguard read
    parameters = inspect.signature(PUBLIC[name]).parameters
    for parameter in ("rules", "names", "mesh"):
        if parameter not in parameters:
            continue
        hint = hints[parameter]
        if parameter == "rules":
            assert hint in (st.Rules, st.Rules | None), (name, hint)
        elif parameter == "names":
            normalised = tuple[st.AxisName, ...]  # a method that takes names already normalised
            takes = {hint, *typing.get_args(hint)}  # box: a tree of names or a names function
            assert takes & {st.Names, normalised, st.NamesFn}, (name, hint)
        else:
            kinds = set(typing.get_args(hint)) or {hint}
            assert kinds & {jax.sharding.Mesh, *typing.get_args(st.AnyMesh)}, (name, hint)


def test_functions_that_take_any_mesh_say_so():
    for name in ("plan", "describe", "to_spec", "preflight", "fsdp", "constrain"):
        hint = typing.get_type_hints(PUBLIC[name])["mesh"]
        assert jax.sharding.AbstractMesh in typing.get_args(hint), name


NAMES_FORMS = {
    "tuple": ("data", None),
    "list": ["data", None],
    "partition-spec": P("data", None),
    "tuple-entry": (("data", "model"), None),
    "unconstrained": ("data", P.UNCONSTRAINED),
}


@pytest.mark.parametrize("form", NAMES_FORMS, ids=list(NAMES_FORMS))
def test_every_form_of_names_is_taken(form):
    names: st.Names = NAMES_FORMS[form]
    box = st.Partitioned(jnp.zeros((8, 4)), names)
    assert box.names == tuple(tuple(e) if isinstance(e, list) else e for e in names)
    assert st.LogicallyPartitioned(jnp.zeros((8, 4)), names).names == box.names


RULES_FORMS = {
    "list-of-pairs": [("batch", "data"), ("embed", ("model",)), ("mlp", None)],
    "tuple-of-pairs": (("batch", "data"), ("embed", ("model",)), ("mlp", None)),
    "mapping": {"batch": "data", "embed": ("model",), "mlp": None},
}


@pytest.mark.parametrize("form", RULES_FORMS, ids=list(RULES_FORMS))
def test_every_form_of_rules_is_taken_with_every_kind_of_mesh_axes(form):
    rules: st.Rules = RULES_FORMS[form]
    mesh: st.AnyMesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    tree = {"x": st.LogicallyPartitioned(jnp.zeros((8, 8, 4)), ("batch", "embed", "mlp"))}
    assert st.to_spec(tree, rules, mesh=mesh) == {"x": P("data", "model", None)}
    with st.logical_axis_rules(rules):
        assert st.get_logical_axis_rules() == tuple(RULES_FORMS["tuple-of-pairs"])


@pytest.mark.parametrize("kind", ["mesh", "abstract"])
def test_any_mesh_is_either_kind(kind):
    mesh: st.AnyMesh = jax.make_mesh((2, 4), ("data", "model"))
    if kind == "abstract":
        mesh = mesh.abstract_mesh
    tree = {"w": st.Partitioned(jnp.zeros((8, 16)), ("data", "model"))}
    assert st.plan(tree, mesh).rows[0].shard_shape == (4, 4)


def test_a_names_function_is_any_function_of_path_and_leaf():
    def by_rank(path, leaf) -> st.Names | None:
        return ("embed", "mlp") if leaf.ndim == 2 else None

    mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
    tree = {"w": jax.ShapeDtypeStruct((64, 512), jnp.float32)}
    functions: list[st.NamesFn] = [
        by_rank,
        lambda path, leaf: ("embed", "mlp"),
        st.match([(r"w$", ("embed", "mlp"))]),
        st.fsdp(mesh, min_size=1),
    ]
    names = [st.box(tree, fn, logical=True)["w"].names for fn in functions]
    assert names == [("embed", "mlp")] * 3 + [(None, ("fsdp",))]


def test_the_typed_usage_that_mypy_checks_runs():
    # tests/typed_usage.py is in mypy's files (CI); here its accepted lines run
    found = runpy.run_path(str(pathlib.Path(__file__).with_name("typed_usage.py")))
    assert found["specs"][0] == found["specs"][1]
    assert found["boxed"][0]["x"].names == ("embed", None)
    assert found["planned"].rows[0].path == "b"
