"""A matmul's share of the peak by its shape, and 8-bit matmuls at the chip's own rate
(new in 0.8): `Hardware.matmul_grid`, `Hardware.eight_bit_speed`, `st.calibrate`'s."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from test_targets import has_compiler

import spmdtree as st

# Private: the per-kernel model and the schedule's reading have no public names
from spmdtree._src.step.hlo.schedule import read_schedule
from spmdtree._src.step.hw import PRESETS, grid_share
from spmdtree._src.step.time.predict import fixed_seconds, kernel_seconds

LIBTPU = pytest.mark.skipif(not has_compiler("tpu"), reason="needs libtpu (spmdtree[tpu])")
MESH = AbstractMesh((1,), ("data",), axis_types=(AxisType.Auto,))

#: A grid as st.calibrate keeps it: small and narrow matmuls far below the peak.
SIZES = (128, 1024, 8192)
GRID = tuple(
    (m, k, n, 0.9 * min(m, k, n) / 8192 + 0.05) for m in SIZES for k in SIZES for n in SIZES
)


def on_grid(hardware):
    return dataclasses.replace(hardware, matmul_grid=GRID)


#: A matmul as a TPU compiles it, hand-written: (m, k) x (k, n) in bf16 or int8.
MATMUL = """HloModule m, is_scheduled=true

