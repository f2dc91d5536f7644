"""spmdtree: say how every array of a pytree is laid out on a device mesh.

Boxes attach names to arrays (mesh axis names, or logical names plus rules);
pure functions over pytrees turn them into `PartitionSpec`s, `NamedSharding`s,
sharding constraints and sharded initialisation, with no module system.

Types for annotating your own code, as the functions take them:

- `Names`: the names of an array's dimensions, one `AxisName` per dimension,
  in a tuple (or list, or `PartitionSpec`);
- `AxisName`: one entry: a name, a tuple of names, None (replicated) or
  ``PartitionSpec.UNCONSTRAINED``;
- `MeshAxes`: the mesh axes of one dimension: an axis, a tuple of axes, None;
- `Rules`: ``(logical_name, mesh_axes)`` pairs in priority order, or a mapping;
- `AnyMesh`: a `jax.sharding.Mesh` or `jax.sharding.AbstractMesh`;
- `NamesFn`: a function ``(key_path, leaf) -> Names | None`` for `box`.

Example:
    >>> import jax, spmdtree as st
    >>> def activations(mesh: st.AnyMesh, rules: st.Rules) -> jax.sharding.PartitionSpec | None:
    ...     names: st.Names = ("batch", "embed")
    ...     return st.logical_to_mesh_axes(names, rules, shape=(16, 512), mesh=mesh)
    >>> activations(jax.sharding.AbstractMesh((8,), ("data",)), [("batch", "data"), ("embed", None)])
    P('data', None)
"""

import sys as _sys

if _sys.argv[:1] == ["-m"]:
    # ``python -m spmdtree advise ...`` imports the package before its __main__ runs
    # (Python says "-m" in sys.argv[0] while it locates that module): jax starts as
    # the spmdtree script starts it (new in 0.8: the CUDA plugin's log came first)
    from spmdtree_cli import started_quietly as _started_quietly

    with _started_quietly(_sys.argv[1:]):
        import jax as _jax  # noqa: F401  (jax's plugins start here)

