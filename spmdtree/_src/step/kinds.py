"""The step wing's closed sets of names, as enums: backends, collective kinds, kernel
classes, link kinds (new in 0.6; 0.5 had the backends' and verdicts' alone), and
advice's verdicts (0.7: here, below the pictures that draw them); `bits`, an element
type's width, which the HLO reader and the hardware both read (0.7). The floor the
others stand on.

Each compares equal to its string, so a user's ``row.kind == "all-reduce"`` and a
table keyed by ``"ici"`` work as before, and the kinds' reprs are their strings'
(a `Collective` prints as it did). The ring algorithm's volumes live here, on
`CollectiveKind`, the one place the bound and a row's `wire_bytes` read them.
"""

from __future__ import annotations

import enum
import itertools
import string


class Backend(enum.StrEnum):
    """The backend whose compiler compiled a step, as `jax.devices()` names it
    (new in 0.5; each compares equal to its string, as 0.4's backends were).

    Example:
        >>> import spmdtree as st
        >>> st.Backend.GPU == "gpu", st.Backend.of("cuda") is st.Backend.GPU
        (True, True)
    """

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"

    @classmethod
    def of(cls, platform: str) -> Backend:
        """A compiler's platform (``"cpu"``, ``"cuda"``, ``"tpu"``, or a device's
        ``"gpu"``) as its backend: the one place ``"cuda"`` becomes ``"gpu"``."""
        return cls.GPU if platform == "cuda" else cls(platform)

    @property
    def estimates(self) -> bool:
        """Whether its figures are the CPU compiler's estimate of an accelerator's
        (new in 0.5).

        Example:
            >>> import spmdtree as st
            >>> st.Backend.CPU.estimates, st.Backend.TPU.estimates
            (True, False)
        """
        return self is Backend.CPU


class _Named(enum.StrEnum):
    """A kind whose repr is its string's: records that hold one print as before."""

    def __repr__(self) -> str:
        return repr(self.value)


class CollectiveKind(_Named):
    """The collective a `Collective` row is, as an accelerator runs it (new in 0.6).

    Example:
        >>> import spmdtree as st
        >>> kind = st.CollectiveKind("reduce-scatter")
        >>> kind == "reduce-scatter", kind.passes, kind.moved(1024, 4)
        (True, 1, 4096)
    """

    ALL_GATHER = "all-gather"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    RAGGED_ALL_TO_ALL = "ragged-all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"

    @property
    def exchanges(self) -> bool:
        """Whether each device sends a part of its buffer to every other one (an
        all-to-all, ragged or not; a ragged one timed at its output buffer's size,
        which bounds what it moves; new in 0.8).

        Example:
            >>> import spmdtree as st
            >>> st.CollectiveKind("ragged-all-to-all").exchanges, st.CollectiveKind("all-gather").exchanges
            (True, False)
        """
        return self in (CollectiveKind.ALL_TO_ALL, CollectiveKind.RAGGED_ALL_TO_ALL)

    @property
    def passes(self) -> int:
        """How many times the ring algorithm goes round: twice for an all-reduce (a
        reduce-scatter, then an all-gather), once for the others."""
        return 2 if self is CollectiveKind.ALL_REDUCE else 1

    def moved(self, size: int, group: int) -> int:
        """The volume one pass of the ring spreads over a group of `group`, of a
        result of `size` bytes per device: a reduce-scatter's whole input (`group`
        results), the result itself for the others. Each device sends
        ``(group - 1) / group`` of it per pass (a collective-permute: its size)."""
        return size * group if self is CollectiveKind.REDUCE_SCATTER else size

    def ring_bytes(self, size: int, group: int) -> int:
        """What each device sends by the ring algorithm, for a result of `size` bytes
        per device over a group of `group`: ``passes x (group - 1) / group x moved``;
        a collective-permute sends its size.

        Example:
            >>> import spmdtree as st
            >>> st.CollectiveKind.ALL_REDUCE.ring_bytes(1024, 4)
            1536
        """
        if self is CollectiveKind.COLLECTIVE_PERMUTE:
            return size
        return self.passes * (group - 1) * self.moved(size, group) // group


class KernelClass(_Named):
    """The classes a predicted step's time is split into (`StepTime.predicted_by_class`'s
    keys; new in 0.6): a device kernel's class (``matmul``, ``attention``,
    ``memory``), the collectives' exposed time, and kernels' fixed costs (launches,
    and waits for HBM's first access: `launch`).

    Example:
        >>> import spmdtree as st
        >>> [str(k) for k in st.KernelClass]
        ['matmul', 'attention', 'memory', 'collectives', 'launch']
    """

    MATMUL = "matmul"
    ATTENTION = "attention"
    MEMORY = "memory"
    COLLECTIVES = "collectives"
    LAUNCH = "launch"


class LinkKind(_Named):
    """A `Hardware`'s link kinds, fastest first (its `links`' keys; new in 0.6): within
    a node or TPU slice (``ici``: NVLink, a TPU's inter-chip links), then across
    (``dcn``: the network between nodes or slices).

    Example:
        >>> import spmdtree as st
        >>> list(st.LinkKind), st.LinkKind.ICI == "ici"
        (['ici', 'dcn'], True)
    """

    ICI = "ici"
    DCN = "dcn"


class Verdict(enum.StrEnum):
    """An `AdviceRow`'s verdict, best first: rows rank in this order (new in 0.5;
    each compares equal to its string, as 0.4's verdicts were).

    Example:
        >>> import spmdtree as st
        >>> st.Verdict.FITS == "fits", list(st.Verdict).index(st.Verdict.TIGHT)
        (True, 1)
    """

    FITS = "fits"
    TIGHT = "tight"
    MAY_FIT = "may fit"
    OVER_BUDGET = "over budget"
    BATCH_UNSHARDED = "batch unsharded"
    DOES_NOT_COMPILE = "does not compile"


def bits(dtype: str) -> int:
    """The bits of an HLO element type: ``bf16`` 16, ``f8e4m3fn`` 8, ``pred`` 8 (0.7:
    here, below the HLO reader and the hardware, which both read it).

    Example:
        >>> bits("bf16"), bits("f8e4m3fn"), bits("pred")
        (16, 8, 8)
    """
    digits = "".join(itertools.takewhile(str.isdigit, dtype.lstrip(string.ascii_lowercase)))
    return int(digits) if digits and dtype != "pred" else 8
