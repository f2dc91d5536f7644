"""The step wing's pictures (floor 1, over kinds; new in 0.8: a room below the core
that imported the wing back): a step's time and advice's table drawn from plain
figures, by matplotlib's object API.
"""

from spmdtree._src.step.pictures.draw import Point as Point
from spmdtree._src.step.pictures.draw import advice_picture as advice_picture
from spmdtree._src.step.pictures.draw import saved as saved
from spmdtree._src.step.pictures.draw import time_picture as time_picture
