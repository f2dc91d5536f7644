"""Time (floor 2, over hlo and hw): the roofline bound and the predicted step time over
the one walk, a trace of it, and a profile joined to it.
"""

from spmdtree._src.step.time.bound import StepTime as StepTime
from spmdtree._src.step.time.bound import ranked_seconds as ranked_seconds
from spmdtree._src.step.time.bound import step_spans as step_spans
from spmdtree._src.step.time.bound import step_time as step_time
from spmdtree._src.step.time.bound import time_json as time_json
from spmdtree._src.step.time.measured import Measurement as Measurement
from spmdtree._src.step.time.measured import compare as compare
from spmdtree._src.step.time.predict import fixed_seconds as fixed_seconds
from spmdtree._src.step.time.predict import kernel_seconds as kernel_seconds
from spmdtree._src.step.time.profile import read_profile as read_profile
from spmdtree._src.step.time.timeline import trace_events as trace_events