ENTRY %main (x: {t}[{m},{k}], w: {t}[{k},{n}]) -> {r}[{m},{n}] {{
  %x = {t}[{m},{k}]{{1,0}} parameter(0)
  %w = {t}[{k},{n}]{{1,0}} parameter(1)
  ROOT %d = {r}[{m},{n}]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


def matmul(m, k, n, t="bf16", r="bf16"):
    (kernel,) = read_schedule(MATMUL.format(m=m, k=k, n=n, t=t, r=r), platform="tpu").events
    return kernel


@pytest.mark.parametrize(
    "shape", [(8192, 8192, 8192), (1024, 1024, 1024), (128, 8192, 8192)], ids=str
)
def test_a_matmuls_share_is_read_by_its_shape_from_the_calibrated_grid(shape):
    chip = on_grid(st.hardware("tpu-v5e"))
    kernel = matmul(*shape)
    m, k, n = shape
    share = dict(((p[0], p[1], p[2]), p[3]) for p in GRID)[shape]
    compute = 2 * m * k * n / (chip.flops_per_second * share)
    memory = kernel.bytes / (chip.hbm_bytes_per_second * chip.memory_efficiency)
    seconds = kernel_seconds(kernel, chip.costs(), chip.flops_per_second)
    assert seconds == pytest.approx(max(compute, memory) + 0.05 * min(compute, memory))


def test_a_small_matmul_is_slower_on_the_grid_than_at_the_largest_share():
    preset = st.hardware("tpu-v5e")
    kernel = matmul(1024, 1024, 1024)
    flat = kernel_seconds(kernel, preset.costs(), preset.flops_per_second)
    by_shape = kernel_seconds(kernel, on_grid(preset).costs(), preset.flops_per_second)
    assert by_shape > 2 * flat  # 0.16 of the peak on this grid, where the preset says 1.0


def test_a_dimension_is_padded_to_the_matrix_unit():
    # 64 columns take the 128 lanes a column tile has: half the work is padding
    costs = on_grid(st.hardware("tpu-v5e")).costs()
    assert grid_share(GRID, 8192, 8192, 64, 128) == pytest.approx(
        grid_share(GRID, 8192, 8192, 128, 128) / 2
    )
    # v6e's matrix unit is 256 wide: on a grid measured from 256 up, 128 columns are
    # padded to it
    wide = tuple((m * 2, k * 2, n * 2, share) for m, k, n, share in GRID)
    assert grid_share(wide, 16384, 16384, 128, 256) == pytest.approx(
        grid_share(wide, 16384, 16384, 256, 256) / 2
    )
    assert costs.tile == (128, 128)


def test_a_dimension_narrower_than_the_matrix_unit_that_the_grid_measured_is_read_as_measured():
    # a grid measured at 64 says what 64 columns cost: padding is in its share already
    narrow = tuple((m // 2, k // 2, n // 2, share) for m, k, n, share in GRID)
    share = dict(((p[0], p[1], p[2]), p[3]) for p in narrow)[4096, 4096, 64]
    assert grid_share(narrow, 4096, 4096, 64, 128) == pytest.approx(share)
    # one narrower still is padded to the grid's smallest; one between to the tile
    assert grid_share(narrow, 4096, 4096, 32, 128) == pytest.approx(share / 2)
    assert grid_share(narrow, 4096, 4096, 96, 128) == pytest.approx(
        grid_share(narrow, 4096, 4096, 128, 128) * 96 / 128
    )
    # on the grid that starts at the tile, 64 columns still take half of it
    assert grid_share(GRID, 8192, 8192, 64, 128) < share


#: A loop's tiny kernels as libtpu schedules them, hand-written: a row read from an index
#: array the chip leaves in HBM, and the same row read from its own memory (``S(1)``).
TINY = """HloModule m, is_scheduled=true

%read {{
  %t = s32[8192,2]{{1,0:T(8,128){t}}} parameter(0)
  %i = s32[]{{:T(128)S(6)}} parameter(1)
  %z = s32[] constant(0)
  ROOT %r = s32[1,2]{{1,0:T(1,128)S(1)}} dynamic-slice(%t, %i, %z), dynamic_slice_sizes={{1,2}}
}}

ENTRY %main (t: s32[8192,2], i: s32[], p: pred[]) -> (s32[1,2], pred[]) {{
  %t = s32[8192,2]{{1,0:T(8,128){t}}} parameter(0)
  %i = s32[]{{:T(128)S(6)}} parameter(1)
  %p = pred[]{{:T(512)}} parameter(2)
  %row = s32[1,2]{{1,0:T(1,128)S(1)}} fusion(%t, %i), kind=kLoop, calls=%read
  %not = pred[]{{:T(512)}} not(%p)
  ROOT %out = (s32[1,2]{{1,0:T(1,128)S(1)}}, pred[]{{:T(512)}}) tuple(%row, %not)
}}
"""


@pytest.mark.parametrize("space, waits", [("", 1), ("S(1)", 0)], ids=["hbm", "on-chip"])
def test_a_kernel_that_reads_an_array_in_hbm_waits_for_its_first_access(space, waits):
    # the scalar op (`not`) is the scalar unit's, inline: no kernel (new in 0.8)
    (row,) = read_schedule(TINY.format(t=space), platform="tpu").events
    assert row.hbm_waits == waits  # it writes the chip's own memory
    chip = dataclasses.replace(st.hardware("tpu-v5e"), launch_seconds=5e-8, access_seconds=3e-7)
    costs = chip.costs()
    assert fixed_seconds(row, costs) == pytest.approx(5e-8 + 3e-7 * waits)


def test_access_seconds_goes_to_json_and_back_and_a_file_without_it_reads():
    chip = dataclasses.replace(st.hardware("tpu-v5e"), access_seconds=3e-7)
    assert st.Hardware.from_json(chip.to_json()) == chip
    older = json.loads(chip.to_json())  # written before 0.8 added it
    del older["access_seconds"]
    read = st.Hardware.from_json(json.dumps(older))
    assert read.access_seconds is None and read.costs().access_seconds == 0.0
    with pytest.raises(ValueError, match="access_seconds"):
        dataclasses.replace(chip, access_seconds=-1.0)


def test_calibrates_fill_is_normal_floats_tiled_to_each_operand_and_integer_zeros():
    # Private: calibrate's benchmarks have no public name
    from spmdtree._src.step.measure.calibrate import BLOCK, _Bench

    bench = _Bench(jax.devices()[0], st.hardware("tpu-v5e"), 2)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    leaf = jax.ShapeDtypeStruct((3, BLOCK // 2 + 5), jnp.bfloat16, sharding=sharding)
    filled = bench.fill(jax.random.key(0), leaf)
    assert filled.shape == leaf.shape and filled.dtype == jnp.bfloat16
    assert filled.sharding == sharding
    values = jnp.asarray(filled, jnp.float32)
    assert 0.015 < float(jnp.std(values)) < 0.025  # measure's scale, 0.02
    assert float(values.ravel()[BLOCK]) == float(values.ravel()[0])  # the block, tiled
    ints = bench.fill(jax.random.key(0), jax.ShapeDtypeStruct((4, 8), jnp.int32, sharding=sharding))
    assert ints.dtype == jnp.int32 and not jnp.any(ints)


def test_between_the_grids_points_the_share_lies_between_theirs():
    low, high = grid_share(GRID, 1024, 1024, 1024, 128), grid_share(GRID, 8192, 8192, 8192, 128)
    middle = grid_share(GRID, 2048, 2048, 2048, 128)
    assert low < middle < high


@LIBTPU
def test_a_convolution_is_read_by_its_shape_too():
    # its output positions x its window and input features x its output features
    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    x = jax.ShapeDtypeStruct((8, 56, 56, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16)
    plan = st.preflight(conv, x, w, mesh=MESH, target="tpu-v5e")
    (kernel,) = [k for k in plan.schedule.kernels() if k.flops]
    assert kernel.m * kernel.n == 8 * 56 * 56 * 64  # SAME's edges take fewer of 9 taps:
    assert 0.95 * 2 * 8 * 56 * 56 * 9 * 64 * 64 < kernel.flops <= 2 * 8 * 56 * 56 * 9 * 64 * 64
    chip = on_grid(st.hardware("tpu-v5e"))
    narrow = kernel_seconds(kernel, chip.costs(), chip.flops_per_second)
    assert narrow > 1.5 * kernel_seconds(kernel, st.hardware("tpu-v5e").costs(), 1.97e14)


def test_an_int8_matmul_runs_at_the_chips_8_bit_rate():
    kernel = matmul(8192, 8192, 8192, "s8", "s32")
    assert kernel.dtype == "s8"
    chip = dataclasses.replace(st.hardware("tpu-v5e"), matmul_efficiency=0.5)
    measured = dataclasses.replace(chip, eight_bit_speed=1.5)
    peak = chip.flops_per_second
    flops = 2 * 8192**3
    for hardware, speed in ((chip, 2.0), (measured, 1.5)):
        compute = flops / (peak * 0.5 * speed)
        memory = kernel.bytes / (hardware.hbm_bytes_per_second * hardware.memory_efficiency)
        expected = max(compute, memory) + 0.05 * min(compute, memory)
        assert kernel_seconds(kernel, hardware.costs(), peak) == pytest.approx(expected)


def test_every_preset_carries_its_data_sheets_8_bit_rate():
    for name in PRESETS:
        assert st.hardware(name).eight_bit_speed == 2.0, name
        assert "eight_bit_speed" not in st.hardware(name).left_out


def test_a_chip_without_an_8_bit_rate_says_so_where_a_step_runs_one():
    chip = dataclasses.replace(st.hardware("tpu-v5e"), eight_bit_speed=None)
    assert "eight_bit_speed" in chip.left_out

    def int8(x, w):
        return jax.lax.dot(x, w, preferred_element_type=jnp.int32)

    x = jax.ShapeDtypeStruct((256, 256), jnp.int8)
    plan = st.preflight(int8, x, x, mesh=MESH)
    said = plan.time(chip).flags
    assert any("eight_bit_speed" in flag for flag in said), said
    bf16 = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    plan = st.preflight(jnp.matmul, bf16, bf16, mesh=MESH)
    assert not any("eight_bit_speed" in flag for flag in plan.time(chip).flags)


def test_the_grid_goes_to_json_and_back():
    chip = on_grid(st.hardware("tpu-v5e"))
    assert st.Hardware.from_json(chip.to_json()) == chip
    data = json.loads(chip.to_json())
    assert data["matmul_grid"][0] == [128, 128, 128, pytest.approx(GRID[0][3])]
    # a file written before 0.8 has neither field: each left out
    del data["matmul_grid"], data["eight_bit_speed"]
    older = st.Hardware.from_json(json.dumps(data))
    assert older.matmul_grid is None and older.eight_bit_speed is None


@pytest.mark.parametrize(
    "grid, said",
    [
        ([[128, 128, 128]], r"matmul_grid has the point \[128, 128, 128\]; expected \(m, k, n, share\)"),
        ([[128, 128, 128, 1.5]], r"matmul_grid has the point .*a share of the peak in \(0, 1\]"),
        ([[128, 128.5, 128, 0.5]], r"matmul_grid has the point .*three whole numbers"),
        ([[128, 128, 128, 0.5], [256, 256, 128, 0.5]], r"matmul_grid is not a full grid: .*not \(128, 256, 128\)"),
        ([[128, 128, 128, 0.5], [128, 128, 128, 0.6]], r"matmul_grid measures \(128, 128, 128\) twice"),
        ([], r"matmul_grid is \[\]; expected a non-empty list"),
    ],
    ids=["three-numbers", "share-above-1", "not-whole", "not-full", "twice", "empty"],
)  # fmt: skip
def test_a_malformed_grid_is_a_value_error_naming_the_field(grid, said):
    data = json.loads(st.hardware("tpu-v5e").to_json())
    data["matmul_grid"] = grid
    with pytest.raises(ValueError, match=rf"^Hardware: {said}"):
        st.Hardware.from_json(json.dumps(data))


def test_calibrate_measures_the_grid_and_the_8_bit_rate(cpu_calibration):
    calibrated = cpu_calibration
    grid = calibrated.matmul_grid
    assert grid is not None and len(grid) == 2 * 2 * 2  # a CPU's: (64, 256) x (64, 128)^2
    assert {p[:3] for p in grid} == {
        (m, k, n) for m in (64, 256) for k in (64, 128) for n in (64, 128)
    }
    assert all(0 < p[3] <= 1 for p in grid)
    assert calibrated.matmul_efficiency == pytest.approx(
        max(calibrated.matmul_efficiency, *(p[3] for p in grid))
    )
    assert calibrated.eight_bit_speed is not None and calibrated.eight_bit_speed > 0
    for figure in ("matmul_grid", "eight_bit_speed"):
        assert calibrated.provenance[figure].startswith("measured 20")
    assert st.Hardware.from_json(calibrated.to_json()) == calibrated
