"""Held against the devices present (floor 4, over preflight; new in 0.7): a step run
and profiled beside its prediction (`measure`), and the chip's own figures measured
(`calibrate`).
"""

from spmdtree._src.step.measure.calibrate import calibrate as calibrate
from spmdtree._src.step.measure.measure import check_here as check_here
from spmdtree._src.step.measure.measure import measure as measure
