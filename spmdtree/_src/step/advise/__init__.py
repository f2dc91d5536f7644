"""Choosing a layout (floor 5, the top): candidates, their plans and compiles, ranked,
said in words.
"""

from spmdtree._src.step.advise.advise import advise as advise
from spmdtree._src.step.advise.advise import step_call as step_call
from spmdtree._src.step.advise.records import Candidate as Candidate
from spmdtree._src.step.advise.space import candidates as candidates
from spmdtree._src.step.advise.space import layouts as layouts