from spmdtree._src.boxes import PARTITION_NAME as PARTITION_NAME
from spmdtree._src.boxes import AxisMetadata as AxisMetadata
from spmdtree._src.boxes import LogicallyPartitioned as LogicallyPartitioned
from spmdtree._src.boxes import Partitioned as Partitioned
from spmdtree._src.boxes import with_logical_partitioning as with_logical_partitioning
from spmdtree._src.boxes import with_partitioning as with_partitioning
from spmdtree._src.constraints import constrain as constrain
from spmdtree._src.constraints import shard as shard
from spmdtree._src.constraints import with_logical_constraint as with_logical_constraint
from spmdtree._src.interop import from_flax as from_flax
from spmdtree._src.optim import optimizer_sharding as optimizer_sharding
from spmdtree._src.pipeline import pipeline as pipeline
from spmdtree._src.pipeline import stages as stages
from spmdtree._src.plan import DiffRow as DiffRow
from spmdtree._src.plan import Plan as Plan
from spmdtree._src.plan import PlanDiff as PlanDiff
from spmdtree._src.plan import PlanRow as PlanRow
from spmdtree._src.plan import plan as plan
from spmdtree._src.report import describe as describe
from spmdtree._src.resolve import (
    RulesFallback as RulesFallback,
)
from spmdtree._src.resolve import (
    UnshardedWarning as UnshardedWarning,
)
from spmdtree._src.resolve import (
    logical_to_mesh as logical_to_mesh,
)
from spmdtree._src.resolve import (
    logical_to_mesh_axes as logical_to_mesh_axes,
)
from spmdtree._src.resolve import (
    logical_to_mesh_sharding as logical_to_mesh_sharding,
)
from spmdtree._src.rules import AnyMesh as AnyMesh
from spmdtree._src.rules import AxisName as AxisName
from spmdtree._src.rules import MeshAxes as MeshAxes
from spmdtree._src.rules import Names as Names
from spmdtree._src.rules import Rules as Rules
from spmdtree._src.rules import get_logical_axis_rules as get_logical_axis_rules
from spmdtree._src.rules import logical_axis_rules as logical_axis_rules
from spmdtree._src.rules import set_logical_axis_rules as set_logical_axis_rules
from spmdtree._src.sequences import balanced_order as balanced_order
from spmdtree._src.sequences import context_attention as context_attention
from spmdtree._src.specs import RuleProblem as RuleProblem
from spmdtree._src.specs import get_partition_spec as get_partition_spec
from spmdtree._src.specs import get_sharding as get_sharding
from spmdtree._src.specs import kept_dimensions as kept_dimensions
from spmdtree._src.specs import to_abstract as to_abstract
from spmdtree._src.specs import to_sharding as to_sharding
from spmdtree._src.specs import to_spec as to_spec
from spmdtree._src.specs import validate_rules as validate_rules
from spmdtree._src.step.advise.advise import advise as advise
from spmdtree._src.step.advise.records import Advice as Advice
from spmdtree._src.step.advise.records import AdviceRow as AdviceRow
from spmdtree._src.step.advise.records import Candidate as Candidate
from spmdtree._src.step.advise.space import candidates as candidates
from spmdtree._src.step.advise.space import layouts as layouts
from spmdtree._src.step.compile.analysis import Memory as Memory
from spmdtree._src.step.compile.compilers import target_compiler_options as target_compiler_options
from spmdtree._src.step.compile.compilers import target_mesh as target_mesh
from spmdtree._src.step.hlo.schedule import Collective as Collective
from spmdtree._src.step.hw.chips import GpuChip as GpuChip
from spmdtree._src.step.hw.chips import TpuChip as TpuChip
from spmdtree._src.step.hw.hardware import Hardware as Hardware
from spmdtree._src.step.hw.hardware import hardware as hardware
from spmdtree._src.step.kinds import Backend as Backend
from spmdtree._src.step.kinds import CollectiveKind as CollectiveKind
from spmdtree._src.step.kinds import KernelClass as KernelClass
from spmdtree._src.step.kinds import LinkKind as LinkKind
from spmdtree._src.step.kinds import Verdict as Verdict
from spmdtree._src.step.measure.calibrate import calibrate as calibrate
from spmdtree._src.step.measure.measure import measure as measure
from spmdtree._src.step.preflight.diagnose import Traffic as Traffic
from spmdtree._src.step.preflight.preflight import preflight as preflight
from spmdtree._src.step.preflight.step_plan import StepPlan as StepPlan
from spmdtree._src.step.time.bound import StepTime as StepTime
from spmdtree._src.step.time.measured import Measurement as Measurement
from spmdtree._src.step.time.measured import OpTime as OpTime
from spmdtree._src.tactics import UnmatchedWarning as UnmatchedWarning
from spmdtree._src.tactics import fsdp as fsdp
from spmdtree._src.tactics import match as match
from spmdtree._src.transforms import accumulate as accumulate
from spmdtree._src.transforms import scan as scan
from spmdtree._src.transforms import sharded_init as sharded_init
from spmdtree._src.transforms import vmap as vmap
from spmdtree._src.trees import NamesFn as NamesFn
from spmdtree._src.trees import add_axis as add_axis
from spmdtree._src.trees import box as box
from spmdtree._src.trees import is_boxed as is_boxed
from spmdtree._src.trees import map_boxes as map_boxes
from spmdtree._src.trees import remove_axis as remove_axis
from spmdtree._src.trees import replace_boxed as replace_boxed
from spmdtree._src.trees import unbox as unbox

__version__ = "0.8.0"

__all__ = [
    "PARTITION_NAME",
    "Advice",
    "AdviceRow",
    "AnyMesh",
    "AxisMetadata",
    "AxisName",
    "Backend",
    "Candidate",
    "Collective",
    "CollectiveKind",
    "DiffRow",
    "GpuChip",
    "Hardware",
    "KernelClass",
    "LinkKind",
    "LogicallyPartitioned",
    "Measurement",
    "Memory",
    "MeshAxes",
    "Names",
    "NamesFn",
    "OpTime",
    "Partitioned",
    "Plan",
    "PlanDiff",
    "PlanRow",
    "RuleProblem",
    "Rules",
    "RulesFallback",
    "StepPlan",
    "StepTime",
    "TpuChip",
    "Traffic",
    "UnmatchedWarning",
    "UnshardedWarning",
    "Verdict",
    "accumulate",
    "add_axis",
    "advise",
    "balanced_order",
    "box",
    "calibrate",
    "candidates",
    "constrain",
    "context_attention",
    "describe",
    "from_flax",
    "fsdp",
    "get_logical_axis_rules",
    "get_partition_spec",
    "get_sharding",
    "hardware",
    "is_boxed",
    "kept_dimensions",
    "layouts",
    "logical_axis_rules",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "map_boxes",
    "match",
    "measure",
    "optimizer_sharding",
    "pipeline",
    "plan",
    "preflight",
    "remove_axis",
    "replace_boxed",
    "scan",
    "set_logical_axis_rules",
    "shard",
    "sharded_init",
    "stages",
    "target_compiler_options",
    "target_mesh",
    "to_abstract",
    "to_sharding",
    "to_spec",
    "unbox",
    "validate_rules",
    "vmap",
    "with_logical_constraint",
    "with_logical_partitioning",
    "with_partitioning",
]
