"""The step compiled and read (floor 3, over compile and time): its record
(`StepPlan`), `preflight` and the stages advise and measure share, and what its
records mean in words (diagnose).
"""

from spmdtree._src.step.preflight.diagnose import EXPERT as EXPERT
from spmdtree._src.step.preflight.diagnose import Closest as Closest
from spmdtree._src.step.preflight.diagnose import nothing_fits as nothing_fits
from spmdtree._src.step.preflight.diagnose import repeated as repeated
from spmdtree._src.step.preflight.diagnose import split_work as split_work
from spmdtree._src.step.preflight.preflight import Keywords as Keywords
from spmdtree._src.step.preflight.preflight import plan_arguments as plan_arguments
from spmdtree._src.step.preflight.preflight import preflight as preflight
from spmdtree._src.step.preflight.preflight import step_plan as step_plan
from spmdtree._src.step.preflight.preflight import trace_for as trace_for
from spmdtree._src.step.preflight.step_plan import StepPlan as StepPlan
