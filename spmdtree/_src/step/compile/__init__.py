"""Where a step compiles (floor 2, over hlo and hw): tracing, the toolchains and
compilers, and the analysis of what they compiled.
"""

from spmdtree._src.step.compile.analysis import Analysis as Analysis
from spmdtree._src.step.compile.analysis import Memory as Memory
from spmdtree._src.step.compile.backends import TOOLCHAINS as TOOLCHAINS
from spmdtree._src.step.compile.backends import Toolchain as Toolchain
from spmdtree._src.step.compile.backends import target_for as target_for
from spmdtree._src.step.compile.compilers import Compiler as Compiler
from spmdtree._src.step.compile.compilers import CpuChild as CpuChild
from spmdtree._src.step.compile.compilers import DoesNotFit as DoesNotFit
from spmdtree._src.step.compile.compilers import Here as Here
from spmdtree._src.step.compile.compilers import TargetChild as TargetChild
from spmdtree._src.step.compile.compilers import check_compiler_options as check_compiler_options
from spmdtree._src.step.compile.compilers import compile_child as compile_child
from spmdtree._src.step.compile.compilers import compiler_for as compiler_for
from spmdtree._src.step.compile.tracing import Arguments as Arguments
from spmdtree._src.step.compile.tracing import Exported as Exported
from spmdtree._src.step.compile.tracing import Traced as Traced
from spmdtree._src.step.compile.tracing import arguments as arguments
from spmdtree._src.step.compile.tracing import called as called
from spmdtree._src.step.compile.tracing import flat_step as flat_step
from spmdtree._src.step.compile.tracing import trace as trace
