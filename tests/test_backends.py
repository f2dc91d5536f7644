"""One `Toolchain` per compiler holds every fact of it (0.6): a fake one, passed in,
is what a step meets; and no room outside it asks which platform it is."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import spmdtree as st

# Private: the toolchains and the compiler's choice have no public names
from spmdtree._src.step.compile.backends import (
    BY_CHIP,
    LIBTPU,
    TOOLCHAINS,
    XLA_CPU,
    XLA_GPU,
    CompilerMissing,
    target_for,
)
from spmdtree._src.step.compile.compilers import compiler_for

STEP = pathlib.Path(st.__file__).parent / "_src" / "step"

#: The rooms that may name a platform: the enums, and the toolchains themselves.
ALLOWED = {"kinds.py", "backends.py"}

#: A test of which platform a step is on: a comparison with a platform's name.
PLATFORM_TEST = re.compile(
    r'(==|!=|\bin)\s*\(?\s*"(cuda|gpu|tpu)"|"(cuda|gpu|tpu)"\s*(==|!=)|platform\s*(==|!=)'
)


def test_no_room_outside_the_toolchains_tests_a_platform_string():
    found = [
        f"{path.relative_to(STEP)}:{number}: {line.strip()}"
        for path in sorted(STEP.rglob("*.py"))
        if path.name not in ALLOWED
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PLATFORM_TEST.search(line)
    ]
    assert found == []


def test_the_scan_finds_a_platform_test_where_there_is_one():
    # the check above can fail: it finds the forms 0.5 wrote
    for line in ('if target.platform == "cuda":', 'kind = "node" if p == "cuda" else "slice"'):
        assert PLATFORM_TEST.search(line), line
    assert not PLATFORM_TEST.search('if screen == "cpu" or asks is None:')


def test_each_backend_has_its_toolchain_and_each_chip_its_target():
    assert {backend: t.backend for backend, t in TOOLCHAINS.items()} == {b: b for b in st.Backend}
    assert target_for(st.hardware("h100")).toolchain is XLA_GPU
    assert target_for(st.hardware("tpu-v5p")).toolchain is LIBTPU
    assert XLA_CPU.own_options(deviceless=False) == dict(XLA_CPU.deviceless_options)  # fake devices
    assert XLA_GPU.own_options(deviceless=False) == {}  # a real GPU compiles as the job


def test_a_fake_compiler_passed_in_is_the_one_checked():
    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    fake = dataclasses.replace(XLA_GPU, name="fake GPU", module="spmdtree_tests_no_such_compiler")
    with pytest.raises(CompilerMissing, match=r"needs the fake GPU compiler.*spmdtree\[cuda\]"):
        compiler_for(mesh, "h100", None, fake)
    installed = dataclasses.replace(fake, module=None)  # nothing to find: always installed
    assert compiler_for(mesh, "h100", None, installed).toolchain is installed


def test_what_a_compiler_refuses_is_its_toolchains_to_say(monkeypatch):
    # a fake GPU compiler that refuses pinned host memory: preflight refuses it, in
    # its words, before anything compiles (the fake compiles nothing)
    fake = dataclasses.replace(XLA_GPU, name="fake GPU", module=None, refuses=("pinned_host",))
    monkeypatch.setitem(BY_CHIP, st.GpuChip, fake)
    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    x = st.Partitioned(
        jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None), memory_kind="pinned_host"
    )
    with pytest.raises(ValueError, match=r"^preflight: .*'pinned_host', which fake GPU does not"):
        st.preflight(lambda x: x.value * 2, x, mesh=mesh, target="h100")


def test_a_chip_of_ones_own_kind_is_compiled_by_its_kinds_toolchain():
    # a subclass of GpuChip is a GpuChip: XLA GPU's target, as Hardware accepts it
    class MyChip(st.GpuChip):
        pass

    h100 = st.hardware("h100")
    chip = MyChip(*dataclasses.astuple(h100.chip))
    mine = dataclasses.replace(h100, name="mine", chip=chip)
    assert target_for(mine).toolchain is XLA_GPU
