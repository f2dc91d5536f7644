"""What each opcode means to the reading: tables keyed by jaxlib's opcode enum.

The collective an opcode is (`SYNC`, `STARTS`, `DONES`), the ops a value passes through
unchanged (`PASS`, `MOVES`) or slice by slice (`ELEMENTWISE`), and the FLOPs
rule of each opcode that computes (`FLOPS`: a dot, a convolution, a library
call), as jax's roofline keys its rules by primitive. A rule reads the typed
record (`instructions.Instr`) and its operands' in the module.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from spmdtree._src.step.hlo.instructions import Array, Instr, Module, Op, config_field
from spmdtree._src.step.kinds import CollectiveKind

#: Ops a value passes through unchanged in content (what is followed to its uses).
PASS = frozenset({Op.kBitcast, Op.kCopy, Op.kReshape, Op.kTranspose})
#: Ops whose result holds their operand's content: `PASS`, and an async copy's two
#: halves (libtpu moves values between memory spaces so).
MOVES = PASS | {Op.kCopyStart, Op.kCopyDone}
#: Elementwise ops: a slice of their result needs only the same slice of their
#: operands, so a reduction's result that flows through them to slices is needed
#: only as slices (``convert`` among them: the CPU pipeline reduces bf16 in f32).
ELEMENTWISE = frozenset(
    [
        Op.kAbs,
        Op.kAdd,
        Op.kAnd,
        Op.kAtan2,
        Op.kCbrt,
        Op.kCeil,
        Op.kClamp,
        Op.kCompare,
        Op.kConvert,
        Op.kCos,
        Op.kDivide,
        Op.kExp,
        Op.kExpm1,
        Op.kFloor,
        Op.kIsFinite,
        Op.kLog,
        Op.kLog1p,
        Op.kLogistic,
        Op.kMaximum,
        Op.kMinimum,
        Op.kMultiply,
        Op.kNegate,
        Op.kNot,
        Op.kOr,
        Op.kPower,
        Op.kRemainder,
        Op.kRoundNearestAfz,
        Op.kRoundNearestEven,
        Op.kRsqrt,
        Op.kSelect,
        Op.kSign,
        Op.kSin,
        Op.kSqrt,
        Op.kSubtract,
        Op.kTan,
        Op.kTanh,
        Op.kXor,
    ]
)
#: The collectives as one op each (synchronous, or inside an async wrapper), by opcode.
SYNC = {
    Op.kAllGather: CollectiveKind.ALL_GATHER,
    Op.kAllReduce: CollectiveKind.ALL_REDUCE,
    Op.kReduceScatter: CollectiveKind.REDUCE_SCATTER,
    Op.kAllToAll: CollectiveKind.ALL_TO_ALL,
    Op.kRaggedAllToAll: CollectiveKind.RAGGED_ALL_TO_ALL,
    Op.kCollectivePermute: CollectiveKind.COLLECTIVE_PERMUTE,
}
#: The ``-start`` halves of async pairs, by opcode.
STARTS = {
    Op.kAllGatherStart: CollectiveKind.ALL_GATHER,
    Op.kAllReduceStart: CollectiveKind.ALL_REDUCE,
    Op.kCollectivePermuteStart: CollectiveKind.COLLECTIVE_PERMUTE,
}
#: The ``-done`` halves of async pairs (whose operand is their start).
DONES = frozenset({Op.kAllGatherDone, Op.kAllReduceDone, Op.kCollectivePermuteDone})


# --- flops -----------------------------------------------------------------------------


def _integers(values: Any) -> list[int] | None:
    """A backend config's list of integers (printed as strings: ``["1","2"]``) as
    ints, or None where it is not one."""
    if not isinstance(values, list) or not all(str(v).isdigit() for v in values):
        return None
    return [int(v) for v in values]


def _dims(array: Array | None) -> tuple[int, ...]:
    return array.dims if array is not None else ()


def _window(ins: Instr, rank: int) -> dict[str, Sequence[int]]:
    """A convolution's window: size, stride, pad (low, high), dilations per spatial
    dimension (defaults where absent)."""
    fields: dict[str, Sequence[int]] = dict.fromkeys(
        ("size", "stride", "lhs_dilate", "rhs_dilate"), [1] * rank
    )
    fields["pad_lo"] = fields["pad_hi"] = [0] * rank
    return {**fields, **ins.window}


def _taps(out: int, size: int, stride: int, pad: int, lhs: int, rhs: int, n: int) -> int:
    """Over the `out` output positions of one spatial dimension, how many kernel taps
    land on a real input element (not padding, not a hole of the input's dilation):
    a batch dimension a TPU writes as a window (``size=4 stride=3 lhs_dilate=4``)
    has one per position.

    Example:
        >>> _taps(out=4, size=4, stride=3, pad=0, lhs=4, rhs=1, n=4)  # 4 heads
        4
        >>> _taps(out=3, size=3, stride=1, pad=1, lhs=1, rhs=1, n=3)  # "SAME", 3 wide
        7
    """
    start = np.arange(out)[:, None] * stride - pad + np.arange(size)[None, :] * rhs
    real = (start >= 0) & (start <= (n - 1) * lhs) & (start % lhs == 0)
    return int(real.sum())


def _conv_flops(out_: Array | None, lhs_: Array | None, rhs_: Array | None, conv: Instr) -> int:
    """2 x output batch x output features x input features per group x the taps
    that touch real input, summed over the output's positions."""
    if conv.labels is None:
        return 0
    lhs_l, rhs_l, out_l = conv.labels
    out, lhs, rhs = _dims(out_), _dims(lhs_), _dims(rhs_)
    if not (len(out) == len(out_l) and len(lhs) == len(lhs_l) and len(rhs) == len(rhs_l)):
        return 0
    spatial = sorted(c for c in out_l if c.isdigit())
    win = _window(conv, len(spatial))
    taps = 1
    for s, c in enumerate(spatial):
        taps *= _taps(
            out[out_l.index(c)],
            win["size"][s],
            win["stride"][s],
            win["pad_lo"][s],
            win["lhs_dilate"][s],
            win["rhs_dilate"][s],
            lhs[lhs_l.index(c)],
        )
    return 2 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def _dot_flops(result: Array | None, lhs: Array | None, contracting: Sequence[int]) -> int:
    shape = _dims(lhs)
    if any(d >= len(shape) for d in contracting):
        return 0
    return 2 * math.prod(_dims(result)) * math.prod(shape[d] for d in contracting)


def _operands(mod: Module, comp: str, ins: Instr) -> list[Array | None]:
    """Each operand's first array (None where it has none, or is not in `comp`)."""
    found = []
    for name in ins.operands:
        given = mod.by_name[comp].get(name)
        found.append(given.arrays[0] if given is not None and given.arrays else None)
    return found


def _result(ins: Instr) -> Array | None:
    return ins.arrays[0] if ins.arrays else None


#: What a grouped matmul's kernel is named by (a TPU runs `jax.lax.ragged_dot` as a
#: kernel of its own, its op_name ending ``ragged_dot_general/ragged-dot-none``, or
#: ``ragged-dot-none`` alone; new in 0.8).
GROUPED = ("ragged_dot", "ragged-dot")


def _source(mod: Module, comp: str, name: str) -> tuple[str, Instr] | None:
    """What makes value `name` of `comp`, seen through what only carries it: into a
    fusion (its root), out of a fused computation (a parameter: its fusion's
    operand), through what moves it unchanged (`MOVES`) or converts it."""
    for _ in range(16):
        ins = mod.by_name.get(comp, {}).get(name)
        if ins is None:
            return None
        if ins.op == Op.kFusion and ins.callees:
            comp = ins.callees[0][1]
            name = next((i.name for i in mod.comps[comp] if i.root), "")
        elif ins.op == Op.kParameter and len(callers := mod.callers.get(comp, [])) == 1:
            comp, caller, _ = callers[0]
            number = int(ins.literal) if ins.literal.isdigit() else len(caller.operands)
            if caller.op != Op.kFusion or number >= len(caller.operands):
                return comp, ins
            name = caller.operands[number]
        elif (ins.op in MOVES or ins.op == Op.kConvert) and ins.operands:
            name = ins.operands[0]
        else:
            return comp, ins
    return None


def groups_of(mod: Module, comp: str, name: str) -> int:
    """How many groups value `name` spreads one array's rows over, where it is a
    grouped matmul's masked operand; else 1 (new in 0.8).

    jax writes a ragged dot's transposes (`jax.lax.ragged_dot`'s gradients, the expert
    weights' among them) as dense dots over a new group dimension: each operand is
    ``select(mask, broadcast(rows), 0)``, the rows (an array, not a scalar) repeated
    once along one new dimension, one per group, and each group keeping its own
    (every backend: libtpu fuses it into a convolution). Each row is in one group,
    so such a dot does 1/groups of its dense FLOPs' work.
    """
    found = _source(mod, comp, name)
    if found is None or found[1].op != Op.kSelect or len(found[1].operands) != 3:
        return 1
    where, select = found
    kept, zeros = (_source(mod, where, n) for n in select.operands[1:])
    if kept is None or zeros is None or kept[1].op != Op.kBroadcast or not kept[1].operands:
        return 1
    if not _zero(mod, *zeros):
        return 1
    rows = _dims(_operands(mod, kept[0], kept[1])[0])
    whole = _dims(_result(kept[1]))
    if not rows or len(whole) != len(rows) + 1 or not math.prod(rows):
        return 1
    return math.prod(whole) // math.prod(rows)


def _zero(mod: Module, comp: str, ins: Instr) -> bool:
    """Whether `ins` is a literal zero: a zero constant, or one broadcast."""
    if ins.op == Op.kBroadcast and ins.operands:
        scalar = _source(mod, comp, ins.operands[0])
        return scalar is not None and _zero(mod, *scalar)
    return ins.op == Op.kConstant and ins.literal.strip() in ("0", "0.0", "-0", "false")


def dot_groups(mod: Module, comp: str, ins: Instr) -> int:
    """The groups of a grouped matmul (`groups_of`): both its operands masked over
    the same groups (a ragged dot's transpose to its weights: each row of both in one
    group); 1 for any other matmul (one operand masked alone is an ordinary masked
    matmul: a padded or a causal one)."""
    if len(ins.operands) < 2:
        return 1
    lhs, rhs = (groups_of(mod, comp, name) for name in ins.operands[:2])
    return lhs if lhs == rhs else 1


def dot_flops(mod: Module, comp: str, ins: Instr) -> int:
    """A dot's: 2 x result elements x its contracted size; a grouped matmul's
    (`groups_of`) over its groups."""
    if not ins.operands:
        return 0
    dense = _dot_flops(_result(ins), _operands(mod, comp, ins)[0], ins.dot.lhs_contracting)
    return dense // dot_groups(mod, comp, ins)


def conv_flops(mod: Module, comp: str, ins: Instr) -> int:
    """A convolution's (`_conv_flops`); a grouped matmul's (`groups_of`) over its
    groups."""
    if len(ins.operands) < 2:
        return 0
    lhs, rhs = _operands(mod, comp, ins)[:2]
    return _conv_flops(_result(ins), lhs, rhs, ins) // dot_groups(mod, comp, ins)


#: The custom calls that run a kernel written outside the compiler: Pallas's, through
#: Mosaic on TPU, through Triton or Mosaic GPU on GPU. The module holds none of their
#: dots; only the cost estimate their author gave ``pallas_call`` says what they do
#: (Mosaic's backend config carries it; Triton's and Mosaic GPU's calls drop it).
_KERNEL_CALLS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu")


def is_kernel_call(ins: Instr) -> bool:
    """Whether `ins` runs a hand-written kernel (`_KERNEL_CALLS`)."""
    return ins.op == Op.kCustomCall and ins.target.startswith(_KERNEL_CALLS)


def kernel_name(ins: Instr) -> str:
    """A hand-written kernel's name: Mosaic's call is named for its kernel's innermost
    name scope (``splash_mha_fwd_residuals.1``); a Triton call is named
    ``pallas_call``. Where that names none of jax's own flash kernels (`FLASH`), the
    scope its op name gives the ``pallas_call`` may: a Triton kernel's
    (``.../mha_forward/pallas_call``, ``transpose(jvp(mha_backward))/pallas_call``),
    or jax's Pallas TPU flash attention's forward, named for the scope it is called
    in (``jvp_jit_flash_attention__``) but its op name
    ``jvp(jit(flash_attention))/pallas_call`` (new in 0.7).

    Example:
        >>> call = Instr("pallas_call.3", Op.kCustomCall, (), False, (), False, (),
        ...     target="__gpu$xla.gpu.triton", op_name="jit(f)/transpose(jvp(mha_backward))/pallas_call")
        >>> kernel_name(call)
        'mha_backward'
    """
    name = ins.name.rsplit(".", 1)[0]
    scopes = ins.op_name.split("/")
    if flash_of(name) is None and len(scopes) > 1 and scopes[-1] == "pallas_call":
        # the scope before is the kernel's own only where pallas_call was given a
        # name= or a scope (jax's kernels are): else it is the caller's, which names
        # nothing
        scope = innermost(scopes[-2])
        return scope if scope in FLASH else name
    return name


def innermost(scope: str) -> str:
    """A name scope without the transformations around it (new in 0.7).

    Example:
        >>> innermost("transpose(jvp(jit(flash_attention)))"), innermost("splash_mha_dq")
        ('flash_attention', 'splash_mha_dq')
    """
    return scope.split("(")[-1].rstrip(")")


#: Where a flash kernel's mask is read (new in 0.7): ``"module"``, the compiled module
#: says which blocks it skips (jax's GPU kernel's causal loop); ``"blocks"``, the block
#: mask it was built with, a constant of the traced step (splash attention); ``"causal"``,
#: the traced kernel runs only the blocks on or below the diagonal (jax's Pallas TPU
#: flash attention, with ``causal=True``).
MaskSource = Literal["module", "blocks", "causal"]


@dataclasses.dataclass(frozen=True)
class Flash:
    """One of jax's own flash-attention kernels, which keep no cost estimate (new in
    0.6): the dots it runs per query-key block pair, each of the head width (the
    forward: the scores and their product with the values; a backward kernel the
    scores again and the gradients it computes), and whether it is a backward one.
    `mask`: where which blocks its mask skips is read (`MaskSource`; 0.6 had
    `mask_read`, the module's alone, and counted splash attention as if its mask kept
    every block). `keys`: the axis of its key operand that runs over the sequence."""

    dots: int
    backward: bool
    mask: MaskSource
    keys: int

    def flops(self, query: Array, key: Array, causal: bool) -> int:
        """2 x dots x queries' elements x keys: per head, a query-key pair's dots of
        the head width; a causal mask keeps half the pairs.

        Example:
            >>> q = Array("bf16", (2, 1024, 8, 128))  # batch, sequence, heads, head width
            >>> Flash(2, False, "module", 1).flops(q, q, causal=False) == 4 * 2 * 8 * 1024 * 1024 * 128
            True
        """
        return 2 * self.dots * query.elements * key.dims[self.keys] // (2 if causal else 1)


#: jax's own flash-attention kernels, by the name their calls carry (a prefix):
#: jax.experimental.pallas.ops.gpu.attention (Triton: operands batch x sequence x
#: heads x head width; its backward recomputes the scores twice, once for dK and dV
#: and once for dQ: 7 dots), ...ops.tpu.splash_attention (Mosaic: the block mask's
#: arrays first, then heads x sequence x head width; dQ's kernel 3 dots, dK and dV's
#: 4, 5 where it fuses dQ's; MQA's alike) and ...ops.tpu.flash_attention (Mosaic:
#: batch x heads x sequence x head width; new in 0.7: its forward keeps a cost
#: estimate, its dK and dV kernel recomputes the scores for 4 dots, its dQ kernel 3).
FLASH: Mapping[str, Flash] = {
    "mha_forward": Flash(2, False, "module", 1),
    "mha_backward": Flash(7, True, "module", 1),
    "mha_preprocess_backward": Flash(0, True, "module", 1),  # the rows of dO x O: no dots
    "splash_mha_fwd": Flash(2, False, "blocks", -2),
    "splash_mha_dq": Flash(3, True, "blocks", -2),
    "splash_mha_dkv": Flash(4, True, "blocks", -2),
    "splash_mqa_fwd": Flash(2, False, "blocks", -2),  # one key-value head: the same dots
    "splash_mqa_dq": Flash(3, True, "blocks", -2),
    "splash_mqa_dkv": Flash(4, True, "blocks", -2),
    "flash_attention": Flash(2, False, "causal", -2),
    "flash_mha_bwd_dkv": Flash(4, True, "causal", -2),
    "flash_mha_bwd_dq": Flash(3, True, "causal", -2),
}


def flash_of(name: str) -> Flash | None:
    """The `FLASH` entry of a kernel of this name, or None.

    Example:
        >>> flash_of("splash_mha_dkv_no_residuals").dots, flash_of("my_kernel")
        (4, None)
    """
    return next((flash for prefix, flash in FLASH.items() if name.startswith(prefix)), None)


#: A ``while`` among a kernel IR's location names (the printed bytecode escapes the
#: byte before it as digits, so no word boundary).
_WHILE = re.compile(r"(?<![A-Za-z_])while(?![A-Za-z_])")


def _flash_flops(mod: Module, comp: str, ins: Instr) -> int:
    """A jax flash kernel's FLOPs from its query and key operands' shapes (the first
    two floating-point ones); its GPU kernel is causal where its loop over key blocks
    stops at its query block: a ``while`` in the kernel's own locations, which the
    Triton call's IR (its backend config, printed as an MLIR dictionary) keeps."""
    flash = flash_of(kernel_name(ins))
    arrays = [a for a in _operands(mod, comp, ins) if a is not None and a.dtype[:1] in "bf"]
    if flash is None or len(arrays) < 2 or len(arrays[1].dims) < 3:
        return 0
    causal = flash.mask == "module" and _WHILE.search(ins.config.get("mlir", "")) is not None
    dots = flash.dots
    query, key = arrays[0], arrays[1]
    if kernel_name(ins).startswith(("splash_mha_dkv", "splash_mqa_dkv")):
        # with BlockSizes(use_fused_bwd_kernel=True) it computes dQ too (dQ, dK and dV
        # among its results, not dK and dV alone): dQ's dot besides its own four. Its
        # other results are blocks of scratch (batched under vmap: 0.6 counted those)
        ends = (query.dims[-2:], key.dims[-2:])
        shaped = [a for a in ins.arrays if len(a.dims) >= len(key.dims) and a.dims[-2:] in ends]
        dots += 1 if len(shaped) >= 3 else 0
    return dataclasses.replace(flash, dots=dots).flops(query, key, causal)


class Kept(NamedTuple):
    """How many of a flash kernel's query-key blocks its mask keeps, as the traced
    step says (new in 0.7): `kept` of `blocks` (over the heads its mask covers);
    where the traced step does not say, 0 of 0, and `why` says why.

    Example:
        >>> Kept(36, 64).scaled(6400), Kept(why="its mask is computed in the step").read
        (3600, False)
    """

    kept: int = 0
    blocks: int = 0
    why: str = ""

    @property
    def read(self) -> bool:
        """Whether the mask was read."""
        return self.blocks > 0

    def scaled(self, flops: int) -> int:
        """`flops` counted over every block, counted over the kept ones."""
        return flops * self.kept // self.blocks if self.read else flops


#: What libtpu writes for the cycles of a kernel it cannot estimate: 2^63 - 1 (new in 0.7).
UNESTIMABLE = 2**63 - 1


def estimated_cycles(ins: Instr) -> int:
    """libtpu's own estimate of an instruction's cycles (its backend config's
    ``estimated_cycles``): 0 where the compiler gives none, `UNESTIMABLE` where
    libtpu says it cannot estimate it (new in 0.7).

    Example:
        >>> call = Instr("fusion.4", Op.kFusion, (), False, (), False, (),
        ...     config={"window_config": {"estimated_cycles": "23750"}})
        >>> estimated_cycles(call), estimated_cycles(Instr("d", Op.kDot, (), False, (), False, ()))
        (23750, 0)
    """
    found = config_field(ins.config, "estimated_cycles")
    return int(found) if isinstance(found, (int, str)) and str(found).isdigit() else 0


def reduced(ins: Instr) -> tuple[int, ...]:
    """The dimensions a reduction reduces: a reduce's ``dimensions``; a
    reduce-window's whose window is wider than 1 (libtpu writes a softmax's
    reduction over a non-minor dimension so); none for any other op (new in 0.7).

    Example:
        >>> window = Instr("r", Op.kReduceWindow, (), False, (), False, (),
        ...     window={"size": (1, 16383, 1)})
        >>> reduced(window)
        (1,)
    """
    if ins.op == Op.kReduce:
        return ins.dimensions
    if ins.op == Op.kReduceWindow:
        return tuple(d for d, size in enumerate(ins.window.get("size", ())) if size > 1)
    return ()


def kernel_estimate(ins: Instr) -> tuple[int, int] | None:
    """A hand-written kernel's own cost estimate, (FLOPs, bytes accessed), as its
    author gave ``pallas_call(cost_estimate=...)``; None where it has none (new in
    0.5).

    Example:
        >>> import dataclasses
        >>> config = {"custom_call_config": {"cost_estimate": {"flops": "4096", "bytes_accessed": "512"}}}
        >>> call = Instr("k", Op.kCustomCall, (), False, (), False, (), config=config,
        ...     target="tpu_custom_call")
        >>> kernel_estimate(call), kernel_estimate(dataclasses.replace(call, config={}))
        ((4096, 512), None)
    """
    found = config_field(ins.config, "cost_estimate") if is_kernel_call(ins) else None
    if not isinstance(found, dict):
        return None
    try:
        return int(found.get("flops", 0)), int(found.get("bytes_accessed", 0))
    except (TypeError, ValueError):
        return None


def custom_flops(mod: Module, comp: str, ins: Instr) -> int:
    """The FLOPs of a library call: a cuBLAS matmul (its dims in its backend config),
    a cuDNN convolution (its window; the backward ones laid out by which operand is
    the forward's output) or cuDNN fused attention; a hand-written kernel's as its
    cost estimate says (none without one; new in 0.5), or, one of jax's own flash
    kernels (`FLASH`), as its shapes say (new in 0.6)."""
    name = ins.target
    if is_kernel_call(ins):
        estimate = kernel_estimate(ins)
        return estimate[0] if estimate is not None else _flash_flops(mod, comp, ins)
    types = _operands(mod, comp, ins)
    result = _result(ins)
    if "gemm" in name.lower() or "matmul" in name.lower():
        dims = _integers(config_field(ins.config, "lhs_contracting_dimensions"))
        return _dot_flops(result, types[0], dims) if dims is not None and types else 0
    if name.startswith("__cudnn$conv") and len(types) >= 2:
        if "BackwardInput" in name:
            return _conv_flops(types[0], result, types[1], ins)
        if "BackwardFilter" in name:
            return _conv_flops(types[1], types[0], result, ins)
        return _conv_flops(result, types[0], types[1], ins)
    if name.startswith("__cudnn$fmha") and len(types) >= 3:
        shape = config_field(ins.config, "intermediate_tensor_shape")
        scores = _integers(shape.get("dimensions") if isinstance(shape, dict) else None)
        if scores is None:
            return 0
        causal = "CAUSAL" in str(config_field(ins.config, "mask_type") or "").upper()
        return _attention_flops(name, scores, types[0], types[2], causal=causal)
    return 0


def _attention_flops(
    name: str,
    scores: Sequence[int],
    query: Array | None,
    value: Array | None,
    *,
    causal: bool = False,
) -> int:
    """cuDNN fused attention: scores (heads x queries x keys, each a dot of the head
    width) and their product with the values; its backward recomputes the scores and
    takes the four gradients' dots. Under a causal mask (``mask_type`` CAUSAL in its
    backend config) cuDNN skips the blocks above the diagonal: half the scores (new
    in 0.5; 0.4 counted them all).

    Example:
        >>> scores, q = [1, 4, 512, 512], Array("bf16", (1, 512, 4, 64))
        >>> _attention_flops("__cudnn$fmhaSoftmax", scores, q, q) == 2 * 2 * 4 * 512 * 512 * 64
        True
        >>> _attention_flops("__cudnn$fmhaSoftmaxBackward", scores, q, q) // (4 * 512 * 512 * 64)
        10
        >>> _attention_flops("__cudnn$fmhaSoftmax", scores, q, q, causal=True) == 2 * 4 * 512 * 512 * 64
        True
    """
    if not _dims(query) or not _dims(value):
        return 0
    size = math.prod(scores) // (2 if causal else 1)
    qk, v = _dims(query)[-1], _dims(value)[-1]
    if "Backward" in name:
        return 2 * size * (3 * qk + 2 * v)
    return 2 * size * (qk + v)


#: The FLOPs rule of each opcode that computes: 2 x result elements x contracted size.
FLOPS: Mapping[Op, Callable[[Module, str, Instr], int]] = {
    Op.kDot: dot_flops,
    Op.kConvolution: conv_flops,
    Op.kCustomCall: custom_flops,
}


def flops(mod: Module, comp: str, ins: Instr) -> int:
    """The FLOPs of instruction `ins` of computation `comp`, by its opcode's rule
    (0 for an opcode without one)."""
    rule = FLOPS.get(ins.op)
    return rule(mod, comp, ins) if rule is not None else 0
